"""The controller's side of a rollback, without Ray: the ranks' checkpoint reports that arrive
after training went back (the controller's methods on a real ``Controller`` whose Ray runtime
context is a stand-in; nothing here starts or joins a cluster)."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from elastic.checkpoint import CheckpointCommitter, CheckpointStore, WorkerCheckpointer
from elastic.config import CheckpointConfig
from elastic.data import DataPosition
from test_checkpoint_store import FakeWorker, assert_same


@pytest.fixture
def controller(rayless_controller, tmp_path):
    """A controller with a committer of every step, as after ``_setup_data_and_checkpoints``."""
    c = rayless_controller(name="rollback")
    store = CheckpointStore(f"file://{tmp_path}", "rollback")
    c.committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1))
    yield c
    c.committer.close()


def part(progress: int, **extra) -> dict:
    """A rank's part with no file (no share of the state): its RNG goes to the manifest."""
    return {"entries": [], "taken_at": time.time(), "progress": progress, "rng": {"python": progress}, **extra}


def committing(c, config: CheckpointConfig, world_size: int, **kwargs) -> None:
    """``c`` as set up for ``config``: its committer, and a group of ``world_size`` stand-ins."""
    c.run_config = dataclasses.replace(c.run_config, checkpoint=config)
    c.committer.close()
    c.committer = CheckpointCommitter(c.committer.store, config, **kwargs)
    c.group = SimpleNamespace(members=[None] * world_size)


def two_ranks_rank_1_pushes_held(c, tmp_path, held_if) -> tuple[list, list, list]:
    """Two ranks' stand-ins and their blocking checkpoint hooks, pushing to ``c``; rank 1's pushes
    of the steps ``held_if`` says go to the returned list instead (in flight), for the test to send."""
    held: list = []

    def notify(step, world_size, parts):  # the ranks' pushes to the controller actor
        if 1 in parts and held_if(step):
            held.append((step, world_size, parts))
        else:
            c.checkpoint_written(step, world_size, parts)

    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(f"file://{tmp_path}", None, "rollback", every_n_steps=1, blocking=True,
                                notify=notify) for _ in workers]
    return workers, hooks, held


def merge_while_pushes_come(c, rank: int, report: dict, queued: list) -> None:
    """The flush's ``report`` of ``rank`` merged on this thread while the rank's ``queued``
    pushes reach the checkpoint thread, 0.3 s later."""
    def checkpoint_thread():
        time.sleep(0.3)
        for push in queued:
            c.checkpoint_written(*push)

    pushes = threading.Thread(target=checkpoint_thread)
    pushes.start()
    try:
        c._merge_ckpt(rank, report)
    finally:
        pushes.join()


def test_a_rollback_takes_the_ranks_progress_back_to_the_step_it_went_back_to(controller, monkeypatch):
    """Every rank loads committed step 3 (no survivor held the state) after a rank reported
    step 10: the commit lag counts from step 3 again, and a rank's step 4 is its progress."""
    c = controller
    c.store, c.dataset_size = c.committer.store, 64
    c.step = 9
    c.checkpoint_written(10, 2, {0: part(10)})
    assert c._progress_step() == 10

    def restore_latest(fast=None):  # the ranks' restore_checkpoint calls, stood in for
        c.step = 3
        return DataPosition(cursor=24)

    monkeypatch.setattr(c, "_restore_latest", restore_latest)
    c._restore_members_from_checkpoint()
    assert c._progress_step() == 3 and c.committer.lag(c._progress_step()) == 3
    c.checkpoint_written(4, 2, {0: part(4)})  # a rank writes step 4 again
    assert c._progress_step() == 4


def test_a_part_taken_before_a_rollback_and_reported_after_it_does_not_complete_the_step(controller, tmp_path):
    """Two ranks trained to step 5; rank 1's part of it is still on its way when every rank
    loads step 3 and the run goes on in a new generation, on other data. Rank 0's new part of
    step 5 comes first, then rank 1's old one: the old one is dropped, so step 5 commits with
    rank 1's new part, and what it commits reads back as the new state. (Taken with the other's
    new part, the manifest recorded the checksum of a file rank 1 then wrote again: a corrupt step.)"""
    c = controller
    c.generation = 1
    held: list = []

    def notify(step, world_size, parts):  # the ranks' pushes to the controller actor
        if step == 5 and 1 in parts and c.generation == 1:
            held.append((step, world_size, parts))  # in flight, as a write the rollback overtook
        else:
            c.checkpoint_written(step, world_size, parts)

    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(f"file://{tmp_path}", None, "rollback", every_n_steps=1, blocking=True,
                                notify=notify) for _ in workers]

    def train(step, batch=None):
        for worker, hook in zip(workers, hooks):
            worker.generation = c.generation  # as TrainWorker.join sets it
            worker.train(step if batch is None else batch)
            worker.completed_step = step
            hook.after_step(worker, step)
        c.committer.set_meta(step, {"data": {"cursor": step}})

    for step in (1, 2, 3):
        train(step)
    at_3 = [worker.get_state() for worker in workers]  # one each: Adam's state is loaded without a copy
    for step in (4, 5):
        train(step)
    assert held and c.committer.flush(10) and c.committer.latest_committed == 4
    for worker, state in zip(workers, at_3):  # every rank loads step 3 (no survivor held the state)
        worker.set_state(state)
    c._rewind(3)
    c.generation = 2  # the rendezvous after it
    train(4, batch=40)  # replanned: other samples than before the rollback
    workers[0].train(50)
    workers[0].completed_step = 5
    hooks[0].after_step(workers[0], 5)
    c.committer.set_meta(5, {"data": {"cursor": 5}})
    c.checkpoint_written(*held.pop())  # rank 1's part of step 5 from before the rollback
    assert c.committer.flush(10) and c.committer.latest_committed == 4
    workers[1].train(50)
    workers[1].completed_step = 5
    hooks[1].after_step(workers[1], 5)
    assert c.committer.flush(10) and c.committer.latest_committed == 5
    assert_same(c.committer.store.read_state(5)[0], workers[1].get_state())
    for hook in hooks:
        hook.close()


def test_a_late_replicas_part_of_the_step_a_rollback_went_back_to_still_commits_it(controller, tmp_path):
    """First-N: the fast replicas were lost, and training went back to step 5, which the late
    replica held. Its part of step 5, still on its way then, is of the history training goes on
    from, and nothing writes step 5 again: dropped with the old generation's later steps, step 5
    never committed, and the next failure or resume went back further. A part of step 6 of the
    old generation is still dropped: training writes step 6 again."""
    c = controller
    c.generation = 3
    # Rank 1's pushes of steps 5 and 6 are in flight when the rollback comes.
    workers, hooks, held = two_ranks_rank_1_pushes_held(c, tmp_path, lambda step: step >= 5)
    try:
        for step in range(1, 7):
            for worker, hook in zip(workers, hooks):
                worker.generation = c.generation
                worker.train(step)
                worker.completed_step = step
                hook.after_step(worker, step)
            c.committer.set_meta(step, {"data": {"cursor": step}})
        assert c.committer.flush(10) and c.committer.latest_committed == 4
        c._rewind(5)  # _sync_state's rollback to the late replica's step
        for push in held:  # its parts of steps 5 and 6, of the state gone back from
            c.checkpoint_written(*push)
        assert c.committer.flush(10) and c.committer.latest_committed == 5
        assert 6 not in c.committer.store.committed_steps()
        c.committer.store.read_state(5)  # whole: every file checks out
    finally:
        for hook in hooks:
            hook.close()
    c.generation = 4  # the rendezvous after it
    assert c._given_up(3, 6) and not c._given_up(3, 5) and not c._given_up(4, 6) and not c._given_up(None, 6)
    c._rewind(5, restored=True)  # a restore gives up every step of the generations before it
    assert c._given_up(4, 5) and c._given_up(4, 1) and not c._given_up(5, 9)


def test_blocking_mode_a_flushed_part_waits_for_the_ranks_earlier_pushes(controller, tmp_path):
    """Blocking mode promises every step on storage. At the end of a run the flush reports each
    rank's newest part again (on the training thread), while its pushes are taken in on the
    checkpoint thread. Rank 1's pushes of steps 1 and 2 are still queued there when its flushed
    part of step 2 comes: taken in first, it made step 1 look skipped by rank 1, step 2 then
    completed, and rank 1's push of step 1 came too late to commit it."""
    c = controller
    committing(c, CheckpointConfig(every_n_steps=1, blocking=True), 2)
    # Rank 1's pushes, behind other work on the controller's checkpoint thread.
    workers, hooks, queued = two_ranks_rank_1_pushes_held(c, tmp_path, lambda step: True)
    try:
        for step in (1, 2):
            for worker, hook in zip(workers, hooks):
                worker.train(step)
                worker.completed_step = step
                hook.after_step(worker, step)
            c.committer.set_meta(step, {"data": {"cursor": step}})
        assert [s for s, _, _ in queued] == [1, 2]
        report = hooks[1].drain()  # the flush's report: rank 1's newest part again
        assert [s for s, _ in report["ckpt_done"]] == [2]
        merge_while_pushes_come(c, 1, {**report, "world_size": 2}, queued)
        assert c.committer.flush(10) and c.committer.latest_committed == 2
        committed = [e["step"] for e in c.committer.drain_events() if e["event"] == "checkpoint_committed"]
        assert committed == [1, 2]
    finally:
        for hook in hooks:
            hook.close()


def test_a_flushed_part_waits_for_the_ranks_push_not_for_its_step_to_complete(controller, tmp_path, monkeypatch,
                                                                             caplog):
    """Blocking mode: rank 0's write of step 2 failed (storage down), so step 2 never completes,
    and the committer holds no part of it once rank 0 reports step 3. The flush's report of rank
    1's step 2 waits for rank 1's push of it, which came long ago: not for the committer to hold
    the part, which it never does (the whole wait, for every rank, at the run's end)."""
    c = controller
    committing(c, CheckpointConfig(every_n_steps=1, blocking=True), 2)
    monkeypatch.setattr(c, "PUSH_WAIT_S", 60.0)
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(f"file://{tmp_path}", None, "rollback", every_n_steps=1, blocking=True,
                                notify=c.checkpoint_written) for _ in workers]
    try:
        for step in (1, 2, 3):
            for worker, hook in zip(workers, hooks):
                worker.train(step)
                worker.completed_step = step
                if (step, worker.rank) == (2, 0):
                    continue  # its write failed: no part, no push
                if (step, worker.rank) == (3, 1):
                    continue  # rank 1 stops after step 2 (its last push)
                hook.after_step(worker, step)
            c.committer.set_meta(step, {"data": {"cursor": step}})
        assert not c.committer.holds(2, 1)  # let go: rank 0 skipped step 2
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="elastic.controller"):
            c._merge_ckpt(1, {**hooks[1].drain(), "world_size": 2})
        assert time.monotonic() - started < 30
        assert "did not come within" not in caplog.text
    finally:
        for hook in hooks:
            hook.close()


def test_a_flushed_milestone_waits_for_the_ranks_push_of_the_milestone_before(controller, tmp_path):
    """Background writes, keep_every=2: a rank's pushes of milestones 2 and 4 are still queued on
    the checkpoint thread when the flush reports milestone 4 again. Taken in first, it moved the
    milestone floor to 4, and milestone 2, when its push came, was dropped for good."""
    c = controller
    committing(c, CheckpointConfig(every_n_steps=1, keep_last=1, keep_every=2), 1, gc_interval_s=0,
               retention_interval_s=0)
    queued: list = []
    worker = FakeWorker(rank=0, world_size=1)
    hook = WorkerCheckpointer(f"file://{tmp_path}", None, "rollback", every_n_steps=1, keep_every=2,
                              notify=lambda *push: queued.append(push))
    try:
        for step in (1, 2, 3, 4):
            worker.train(step)
            worker.completed_step = step
            hook.after_step(worker, step)
            assert hook.flush(10)
            c.committer.set_meta(step, {"data": {"cursor": step}})
        merge_while_pushes_come(c, 0, {**hook.drain(), "world_size": 1}, queued)
        assert c.committer.flush(10) and c.committer.latest_committed == 4
        assert c.committer.store.committed_steps() == [2, 4]
    finally:
        hook.close()


def test_a_flushed_part_of_an_old_group_counts_as_its_snapshots_rank(controller):
    """A shrink renumbered the ranks: the rank asked at the run's end is rank 0 of 2, and its
    newest pushed part is still the one it wrote as rank 1 of 3. The second report of it went
    in as rank 0's of world size 2, which replaced the step's parts of the old world."""
    c = controller
    c.group = SimpleNamespace(members=[None, None])
    c.checkpoint_written(5, 3, {0: part(5), 2: part(5)})
    again = {**part(5), "again": True, "rank": 1, "world_size": 3}
    c._merge_ckpt(0, {"ckpt_done": [(5, again)], "ckpt_events": [], "world_size": 2})
    assert all(c.committer.holds(5, r) for r in range(3))
