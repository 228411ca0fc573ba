"""A commit's persist time when the ranks' hosts and the controller's keep different clocks:
parts carry their snapshot's age, read on the clock that took it, and the controller dates the
snapshot on its own clock from that (``elastic.checkpoint.store.with_age``). No Ray here: the
controller's methods on a real ``Controller`` whose Ray runtime context is a stand-in."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from elastic.actors.worker import TrainWorker
from elastic.checkpoint import CheckpointCommitter, CheckpointStore, WorkerCheckpointer
from elastic.checkpoint.store import taken_at_here, with_age, with_ages
from elastic.config import CheckpointConfig
from test_checkpoint_store import FakeWorker

AHEAD_S = 3600.0  # a worker host whose clock is an hour ahead of the controller's


def test_a_part_leaves_its_host_with_its_age_and_is_dated_on_the_receivers_clock():
    taken_at = time.time() + AHEAD_S  # the worker host's clock
    part = {"entries": [], "taken_at": taken_at}
    aged = with_age(part, now=taken_at + 0.25)  # sent a quarter second after the snapshot
    assert aged["age_s"] == pytest.approx(0.25) and part == {"entries": [], "taken_at": taken_at}
    here = taken_at_here(aged)
    assert time.time() - 0.25 - 5 < here <= time.time() - 0.25  # on this clock, not an hour ahead
    # A part that never left its host (no age): its own time, as it is. No time at all: none.
    assert taken_at_here(part) == taken_at and taken_at_here({"entries": []}) is None
    assert with_age({"entries": []}) == {"entries": []}
    # A snapshot dated after the sending (the clock stepped back in between) is not negative.
    assert with_age(part, now=taken_at - 1)["age_s"] == 0.0
    now = time.time()
    parts = with_ages({0: {"taken_at": now - 1}, 1: {"taken_at": now - 3}})
    assert parts[1]["age_s"] - parts[0]["age_s"] == pytest.approx(2.0)


@pytest.fixture
def controller(rayless_controller, tmp_path):
    c = rayless_controller(name="clocks")
    c.committer = CheckpointCommitter(CheckpointStore(f"file://{tmp_path}", "clocks"),
                                      CheckpointConfig(every_n_steps=1))
    yield c
    c.committer.close()


def test_the_persist_time_of_a_commit_is_not_off_by_the_hosts_clock_difference(controller, tmp_path):
    """A rank writes step 1 on a host whose clock is an hour ahead, and its part reaches the
    controller as the worker sends it (``with_ages`` on that host's clock). Before, the
    controller took its own clock minus the part's ``taken_at``: about -3600 s here."""
    c = controller

    def notify(step, world_size, parts):  # the rank's push, on a host an hour ahead
        ahead = {rank: {**part, "taken_at": part["taken_at"] + AHEAD_S} for rank, part in parts.items()}
        sent_at = time.time() + AHEAD_S
        c.checkpoint_written(step, world_size, {rank: with_age(part, sent_at) for rank, part in ahead.items()})

    worker = FakeWorker()
    hook = WorkerCheckpointer(f"file://{tmp_path}", None, "clocks", every_n_steps=1, blocking=True, notify=notify)
    try:
        started = time.time()
        worker.train(1)
        worker.completed_step = 1
        hook.after_step(worker, 1)
        c.committer.set_meta(1, {"data": {"cursor": 1}})
        assert c.committer.flush(10) and c.committer.latest_committed == 1
        took = time.time() - started
    finally:
        hook.close()
    committed = [e for e in c.committer.drain_events() if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in committed] == [1]
    assert 0 <= committed[0]["persist_s"] <= took


def test_a_ranks_step_results_carry_the_ages_of_its_finished_parts():
    """Parts that ride on step results (no controller to push to, a flush at the end)."""
    taken_at = time.time() - 0.5
    report = {"ckpt_done": [(3, {"entries": [], "taken_at": taken_at}), (4, {"entries": []})], "ckpt_events": []}
    out = TrainWorker._ckpt_report(SimpleNamespace(world_size=2), report)
    assert out["world_size"] == 2 and out["ckpt_events"] == []
    (step3, part3), (step4, part4) = out["ckpt_done"]
    assert (step3, step4) == (3, 4) and "age_s" not in part4
    assert 0.5 <= part3["age_s"] < 0.5 + 5 and part3["taken_at"] == taken_at
