"""ReplicaBuffers: a model's buffers as one float64 vector and back, and a step's undo."""

from __future__ import annotations

import torch

from elastic.actors.buffers import ReplicaBuffers, wide_buffer_names


def bn_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def test_a_model_without_buffers_has_nothing_to_agree_on():
    assert not ReplicaBuffers(torch.nn.Linear(4, 3), "cpu")


def test_pack_and_unpack_round_trip_every_dtype():
    model = bn_model()
    model.register_buffer("flag", torch.tensor([True, False]))
    model.register_buffer("halfs", torch.tensor([0.5, 1.25], dtype=torch.float16))
    bufs = ReplicaBuffers(model, "cpu")
    assert bufs.flat.dtype == torch.float64 and bufs.flat.numel() == 3 + 3 + 1 + 2 + 2
    model[1].running_mean.fill_(0.25)
    model[1].num_batches_tracked.fill_(2**40 + 1)  # exact in float64, not in float32
    bufs.pack()
    before = {k: v.clone() for k, v in model.state_dict().items()} | {"flag": model.flag.clone(), "halfs": model.halfs.clone()}
    for b in model.buffers():
        b.zero_()
    bufs.unpack()
    after = dict(model.state_dict()) | {"flag": model.flag, "halfs": model.halfs}
    for k, v in before.items():
        assert torch.equal(after[k], v) and after[k].dtype == v.dtype, k


def test_an_integer_constant_beyond_float64s_exact_range_is_left_as_it_is():
    # Through float64, 2**61 - 1 (a hash modulus) came back as 2**61: on every rank but rank 0 in
    # data parallel (a ReplicaDivergence), on every replica in first-N (a constant changed).
    model = bn_model()
    model.register_buffer("modulus", torch.tensor([2**61 - 1, 7]))
    model.register_buffer("edge", torch.tensor([-(2**53), 2**53]))  # still exact: kept
    assert wide_buffer_names(model) == ["modulus"]
    bufs = ReplicaBuffers(model, "cpu", leave_out=wide_buffer_names(model))
    assert bufs.flat.numel() == 3 + 3 + 1 + 2 and all(b is not model.modulus for b in bufs.tensors)
    bufs.pack()
    bufs.flat.zero_()
    bufs.unpack()
    assert model.modulus.tolist() == [2**61 - 1, 7] and model.edge.tolist() == [0, 0]


def test_the_buffers_left_out_are_those_any_rank_holds_wide(monkeypatch):
    # Decided on each rank's own values, a rank whose buffer differed (a model_fn not
    # deterministic under the seed; no broadcast of buffers at DDP's construction before torch
    # 2.13) built a vector of another length, and the buffers' collective failed or hung.
    from elastic.actors.buffers import buffer_survey

    model = bn_model()
    model.register_buffer("salt", torch.tensor([5]))  # this rank's: narrow
    model.register_buffer("cache", torch.zeros(2), persistent=False)
    other = ({"cache": ((3,), "torch.float32")}, ["salt"])  # another rank: salt beyond 2**53, a longer cache

    def all_gather_object(every, mine, group=None):
        every[:] = [mine, other]

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert buffer_survey(model, None) == (["cache"], ["salt"])


def test_a_mean_of_integer_buffers_is_rounded_back():
    model = bn_model()
    bufs = ReplicaBuffers(model, "cpu")
    bufs.pack()
    bufs.flat[-1] = 6.6  # num_batches_tracked is the last buffer
    bufs.unpack()
    assert model[1].num_batches_tracked.item() == 7


def test_restore_undoes_what_a_forward_did_to_the_statistics():
    model = bn_model().train()
    bufs = ReplicaBuffers(model, "cpu")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    bufs.save()
    model(torch.randn(8, 4))  # a step's forward: running statistics and the counter move
    assert not torch.equal(model[1].running_mean, start["1.running_mean"])
    bufs.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k


def test_non_persistent_buffers_are_caches_not_state():
    # A cache that grows in the forward (as rotary-embedding caches are re-registered longer) would
    # give ranks vectors of different lengths; it is not state, and is left alone.
    model = bn_model()
    model.register_buffer("cache", torch.zeros(5), persistent=False)
    bufs = ReplicaBuffers(model, "cpu")
    assert all(t is not model.cache for t in bufs.tensors)
    assert bufs.flat.numel() == 3 + 3 + 1
