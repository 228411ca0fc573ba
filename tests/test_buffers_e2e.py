"""Module buffers (BatchNorm's running statistics) on real Ray: a resumed run, a run that healed
from a killed rank and an uninterrupted run end with the same buffers, and first-N replicas hold
identical buffers (the replica checksum covers them).
"""

from __future__ import annotations

import copy

import pytest
import torch

import elastic
from helpers import assert_weights_close, initial_model, loss_fn, make_bn_model, make_dataset, make_sgd

pytestmark = pytest.mark.slow

STEPS = 10


def trainer(name, storage=None, backups=0, faults=None, **scaling):
    return elastic.Trainer(
        make_bn_model, make_sgd, make_dataset, loss_fn, 32,
        scaling=elastic.ScalingConfig(num_workers=2, num_backups=backups, **scaling),
        run=elastic.RunConfig(name=name, seed=0, storage=storage,
                              checkpoint=elastic.CheckpointConfig(min_shard_bytes=0)),
        failure=elastic.FailureConfig(checksum_every_n_steps=1), faults=faults)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster):
    result = trainer("bn-reference").fit(steps=STEPS)
    # the statistics moved, and every replica ended with the same parameters and buffers
    assert result.model_state["1.num_batches_tracked"].item() == STEPS
    assert len(set(result.replica_checksums)) == 1
    return result.model_state


def test_a_resumed_run_ends_with_the_buffers_of_an_uninterrupted_one(ray_cluster, tmp_path, uninterrupted):
    # Both ranks write a share (min_shard_bytes=0), so rank 1 writes half of the model's tensors:
    # before the buffers were agreed after every step, its running statistics were its own.
    url = f"file://{tmp_path}/ckpt"
    trainer("bn-resume", url).fit(steps=5)
    resumed = trainer("bn-resume", url).fit(steps=STEPS)
    assert resumed.metrics["restored_from"] == 5
    assert_weights_close(resumed.model_state, uninterrupted, atol=1e-6)


def test_a_step_a_peer_died_in_leaves_no_trace_in_the_survivors_buffers(ray_cluster, uninterrupted):
    # Rank 1 dies in step 4, after rank 0's forward updated its statistics: the step is replayed,
    # and rank 0 must not count that batch twice.
    healed = trainer("bn-kill", backups=1, faults=[{"kind": "kill", "rank": 1, "at_step": 4}]).fit(steps=STEPS)
    assert len(healed.recoveries) == 1
    assert_weights_close(healed.model_state, uninterrupted, atol=1e-6)


def test_first_n_replicas_agree_on_their_buffers(ray_cluster):
    # The slow replica's own statistics never count; every replica, it included, ends with the
    # fast ranks' mean (checked after every step: checksum_every_n_steps=1).
    result = trainer("bn-first-n", backups=1, aggregation="first_n",
                     faults=[{"kind": "slow", "rank": 2, "factor": 200.0, "from_step": 1}]).fit(steps=STEPS)
    assert all(h["ranks"] == [0, 1] for h in result.history)
    assert len(result.replica_checksums) == 3 and len(set(result.replica_checksums)) == 1
    assert result.model_state["1.num_batches_tracked"].item() == STEPS
    # What they agree on is the fast ranks' mean: one process replaying the run, each step's
    # shards of ranks 0 and 1 (from the ledger) from the same state, their gradients and
    # buffers averaged, holds the same parameters and running statistics.
    shards = [[e["indices"] for e in sorted((e for e in result.ledger if e["step"] == step and e["used"]),
                                            key=lambda e: e["rank"])] for step in range(1, STEPS + 1)]
    assert all(len(step) == 2 for step in shards)
    assert_weights_close(result.model_state, first_n_reference(shards), atol=1e-6)
    # and the check tells the mean apart: rank 0's own statistics (its batches only) are elsewhere
    own = first_n_reference(shards, buffers_of=0)
    assert (result.model_state["1.running_mean"] - own["1.running_mean"]).abs().max() > 1e-3


def first_n_reference(shards: list[list[list[int]]], buffers_of: int | None = None) -> dict:
    """One process trains on each step's fast shards: every shard's forward and backward from the
    step's starting state, the gradients averaged as first-N averages them, and the buffers the
    shards' forwards left averaged in float64 (elastic/actors/buffers.py), or ``buffers_of``'s own."""
    model = initial_model(0, make_bn_model)
    opt = make_sgd(model.parameters())
    ds = make_dataset()
    params = list(model.parameters())
    for step_shards in shards:
        start = copy.deepcopy(model.state_dict())
        grads, buffers = [], []
        for idx in step_shards:
            model.load_state_dict(start)
            model.zero_grad(set_to_none=True)
            loss_fn(model, ds[idx]).backward()
            grads.append([p.grad.clone() for p in params])
            buffers.append([b.detach().clone() for b in model.buffers()])
        model.load_state_dict(start)  # the forwards' buffer updates undone; the mean set below
        with torch.no_grad():
            for i, b in enumerate(model.buffers()):
                if buffers_of is not None:
                    b.copy_(buffers[buffers_of][i])
                    continue
                mean = sum(bs[i].double() for bs in buffers) / len(buffers)
                b.copy_(mean if b.is_floating_point() else mean.round())
        for j, p in enumerate(params):
            p.grad = sum(g[j] for g in grads) / len(grads)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
