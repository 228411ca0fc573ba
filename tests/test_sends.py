"""The first-N leader's update sends (elastic/actors/sends.py) over a real gloo pair.

The point of ``UpdateSends`` is a fact about gloo that a fake cannot show: a send's work never
reports completion before ``wait()``, so polling it kept every copy. These tests run two
processes with a real gloo group: the sender's copies stay bounded and are reused, every update
arrives intact and in order, and a receiver more than ``limit`` sends behind holds the sender up.
"""

from __future__ import annotations

import os
import time

import pytest

from elastic.actors.sends import MAX_IN_FLIGHT, SEND_BUDGET_BYTES, UpdateSends, in_flight_limit
from helpers import run_pair

SIZE = 100_000
LIMIT = 3


def _pair(rank: int, store_path: str, mode: str, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        count = 40 if mode in ("bounded", "confirmed") else LIMIT + 1
        token = torch.zeros(1)
        if rank == 0:
            sends = UpdateSends(dist.isend, MAX_IN_FLIGHT if mode == "confirmed" else LIMIT)
            vector, ptrs, most, returned = torch.empty(SIZE), set(), 0, []
            for step in range(count):
                vector.fill_(float(step))
                sends.send(vector, [1], tag=step)
                returned.append(time.time())
                ptrs.add(sends._in_flight[-1][1].data_ptr())
                most = max(most, len(sends))
                if mode == "confirmed":
                    # What a first-N step shows the leader: the receiver reduces with it, which
                    # it does only once it holds every earlier update.
                    dist.all_reduce(token)
                    sends.confirm({0, 1})
            out.put(("sender", {"distinct_buffers": len(ptrs), "most_in_flight": most, "returned": returned}))
        else:
            if mode == "lagging":
                time.sleep(5.0)  # the sender's first LIMIT isends return meanwhile, even on a loaded machine
            started = time.time()
            got = torch.empty(SIZE)
            seen = []
            for step in range(count):
                dist.recv(got, src=0, tag=step)
                seen.append((float(got.min()), float(got.max())))
                if mode == "confirmed":
                    dist.all_reduce(token)
            out.put(("receiver", {"started": started, "seen": seen}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_pair(tmp_path, mode: str) -> dict:
    return run_pair(_pair, os.path.join(str(tmp_path), f"store-{mode}"), mode)


def test_copies_stay_bounded_and_reused_and_every_update_arrives_in_order(tmp_path):
    r = _run_pair(tmp_path, "bounded")
    sender, receiver = r["sender"], r["receiver"]
    # Never more than LIMIT. (On torch 2.13's gloo it is exactly LIMIT: a send never reports
    # completion before wait(), which is why UpdateSends exists.)
    assert 1 <= sender["most_in_flight"] <= LIMIT
    # 40 sends through at most LIMIT + 1 buffers (one in flight beyond the limit before the wait)
    assert sender["distinct_buffers"] <= LIMIT + 1
    assert receiver["seen"] == [(float(s), float(s)) for s in range(40)]


def test_sends_to_ranks_that_reduced_since_are_taken_back_at_once(tmp_path):
    # On gloo nothing reports completion, so before confirm() a leader with the benchmark's
    # limit (64) made a fresh buffer for each of its first 65 sends: page faults on its critical
    # path. A receiver that reduced with it has received them all: one buffer serves every send.
    r = _run_pair(tmp_path, "confirmed")
    sender, receiver = r["sender"], r["receiver"]
    assert sender["most_in_flight"] == 1 and sender["distinct_buffers"] == 1
    assert receiver["seen"] == [(float(s), float(s)) for s in range(40)]


def test_a_receiver_more_than_limit_behind_holds_the_sender_up(tmp_path):
    r = _run_pair(tmp_path, "lagging")
    returned, started = r["sender"]["returned"], r["receiver"]["started"]
    # The first LIMIT sends return while the receiver sleeps; the next waits for it to receive.
    assert all(t < started for t in returned[:LIMIT])
    assert returned[LIMIT] >= started
    assert r["receiver"]["seen"] == [(float(s), float(s)) for s in range(LIMIT + 1)]


class _Work:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        return True


class _Vector:
    """Stands in for a tensor: ``new_empty`` and ``copy_`` are all UpdateSends uses."""

    def __init__(self):
        self.value = None

    def new_empty(self, shape):
        return _Vector()

    def copy_(self, other):
        self.value = other.value
        return self

    @property
    def shape(self):
        return (1,)


def test_sends_that_report_completion_are_reaped_without_waiting():
    works: list[_Work] = []

    def isend(buf, dst, tag):
        works.append(_Work(done=True))  # as NCCL reports a finished send
        return works[-1]

    sends = UpdateSends(isend, limit=4)
    vector = _Vector()
    for step in range(10):
        sends.send(vector, [1, 2], tag=step)
    assert len(sends) == 1  # all earlier sends were reaped when the next one went out
    assert len(works) == 20


def test_confirm_takes_back_the_oldest_sends_whose_every_destination_reduced_in_order():
    works: list[_Work] = []

    def isend(buf, dst, tag):
        works.append(_Work(done=False))  # as gloo: never reports completion
        return works[-1]

    sends = UpdateSends(isend, limit=64)
    vector = _Vector()
    sends.send(vector, [2], tag=1)
    sends.send(vector, [1, 2], tag=2)
    sends.send(vector, [2], tag=3)
    sends.confirm({0, 1})  # rank 2 did not reduce: its sends (the oldest among them) stay
    assert len(sends) == 3 and not any(w.waited for w in works)
    sends.confirm({0, 2})  # the oldest goes; the next also went to rank 1, which did not reduce
    assert len(sends) == 2 and [w.waited for w in works] == [True, False, False, False]
    sends.confirm({0, 1, 2})
    assert len(sends) == 0 and all(w.waited for w in works)
    sends.send(vector, [2], tag=4)  # into a buffer taken back, not a new one
    assert len(sends._free) == 2


def test_in_flight_limit_follows_the_byte_budget():
    assert in_flight_limit(1_600_000) == MAX_IN_FLIGHT  # the benchmark's MLP
    assert in_flight_limit(SEND_BUDGET_BYTES // 4) == 4
    assert in_flight_limit(4 << 30) == 2  # a 1B-parameter fp32 model still gets one step of slack
    with pytest.raises(ValueError, match="limit"):
        UpdateSends(lambda *a, **k: None, 0)
