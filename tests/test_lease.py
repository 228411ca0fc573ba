"""The run's storage lease (``RunLease``): one live run per run directory, across Ray clusters.

Real storage (``file://`` and ``memory://``), a fake clock: the waits are ``ttl_s`` long, and a
second holder renews from inside the waiting one's sleep, as a live driver elsewhere would.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic.checkpoint import CheckpointCommitter, CheckpointStore
from elastic.checkpoint.lease import LEASE_FILE, LeaseHeld, RunLease
from elastic.checkpoint.storage import RetryPolicy, Storage, StorageUnavailable
from elastic.checkpoint.testing import clear_memory
from elastic.config import CheckpointConfig, ConfigError

FAST = RetryPolicy(attempts=1)


class Clock:
    """Wall and monotonic time that move only when someone sleeps; ``during_sleep`` runs at each
    sleep (another driver renewing its lease meanwhile)."""

    def __init__(self, start: float = 1_800_000_000.0):
        self.now = start
        self.slept = 0.0
        self.during_sleep = lambda: None

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s
        self.during_sleep()


@pytest.fixture(params=["file", "memory"])
def storage(request, tmp_path):
    if request.param == "file":
        yield Storage(f"file://{tmp_path}/runs/r", retry=FAST)
    else:
        url = f"memory://elastic-lease-test-{id(request)}-{time.monotonic_ns()}/r"
        yield Storage(url, retry=FAST)
        clear_memory(url)


def lease(storage, clock, cluster="cluster-a", host="host-a", **kw):
    return RunLease(storage, {"run": "r", "cluster": cluster, "gcs": f"{host}:6379", "job": "02000000",
                              "host": host, "pid": 4242}, renew_s=5.0, ttl_s=30.0, clock=clock.time,
                    monotonic=clock.time, sleep=clock.sleep, **kw)


def on_storage(storage) -> dict:
    return json.loads(storage.read_bytes(LEASE_FILE))


def test_a_free_run_directory_is_taken_renewed_and_released(storage):
    clock = Clock()
    mine = lease(storage, clock)
    assert mine.acquire() is None  # nothing taken over
    assert mine.held and clock.slept == 0  # no wait when there is no lease
    first = on_storage(storage)
    assert first["owner"] == mine.record["owner"] and first["host"] == "host-a"
    clock.now += 5
    assert mine.renew()
    again = on_storage(storage)
    assert again["count"] == first["count"] + 1 and again["renewed_at"] == first["renewed_at"] + 5
    mine.release()
    assert not storage.exists(LEASE_FILE) and not mine.held


def test_a_live_run_elsewhere_is_refused_naming_it_and_the_fields_to_change(storage):
    clock = Clock()
    theirs = lease(storage, clock, cluster="cluster-b", host="host-b")
    theirs.acquire()
    clock.during_sleep = lambda: theirs.renew()  # alive: renews while the newcomer watches
    mine = lease(storage, clock)
    with pytest.raises(LeaseHeld) as err:
        mine.acquire()
    text = str(err.value)
    assert isinstance(err.value, ConfigError)
    assert "RunConfig.name" in text and "RunConfig.storage" in text and "host-b" in text and "host-b:6379" in text
    assert clock.slept <= 30.0  # decided within the ttl
    assert on_storage(storage)["owner"] == theirs.record["owner"]  # theirs untouched
    assert not mine.held


def test_a_lease_not_renewed_for_the_ttl_is_taken_over(storage):
    clock = Clock()
    dead = lease(storage, clock, cluster="cluster-b", host="host-b")
    dead.acquire()  # and never renewed again: its driver died
    mine = lease(storage, clock)
    watched = []
    took = mine.acquire(on_watch=watched.append)
    assert len(watched) == 1 and "watching it for up to 30 s" in watched[0] and "host-b" in watched[0]
    assert "not renewed for 30 s" in took and "host-b" in took
    assert clock.slept >= 30.0  # watched for the whole ttl first
    assert on_storage(storage)["owner"] == mine.record["owner"]
    # The old holder, back (a partition healed), finds it lost at its next renewal.
    assert not dead.renew()
    assert "host-a" in dead.lost and not dead.held
    assert on_storage(storage)["owner"] == mine.record["owner"]  # it wrote nothing over it


def test_a_lease_of_this_ray_cluster_is_taken_over_at_once(storage):
    clock = Clock()
    lease(storage, clock, host="old-controller").acquire()
    mine = lease(storage, clock)  # the same cluster: a live holder would hold the run's name here
    assert "ended on this Ray cluster" in mine.acquire(on_watch=pytest.fail)
    assert clock.slept == 0


def test_a_lease_renewed_long_ago_by_the_readers_clock_is_watched_briefly_then_taken(storage):
    clock = Clock()
    lease(storage, clock, cluster="cluster-b").acquire()
    clock.now += RunLease.STALE_AFTER_S + 1
    mine = lease(storage, clock)
    assert "renewed 601 s ago and not since" in mine.acquire()
    assert 5.0 <= clock.slept <= 2 * 5.0 + 2.0  # two of its renewals and a margin, not the ttl


def test_a_live_holder_whose_clock_is_far_behind_is_not_taken_over(storage):
    clock = Clock()
    theirs = lease(storage, clock, cluster="cluster-b")
    theirs.acquire()
    theirs._clock = lambda: clock.now - RunLease.STALE_AFTER_S - 60  # its clock 11 minutes behind
    theirs.renew()
    clock.during_sleep = lambda: theirs.renew()
    with pytest.raises(LeaseHeld):
        lease(storage, clock).acquire()


def test_a_holder_cut_off_for_most_of_the_ttl_is_no_longer_current_until_it_renews(storage):
    clock = Clock()
    mine = lease(storage, clock)
    mine.acquire()
    assert mine.current()
    clock.now += 30.0 - 5.0 - 0.1  # ttl_s - renew_s, nearly
    assert mine.current()
    clock.now += 0.2
    assert not mine.current() and mine._wake.is_set()  # and asks for a renewal now
    assert mine.renew() and mine.current()
    theirs = lease(storage, clock, cluster="cluster-b")
    theirs._write()
    assert not mine.renew() and not mine.current()


def test_holders_without_a_cluster_are_never_taken_for_the_same_cluster(storage):
    clock = Clock()
    theirs = lease(storage, clock, cluster=None)
    theirs.acquire()
    clock.during_sleep = lambda: theirs.renew()
    with pytest.raises(LeaseHeld):
        lease(storage, clock, cluster=None).acquire()


def test_a_lease_file_that_is_not_elastics_is_watched_like_any_other(storage):
    clock = Clock()
    storage.write_bytes(LEASE_FILE, b"\x00 not json")
    mine = lease(storage, clock)
    assert "not renewed for 30 s" in mine.acquire()
    assert on_storage(storage)["owner"] == mine.record["owner"]


def test_a_lease_released_while_the_newcomer_watches_is_taken(storage):
    clock = Clock()
    theirs = lease(storage, clock, cluster="cluster-b")
    theirs.acquire()
    clock.during_sleep = theirs.release
    assert "released while this run waited" in lease(storage, clock).acquire()


def test_two_runs_starting_together_end_with_one_holder(storage):
    """Both read no lease; the one whose write is overwritten before its read-back is refused."""
    clock = Clock()
    mine = lease(storage, clock)
    theirs = lease(storage, clock, cluster="cluster-b", host="host-b")
    write = mine._write

    def write_then_theirs():
        write()
        theirs._write()  # theirs lands right after ours

    mine._write = write_then_theirs
    with pytest.raises(LeaseHeld, match="same moment"):
        mine.acquire()
    assert not mine.held


def test_two_holders_converge_at_the_next_renewal(storage):
    """Both read no lease and each read back its own write (the other's landed after): the one
    that reads the other's at its renewal stops, and the other keeps it."""
    clock = Clock()
    first = lease(storage, clock)
    second = lease(storage, clock, cluster="cluster-b", host="host-b")
    first.acquire()
    second._write()  # as if its acquire had read no lease before first's write landed
    second.held = True
    assert not first.renew() and "host-b" in first.lost
    assert second.renew() and second.renew()
    assert on_storage(storage)["owner"] == second.record["owner"]


def test_release_leaves_another_holders_lease(storage):
    clock = Clock()
    mine = lease(storage, clock)
    mine.acquire()
    theirs = lease(storage, clock, cluster="cluster-b")
    theirs._write()
    mine.release()
    assert on_storage(storage)["owner"] == theirs.record["owner"]


def test_renewals_on_their_thread_tell_an_outage_and_a_loss(tmp_path):
    storage = Storage(f"file://{tmp_path}/runs/r", retry=FAST)
    mine = RunLease(storage, {"cluster": "a", "host": "h"}, renew_s=0.05, ttl_s=1.0)
    mine.acquire()
    events, lost = [], threading.Event()
    failing = threading.Event()
    read = storage.read_bytes

    def flaky_read(*a, **kw):
        if failing.is_set():
            raise StorageUnavailable("read lease.json failed after 1 attempts: ConnectionError")
        return read(*a, **kw)

    storage.read_bytes = flaky_read
    mine.start_renewing(lambda why: (events.append(("lost", why)), lost.set()),
                        on_event=lambda kind, message: events.append((kind, message)))
    try:
        failing.set()
        deadline = time.monotonic() + 10
        while not any(k == "lease_renewal_failed" for k, _ in events) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.4)  # several more renewals fail
        failing.clear()
        while not any(k == "lease_renewed" for k, _ in events) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # several more succeed
        assert [k for k, _ in events] == ["lease_renewal_failed", "lease_renewed"]  # once each, not per try
        other = RunLease(storage, {"cluster": "b", "host": "elsewhere"})
        # Again until found: a renewal between its read and its write puts its own back once.
        while not lost.wait(0.05) and time.monotonic() < deadline:
            other._write()
        assert lost.is_set()
        assert events[-1][0] == "lost" and "elsewhere" in events[-1][1]
    finally:
        mine.stop()
    assert mine._thread is not None and not mine._thread.is_alive()


def test_release_waits_briefly_for_a_renewal_under_way_and_then_leaves_the_lease(tmp_path):
    storage = Storage(f"file://{tmp_path}/runs/r", retry=FAST)
    mine = RunLease(storage, {"cluster": "a"}, renew_s=0.05)
    mine.acquire()
    stuck, inside = threading.Event(), threading.Event()
    read = storage.read_bytes

    def slow_read(*a, **kw):
        if stuck.is_set():
            inside.set()
            time.sleep(5)
        return read(*a, **kw)

    storage.read_bytes = slow_read
    mine.start_renewing(lambda why: None)
    stuck.set()
    assert inside.wait(5)
    t0 = time.monotonic()
    mine.release()
    assert time.monotonic() - t0 < RunLease.RELEASE_WAIT_S + 1.0
    # Not deleted under a renewal that could write it again after the delete.
    assert storage.exists(LEASE_FILE)


def _write_step(committer, store, step):
    """Step ``step``'s one shard written and handed to ``committer``, with its meta."""
    import torch

    committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, {"model": {"w": torch.full((3,), step)}}))
    committer.set_meta(step, {})


def _committed_then_gated(committer, store, close_the_gate):
    """Step 1 committed; then the gate closed and step 2 handed over, to wait there."""
    _write_step(committer, store, 1)
    assert committer.flush(10) and store.committed_steps() == [1]
    close_the_gate()
    _write_step(committer, store, 2)


def test_a_committer_whose_gate_is_closed_holds_its_manifests_and_deletes_until_it_opens(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", "run")
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=1, blocking=True), retry_min_s=0.01,
                                    retry_max_s=0.05)
    is_open = threading.Event()
    is_open.set()
    committer.gate(is_open.is_set)

    try:
        _committed_then_gated(committer, store, is_open.clear)
        assert not committer.flush(0.5)  # waiting, not dropped
        assert store.committed_steps() == [1]
        is_open.set()
        assert committer.flush(10)
        assert store.committed_steps() == [2]  # committed once open, and keep_last=1 applied then
    finally:
        committer.close()


def test_a_committer_halted_for_a_lost_lease_ends_at_once(tmp_path):
    """As the controller wires it: the gate is the lease's ``current``, closed for good once
    the lease is lost. A commit waiting at the gate is dropped at the halt, not retried until
    the close's timeout. (Its wait at the gate before the halt is told as a storage outage: a
    lease not renewed lately is most often storage that does not answer.)"""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", "run")
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=3), retry_min_s=1.0, retry_max_s=5.0)
    lost = threading.Event()
    committer.gate(lambda: not lost.is_set())

    try:
        _committed_then_gated(committer, store, lost.set)
        time.sleep(0.3)  # at the gate, backing off
        t0 = time.monotonic()
        committer.halt("another driver took over this run's storage")
        assert committer.flush(5) and time.monotonic() - t0 < 1.0
        kinds = [e["event"] for e in committer.drain_events()]
        assert "checkpoint_halted" in kinds, kinds
        t0 = time.monotonic()
    finally:
        assert committer.close(5) and time.monotonic() - t0 < 1.0
    assert store.committed_steps() == [1]


def test_a_halted_committer_commits_and_deletes_nothing_more(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", "run")
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=1, blocking=True))

    try:
        _write_step(committer, store, 1)
        assert committer.flush(10) and store.committed_steps() == [1]
        committer.halt("another driver took over this run's storage")
        assert committer.halted
        _write_step(committer, store, 2)
        assert committer.flush(10)
        # No manifest of step 2, and step 1 not deleted for it by keep_last=1.
        assert store.committed_steps() == [1] and committer.latest_committed == 1
        assert "checkpoint_halted" in [e["event"] for e in committer.drain_events()]
    finally:
        committer.close()
    assert store.committed_steps() == [1]


def test_the_resume_waits_out_storage_that_does_not_answer_and_says_so(rayless_controller, tmp_path):
    """The resume's own wait (``Controller._restore_latest``), as the lease's: the outage is
    told (``storage_outage`` then ``storage_recovered``, what "resume") and shown while it lasts."""
    c = rayless_controller(name="resume-wait")
    c.store = CheckpointStore(f"file://{tmp_path}/ckpt", "resume-wait")
    calls, shown = [], []

    def restore_once(fast=None):
        calls.append(fast)
        if len(calls) < 3:
            shown.append(c._resume_outage is not None and c._resume_outage.active)
            raise StorageUnavailable("list step-* failed after 4 attempts: ConnectionError")
        return "position"

    c._restore_latest_once = restore_once
    assert c._restore_latest() == "position"
    assert len(calls) == 3 and shown == [False, True]  # active from the first failure on
    assert not c._resume_outage.active
    waits = [e for e in c.events if e.kind in ("storage_outage", "storage_recovered")]
    assert [e.kind for e in waits] == ["storage_outage", "storage_recovered"]
    assert all(e.details["what"] == "resume" for e in waits)


def test_status_says_the_run_waits_on_another_runs_lease_while_it_watches_it(rayless_controller, tmp_path,
                                                                             monkeypatch):
    # `elastic status` said "still placing workers" through a watch of up to 30 s.
    c = rayless_controller(name="watched")
    # This process's lease as a controller's on this cluster, whether or not a module before
    # this one left Ray initialized here (the stand-in runtime context refuses to be asked).
    monkeypatch.setattr(RunLease, "for_this_process", classmethod(
        lambda cls, storage, run, **kw: cls(storage, {"run": run, "cluster": "here", "host": "this-host"}, **kw)))
    c.store = CheckpointStore(f"file://{tmp_path}/ckpt", "watched")
    # Another cluster's lease, renewed an hour ago by its clock every 0.2 s: watched 2.4 s, then taken.
    RunLease(c.store.storage, {"run": "watched", "cluster": "elsewhere", "host": "other-host", "pid": 7},
             renew_s=0.2, clock=lambda: time.time() - 3600)._write()
    assert c.status()["waiting_for"] is None
    failed = []

    def take():
        try:
            c._take_lease()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failed.append(exc)
    taking = threading.Thread(target=take)
    taking.start()
    try:
        seen = None
        deadline = time.monotonic() + 10
        while seen is None and taking.is_alive() and time.monotonic() < deadline:
            seen = c.status()["waiting_for"]
            time.sleep(0.02)
        taking.join(30)
        assert not failed and seen is not None
        assert "found the lease of another run of this name" in seen and "other-host" in seen
        assert c.status()["waiting_for"] is None and c._lease.held  # taken: waiting on nothing
        assert any(e.kind == "lease" and e.message == seen for e in c.events)
    finally:
        taking.join(30)
        if c._lease is not None:
            c._lease.stop()
            c._lease.release()
