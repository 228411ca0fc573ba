"""First-N's gradient vector: every trainable parameter's gradient, which parameters got one, and
the loss, in one flat buffer that a step all-reduces, sends and receives whole.

Layout: ``[gradients (parameter order) | presence, one slot per parameter | loss]``.

The gradients are views: each parameter's ``.grad`` is its slice of the buffer, so backward
accumulates straight into it and nothing is copied in or out (the idea of DDP's
``gradient_as_bucket_view``); ``zero_grad(set_to_none=False)`` keeps the views.

Why the presence slots: a parameter that no sample of the step reached (a branch the forward
skipped, an expert no token was routed to) has no gradient in one process, and the optimizer
leaves it alone: no weight decay, no momentum, no Adam moment update. With views its ``.grad``
is zeros instead, and an optimizer steps a parameter whose gradient is zeros: AdamW decays it,
momentum moves it. So each replica marks the parameters its backward reached (a hook after
accumulation), the marks are summed with the gradients, and before the optimizer step a
parameter that no fast replica reached gets ``.grad = None`` (its view is put back after). The
mean of the marked gradients is one process's full-batch gradient: a replica that did not reach
a parameter adds zeros, as samples that do not reach it add nothing. Data parallel needs none of
this: DDP leaves a globally unused parameter's gradient untouched (``find_unused_parameters``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from elastic._lazy import LazyModule

torch = LazyModule("torch")


class FlatGrads:
    """The flat buffer for a model's trainable parameters (see the module docstring). Build it
    once per model: it registers a hook on every parameter. ``bind`` makes a new buffer (each
    rendezvous) and points every ``.grad`` into it."""

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied parameters once
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"aggregation='first_n' needs the trainable parameters in one dtype, "
                             f"got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else None
        self._reached = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._mark(i))
        self.flat = None

    def _mark(self, i: int):
        def hook(_param) -> None:
            self._reached[i] = True
        return hook

    def bind(self, device) -> "torch.Tensor":
        """A new zeroed buffer on ``device``, every ``.grad`` a view into it; returns it."""
        sizes = [p.numel() for p in self.params]
        self.flat = torch.zeros(sum(sizes) + len(self.params) + 1, device=device, dtype=self.dtype)
        offset = 0
        for p, n in zip(self.params, sizes):
            p.grad = self.flat[offset: offset + n].view_as(p)
            offset += n
        self._presence = self.flat[offset: offset + len(self.params)]
        return self.flat

    def before_backward(self) -> None:
        self._reached = [False] * len(self.params)

    def after_backward(self, loss) -> None:
        """Write this replica's presence marks and its loss into the buffer."""
        if all(self._reached):
            self._presence.fill_(1)
        else:
            self._presence.copy_(torch.tensor(self._reached, dtype=self._presence.dtype))
        self.flat[-1] = loss.detach()

    @property
    def loss(self) -> float:
        return float(self.flat[-1])

    @contextmanager
    def unreached_set_aside(self) -> Iterator[None]:
        """With the agreed buffer in place (summed or received): parameters that no fast replica
        reached have no gradient for what runs inside (the optimizer step, clipping)."""
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
