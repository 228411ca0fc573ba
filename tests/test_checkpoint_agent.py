"""The node checkpoint agent without Ray: shared snapshot slots, the rank's side and the agent's
side over their real Unix socket, pooling of a node's parts, a rank that never waits for a busy
agent, and a rank whose agent is gone writing its checkpoints itself."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from elastic.checkpoint import CheckpointCommitter, CheckpointStore, WorkerCheckpointer
from elastic.checkpoint.agent import CheckpointAgent, receive_message, send_message
from elastic.checkpoint.codec import encode_tensor_buffers, shard_layout
from elastic.checkpoint.shm import SlotRing, supported
from elastic.checkpoint.store import shard_name
from elastic.checkpoint.worker_hook import AgentCheckpointer
from elastic.config import CheckpointConfig
from test_checkpoint_store import FAST, FakeWorker, assert_same, backend, finish, run_training  # noqa: F401 - backend: a fixture

pytestmark = pytest.mark.skipif(not supported(), reason="memfds are Linux only")

RUN = "agent-run"


class _Calls:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def remote(self, *args):
        self.calls.append(args)
        self.fn(*args)


class FakeController:
    """What the agent calls on the controller actor, fed into a real committer as the controller does."""

    def __init__(self, committer: CheckpointCommitter):
        self.committer = committer
        self.events: list = []
        self.checkpoint_written = _Calls(self._written)
        self.checkpoint_events = _Calls(lambda events: self.events.extend(events))

    def _written(self, step, world_size, parts):
        for rank, part in parts.items():
            self.committer.add(step, int(rank), world_size, part["entries"], taken_at=part.get("taken_at"),
                               rng=part.get("rng"))


@pytest.fixture
def node(backend):
    """An agent with a fake controller and a committer in the background mode of a run."""
    _, url, options = backend
    store = CheckpointStore(url, RUN, options, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1, keep_last=2))
    controller = FakeController(committer)
    agent = CheckpointAgent(url, options, RUN, controller)
    yield agent, controller, committer, store, (url, options)
    agent.shutdown()
    committer.close()


def link(agent, every=1, min_shard_bytes=0, fallback=None) -> AgentCheckpointer:
    return AgentCheckpointer(agent.address(), every, fallback or (lambda: pytest.fail("fell back")), min_shard_bytes)


def test_slot_ring_holds_the_data_section_of_the_shard_file():
    tensors = {"w": torch.randn(3, 5), "steps": torch.arange(4, dtype=torch.int64), "half": torch.randn(7).bfloat16(),
               "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    layout = shard_layout(tensors)
    ring = SlotRing.create(layout, nslots=2, meta_capacity=100)
    fd = ring.take_fd()
    other = SlotRing.attach(fd, ring.desc)  # the agent's mapping, as received over the socket
    try:
        ring.copy_in(1, tensors)
        ring.put_meta(1, b'{"rng": 1}')
        expected = b"".join(bytes(b) for b in encode_tensor_buffers(tensors)[1:])
        assert bytes(other.data(1)) == expected and other.meta(1, 10) == b'{"rng": 1}'
        assert other.layout == layout and bytes(other.data(0)) == bytes(len(expected))  # slot 0 untouched
        with pytest.raises(ValueError):
            ring.put_meta(0, b"x" * (ring.meta_capacity + 1))
        with pytest.raises(ValueError):
            other.data(2)
        with pytest.raises(ValueError):
            ring.take_fd()  # sent once
    finally:
        ring.close()
        other.close()


def test_slot_memory_is_page_locked_once_for_gpu_copies_and_released_with_the_ring():
    """The CUDA runtime is a stand-in here (no GPU on the test machine): what matters is that
    the ring registers its whole mapping once and unregisters it when closed."""
    class FakeCudart:
        def __init__(self, result=0):
            self.calls, self.result = [], result

        def cudaHostRegister(self, ptr, size, flags):
            self.calls.append(("register", ptr, size, flags))
            return self.result

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return 0

    layout = shard_layout({"w": torch.randn(16)})
    ring = SlotRing.create(layout, nslots=3, meta_capacity=64)
    cudart = FakeCudart()
    assert ring.pin(cudart) and ring.pin(cudart)
    (register,) = cudart.calls
    assert register[0] == "register" and register[2] == ring.desc["size"] and register[3] == 0
    ring.close()
    assert cudart.calls[-1] == ("unregister", register[1])
    refused = SlotRing.create(layout, nslots=3, meta_capacity=64)
    try:
        assert refused.pin(FakeCudart(result=1)) is False  # copies still work, unpinned
        refused.copy_in(0, {"w": torch.ones(16)})
        assert bytes(refused.data(0)) == torch.ones(16).numpy().tobytes()
    finally:
        refused.close()


@pytest.mark.parametrize("min_shard_bytes", [0, 10**9])
def test_agent_persists_a_nodes_snapshots_and_reports_one_message_a_step(node, min_shard_bytes):
    """``10**9``: rank 0 writes the whole state, rank 1 hands over only its RNG."""
    agent, controller, committer, store, _ = node
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [link(agent, every=2, min_shard_bytes=min_shard_bytes) for _ in workers]
    agent.expect(2, [0, 1])  # as the controller does when the group forms
    try:
        run_training(workers, hooks, committer, range(1, 5))
        expected = workers[0].get_state()
        run_training(workers, hooks, committer, [5])  # trains on before the writes are done: the slot is a copy
        finish(workers, hooks, committer)
        assert committer.latest_committed == 4
        state, meta = store.read_state(4)
        assert_same(state, expected)
        assert meta == {"data": {"cursor": 4}}
        files = [e["path"] for e in store.load_manifest(4)["files"]]
        assert files == [shard_name(4, r, 2) for r in range(2 if min_shard_bytes == 0 else 1)]
        assert all(store.read_rng(4, r) is not None for r in range(2))
        # Pooled: the agent sends a step's parts of both ranks in one message (a part that waited
        # POOL_WAIT_S for the other rank goes alone: only on a machine far too loaded to count on).
        calls = controller.checkpoint_written.calls
        assert calls and any(sorted(parts) == [0, 1] for _, _, parts in calls)
        assert agent.stats()["ranks"] == [0, 1]
    finally:
        for hook in hooks:
            hook.close()


def test_a_busy_agent_keeps_only_the_newest_snapshot_and_the_rank_never_waits(node, monkeypatch):
    agent, controller, committer, store, _ = node
    release = threading.Event()
    write = store.write_shard.__func__

    def slow_write(self, *args):
        release.wait(20)
        return write(self, *args)

    monkeypatch.setattr(CheckpointStore, "write_shard", slow_write)
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent)
    try:
        t0 = time.monotonic()
        run_training([worker], [hook], committer, range(1, 9))  # step 1's write hangs meanwhile
        assert time.monotonic() - t0 < 5
        assert hook.flush(0.2) is False  # still writing the first snapshot
        release.set()
        assert hook.flush(10)
        run_training([worker], [hook], committer, [9])
        finish([worker], [hook], committer)
        committed = [e["step"] for e in committer.drain_events() if e["event"] == "checkpoint_committed"]
        # The first write hung while steps 2..8 came: each replaced the one waiting before it,
        # so at most the first, the newest of them and step 9 were written.
        assert committed[-1] == 9 and len(committed) <= 3 and committed == sorted(committed)
        assert_same(store.read_state(9)[0], worker.get_state())
    finally:
        release.set()
        hook.close()


def test_with_no_free_slot_the_rank_drops_the_snapshot_instead_of_waiting():
    """An agent that takes the messages but hands no slot back: after ``SLOTS`` snapshots the
    next ones are dropped, at once."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    address = f"\0elastic-test-{os.getpid()}-{time.monotonic_ns()}"
    server.bind(address)
    server.listen(1)
    received: list[str] = []

    def fake_agent():
        conn, _ = server.accept()
        with conn:
            while True:
                message, fds = receive_message(conn)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    return
                received.append(message["op"])
                if message["op"] == "flush":
                    send_message(conn, {"op": "flushed", "id": message["id"], "ok": True, "done": [], "events": []})

    thread = threading.Thread(target=fake_agent, daemon=True)
    thread.start()
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(type("A", (), {"address": lambda self: address})())
    try:
        t0 = time.monotonic()
        for step in range(1, 7):
            worker.train(step)
            assert hook.after_step(worker, step) == {"ckpt_done": [], "ckpt_events": []}
        assert time.monotonic() - t0 < 5
        assert hook.dropped == 6 - AgentCheckpointer.SLOTS
        assert hook.flush(5)
        assert received.count("snap") == AgentCheckpointer.SLOTS and received.count("ring") == 1
    finally:
        hook.close()
        server.close()


def test_a_rank_whose_agent_is_gone_writes_its_checkpoints_itself(node):
    agent, controller, committer, store, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    fallbacks = []

    def in_process():
        hook = WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST)
        fallbacks.append(hook)
        return hook

    hook = link(agent, fallback=in_process)
    try:
        run_training([worker], [hook], committer, [1, 2])
        assert hook.flush(10)
        agent.shutdown()
        for link_ in list(agent._links):
            link_.conn.shutdown(2)  # as if the agent's process died: its sockets close
        deadline = time.monotonic() + 5
        while agent._links and time.monotonic() < deadline:
            time.sleep(0.01)
        reports = run_training([worker], [hook], committer, [3])
        assert fallbacks and hook.fallback is fallbacks[0]
        assert [e["event"] for e in reports[0]["ckpt_events"]] == ["checkpoint_agent_lost"]
        events = finish([worker], [hook], committer)
        assert not [e for e in events if e["event"] == "checkpoint_failed"]
        assert committer.latest_committed == 3
        assert_same(store.read_state(3)[0], worker.get_state())
    finally:
        hook.close()


def test_an_agent_gone_before_the_last_write_costs_the_run_no_step(node):
    """The agent dies with the newest snapshot unwritten: the end-of-run flush snapshots that
    step again and writes it in the rank's process."""
    agent, controller, committer, store, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent, fallback=lambda: WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST))
    try:
        run_training([worker], [hook], committer, [1])
        assert hook.flush(10)
        for link_ in list(agent._links):
            link_.persister.close(0.1)  # drops whatever arrives from now on
        agent.shutdown()
        run_training([worker], [hook], committer, [2])  # handed over, never written
        for link_ in list(agent._links):
            link_.conn.shutdown(socket.SHUT_RDWR)
        assert hook.flush(10, worker=worker) and hook.fallback is not None
        out = hook.drain()
        assert [e["event"] for e in out["ckpt_events"]] == ["checkpoint_agent_lost"]
        for step, part in out["ckpt_done"]:
            committer.add(step, 0, 1, part["entries"], rng=part.get("rng"))
        assert committer.flush(10) and committer.latest_committed == 2
        assert_same(store.read_state(2)[0], worker.get_state())
    finally:
        hook.close()


def test_a_bigger_meta_moves_to_a_new_ring_and_the_old_one_is_unmapped_once_free(node):
    agent, controller, committer, store, _ = node
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent)
    try:
        run_training([worker], [hook], committer, [1])
        assert hook.flush(10)
        (first,) = hook._ring_of
        ring = hook._ring_of[first][0]
        bigger = hook._ring(ring.layout, ring.meta_capacity + 1)
        assert bigger != first and first in hook._retired  # the old one waits for its slots
        hook._poll()
        assert first not in hook._ring_of and first not in hook._retired  # all of its slots were back
        run_training([worker], [hook], committer, [2])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 2
    finally:
        hook.close()


def test_messages_are_refused_when_the_agent_queue_is_full_not_waited_for():
    """The rank's sends never block: a full socket queue raises at once."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with pytest.raises(BlockingIOError):
            for _ in range(100_000):
                send_message(a, {"op": "snap", "pad": "x" * 1000}, block=False)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("may_restore", [True, False])
def test_writer_threads_run_in_the_background_and_at_normal_priority_while_a_flush_waits(monkeypatch, may_restore):
    """Where the process may raise a thread back (root here; ``RLIMIT_NICE`` or ``CAP_SYS_NICE``
    elsewhere) writers are idle-class and a flush lifts them; elsewhere they run at nice 19 and
    stay there."""
    from elastic.checkpoint import agent as agent_module

    monkeypatch.setattr(agent_module, "can_restore_priority", lambda: may_restore)
    priority = agent_module.WriterPriority(background=True)
    seen: dict = {}
    entered, done = threading.Event(), threading.Event()

    def writer():
        priority.enter()
        seen["tid"] = threading.get_native_id()
        entered.set()
        done.wait(10)
        priority.leave()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert entered.wait(10)
        tid = seen["tid"]
        if may_restore:
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
            with priority.boosted():
                assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        else:
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, tid) == 19
            with priority.boosted():
                assert os.getpriority(os.PRIO_PROCESS, tid) == 19
    finally:
        done.set()
        thread.join(10)
