"""First-N's flat gradient buffer (elastic/actors/grads.py), in one process."""

from __future__ import annotations

import torch

from elastic.actors.grads import FlatGrads
from helpers import make_model_with_unused_branch, run_pair


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
    # views into the buffer (its storage), not copies
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    with grads.for_update():
        assert [p.grad is not None for p in params] == reached
    # the views are back: the next backward accumulates into the buffer again
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in params)


def test_a_new_buffer_is_made_once_the_old_one_is_let_go(monkeypatch):
    # A rebuild held the old buffer (through the parameters' views) while it made the new one:
    # twice the gradients' memory, out of GPU memory only in a recovery.
    import weakref

    from elastic.actors import grads as grads_module

    model = torch.nn.Linear(64, 64)
    grads = FlatGrads(model)
    old = weakref.ref(grads.bind(torch.device("cpu")))
    held_at_allocation = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        held_at_allocation.append(old() is not None)
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(grads_module.torch, "zeros", zeros)
    grads.bind(torch.device("cpu"))
    assert held_at_allocation == [False]


def test_every_parameter_reached_sets_nothing_aside():
    # Only "a gradient is there" was checked: zeros, or a copy the next backward would not
    # accumulate into, passed as well.
    model = torch.nn.Linear(3, 2)
    grads = FlatGrads(model)
    flat = grads.bind(torch.device("cpu"))
    grads.before_backward()
    loss = model(torch.tensor([[1.0, 2.0, 3.0]])).sum()
    loss.backward()
    grads.after_backward(loss)
    # d(sum of W x + b)/dW is x in every row, d/db is 1: [loss | 2 marks | weight (2x3) | bias (2)]
    assert torch.equal(flat, torch.tensor([loss.item(), 1, 1, 1, 2, 3, 1, 2, 3, 1, 1]))
    with grads.for_update():
        assert torch.equal(model.weight.grad, torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]))
        assert torch.equal(model.bias.grad, torch.ones(2))
        # still the buffer's slices (what the optimizer steps on is what was averaged): the
        # weight's six elements after the loss and the marks, the bias's two after those
        assert model.weight.grad.data_ptr() == flat[3:9].data_ptr() and model.weight.grad.shape == (2, 3)
        assert model.bias.grad.data_ptr() == flat[9:11].data_ptr()
        flat[3:].mul_(2)  # an average that came in: the parameters see it
        assert model.weight.grad[0].tolist() == [2.0, 4.0, 6.0] and model.bias.grad.tolist() == [2.0, 2.0]


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


def test_a_gradient_a_replica_did_not_compute_takes_its_parameters_layout():
    # An fp32 channels_last conv beside an fp64 head is copied in and out of the fp64 buffer. A
    # late replica (no backward) got a contiguous gradient, the fast ones autograd's
    # channels_last one: the same values, summed in another order by clip_grad_norm_.
    def build():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
        return torch.nn.ModuleDict({"conv": conv, "head": torch.nn.Linear(4, 2).double()})

    fast, late = build(), build()
    g_fast, g_late = FlatGrads(fast), FlatGrads(late)
    flat_fast, flat_late = g_fast.bind(torch.device("cpu")), g_late.bind(torch.device("cpu"))
    g_fast.before_backward()
    loss = fast["conv"](torch.randn(2, 8, 6, 6)).sum() + fast["head"](torch.randn(1, 4).double()).sum().float()
    loss.backward()
    g_fast.after_backward(loss)
    flat_late.copy_(flat_fast)  # the agreed update, as a late replica receives it
    norms = []
    for model, g in ((fast, g_fast), (late, g_late)):
        with g.for_update():
            weight = model["conv"].weight
            assert weight.grad.stride() == weight.stride()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    assert torch.equal(norms[0], norms[1])


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
    assert flat[1 + len(list(model.parameters())):].abs().sum() > 0  # the gradients


def test_a_gradient_the_step_fn_drops_after_the_backward_is_no_gradient():
    # A step_fn that freezes a layer for this step (``p.grad = None`` after backward): one process
    # does not step it; marked present, every replica stepped it on zeros (weight decay, momentum).
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.float64))
    grads = FlatGrads(model)
    grads.bind(torch.device("cpu"))
    grads.before_backward()
    loss = model[1](model[0](torch.ones(2, 3)).double()).sum()
    loss.backward()
    for p in list(model[0].parameters())[:1] + list(model[1].parameters())[:1]:  # one of each dtype
        p.grad = None
    grads.after_backward(loss)
    assert grads._presence.tolist() == [0.0, 1.0, 0.0, 1.0]
    with grads.for_update():
        assert [p.grad is not None for p in model.parameters()] == [False, True, False, True]


# ---- reducing during the backward (known fast sets) ---------------------------------------------
class Branchy(torch.nn.Module):
    """A bf16 input layer, five fp32 ones, and a branch only some replicas' batches reach."""

    def __init__(self):
        super().__init__()
        self.low = torch.nn.Linear(32, 32).to(torch.bfloat16)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(5)])
        self.branch = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, x, reach_branch: bool):
        h = self.body(self.low(x.to(torch.bfloat16)).float())
        if reach_branch:
            h = h + self.branch(h)
        return self.head(h)


class Reentrant(torch.nn.Module):
    """A layer used inside and outside a reentrant checkpoint: its gradient accumulates twice."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, x, reach_branch: bool):
        from torch.utils.checkpoint import checkpoint

        x = x.requires_grad_()
        return self.head(checkpoint(self.shared, x, use_reentrant=True) + self.shared(x))


def _reduce_both_ways(rank: int, init_file: str, out) -> None:
    """Each model's buffer averaged during the backward and in one all-reduce after it, on a real
    two-rank gloo group; what went out before the backward returned."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        found = {}
        for build in (Branchy, Reentrant):
            torch.manual_seed(0)
            model = build()
            grads = FlatGrads(model)
            flat = grads.bind(torch.device("cpu"))
            grads.plan_buckets(1, 4096)  # a first bucket of one parameter, then ~1 Linear(32, 32) each
            sums, early = [], []
            for way in ("after", "agreed", "during"):  # "agreed": a first step, reduced after
                torch.manual_seed(100 + rank)
                x = torch.randn(8, 32)
                grads.before_backward()
                if way == "during":
                    grads.begin_early_reduce(None, 2)
                loss = model(x, reach_branch=rank == 0).square().mean()
                model.zero_grad(set_to_none=False)
                loss.backward()
                early.append(len(grads._works))
                grads.after_backward(loss)
                if way == "during":
                    grads.finish_reduce()
                else:
                    grads.reduce(None, 2)
                sums.append(flat.tolist())  # plain data: a tensor in the queue outlives its process
                flat.zero_()
            found[build.__name__] = (sums, early, len(grads.buckets), grads.accumulates_twice)
        # A fresh FlatGrads whose first step is known (a group formed with exactly N replicas):
        # that backward reduces after it, so a gradient accumulated twice is seen, not raised on.
        torch.manual_seed(0)
        model = Reentrant()
        grads = FlatGrads(model)
        flat = grads.bind(torch.device("cpu"))
        grads.plan_buckets(1, 4096)
        sums, early = [], []
        for _ in range(2):
            torch.manual_seed(100 + rank)
            x = torch.randn(8, 32)
            grads.before_backward()
            grads.begin_early_reduce(None, 2)
            loss = model(x, reach_branch=True).square().mean()
            model.zero_grad(set_to_none=False)
            loss.backward()
            early.append(len(grads._works))
            grads.after_backward(loss)
            grads.finish_reduce()
            sums.append(flat.tolist())
            flat.zero_()
        found["ReentrantKnownFirst"] = (sums, early, len(grads.buckets), grads.accumulates_twice)
        out.put((rank, found))
    finally:
        dist.destroy_process_group()


def test_reducing_during_the_backward_averages_what_one_all_reduce_after_it_averages(tmp_path):
    results = run_pair(_reduce_both_ways, str(tmp_path / "init"))
    for rank in (0, 1):
        sums, early, buckets, twice = results[rank]["Branchy"]
        assert buckets >= 6 and not twice
        assert sums[2] == sums[0]  # bucket by bucket during the backward: the same mean
        assert sums[2] == results[1 - rank]["Branchy"][0][2]  # and the same on both ranks
        # Buckets, in the order they go out: the head's bias; the head's weight with the
        # branch; then the body's, one layer each; last the bf16 layer's (copied in after the
        # backward). Rank 0's batch reaches the branch: all but the last go out during its
        # backward. Rank 1's does not: the branch's bucket waits for the end, and so do all after it.
        assert early[0] == early[1] == 0
        assert early[2] == (buckets - 1 if rank == 0 else 1)
        # reentrant checkpointing accumulates twice: seen in the first step, never early again
        sums, early, _, twice = results[rank]["Reentrant"]
        assert twice and early == [0, 0, 0]
        assert sums[2] == sums[0]
        # ...and seen too when the first step of all is one reduced during the backward
        sums, early, _, twice = results[rank]["ReentrantKnownFirst"]
        assert twice and early == [0, 0] and sums[0] == sums[1] == results[rank]["Reentrant"][0][0]


def _fp16_mean(rank: int, init_file: str, out) -> None:
    """Two gloo ranks, an fp16 parameter whose gradient is 40000 on each: the mean, both ways."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 1, bias=False)).half()
        grads = FlatGrads(model)
        flat = grads.bind(torch.device("cpu"))
        grads.plan_buckets(1, 1)  # a bucket per parameter
        found = []
        for way in ("after", "during"):
            flat.fill_(40000.0)  # each replica's gradients (and loss): finite in fp16, their sum is not
            if way == "after":
                grads.reduce(None, 2)
            else:
                grads.begin_early_reduce(None, 2)
                grads.finish_reduce()  # no backward ran: every bucket goes out here, one by one
            found.append(sorted(set(flat.float().tolist())))
        out.put((rank, found))
    finally:
        dist.destroy_process_group()


def test_an_fp16_models_mean_does_not_overflow_where_its_sum_would(tmp_path):
    # The fast N summed fp16 gradients and divided after: 2 x 40000 is inf in fp16 (max 65504),
    # and every replica stepped on inf alike. Each divides first now, as DDP does.
    results = run_pair(_fp16_mean, str(tmp_path / "init"))
    assert results[0] == results[1] == [[40000.0], [40000.0]]


def test_buckets_cover_the_gradients_in_reverse_order_at_the_caps_and_wait_for_other_dtypes():
    torch.manual_seed(0)
    model = Branchy()
    grads = FlatGrads(model)
    flat = grads.bind(torch.device("cpu"))
    sizes = [p.numel() * 4 for p in grads.params]  # fp32 buffer
    grads.plan_buckets(sizes[-1], 3 * 32 * 33 * 4)
    # reverse order, contiguous, from the buffer's end down to 0 (the loss and marks go last)
    assert grads.buckets[0][1] == flat.numel() and grads.buckets[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(grads.buckets, grads.buckets[1:]))
    assert grads.buckets[0] == (flat.numel() - grads.params[-1].numel(), flat.numel())  # the first cap
    assert len(grads.buckets) == 4  # head bias; head weight, branch, body 4-3; body 2-0; the bf16 layer
    # only the last bucket (with the bf16 input layer, copied in after the backward) waits
    assert grads._early_ok == [True, True, True, False]
    assert {grads._bucket_of[i] for i, p in enumerate(grads.params) if p.dtype == torch.bfloat16} == {3}
    # a bf16 layer anywhere keeps its bucket back
    mixed = FlatGrads(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16),
                                          torch.nn.Linear(4, 4)))
    mixed.bind(torch.device("cpu"))
    mixed.plan_buckets(1, 1)  # a bucket per parameter
    assert mixed._early_ok == [True, True, False, False, True, False]


def test_a_buffer_with_no_bucket_plan_is_reduced_whole_after_the_backward():
    grads = FlatGrads(torch.nn.Linear(3, 2))
    flat = grads.bind(torch.device("cpu"))
    assert grads.buckets == [(0, flat.numel())] and grads._early_ok == [False]


def test_a_model_whose_trainable_parameters_changed_or_that_has_sparse_gradients_is_refused_by_name():
    # Unfrozen after the group formed, a parameter had no slot: fast replicas stepped it on their
    # own gradients, resting ones on stale ones, and they diverged until the checksum ended the run.
    import pytest

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    grads = FlatGrads(model)
    grads.check_model(model)
    model[0].weight.requires_grad_(True)  # gradual unfreezing, mid-run
    with pytest.raises(RuntimeError, match=r"changed after the group formed: 0.weight \(unfrozen\)"):
        grads.check_model(model)
    # A parameter replaced (weight_norm, an adapter swapped in) was named "unfrozen", and the same
    # parameters in another order named nothing at all, beside advice about requires_grad.
    model[0].weight.requires_grad_(False)
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"changed after the group formed: 1.weight \(replaced\)\."):
        grads.check_model(model)
    shortened = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    grads = FlatGrads(shortened)
    shortened[1] = torch.nn.Identity()  # a head dropped mid-run: its parameters are gone, not reordered
    with pytest.raises(RuntimeError, match=r"formed: 1.weight \(removed\), 1.bias \(removed\)\."):
        grads.check_model(shortened)
    reordered = torch.nn.Linear(4, 2)
    grads = FlatGrads(reordered)
    reordered._parameters = dict(reversed(list(reordered._parameters.items())))
    with pytest.raises(RuntimeError, match=r"formed: the same parameters, registered again or in another order"):
        grads.check_model(reordered)
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=r"sparse gradients \(0 has sparse=True\)"):
        FlatGrads(sparse).check_model(sparse)
    # A complex parameter made the presence marks complex: the first update failed comparing them.
    complex_ = torch.nn.Linear(4, 2, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=r"complex parameters \(weight, bias\)"):
        FlatGrads(complex_).check_model(complex_)
