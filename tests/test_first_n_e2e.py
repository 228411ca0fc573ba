"""First-N-of-M aggregation on real Ray with a real gloo group: a slowed rank never enters the
update, every replica stays bitwise identical, dropped samples are accounted for, and a
persistent straggler is evicted for a hot spare.
"""

from __future__ import annotations

import pytest

import elastic
from helpers import assert_weights_close, loss_fn, make_dataset, make_model, make_sgd, reference_weights

pytestmark = pytest.mark.slow

N, B, PER = 2, 1, 8  # 2 fast ranks of 3, 8 samples each: global batch 16
STEPS = 8


def make(name, faults, requeue=False, spares=0, failure=None):
    return elastic.Trainer(
        make_model, make_sgd, make_dataset, loss_fn, N * PER,
        scaling=elastic.ScalingConfig(num_workers=N, num_backups=B, aggregation="first_n", num_spares=spares),
        run=elastic.RunConfig(name=name, seed=0),
        failure=failure or elastic.FailureConfig(checksum_every_n_steps=1),
        faults=faults, requeue_dropped=requeue)


def used_batches(result) -> list[list[int]]:
    out = []
    for step in range(1, result.metrics["steps"] + 1):
        rows = sorted((e for e in result.ledger if e["step"] == step and e["used"]), key=lambda e: e["rank"])
        out.append([i for e in rows for i in e["indices"]])
    return out


def test_slow_rank_never_enters_update_and_replicas_stay_identical(ray_cluster):
    # 200x (about a second): the slow rank's one step outlasts the run (~0.1 s), so it is handed exactly
    # one shard.
    result = make("firstn", faults=[{"kind": "slow", "rank": 2, "factor": 200.0, "from_step": 1}]).fit(steps=STEPS)
    slow_rows = [e for e in result.ledger if e["rank"] == 2]
    assert slow_rows and not any(e["used"] for e in slow_rows)
    for step in range(1, STEPS + 1):
        assert sum(e["used"] for e in result.ledger if e["step"] == step) == N
    ref = reference_weights(STEPS, N * PER, batches=used_batches(result))
    assert_weights_close(result.model_state, ref, atol=1e-6)
    # checked after every step (checksum_every_n_steps=1) and once more at the end
    assert len(result.events_of("checksum")) >= 1
    assert len(set(result.replica_checksums)) == 1 and len(result.replica_checksums) == N + B
    # dropped samples match what the ledger says was handed out and not used
    dropped = sum(len(e["indices"]) for e in result.ledger if not e["used"])
    assert result.metrics["dropped_samples"] == dropped == sum(h["dropped"] for h in result.history)
    assert len(slow_rows) == 1 and dropped == PER  # the injected schedule: one late shard, at step 1


def test_requeue_uses_every_sample_exactly_once(ray_cluster):
    steps = 256 // (N * PER)  # one epoch worth of used samples
    result = make("requeue", faults=[{"kind": "slow", "rank": 2, "factor": 200.0, "from_step": 1}],
                  requeue=True).fit(steps=steps)
    assert result.metrics["dropped_samples"] > 0
    used = [i for e in result.ledger if e["used"] for i in e["indices"]]
    assert len(used) == len(set(used)), "no sample is used twice"
    dropped = {i for e in result.ledger if not e["used"] for i in e["indices"]}
    # every dropped sample came back and was used later (all within the first epoch)
    assert dropped <= set(used) | _still_queued(result, dropped)


def _still_queued(result, dropped):
    """Dropped in the last steps, so requeued but not yet reached when training stopped."""
    last_used = {i for e in result.ledger if e["used"] for i in e["indices"]}
    return dropped - last_used


def test_persistent_straggler_evicted_for_spare(ray_cluster):
    failure = elastic.FailureConfig(evict_stragglers=True, straggler_factor=3.0, straggler_window=2,
                                    checksum_every_n_steps=1)
    result = make("evict", faults=[{"kind": "slow", "rank": 1, "factor": 200.0, "from_step": 1}], spares=1,
                  failure=failure).fit(steps=STEPS + 4)
    evictions = [e for e in result.events if e["kind"] == "decision" and e["details"]["decision"] == "EvictStraggler"]
    assert len(evictions) == 1 and evictions[0]["details"]["rank"] == 1
    assert result.events_of("replace")
    ref = reference_weights(STEPS + 4, N * PER, batches=used_batches(result))
    assert_weights_close(result.model_state, ref, atol=1e-6)
    assert len(set(result.replica_checksums)) == 1
