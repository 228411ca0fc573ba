"""Module buffers (BatchNorm's running statistics) on real Ray: a resumed run, a run that healed
from a killed rank and an uninterrupted run end with the same buffers, and first-N replicas hold
identical buffers (the replica checksum covers them).
"""

from __future__ import annotations

import pytest

import elastic
from helpers import assert_weights_close, loss_fn, make_bn_model, make_dataset, make_sgd

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
