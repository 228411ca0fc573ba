"""Ranks pooling written checkpoint parts in a real c10d TCPStore (loopback, port 0)."""

from __future__ import annotations

import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.checkpoint.pool import PartPool, PoolRetired
from elastic.checkpoint.store import shard_name
from elastic.checkpoint.worker_hook import WorkerCheckpointer
from helpers import free_port


@pytest.fixture()
def master():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield store


def pools(master, world):
    """One client connection per rank, as in the workers."""
    return [PartPool("127.0.0.1", master.port, world) for _ in range(world)]


def test_the_rank_that_completes_a_step_gets_every_part(master):
    p = pools(master, 3)
    assert p[0].add(5, 0, {"entries": ["a"]}) is None
    assert p[2].add(5, 2, {"entries": ["c"]}) is None
    assert p[1].add(5, 1, {"entries": ["b"]}) == {0: {"entries": ["a"]}, 1: {"entries": ["b"]},
                                                 2: {"entries": ["c"]}}


def test_a_skipped_step_stays_incomplete_and_later_steps_still_complete(master):
    p = pools(master, 2)
    assert p[0].add(3, 0, {"n": 3}) is None
    # rank 1's writer moved past step 3 to step 4 (superseded): step 3 can never complete
    assert p[1].add(4, 1, {"n": 4}) is None
    assert p[0].add(4, 0, {"n": 4}) == {0: {"n": 4}, 1: {"n": 4}}
    # step 3 + SLOTS lands in step 3's slot: the stale value there is a different step
    assert p[1].add(3 + p[1].slots, 1, {"n": 19}) is None
    assert p[0].add(3 + p[0].slots, 0, {"n": 19}) == {0: {"n": 19}, 1: {"n": 19}}


def test_a_rank_far_behind_still_completes_its_steps(master):
    # A late first-N replica may trail the leader by up to 64 sends plus a dispatch window of 16.
    p = pools(master, 2)
    for step in range(1, 81):
        assert p[0].add(step, 0, {"n": step}) is None
    assert p[1].add(1, 1, {"n": 1}) == {0: {"n": 1}, 1: {"n": 1}}
    assert p[1].add(80, 1, {"n": 80}) == {0: {"n": 80}, 1: {"n": 80}}


def test_slots_are_reused(master):
    p = pools(master, 2)
    for step in range(1, 3 * p[0].slots):
        assert p[0].add(step, 0, {}) is None
        assert p[1].add(step, 1, {}) == {0: {}, 1: {}}
    client = dist.TCPStore("127.0.0.1", master.port, None, False, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    assert client.num_keys() <= 3 * p[0].slots + 1  # parts and claims (plus the store's own key)


def test_one_rank_sends_a_step_that_two_see_complete(master):
    p = pools(master, 2)
    # Both parts are set before either rank looks (the race the claim settles).
    for rank in (0, 1):
        p[rank]._connect().set(f"{7 % p[rank].slots}/{rank}", '{"step": 7, "part": {"r": %d}}' % rank)
    first = p[1].add(7, 1, {"r": 1})
    second = p[0].add(7, 0, {"r": 0})
    assert first == {0: {"r": 0}, 1: {"r": 1}}
    assert second is None


def test_a_part_is_reported_directly_when_the_store_is_gone(tmp_path):
    sent = []
    ckpt = WorkerCheckpointer(f"file://{tmp_path}/ck", None, "pool", 1,
                              notify=lambda step, world, parts: sent.append((step, world, parts)))
    model = torch.nn.Linear(4, 2)
    worker = types.SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   scheduler=None, completed_step=1, rank=1, world_size=2,
                                   part_pool=PartPool("127.0.0.1", free_port(), 2, timeout_s=0.5))
    ckpt.after_step(worker, 1)
    assert ckpt.flush(10)
    assert [(s, w, sorted(parts)) for s, w, parts in sent] == [(1, 2, [1])]
    assert [e["path"] for e in sent[0][2][1]["entries"]] == [shard_name(1, 1, 2)]
    # The end-of-training drain reports the pushed part again, with its snapshot time, so a step
    # committed from that report still says how long it took to persist.
    (step, part), = ckpt.drain()["ckpt_done"]
    assert (step, part["entries"], part["taken_at"]) == (1, sent[0][2][1]["entries"], sent[0][2][1]["taken_at"])
    ckpt.close()


def test_a_pool_of_a_group_left_never_connects_and_one_of_a_live_group_tries_again(monkeypatch):
    """A pool's group torn down before its first part (a failure right after a rendezvous): each
    of the old group's queued snapshots carries the pool and retried the connect for about twice
    the store's timeout on the writer thread. Once the rank left (retire), it fails at once. In a
    live group a failed connect is tried again: given up on, it left every later step incomplete."""
    tries = []
    real = dist.TCPStore

    def counting(*args, **kwargs):
        tries.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", counting)
    pool = PartPool("127.0.0.1", free_port(), 2, timeout_s=0.5)
    for step in (1, 2):
        with pytest.raises(Exception):
            pool.add(step, 0, {"r": 0})
    assert len(tries) == 2  # tried again while the group may live
    pool.retire()
    for step in (3, 4):
        with pytest.raises(PoolRetired, match="of a group this rank left"):
            pool.add(step, 0, {"r": 0})
    assert len(tries) == 2


def test_a_retired_pool_that_is_connected_still_completes_a_step(master):
    # A part written after its rank left the group: where the group's other parts of its step
    # are in the pool (a rank that died after adding its own), the step completes there, and
    # only that pool holds the dead rank's part. (One that does not complete goes on its own:
    # WorkerCheckpointer._push.)
    p = pools(master, 2)
    assert p[0].add(1, 0, {"r": 0}) is None  # connected now
    assert p[1].add(2, 1, {"r": 1}) is None
    p[0].retire()
    assert p[0].retired
    assert p[0].add(2, 0, {"r": 0}) == {0: {"r": 0}, 1: {"r": 1}}


class Written:
    """A WorkerCheckpointer whose snapshots are written and pushed before the call returns (each
    call flushes the writer thread), so no snapshot supersedes another waiting for it."""

    def __init__(self, ckpt: WorkerCheckpointer):
        self.ckpt = ckpt

    def after_step(self, worker, step):
        self.ckpt.after_step(worker, step)
        assert self.ckpt.flush(10)

    def snapshot(self, worker, step, pooled=True):
        self.ckpt.snapshot(worker, step, pooled=pooled)
        assert self.ckpt.flush(10)

    def __getattr__(self, name):
        return getattr(self.ckpt, name)


def pooled_rank(tmp_path, master, sent, blocking=False, keep_every=0):
    """Rank 1 of 2 writing in process, pooling its parts in ``master``'s store (not when
    ``blocking``, nor its milestones: see the tests below); rank 0 never adds any."""
    ckpt = WorkerCheckpointer(f"file://{tmp_path}/ck", None, "pool", 1, blocking=blocking, keep_every=keep_every,
                              notify=lambda step, world, parts: sent.append((step, world, sorted(parts))))
    model = torch.nn.Linear(4, 2)
    worker = types.SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   scheduler=None, completed_step=1, rank=1, world_size=2,
                                   part_pool=PartPool("127.0.0.1", master.port, 2))
    return Written(ckpt), worker


def test_a_part_left_waiting_in_the_pool_is_reported_when_the_rank_leaves_the_group(tmp_path, master):
    # Rank 0 (an evicted straggler) never adds its part of step 1: rank 1's waited in the pool,
    # and once rank 1 left the group nothing would ever report it.
    sent = []
    ckpt, worker = pooled_rank(tmp_path, master, sent)
    ckpt.after_step(worker, 1)
    assert sent == []  # pooled, waiting for rank 0's
    worker.part_pool.retire()  # as TrainWorker.leave does, then:
    ckpt.left_group()
    assert sent == [(1, 2, [1])]
    ckpt.left_group()  # reported once
    # Parts of snapshots taken before the leave (their payloads hold the retired pool): one
    # that completes its step in the pool goes with the others' parts (rank 0 added its part of
    # step 3), one that does not goes on its own.
    worker.completed_step = 2
    ckpt.after_step(worker, 2)
    PartPool("127.0.0.1", master.port, 2).add(3, 0, {"entries": []})
    worker.completed_step = 3
    ckpt.after_step(worker, 3)
    assert sent == [(1, 2, [1]), (2, 2, [1]), (3, 2, [0, 1])]
    ckpt.close()


def test_a_snapshot_off_the_pool_is_reported_on_its_own(tmp_path, master):
    # The snapshot a new group takes after an eviction (TrainWorker.snapshot_checkpoint): the
    # group's other ranks never add that step to its pool.
    sent = []
    ckpt, worker = pooled_rank(tmp_path, master, sent)
    ckpt.snapshot(worker, 1, pooled=False)
    assert sent == [(1, 2, [1])]
    ckpt.left_group()
    assert sent == [(1, 2, [1])]  # nothing was left waiting
    ckpt.close()


def test_blocking_mode_reports_each_ranks_own_parts_even_with_a_pool(tmp_path, master):
    """Blocking mode promises every step on storage, in order. A pooled step goes from the rank
    that completed it, and Ray orders one submitter's calls only: step 6 sent by rank 0 could
    reach the controller before step 5 sent by rank 1, and the committer took 5 for superseded
    and never committed it. In blocking mode each rank reports its own parts, in its own order."""
    sent = []
    ckpt, worker = pooled_rank(tmp_path, master, sent, blocking=True)
    PartPool("127.0.0.1", master.port, 2).add(1, 0, {"entries": []})  # rank 0's part is in the pool
    for step in (1, 2):
        worker.completed_step = step
        ckpt.after_step(worker, step)
    assert sent == [(1, 2, [1]), (2, 2, [1])]  # rank 1's own, one a step (pooled: step 1 with rank 0's)
    ckpt.left_group()
    assert len(sent) == 2  # nothing was left waiting in the pool
    ckpt.close()


def test_a_milestones_part_is_reported_on_its_own(tmp_path, master):
    """The committer lets an older keep_every milestone go once a newer one is handed over,
    which holds only if every rank's part of the older one came first. Pooled, milestone 2 sent
    by one rank could come after milestone 4 sent by another, and milestone 2 was dropped."""
    sent = []
    ckpt, worker = pooled_rank(tmp_path, master, sent, keep_every=2)
    for step in (1, 2, 3):
        worker.completed_step = step
        ckpt.after_step(worker, step)
    assert sent == [(2, 2, [1])]  # steps 1 and 3 wait in the pool for rank 0's parts
    ckpt.close()
