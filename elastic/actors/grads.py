"""First-N's gradient vector: every trainable parameter's gradient, which parameters got one, and
the loss, in one flat buffer that a step all-reduces, sends and receives whole.

Layout: ``[gradients (parameter order) | presence, one slot per parameter | loss]``.

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
accumulation), the marks are summed with the gradients, and before the optimizer step a
parameter that no fast replica reached gets ``.grad = None`` (its view is put back after). The
mean of the marked gradients is one process's full-batch gradient: a replica that did not reach
a parameter adds zeros, as samples that do not reach it add nothing. Data parallel needs none of
this: DDP leaves a globally unused parameter's gradient untouched (``find_unused_parameters``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

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
    back, so such a gradient is summed over the fast N in the wider dtype and rounded once.
    """

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied parameters once
        self.dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params)) if self.params else None
        self._cast = [i for i, p in enumerate(self.params) if p.dtype != self.dtype]  # no view: copied in and out
        self._viewed = [i for i, p in enumerate(self.params) if p.dtype == self.dtype]
        self._reached = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._mark(i))
        self.flat = None
        self._slots: list = []

    def _mark(self, i: int):
        def hook(_param) -> None:
            self._reached[i] = True
        return hook

    def bind(self, device) -> "torch.Tensor":
        """A new zeroed buffer on ``device``, every ``.grad`` of the buffer's dtype a view into
        it; returns it."""
        sizes = [p.numel() for p in self.params]
        self.flat = torch.zeros(sum(sizes) + len(self.params) + 1, device=device, dtype=self.dtype)
        self._slots, offset = [], 0
        for p, n in zip(self.params, sizes):
            slot = self.flat[offset: offset + n].view(p.shape)
            self._slots.append(slot)
            p.grad = slot if p.dtype == self.dtype else None  # None: its own tensor, made by the next backward
            offset += n
        self._presence = self.flat[offset: offset + len(self.params)]
        return self.flat

    def before_backward(self) -> None:
        self._reached = [False] * len(self.params)

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
            if grad is None or not self._reached[i]:
                slot.zero_()
            else:
                slot.copy_(grad.to_dense() if grad.is_sparse else grad)
            p.grad = slot
        for i in self._cast:
            grad = self.params[i].grad
            if grad is None or not self._reached[i]:
                self._slots[i].zero_()
            else:
                self._slots[i].copy_(grad.to_dense() if grad.is_sparse else grad)
        if all(self._reached):
            self._presence.fill_(1)
        else:
            self._presence.copy_(torch.tensor(self._reached, dtype=self._presence.dtype))
        self.flat[-1] = loss.detach()

    @property
    def loss(self) -> float:
        return float(self.flat[-1])

    @contextmanager
    def for_update(self) -> Iterator[None]:
        """With the agreed buffer in place (summed and divided, or received): the parameters'
        gradients for what runs inside (the optimizer step, clipping). Gradients that are not
        views take the agreed values, rounded to their dtype; parameters that no fast replica
        reached have no gradient, as in one process."""
        for i in self._cast:
            p, slot = self.params[i], self._slots[i]
            if p.grad is None or p.grad.is_sparse:
                p.grad = slot.to(p.dtype)
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
