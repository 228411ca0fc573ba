"""The benchmarks' JSON lines: one per figure, a number or null with a word why, and valid JSON."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture
def lines(monkeypatch):
    import common

    out = io.StringIO()
    monkeypatch.setattr(common, "_FIGURES", out)
    def strict(constant):  # json.loads takes NaN and Infinity, which no other JSON reader does
        pytest.fail(f"not JSON: {constant}")

    return lambda: [json.loads(line, parse_constant=strict) for line in out.getvalue().splitlines()]


def test_a_figure_is_a_number_or_null_with_a_word_why(lines):
    from common import emit

    emit("a", 1.5, "s", n=3)
    emit("b", None, "bytes")  # a null with no word read like a result
    emit("c", float("nan"), "ratio", caveat="kept")
    emit("d", None, "ratio", value_note="no ratio: a lost time is not positive")
    a, b, c, d = lines()
    assert a == {"figure": "a", "value": 1.5, "unit": "s", "n": 3}
    assert b["value"] is None and "not measured" in b["value_note"]
    assert c["value"] is None and "not a finite number (nan)" in c["value_note"] and c["caveat"] == "kept"
    assert d["value_note"] == "no ratio: a lost time is not positive"


def test_a_detail_that_is_no_finite_number_goes_out_as_null_not_invalid_json(lines):
    from common import emit

    emit("e", 2.0, "ratio", per_round=[1.0, float("nan")], nested={"x": float("inf")})
    (e,) = lines()
    assert e["per_round"] == [1.0, None] and e["nested"] == {"x": None}


def test_snapshot_cost_times_the_default_runs_split_two_writers_of_half_the_state():
    """With ``CheckpointConfig.min_shard_bytes`` the default 3.2 MB state goes to two writers of
    ~1.6 MB that rotate with the step; timed with 0, every rank wrote ~0.8-1.05 MB every step."""
    import elastic
    import snapshot_cost
    from elastic.checkpoint.codec import flatten_state
    from elastic.checkpoint.worker_hook import live_state

    args = snapshot_cost.build_parser().parse_args([])
    assert args.min_shard_bytes == elastic.CheckpointConfig().min_shard_bytes
    w = snapshot_cost.workload_from_args(args)
    rank = snapshot_cost.Rank(w, args.rank)
    rank.train_step()  # the momentum buffers, as at every timed snapshot
    tensors, _ = flatten_state(live_state(rank))
    state_bytes = sum(t.nbytes for t in tensors.values())
    shares = [snapshot_cost.share_at(tensors, args.rank, w.workers, args.min_shard_bytes, step)
              for step in range(1, w.workers + 1)]
    writing = [s for s in shares if s["writes"]]
    assert len(writing) == 2  # one step in two, over a full rotation
    for s in writing:
        assert abs(s["bytes"] - state_bytes / 2) < 0.05 * state_bytes, (s, state_bytes)
    assert sum(s["bytes"] for s in writing) == state_bytes  # each half once: shard 0 and shard 1
    assert sum(s["skeleton"] for s in writing) == 1
    assert all(s["bytes"] == 0 and not s["skeleton"] for s in shares if not s["writes"])


class _FakeResult:
    def __init__(self, failures=0, recoveries=()):
        self.metrics = {"failures": failures}
        self.recoveries = list(recoveries)


def test_a_run_with_a_failure_or_a_recovery_fails_the_benchmark_naming_the_run():
    from common import require_clean

    require_clean(_FakeResult(), "ours clean")  # no failure: nothing said
    with pytest.raises(SystemExit, match="ours throughput-0"):
        require_clean(_FakeResult(failures=1, recoveries=[{"kind": "failure", "step": 1}]), "ours throughput-0")
    with pytest.raises(SystemExit, match="evict run"):  # a recovery alone is enough
        require_clean(_FakeResult(recoveries=[{"kind": "hang", "step": 70}]), "evict run")


def test_a_spare_ready_only_at_the_evict_runs_last_step_records_no_ratio_and_fails_nothing():
    import straggler

    steps = 20
    history = [{"step": s, "step_time_s": 0.01, "samples": 256, "controller_time_s": 0.001}
               for s in range(1, steps + 1)]
    healthy = {"mode": "healthy", "history": history}
    run = {"mode": "evict", "history": history, "run_steps": steps, "evicted_after_step": 8, "evicted_rank": 3,
           "evict_reason": "slow", "spare_ready_step": steps,
           "after_spare_ready": straggler.history_throughput(history, steps)}
    out = straggler.evict_details(run, healthy)
    assert out["ratio_after_spare_ready"] is None and "last step" in out["ratio_after_spare_ready_note"]
    assert out["steps_after_spare_ready"] == 0
    # Steps left after it: the ratio is taken as before.
    run.update(spare_ready_step=15, after_spare_ready=straggler.history_throughput(history, 15))
    assert straggler.evict_details(run, healthy)["ratio_after_spare_ready"] == pytest.approx(1.0)


def test_the_straggler_runs_data_lasts_every_step_of_first_ns_five_replicas():
    # Sized by the global batch (the 4 workers' shards a step), the first-N runs, which hand each of
    # their five replicas a worker's shard, wrapped their epoch at step 320 of 400.
    import argparse

    import common
    from elastic.data import ShardPlan

    p = argparse.ArgumentParser()
    common.add_workload_args(p, steps=400)
    args = p.parse_args([])
    w = common.workload_from_args(args, replicas=args.workers + 1)
    plan = ShardPlan(w.dataset_size, seed=0)
    assert {plan.take(args.workers + 1, w.batch_per_worker)[0] for _ in range(400)} == {0}
    assert common.workload_from_args(args).dataset_size == 400 * w.global_batch  # data parallel: as before
