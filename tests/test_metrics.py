"""The dashboard metrics' bookkeeping, with recording stand-ins for Ray's metric objects (the
real ones are scraped from Prometheus in tests/test_jobs_e2e.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

from elastic.metrics import RunMetrics


class Recorder:
    def __init__(self):
        self.values = defaultdict(list)

    def set(self, value, tags):
        self.values[tags.get("rank")].append(value)

    observe = inc = set


def metrics() -> RunMetrics:
    m = RunMetrics("r")
    m._m = defaultdict(Recorder)
    return m


def controller(ranks):
    rows = [{"rank": r, "heartbeat_age_s": 0.1, "straggler_score": 1.0, "behind_steps": 0, "step_time_s": 0.2}
            for r in ranks]
    return SimpleNamespace(rank_rows=lambda spares: rows, group=SimpleNamespace(spares=[], pending_spares=0),
                           committer=None)


def record(step, world, **extra):
    return SimpleNamespace(**{"step": step, "step_time_s": 0.2, "samples": 64, "world_size": world, "grad_norm": None,
                              "dropped": 0, "update_skipped": False, **extra})


def test_a_rank_gone_after_a_shrink_stops_showing_its_last_values():
    m = metrics()
    m.on_step(record(1, 4), controller(range(4)))
    m.on_step(record(2, 3), controller(range(3)))  # shrunk: rank 3 is no more
    for name in ("heartbeat_age", "straggler", "rank_behind", "rank_step_time"):
        assert math.isnan(m._m[name].values["3"][-1]), name
        assert m._m[name].values["2"][-1] == m._m[name].values["2"][0]
    m.on_step(record(3, 3), controller(range(3)))
    assert len(m._m["straggler"].values["3"]) == 2  # set to NaN once, then left alone


def test_heartbeat_ages_are_published_while_a_step_waits():
    m = metrics()
    m.on_heartbeats({0: 0.5, 1: 12.0})
    assert m._m["heartbeat_age"].values == {"0": [0.5], "1": [12.0]}


def test_a_rank_seen_only_by_its_heartbeat_is_blanked_when_the_group_shrinks():
    # Rank 3 hangs in the first window: only on_heartbeats ever named it, then a shrink to two
    # ranks left its 45 s heartbeat age on the dashboard for good.
    m = metrics()
    m.on_heartbeats({0: 0.1, 1: 0.1, 2: 0.1, 3: 45.0})
    m.on_step(record(1, 2), controller(range(2)))
    assert math.isnan(m._m["heartbeat_age"].values["3"][-1]) and math.isnan(m._m["heartbeat_age"].values["2"][-1])


def test_a_rank_with_no_result_in_the_window_shows_no_step_time_not_its_last_fast_one():
    # A late first-N replica returns no result: its step-time gauge kept its last fast value.
    m = metrics()
    c = controller(range(3))
    m.on_step(record(1, 3), c)
    c.rank_rows(False)[2].update(step_time_s=None, straggler_score=40.0)
    m.on_step(record(2, 3), c)
    assert m._m["rank_step_time"].values["2"][0] == 0.2 and math.isnan(m._m["rank_step_time"].values["2"][-1])
    assert m._m["rank_step_time"].values["1"] == [0.2, 0.2]


def test_a_rank_with_no_straggler_score_yet_shows_none_not_a_typical_one():
    # The warm-up, a rank's cold first step: no score. Gauge.set(None) sets nothing, and 1.0
    # said "typical" of a spare three times slower.
    m = metrics()
    c = controller(range(2))
    c.rank_rows(False)[1].update(straggler_score=None)
    m.on_step(record(1, 2), c)
    assert math.isnan(m._m["straggler"].values["1"][-1]) and m._m["straggler"].values["0"] == [1.0]


def test_the_group_and_pool_gauges_follow_a_recovery_before_any_step():
    # A failure promotes the only spare and waits for capacity: no step completes meanwhile, and
    # the gauges showed the pool from before the failure (one spare available).
    m = metrics()
    m.on_step(record(5, 4), controller(range(4)))
    m.on_membership(world_size=3, spares=0, building=1)
    assert m._m["world_size"].values[None][-1] == 3
    assert m._m["spares"].values[None][-1] == 0 and m._m["spares_building"].values[None][-1] == 1


def test_an_fp16_step_whose_update_was_skipped_is_counted():
    m = metrics()
    m.on_step(record(1, 2), controller(range(2)))
    m.on_step(record(2, 2, update_skipped=True), controller(range(2)))
    assert m._m["skipped"].values[None] == [1]


def test_a_step_kept_after_a_rebuild_counts_its_drops_and_moves_the_step():
    m = metrics()
    kept = SimpleNamespace(step=7, dropped=8)
    m.on_kept_step(kept)
    assert m._m["step"].values[None] == [7] and m._m["dropped"].values[None] == [8]


def test_every_gauge_is_set_again_with_its_last_value_until_the_run_ends():
    # Ray 2.60 exports a gauge once after it is set and its agent keeps it ~20 s: a gauge set
    # only when something happens (a recovery's seconds, the pool while waiting for capacity)
    # dropped off Prometheus. The refresher sets each again; a gone rank's series is let go.
    m = metrics()
    m.on_step(record(1, 2), controller(range(2)))
    m.on_recovery("actor_died", 1.5)
    m.on_step(record(2, 1), controller(range(1)))  # shrunk: rank 1 is no more
    before = {name: {rank: list(v) for rank, v in rec.values.items()} for name, rec in m._m.items()}
    m.refresh()
    assert m._m["recovery_s"].values[None][-1] == 1.5 and len(m._m["recovery_s"].values[None]) == 2
    assert m._m["step"].values[None][-1] == 2 and m._m["world_size"].values[None][-1] == 1
    assert m._m["straggler"].values["0"][-1] == 1.0
    assert m._m["straggler"].values["1"] == before["straggler"]["1"]  # NaN once, then left to age out
    assert m._m["step_time"].values == before["step_time"]  # the histogram is cumulative: never re-observed
    assert m._m["failures"].values == before.get("failures", {}) and \
        m._m["recoveries"].values[None] == before["recoveries"][None]  # nor are counters
    m.close()
    m.refresh()
    assert len(m._m["recovery_s"].values[None]) == 2  # ended: nothing is set again


def test_the_refresher_thread_starts_with_the_first_gauge_and_stops_at_close(monkeypatch):
    import time

    from elastic import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "refresh_interval_s", lambda: 0.01)
    m = metrics()
    m.on_membership(world_size=4, spares=0, building=1)
    deadline = time.time() + 5
    while len(m._m["spares_building"].values[None]) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(m._m["spares_building"].values[None]) >= 3
    m.close()
    m._refresher.join(timeout=5)
    assert not m._refresher.is_alive()


def test_a_commit_sets_the_persist_time_and_the_lag_now():
    m = metrics()
    m.on_checkpoint(0.25, lag=0)
    m.on_checkpoint(None, lag=1)  # a commit whose snapshot time is not known leaves the gauge as it was
    assert m._m["persist_s"].values[None] == [0.25] and m._m["ckpt_lag"].values[None] == [0, 1]


def test_run_metrics_travel_to_the_controller_without_their_thread_or_values():
    import pickle

    m = metrics()
    m.on_membership(world_size=4, spares=1, building=0)
    copy = pickle.loads(pickle.dumps(m))
    assert copy.run == "r" and copy._m is None and copy._last == {} and copy._refresher is None
    m.close()


def test_a_lost_ranks_heartbeat_age_grows_while_nothing_else_updates_it(monkeypatch):
    # Rank 1's node died; the run waits 30 minutes for capacity. No step completes and no gather
    # asks for heartbeats, so the gauge was set again with its last value (~0 s), while
    # `elastic status` showed the age growing: an alert on it never fired.
    import elastic.metrics as metrics_module

    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m = metrics()
    m.on_heartbeats({0: 0.5, 1: 2.0})
    clock[0] += 60
    m.refresh()
    assert m._m["heartbeat_age"].values["1"][-1] == 62.0 and m._m["heartbeat_age"].values["0"][-1] == 60.5
    m.on_step(record(1, 1), controller([0]))  # rank 1 is gone: NaN once, then not set again
    clock[0] += 60
    m.refresh()
    assert math.isnan(m._m["heartbeat_age"].values["1"][-1])
    assert abs(m._m["heartbeat_age"].values["0"][-1] - 60.1) < 1e-9


def test_a_rebuild_shows_no_throughput_and_only_the_lost_ranks_heartbeat_age_grows(monkeypatch):
    # During a recovery the last step's throughput stayed on the dashboard, every survivor's
    # heartbeat age grew as if hung (no one asks them while the ring is rebuilt), and the old
    # ring's straggler scores stayed on the rank numbers the new group takes.
    import elastic.metrics as metrics_module

    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m = metrics()
    m.on_step(record(5, 3), controller(range(3)))
    m.on_rebuild(lost={1})
    assert m._m["samples"].values[None][-1] == 0.0
    for name in ("straggler", "rank_behind", "rank_step_time"):
        assert all(math.isnan(m._m[name].values[r][-1]) for r in ("0", "1", "2")), name
    assert math.isnan(m._m["heartbeat_age"].values["0"][-1]) and math.isnan(m._m["heartbeat_age"].values["2"][-1])
    clock[0] += 60
    m.refresh()
    assert abs(m._m["heartbeat_age"].values["1"][-1] - 60.1) < 1e-9  # the lost rank's keeps growing: its alert fires
    assert math.isnan(m._m["heartbeat_age"].values["0"][-1])  # survivors: not set again
    assert m._m["samples"].values[None][-1] == 0.0
    m.on_group([0, 1])  # rebuilt, shrunk to two: rank 1 a promoted spare, rank 2 gone
    assert m._m["heartbeat_age"].values["1"][-1] == 0.0 and m._m["heartbeat_age"].values["0"][-1] == 0.0
    assert math.isnan(m._m["straggler"].values["1"][-1]) and math.isnan(m._m["heartbeat_age"].values["2"][-1])
    clock[0] += 5
    m.refresh()
    assert m._m["heartbeat_age"].values["1"][-1] == 5.0 and len(m._m["heartbeat_age"].values["2"]) == 2  # NaN once


def test_the_lag_gauge_counts_from_the_newest_step_a_rank_finished_and_a_rewind_moves_the_step():
    asked = []
    m = metrics()
    c = controller(range(2))
    c.committer = SimpleNamespace(lag=lambda step: asked.append(step) or step - 3)
    c._progress_step = lambda: 9  # a rank ahead of the step booked (a window's later steps, a late replica)
    m.on_step(record(7, 2), c)
    assert asked == [9] and m._m["ckpt_lag"].values[None][-1] == 6
    m.on_rewind(4, lag=0)  # restarted from the checkpoint of step 4
    assert m._m["step"].values[None][-1] == 4 and m._m["ckpt_lag"].values[None][-1] == 0


def test_ages_read_on_another_thread_are_published_with_the_rank_numbers_of_the_same_moment():
    # The run's end's heartbeat thread read the ranks (4, numbered 0-3) and their ages, then
    # published them; a late replica released meanwhile on the step thread renumbered the rest,
    # and the new group's on_group forgot rank 3 in between: published after it, rank 3 aged on
    # the gauge until the run ended. Read under the lock on_group takes, the ages and the
    # numbers are those of one moment: before the new group (then on_group blanks rank 3) or
    # after it.
    import threading

    m = metrics()
    m.on_group([0, 1, 2, 3])
    group = [0, 1, 2, 3]
    reading, release = threading.Event(), threading.Event()

    def ages():
        now_in = list(group)
        reading.set()
        release.wait(5)
        return {r: 7.0 for r in now_in}

    beats = threading.Thread(target=m.on_heartbeats, args=(ages,))
    beats.start()
    assert reading.wait(5)
    group.remove(3)  # the step thread: a late replica released, the rest renumbered ...
    formed = threading.Thread(target=m.on_group, args=([0, 1, 2],))  # ... and the new group formed
    formed.start()
    formed.join(0.3)
    assert formed.is_alive()  # it waits for the ages read before it to be published
    release.set()
    beats.join(5)
    formed.join(5)
    assert math.isnan(m._m["heartbeat_age"].values["3"][-1])
    assert m._m["heartbeat_age"].values["0"][-1] == 0.0
    m.refresh()
    assert math.isnan(m._m["heartbeat_age"].values["3"][-1])  # blanked once, then not set again
