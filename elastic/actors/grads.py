"""First-N's gradient vector: every trainable parameter's gradient, which parameters got one, and
the loss, in one flat buffer that a step all-reduces, sends and receives whole.

Layout: ``[loss | presence, one slot per parameter | gradients (parameter order)]``.

The gradients are views: each parameter's ``.grad`` is its slice of the buffer, so backward
accumulates straight into it and nothing is copied in or out (the idea of DDP's
``gradient_as_bucket_view``); ``zero_grad(set_to_none=False)`` keeps the views. The buffer is in
the parameters' widest dtype; a parameter of another dtype (fp32 norms beside a bf16 body) has no
view and its gradient is copied in after backward and back before the update (``FlatGrads``).
The loss slot has the buffer's dtype too: a bf16-only model reports its loss rounded to bf16.

Why the presence slots: a parameter that no sample of the step reached (a branch the forward
skipped, an expert no token was routed to) has no gradient in one process, and the optimizer
leaves it alone: no weight decay, no momentum, no Adam moment update. With views its ``.grad``
is zeros instead, and an optimizer steps a parameter whose gradient is zeros: AdamW decays it,
momentum moves it. So each replica marks the parameters its backward reached (a hook after
accumulation), the marks are averaged with the gradients, and before the optimizer step a
parameter that no fast replica reached gets ``.grad = None`` (its view is put back after). The
mean of the marked gradients is one process's full-batch gradient: a replica that did not reach
a parameter adds zeros, as samples that do not reach it add nothing. Data parallel needs none of
this: DDP leaves a globally unused parameter's gradient untouched (``find_unused_parameters``).

Reducing during the backward (``begin_early_reduce``/``finish_reduce``). In a step whose fast set
is known before it starts (elastic/actors/sitout.py), the fast N reduce the buffer bucket by
bucket while their backward still runs, as DDP does, instead of in one all-reduce after it (not
under a ``step_fn``, which may call backward twice or change a gradient after it). The
buckets are fixed at ``bind``: runs of parameters in reverse order (the order backward mostly
produces them), each closed once it holds ``cap_bytes`` (the first once it holds
``first_cap_bytes``), DDP's sizes for the device (``ddp_bucket_kwargs``); the last one also holds
the loss and the presence marks. Why it holds:
- Collectives on a group must be issued in the same order on every member, so buckets go out
  strictly in bucket order: a bucket whose gradients are all in waits for the buckets before it,
  and one that never fills early (a parameter this replica's batch did not reach, a parameter of
  another dtype, whose slot is written only after the backward, and the last, with the loss and
  the marks) holds back every later one until ``finish_reduce``, which issues the rest in order.
  When a bucket goes out differs from replica to replica; the order never does. A model of one
  bucket is reduced as in any other step: one all-reduce of the whole buffer, after the backward.
- A bucket's slots are final once each of its parameters' post-accumulate hook has run with its
  ``.grad`` still the view: nothing writes them again before the update. A ``.grad`` that is not
  the view at its hook (``after_backward`` copies it in later) keeps its bucket back.
- The means are the same, element by element, as one all-reduce's, up to the reduction's
  association (which gloo's ring picks per chunk), and identical on every fast replica; the late
  ones receive the leader's copy as before.
Measured on the 2-vCPU VM (N=2 of 3, the third rank resting behind a 2 s delay, an MLP with
three 1536-wide layers, 20 MB of gradients in 4 MiB buckets, 50 steps, three alternating pairs):
median step 119/134/121 ms against 128/141/125 ms with one all-reduce after the backward. On two
shared cores the backward and gloo's threads compete; the overlap is meant for GPUs and NCCL.
Why not DDP with a comm hook here: its reducer belongs to one process group, and its first-step
bucket rebuild and its buffer broadcast are collectives over all of it, which a replica sitting
the step out never joins.
"""

from __future__ import annotations

import functools
import math
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from elastic._lazy import LazyModule

torch = LazyModule("torch")


class FlatGrads:
    """The flat buffer for a model's trainable parameters (see the module docstring). Build it
    once per model: it registers a hook on every parameter. ``bind`` makes a new buffer (each
    rendezvous) and points every ``.grad`` it can into it.

    Parameters of several dtypes (a bf16 body with fp32 norms or head, say) share one buffer in
    the widest of them (``torch.promote_types``), so a step stays one all-reduce and one send.
    Parameters of that dtype have views, as above. The others keep a ``.grad`` of their own
    dtype: ``after_backward`` copies it into its slot, and ``for_update`` copies the agreed mean
    back, so such a gradient is averaged over the fast N in the wider dtype and rounded once.
    """

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied parameters once
        # Every parameter, trainable or not, by a weak reference (a strong one would keep a
        # replaced parameter's memory; an id alone can be a new parameter's at the same address),
        # and the trainable ones' names: check_model tells one replaced or removed since from
        # one unfrozen.
        self._built = {id(p): weakref.ref(p) for p in model.parameters()}
        names = {id(p): name for name, p in model.named_parameters()}
        self._param_names = [names.get(id(p), "?") for p in self.params]
        self.dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params)) if self.params else None
        self._cast = [i for i, p in enumerate(self.params) if p.dtype != self.dtype]  # no view: copied in and out
        self._viewed = [i for i, p in enumerate(self.params) if p.dtype == self.dtype]
        self._reached = [False] * len(self.params)
        self._sparse_checked = False  # check_model
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._mark(i))
        self.flat = None
        self._slots: list = []
        # Buckets for reducing during the backward (module docstring): (start, end) element ranges
        # of the buffer in the order they go out, each parameter's bucket, and which buckets may
        # go out early (none holds a parameter of another dtype).
        self.buckets: list[tuple[int, int]] = []
        self._bucket_of: list[int] = []
        self._bucket_params: list[int] = []
        self._early_ok: list[bool] = []
        self._reducing = False  # a step reducing during its backward is under way
        self.accumulates_twice = False  # seen once: no early reduce for this model (see _mark)
        self._backwards = 0  # backwards seen; the first never reduces early (see begin_early_reduce)
        self._group = None
        self._works: list = []
        self._n = 1  # members of the group reduced over: each divides by it first (reduce)
        self._waiting: list[int] = []  # per bucket: its parameters whose gradients are not in yet
        self._next = 0  # the next bucket to go out

    def check_model(self, model) -> None:
        """Raise, before a first-N step, when the model is not one this buffer can average alike
        on every replica (a user error, named). Why: first-N averages the parameters that were
        trainable when this buffer was built. One unfrozen later (gradual unfreezing) has no slot:
        the fast replicas stepped it on their own gradients, the resting ones on stale ones, and
        the replicas diverged until the checksum stopped the run. And a sparse embedding's
        gradient is made dense here, which a sparse optimizer refuses, and would send the whole
        table every step."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        if len(trainable) != len(self.params) or any(a is not b for a, b in zip(trainable, self.params)):
            then = {id(p) for p in self.params}
            now = {id(p) for p in model.parameters()}

            def built(p) -> bool:
                ref = self._built.get(id(p))
                return ref is not None and ref() is p

            changed = [f"{name} (replaced)" if not built(p) else f"{name} ({'unfrozen' if p.requires_grad else 'frozen'})"
                       for name, p in model.named_parameters()
                       if not built(p) or p.requires_grad != (id(p) in then)]
            named = {name for name, _ in model.named_parameters()}  # a name still there was replaced, not removed
            changed += [f"{name} (removed)" for p, name in zip(self.params, self._param_names)
                        if id(p) not in now and name not in named]
            # The same parameters, registered again or in another order, name none: said so,
            # not left as an empty list beside advice about requires_grad.
            what = (f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}" if changed else
                    "the same parameters, registered again or in another order")
            raise RuntimeError(
                f"first-N aggregation: the model's trainable parameters changed after the group formed: {what}. "
                "Set requires_grad, and replace or re-register parameters (weight_norm, parametrize, an "
                "adapter), in model_fn, before training: first-N averages the parameters trainable when the "
                "group formed, and one changed later would be stepped differently on different replicas.")
        if not self._sparse_checked:
            self._sparse_checked = True
            sparse = sparse_embeddings(model)
            if sparse:
                raise RuntimeError(f"first-N aggregation does not support sparse gradients ({', '.join(sparse)} "
                                   "has sparse=True): use dense embeddings with first-N, or data parallel.")
            # The flat buffer takes the gradients' dtype, and each step's presence marks (which
            # replicas reached a parameter) are read from it as real numbers: with a complex
            # parameter they were complex, and the first update failed comparing them.
            complex_ = [name for name, p in model.named_parameters() if p.requires_grad and p.is_complex()]
            if complex_:
                raise RuntimeError(f"first-N aggregation does not support complex parameters ({', '.join(complex_[:5])}"
                                   "): use data parallel (aggregation='all'), or keep them as real and imaginary parts.")

    def _mark(self, i: int):
        def hook(param) -> None:
            if self._reached[i]:
                # Accumulated twice in one backward (reentrant activation checkpointing runs a
                # backward of its own): a bucket could go out before its last addition, so this
                # model's buckets go out after the backward from now on. The first backward of
                # every FlatGrads reduces after it (begin_early_reduce), so this is seen before
                # any early reduce, even in a group formed with exactly N replicas.
                self.accumulates_twice = True
                if self._reducing:
                    raise RuntimeError(
                        f"first-N: parameter {i}'s gradient was accumulated twice in one backward, "
                        "after its bucket may have been sent (this had not happened in earlier steps); "
                        "with activation checkpointing, use torch.utils.checkpoint(..., use_reentrant=False)")
            self._reached[i] = True
            if self._reducing and param.grad is not None and param.grad.data_ptr() == self._slots[i].data_ptr():
                self._waiting[self._bucket_of[i]] -= 1
                self._issue_ready()
        return hook

    def bind(self, device) -> "torch.Tensor":
        """A new zeroed buffer on ``device``, every ``.grad`` of the buffer's dtype a view into
        it; returns it."""
        sizes = [p.numel() for p in self.params]
        # The old buffer let go first (the parameters' views hold it too): a rebuild held both
        # at once, twice the gradients' memory, and a model that fit while training went out of
        # GPU memory only in a recovery.
        self.flat = self._presence = None
        self._slots = []
        for p in self.params:
            p.grad = None
        self.flat = torch.zeros(1 + len(self.params) + sum(sizes), device=device, dtype=self.dtype)
        self._presence = self.flat[1: 1 + len(self.params)]
        self._slots, self._offsets, offset = [], [], 1 + len(self.params)
        for p, n in zip(self.params, sizes):
            slot = self.flat[offset: offset + n].view(p.shape)
            self._slots.append(slot)
            self._offsets.append(offset)
            p.grad = slot if p.dtype == self.dtype else None  # None: its own tensor, made by the next backward
            offset += n
        self.plan_buckets(math.inf, math.inf)  # one bucket, reduced after the backward, until sized
        return self.flat

    def plan_buckets(self, first_cap_bytes: int, cap_bytes: int) -> None:
        """Fix the buckets of ``bind``'s buffer (module docstring); call after ``bind``."""
        size, cast = self.flat.element_size(), set(self._cast)
        self.buckets, self._bucket_of, self._bucket_params, self._early_ok = [], [0] * len(self.params), [], []
        cap, members, nbytes = first_cap_bytes, [], 0
        for i in reversed(range(len(self.params))):
            members.append(i)
            nbytes += self._slots[i].numel() * size
            self._bucket_of[i] = len(self.buckets)
            if i == 0 or nbytes >= cap:
                end = self._offsets[members[0]] + self._slots[members[0]].numel()
                # The last bucket starts at 0: with the loss and the presence marks, which
                # after_backward writes, it goes out last, in finish_reduce (a model of one
                # bucket: one all-reduce of the whole buffer, as in a step reduced after).
                self.buckets.append((self._offsets[i] if i else 0, end))
                self._bucket_params.append(len(members))
                self._early_ok.append(i > 0 and not cast.intersection(members))
                cap, members, nbytes = cap_bytes, [], 0

    def reduce(self, group, n: int) -> None:
        """The whole buffer at once, after ``after_backward``: the mean over ``group`` (a
        process group; None: the default one) of its ``n`` members. Each member divides by ``n``
        before the all-reduce, as DDP does: a sum of fp16 gradients overflows to inf where their
        mean does not (every replica would then step on inf alike, and no checksum would tell)."""
        self.flat.div_(n)
        torch.distributed.all_reduce(self.flat, group=group)

    def begin_early_reduce(self, group, n: int) -> None:
        """This step's backward sends each bucket to ``group`` (a process group; None: the
        default one) as soon as it and every bucket before it are in, divided by ``n`` first
        (``reduce``); ``finish_reduce``, after ``after_backward``, sends the rest and waits for
        all of it. Call after ``before_backward``."""
        self._group, self._works, self._next, self._n = group, [], 0, n
        # A bucket that may not go out early waits for one more "parameter": finish_reduce.
        self._waiting = [n if ok else n + 1 for n, ok in zip(self._bucket_params, self._early_ok)]
        # Not in this replica's first backward: it has not yet shown whether the model accumulates
        # a gradient twice (a fresh spare, or fresh ranks restored from a checkpoint, whose group
        # starts with exactly N, so its first steps are known). Its buckets go out in
        # finish_reduce, in the same order as its peers' early ones, so the collectives match.
        self._reducing = not self.accumulates_twice and self._backwards > 0

    def _issue_ready(self) -> None:
        while self._next < len(self.buckets) and self._waiting[self._next] <= 0:
            self._works.append(self._issue(self._next))

    def _issue(self, b: int):
        start, end = self.buckets[b]
        self._next = b + 1
        bucket = self.flat[start:end]
        bucket.div_(self._n)
        return torch.distributed.all_reduce(bucket, group=self._group, async_op=True)

    def finish_reduce(self) -> None:
        """Send the buckets not yet out, in order (the last with the loss and the presence
        marks), and wait for all of it: the buffer then holds the fast replicas' mean. (A failure
        on the way leaves the works behind: the step's group is torn down, see
        ``TrainWorker._run_guarded``.)"""
        self._reducing = False
        works, self._works = self._works, []
        while self._next < len(self.buckets):
            works.append(self._issue(self._next))
        for work in works:
            work.wait()
        self._group = None

    def release(self) -> None:
        """Let go of the step's group and its works (``TrainWorker.leave``): a work holds its
        gloo context, and a group referenced here keeps its sockets open, so peers blocked on
        this rank would wait out their timeout instead of raising at once."""
        self._group, self._works, self._reducing = None, [], False

    def before_backward(self) -> None:
        self._reached = [False] * len(self.params)
        self._reducing = False  # a step that failed mid-backward left it on

    def after_backward(self, loss) -> None:
        """Write this replica's gradients that are not views, its presence marks and its loss
        into the buffer.

        A gradient that should be a view and is not (a ``step_fn`` that called
        ``model.zero_grad()``, whose default ``set_to_none=True`` drops the views, so backward
        made new tensors) is copied into its slot and the view put back. Otherwise the buffer
        would hold zeros for it, and each replica would step on its own gradient: replicas that
        differ, found only by the checksum."""
        for i in self._viewed:
            p, slot = self.params[i], self._slots[i]
            grad = p.grad
            if grad is not None and grad.data_ptr() == slot.data_ptr():
                continue
            if grad is None:
                # Reached, then dropped by the step_fn (``p.grad = None``, to freeze it this
                # step): not this replica's gradient, as one process's optimizer skips it.
                self._reached[i] = False
            if not self._reached[i]:
                slot.zero_()
            else:
                slot.copy_(grad.to_dense() if grad.is_sparse else grad)
            p.grad = slot
        for i in self._cast:
            grad = self.params[i].grad
            if grad is None:
                self._reached[i] = False  # as above
            if not self._reached[i]:
                self._slots[i].zero_()
            else:
                self._slots[i].copy_(grad.to_dense() if grad.is_sparse else grad)
        if all(self._reached):
            self._presence.fill_(1)
        else:
            self._presence.copy_(torch.tensor(self._reached, dtype=self._presence.dtype))
        self.flat[0] = loss.detach()
        self._backwards += 1

    @property
    def loss(self) -> float:
        return float(self.flat[0])

    @contextmanager
    def for_update(self) -> Iterator[None]:
        """With the agreed buffer in place (averaged, or received): the parameters'
        gradients for what runs inside (the optimizer step, clipping). Gradients that are not
        views take the agreed values, rounded to their dtype; parameters that no fast replica
        reached have no gradient, as in one process."""
        for i in self._cast:
            p, slot = self.params[i], self._slots[i]
            if p.grad is None or p.grad.is_sparse:
                # In the parameter's layout, as autograd makes a gradient: a contiguous copy of a
                # channels_last parameter's gradient on a replica that had none (a late one)
                # holds the same values in another order, and clip_grad_norm_ sums in memory
                # order, so its norm, and then its update, differed from the fast replicas'.
                p.grad = torch.empty_like(p, memory_format=torch.preserve_format).copy_(slot)
            else:
                p.grad.copy_(slot)
        marks = self._presence.tolist()
        if all(m > 0 for m in marks):
            yield
            return
        aside = [(p, p.grad) for p, m in zip(self.params, marks) if m <= 0]
        for p, _ in aside:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in aside:
                p.grad = grad  # the view again: the next backward accumulates into the buffer


def sparse_embeddings(model: Any) -> list[str]:
    """The names of the model's trainable embeddings with sparse gradients (``sparse=True``)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
