"""First-N's flat gradient buffer (elastic/actors/grads.py), in one process."""

from __future__ import annotations

import torch

from elastic.actors.grads import FlatGrads
from helpers import make_model_with_unused_branch


def test_the_buffer_holds_views_marks_and_the_loss_and_unreached_parameters_sit_out():
    torch.manual_seed(0)
    model = make_model_with_unused_branch()
    grads = FlatGrads(model)
    flat = grads.bind(torch.device("cpu"))
    params = list(model.parameters())
    assert flat.numel() == sum(p.numel() for p in params) + len(params) + 1
    grads.before_backward()
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    grads.after_backward(loss)
    assert grads.loss == loss.item()
    reached = [not name.startswith("unused.") for name, _ in model.named_parameters()]
    assert grads._presence.tolist() == [float(r) for r in reached]
    assert all(p.grad.data_ptr() >= flat.data_ptr() for p in params)  # views into the buffer, not copies
    with grads.unreached_set_aside():
        assert [p.grad is not None for p in params] == reached
    # the views are back: the next backward accumulates into the buffer again
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in params)


def test_every_parameter_reached_sets_nothing_aside():
    model = torch.nn.Linear(3, 2)
    grads = FlatGrads(model)
    grads.bind(torch.device("cpu"))
    grads.before_backward()
    loss = model(torch.ones(1, 3)).sum()
    loss.backward()
    grads.after_backward(loss)
    with grads.unreached_set_aside():
        assert all(p.grad is not None for p in model.parameters())
