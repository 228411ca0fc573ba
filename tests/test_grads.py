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
    with grads.for_update():
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
    with grads.for_update():
        assert all(p.grad is not None for p in model.parameters())


def test_parameters_of_another_dtype_are_averaged_in_the_widest_and_rounded_once():
    # A bf16 body with an fp32 head: one fp32 buffer; the bf16 gradients are copied in, summed
    # over the replicas there, and the mean comes back rounded to bf16 once.
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4).to(torch.bfloat16), torch.nn.Linear(4, 2))

    replicas = [build(), build()]
    buffers, grads = [], []
    for seed, model in enumerate(replicas):
        g = FlatGrads(model)
        buffers.append(g.bind(torch.device("cpu")))
        grads.append(g)
        assert g.dtype == torch.float32
        g.before_backward()
        torch.manual_seed(10 + seed)
        x = torch.randn(5, 3)
        loss = model[1](model[0](x.to(torch.bfloat16)).float()).square().mean()
        loss.backward()
        g.after_backward(loss)
    own = [[p.grad.clone() for p in m.parameters()] for m in replicas]
    total = buffers[0] + buffers[1]
    for flat in buffers:  # what the all-reduce and the division do
        flat.copy_(total / 2)
    for model, g in zip(replicas, grads):
        with g.for_update():
            for i, p in enumerate(model.parameters()):
                mean = (own[0][i].float() + own[1][i].float()) / 2
                assert p.grad.dtype == p.dtype
                assert torch.equal(p.grad, mean.to(p.dtype))
    assert [p.dtype for p in replicas[0].parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2
    # the fp32 head's gradients are views into the buffer, the bf16 body's are not
    fp32 = [p for p in replicas[0].parameters() if p.dtype == torch.float32]
    assert all(p.grad.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr() for p in fp32)


def test_a_step_fn_that_drops_the_views_still_fills_the_buffer():
    # model.zero_grad() sets .grad to None by default: backward then makes new tensors, and the
    # buffer (what the replicas all-reduce) held zeros for them.
    torch.manual_seed(0)
    model = make_model_with_unused_branch()
    reference = make_model_with_unused_branch()
    reference.load_state_dict(model.state_dict())
    grads = FlatGrads(model)
    flat = grads.bind(torch.device("cpu"))
    x = torch.randn(4, 16)
    grads.before_backward()
    model.zero_grad()  # what the user's step_fn did
    loss = model(x).sum()
    loss.backward()
    grads.after_backward(loss)
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name  # a view again
        expected = torch.zeros_like(p) if q.grad is None else q.grad
        assert torch.equal(p.grad, expected), name
    assert flat[:-1].abs().sum() > 0
