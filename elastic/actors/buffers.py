"""A replica's module buffers (BatchNorm's running statistics and batch counter, say) as one vector,
so replicas can agree on them after a step and a failed step can be undone.

Why buffers need their own handling: an optimizer step only touches parameters, but a module in
training mode updates its buffers in the forward pass, from its own batch. Left alone:
- In data parallel, DDP broadcasts rank 0's buffers at the start of each forward, so between
  steps every other rank holds buffers updated from its own batch. A checkpoint written by
  another rank (the writing duty rotates and is spread over ranks) or a state sent from another
  peer carried those, and a resumed run's running statistics differed from an uninterrupted
  run's (by 0.02-0.03 on a small BatchNorm model), while its parameters matched.
- In first-N, nothing synchronised them at all: every replica kept statistics of its own
  batches, and the parameter checksum could not see it.
- A step that failed after its forward (a peer died in the all-reduce) left its update in the
  survivors' buffers, and its replay updated them a second time.

So after every step the replicas make their buffers identical: in data parallel rank 0's
(DDP's own rule, broadcast at the end of the step instead of the start of the next, with DDP's
per-forward buffer broadcast off, so still one broadcast a step); in first-N the mean over the fast N, as
for the gradient (rank 0 may be the straggler), which late replicas receive with the update.
And each step saves the buffers first, so a step that fails before its update puts them back.

The vector is float64 whatever the buffers' dtypes: integer counters (``num_batches_tracked``)
stay exact up to 2**53, and floating statistics lose nothing to a lower-precision model dtype.
Integer and bool buffers are rounded back. An integer buffer that holds a value beyond 2**53 on
any rank when the group forms is left out (``buffer_survey``'s wide ones): such a value is a
constant (a hash modulus like 2**61 - 1, a seed), and through float64 it came back rounded, on
every rank but rank 0 in data parallel (a ReplicaDivergence), on every replica in first-N (a
constant silently changed). Decided from every rank's values, gathered at the join: decided on
its own values, a rank whose buffer differed (a model_fn not deterministic under the seed; DDP
broadcasts no buffer at construction before torch 2.13) would build a vector of another length,
and the buffers' collective would fail or hang.

Only persistent buffers (those in ``state_dict``) are agreed on: they are the model's state, the
ones a checkpoint holds. A non-persistent buffer is a constant or a cache the module can rebuild,
and some grow in the forward (rotary-embedding caches that are re-registered at a longer length):
a survivor's would then be longer than a fresh spare's, and a vector of every buffer would not
even have the same length on every rank. The buffers are the module's tensors at join time; a
module that replaces a persistent buffer (rather than updating it in place, as BatchNorm does)
is not followed.
"""

from __future__ import annotations

from typing import Iterable

from elastic._lazy import LazyModule

torch = LazyModule("torch")


class ReplicaBuffers:
    """The buffers of ``model`` packed into ``flat`` (float64) and back."""

    def __init__(self, model, device, leave_out: Iterable[str] = ()):
        """``leave_out``: names of persistent buffers not agreed on (``buffer_survey``'s wide
        ones, which float64 cannot hold exactly), the same on every rank."""
        names = set(model.state_dict(keep_vars=True)) - set(leave_out)
        # float64 cannot hold complex ones either
        self.tensors = [b for name, b in model.named_buffers() if name in names and not b.is_complex()]
        total = sum(b.numel() for b in self.tensors)
        self.flat = torch.zeros(total, dtype=torch.float64, device=device) if total else None
        self._saved = torch.zeros_like(self.flat) if total else None

    def __bool__(self) -> bool:
        return self.flat is not None

    def pack(self, into=None) -> None:
        """Copy every buffer into ``into`` (default ``flat``)."""
        out = self.flat if into is None else into
        offset = 0
        for b in self.tensors:
            n = b.numel()
            out[offset:offset + n].copy_(b.detach().reshape(-1))
            offset += n

    def unpack(self, source=None) -> None:
        """Set every buffer from ``source`` (default ``flat``), rounding for integer and bool ones."""
        src = self.flat if source is None else source
        offset = 0
        with torch.no_grad():
            for b in self.tensors:
                n = b.numel()
                part = src[offset:offset + n].view(b.shape)
                b.copy_(part if b.is_floating_point() else part.round())
                offset += n

    def save(self) -> None:
        """Remember the buffers as they are before a step."""
        self.pack(self._saved)

    def restore(self) -> None:
        """Put back what ``save`` remembered: the failed step leaves no trace."""
        self.unpack(self._saved)


FLOAT64_EXACT = 2 ** 53  # every integer up to this magnitude is exact in float64


def fits_float64(b) -> bool:
    """Whether float64 holds every value of buffer ``b`` exactly (an integer one up to 2**53)."""
    if b.is_floating_point() or b.dtype == torch.bool or b.numel() == 0:
        return True
    return bool(b.min() >= -FLOAT64_EXACT) and bool(b.max() <= FLOAT64_EXACT)


def cache_buffer_names(model) -> set[str]:
    """The names of ``model``'s non-persistent buffers (those ``state_dict`` does not hold): caches
    a module may size by what its forward saw (rotary tables, a causal mask), so they may differ
    between ranks in content and in size (``buffer_survey``)."""
    names = set(model.state_dict(keep_vars=True))
    return {name for name, _ in model.named_buffers() if name not in names}


def wide_buffer_names(model) -> list[str]:
    """The persistent buffers of ``model`` holding a value float64 cannot hold exactly (an
    integer beyond 2**53), on this rank."""
    names = set(model.state_dict(keep_vars=True))
    return [name for name, b in model.named_buffers() if name in names and not fits_float64(b)]


def buffer_survey(model, group) -> tuple[list[str], list[str]]:
    """(uneven, wide), the same sorted lists on every rank of ``group``, from one gather:
    ``uneven`` the non-persistent buffers whose shape or dtype is not the same on every rank,
    those left out of the broadcast of rank 0's module state at a join (first-N's, and DDP's
    constructor, told through its ignore list); ``wide`` the persistent ones some rank holds a
    value beyond 2**53 in (``wide_buffer_names``), left out of ``ReplicaBuffers``.

    Why: a survivor whose cache had grown (rotary tables, a causal mask) sent more bytes than a
    fresh spare's shorter one expected (gloo aborts the process), or a fresh rank 0 sent fewer,
    overwriting the head of the survivors' cache and the next buffer's with bytes of another
    layout, where no checksum looks. Why not every non-persistent buffer (as a first fix did):
    one of the same layout everywhere that holds state (random features drawn at build) is made
    rank 0's, as DDP makes it. One small collective at every join, whatever the model holds: a
    module that registers its cache in its first forward has it on the survivors and not on a
    fresh spare, and a call made only where there were such buffers would have paired with the
    join's next collective on the others. A buffer some ranks lack is uneven."""
    names = cache_buffer_names(model)
    dist = torch.distributed
    mine = {name: (tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers() if name in names}
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (mine, wide_buffer_names(model)), group=group)
    caches = [e[0] for e in every]
    uneven = sorted(name for name in set().union(*caches) if len({str(e.get(name)) for e in caches}) > 1)
    return uneven, sorted(set().union(*(e[1] for e in every)))
