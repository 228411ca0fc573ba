"""The node checkpoint agent without Ray: shared snapshot slots, the rank's side and the agent's
side over their real Unix socket, pooling of a node's parts, a rank that never waits for a busy
agent, and a rank whose agent is gone writing its checkpoints itself."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import random
import socket
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from elastic.checkpoint import CheckpointCommitter, CheckpointStore, UnsaveableState, WorkerCheckpointer
from elastic.checkpoint.agent import CheckpointAgent, NodeAgents, receive_message, send_message
from elastic.checkpoint.codec import capture_rng, encode_tensor_buffers, shard_layout
from elastic.checkpoint.shm import SlotRing, supported
from elastic.checkpoint.store import shard_name, taken_at_here
from elastic.actors.worker import _to_device
from elastic.checkpoint.worker_hook import AgentCheckpointer
from elastic.config import CheckpointConfig
from test_checkpoint_store import FAST, FakeWorker, add_parts, assert_same, backend, finish, run_training  # noqa: F401 - backend: a fixture

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
            self.committer.add(step, int(rank), world_size, part["entries"], taken_at=taken_at_here(part),
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


def test_a_ring_whose_description_does_not_add_up_is_refused():
    # Slots beyond a shorter mapping: a memoryview slice is cut short without a word, and a
    # shard was written truncated with a matching checksum.
    page = mmap.PAGESIZE
    for desc in ({"nslots": 3, "slot_bytes": page, "size": 2 * page}, {"nslots": 0, "slot_bytes": page, "size": 0}):
        fd = os.memfd_create("t")
        try:
            os.ftruncate(fd, 2 * page)
            with pytest.raises(ValueError, match="does not add up"):
                SlotRing(fd, desc)
        finally:
            os.close(fd)  # left open when it raises: the receiver closes it


def test_slot_ring_holds_the_data_section_of_the_shard_file_and_the_meta_after_it():
    tensors = {"w": torch.randn(3, 5), "steps": torch.arange(4, dtype=torch.int64), "half": torch.randn(7).bfloat16(),
               "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    layout = shard_layout(tensors)
    nbytes = sum(e["nbytes"] for e in layout)
    ring = SlotRing.create(nslots=2, slot_bytes=nbytes + 100)
    other = SlotRing(ring.take_fd(), ring.desc)  # the agent's mapping, as received over the socket
    try:
        ring.copy_in(1, "a", layout, tensors)
        ring.put(1, nbytes, b'{"rng": 1}')
        expected = b"".join(bytes(b) for b in encode_tensor_buffers(tensors)[1:])
        assert bytes(other.data(1, nbytes)) == expected and other.read(1, nbytes, 10) == b'{"rng": 1}'
        assert bytes(other.data(0, nbytes)) == bytes(nbytes)  # slot 0 untouched
        # Another layout in the same slot (a rank whose share rotates): the same bytes, other views.
        small = shard_layout({"x": torch.arange(3, dtype=torch.int32)})
        ring.copy_in(1, "b", small, {"x": torch.arange(3, dtype=torch.int32)})
        assert bytes(other.data(1, 12)) == torch.arange(3, dtype=torch.int32).numpy().tobytes()
        with pytest.raises(ValueError, match="do not fit a slot"):
            ring.put(0, nbytes, b"x" * (ring.slot_bytes - nbytes + 1))
        with pytest.raises(ValueError, match="is outside a ring of 2"):
            other.data(2, 1)
        with pytest.raises(ValueError, match="already taken"):
            ring.take_fd()  # sent once
    finally:
        ring.close()
        other.close()


def test_a_ring_that_cannot_be_mapped_leaves_no_descriptor_open(monkeypatch):
    """mmap refused (ENOMEM, the vm.max_map_count limit): neither the memfd kept for the agent
    nor the one being mapped stays open, whichever step fails."""
    from elastic.checkpoint import shm

    name = f"elastic-test-{uuid.uuid4().hex}"
    memfd_create = os.memfd_create
    monkeypatch.setattr(os, "memfd_create", lambda _, flags=0: memfd_create(name, flags))  # ours, to count

    def refuse(*args):
        assert len(memfd_descriptors(name)) == 2  # the agent's and the one being mapped
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(shm, "mmap", SimpleNamespace(mmap=refuse))
    for _ in range(3):
        with pytest.raises(OSError, match="Cannot allocate memory"):
            SlotRing.create(nslots=3, slot_bytes=128)
    assert memfd_descriptors(name) == []

    def too_big(fd, size):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(os, "ftruncate", too_big)  # before the duplicate: the one descriptor is closed
    with pytest.raises(OSError, match="too large"):
        SlotRing.create(nslots=3, slot_bytes=128)
    assert memfd_descriptors(name) == []


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
    ring = SlotRing.create(nslots=3, slot_bytes=128)
    cudart = FakeCudart()
    assert ring.pin(cudart) and ring.pin(cudart)
    (register,) = cudart.calls
    assert register[0] == "register" and register[2] == ring.desc["size"] and register[3] == 0
    ring.close()
    assert cudart.calls[-1] == ("unregister", register[1])
    refused = SlotRing.create(nslots=3, slot_bytes=128)
    try:
        assert refused.pin(FakeCudart(result=1)) is False  # copies still work, unpinned
        refused.copy_in(0, 0, layout, {"w": torch.ones(16)})
        assert bytes(refused.data(0, 64)) == torch.ones(16).numpy().tobytes()
    finally:
        refused.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class GpuWorker(FakeWorker):
    """FakeWorker training on the GPU: parameters and Adam's moments live in device memory."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        super().__init__(rank, world_size)
        self.model.cuda()  # in place: the optimizer's parameter references stay valid

    def train(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(5, 8, generator=gen).cuda(), torch.randn(5, 4, generator=gen).cuda()
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.completed_step = step


@needs_cuda
def test_a_slot_is_page_locked_by_the_cuda_runtime_and_takes_device_tensors():
    tensors = {"w": torch.randn(256, 33, device="cuda"), "i": torch.arange(7, device="cuda"),
               "h": torch.randn(5, device="cuda").bfloat16(), "cpu": torch.ones(3)}
    layout = shard_layout(tensors)
    nbytes = sum(e["nbytes"] for e in layout)
    ring = SlotRing.create(nslots=3, slot_bytes=nbytes + 64)
    try:
        ring.copy_in(2, 0, layout, tensors)
        assert ring._pinned is True
        whole = torch.frombuffer(ring.data(2, nbytes), dtype=torch.uint8)
        assert whole.is_pinned()  # the runtime knows the mapping as page-locked host memory
        del whole
        expected = b"".join(bytes(b) for b in encode_tensor_buffers({k: v.cpu() for k, v in tensors.items()})[1:])
        assert bytes(ring.data(2, nbytes)) == expected
    finally:
        ring.close()  # unregisters; a CUDA error here would raise in the next CUDA call
    torch.cuda.synchronize()


@needs_cuda
@pytest.mark.parametrize("backend", ["file", "memory"], indirect=True)
def test_a_gpu_rank_checkpoints_through_the_agent_and_the_state_reads_back_on_the_host(node):
    agent, controller, committer, store, _ = node
    worker = GpuWorker()
    hook = link(agent)
    try:
        run_training([worker], [hook], committer, [1, 2, 3])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 3
        state, _ = store.read_state(3)
        assert all(t.device.type == "cpu" for t in state["model"].values())
        assert_same(state, _to_device(worker.get_state(), torch.device("cpu")))
        assert all(ring._pinned for ring, _ in hook._rings.values())
    finally:
        hook.close()


def test_the_agent_writes_the_rng_the_rank_read_inside_the_step(node):
    """The rank reads its RNG into the slot; the agent encodes it into the shard's meta later,
    and what it wrote is the state at the snapshot, not after the draws the rank made since."""
    agent, controller, committer, store, _ = node
    worker, hook = FakeWorker(), link(agent)
    agent.expect(1, [0])
    try:
        worker.train(1)
        torch.manual_seed(21)
        np.random.seed(22)
        random.seed(23)
        expected = capture_rng()
        hook.after_step(worker, 1)
        torch.rand(3), np.random.rand(3), random.random()  # the next step's draws, before the agent writes
        committer.set_meta(1, {"data": {"cursor": 1}})
        finish([worker], [hook], committer)
        assert committer.latest_committed == 1
        assert store.read_rng(1, 0) == expected
    finally:
        hook.close()


def test_the_agent_writes_unsigned_and_fp8_tensors_without_sending_the_rank_off(node):
    # uint16/32/64 and fp8 have safetensors names, but ours lacked them: such a rank wrote in its
    # own process for the rest of the run, reported as its agent lost.
    agent, controller, committer, store, _ = node
    worker, hook = FakeWorker(), link(agent)  # fallback: pytest.fail
    kinds = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
    for i, dtype in enumerate(kinds):
        worker.model.register_buffer(f"b{i}", torch.arange(1, 6).to(dtype))
    try:
        run_training([worker], [hook], committer, [1])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 1 and hook.fallback is None
        model = store.read_state(1)[0]["model"]
        for i, dtype in enumerate(kinds):
            back = model[f"b{i}"]
            assert back.dtype == dtype and torch.equal(back.view(torch.uint8), worker.model.get_buffer(f"b{i}")
                                                       .view(torch.uint8))
        assert "checkpoint_agent_lost" not in [e.get("event") for e in controller.events]
    finally:
        hook.close()


def test_a_rank_whose_agent_writer_thread_died_writes_in_its_own_process(node, monkeypatch):
    # The link's writer thread died (its thread_init raised): every later snapshot came back
    # unwritten, and the rank handed them over for good, none of its steps committing again.
    from elastic.checkpoint import agent as agent_module

    def cannot_enter(self):
        raise RuntimeError("cannot set the writer's priority (test)")

    monkeypatch.setattr(agent_module._RankLink, "_writer_enter", cannot_enter)
    agent, controller, committer, store, (url, options) = node
    worker, fell_back = FakeWorker(), []
    hook = link(agent, fallback=lambda: fell_back.append(1) or WorkerCheckpointer(url, options, RUN, 1))
    try:
        deadline = time.monotonic() + 10
        step = 0
        while hook.fallback is None:
            assert time.monotonic() < deadline, "the rank never fell back"
            step += 1
            worker.train(step)
            hook.after_step(worker, step)
            time.sleep(0.05)
        assert fell_back == [1]
    finally:
        hook.close()


def test_a_links_socket_is_closed_by_the_report_thread_after_its_queued_sends(node, monkeypatch):
    # Closed on the link's own thread, while the report thread could still be sending it a slot's
    # return: a descriptor number reused by the next rank's link got that rank a wrong slot.
    from elastic.checkpoint import agent as agent_module

    agent, *_ = node
    at_forget = []
    real = agent_module.CheckpointAgent._forget

    def forget(self, link):
        time.sleep(0.2)  # the link's own thread has long gone past its close() by now
        at_forget.append((threading.current_thread().name, link.conn.fileno() != -1))
        real(self, link)

    monkeypatch.setattr(agent_module.CheckpointAgent, "_forget", forget)
    worker, hook = FakeWorker(), link(agent)
    worker.train(1)
    hook.after_step(worker, 1)
    deadline = time.monotonic() + 30
    while not agent.pool.connected() and time.monotonic() < deadline:
        time.sleep(0.01)  # the agent takes the connection on its own thread (loaded: seconds)
    (linked,) = agent.pool.connected()
    hook.close()  # the rank goes
    deadline = time.monotonic() + 10
    while not at_forget and time.monotonic() < deadline:
        time.sleep(0.01)
    assert at_forget and at_forget[0][1]  # still open when its sends were done
    assert "link" not in at_forget[0][0]  # not on the link's own thread
    assert linked.conn.fileno() == -1


def test_a_connect_to_an_agent_that_does_not_accept_is_bounded(monkeypatch):
    # A listener with a full backlog (an agent at its open-files limit) left the connect blocked
    # for good, and the rank's set-up with it.
    from elastic.checkpoint import worker_hook

    monkeypatch.setattr(worker_hook, "CONNECT_TIMEOUT_S", 0.2, raising=False)
    address = f"\0elastic-test-full-{os.getpid()}-{random.random()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    queued = []
    try:
        listener.bind(address)
        listener.listen(0)
        while True:  # fill the backlog: a connect that would block ends the loop
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect(address)
            except BlockingIOError:
                break
        t0 = time.monotonic()
        with pytest.raises(OSError):
            worker_hook._connect_agent(address)
        assert time.monotonic() - t0 >= 0.2  # waited for room, as the bound says
        # A backlog full for a moment: the connect waits for the agent to take one.
        monkeypatch.setattr(worker_hook, "CONNECT_TIMEOUT_S", 10.0)
        taken = []
        threading.Timer(0.3, lambda: taken.append(listener.accept()[0])).start()
        worker_hook._connect_agent(address).close()
        assert taken
    finally:
        for s in queued:
            s.close()
        for s in taken if "taken" in locals() else []:
            s.close()
        listener.close()


def test_a_flush_after_the_ranks_are_renumbered_names_the_parts_snapshot_rank_and_world(node):
    # After a shrink renumbered the ranks, a flush before any snapshot of the new world reported
    # the agent's last part with no rank: the controller filed rank 1 of 2's part as the asking
    # rank 0 of 1's, which replaced the old world's reports of the step (never committed).
    agent, *_ = node
    worker, hook = FakeWorker(rank=1, world_size=2), link(agent)
    try:
        worker.train(2)
        hook.after_step(worker, 2)
        worker.rank, worker.world_size = 0, 1  # renumbered by a shrink
        assert hook.flush(10, worker=worker)
        ((step, part),) = hook.drain()["ckpt_done"]
        assert step == 2 and part["again"] and (part["rank"], part["world_size"]) == (1, 2)
    finally:
        hook.close()


def test_the_agent_sends_each_part_with_its_age_on_the_nodes_clock(node):
    """The controller may run on another host, with another clock: it dates the snapshot from
    the part's age (``with_age``), read here, where the snapshot was taken."""
    agent, controller, committer, _, _ = node
    worker, hook = FakeWorker(), link(agent)
    agent.expect(1, [0])
    try:
        started = time.time()
        worker.train(1)
        hook.after_step(worker, 1)
        committer.set_meta(1, {"data": {"cursor": 1}})
        finish([worker], [hook], committer)
        assert committer.latest_committed == 1
        parts = [part for _, _, sent in controller.checkpoint_written.calls for part in sent.values()]
        assert parts and all(0 <= part["age_s"] <= time.time() - started for part in parts)
        assert all(started <= part["taken_at"] <= part["taken_at"] + part["age_s"] <= time.time() for part in parts)
    finally:
        hook.close()


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
        assert agent.stats()["ranks"] == [0, 1]
    finally:
        for hook in hooks:
            hook.close()


@pytest.mark.parametrize("min_shard_bytes", [0, 10**9])
def test_the_agent_sends_a_steps_parts_of_the_nodes_ranks_in_one_message(node, min_shard_bytes, monkeypatch):
    """Pooled: one message a step to the controller, with both ranks' parts. Each step's writes
    are flushed before the next step, and the pool waits a minute for a rank instead of
    POOL_WAIT_S (2 s): in suite runs (two pytest processes on two cores) the idle-class writers
    were seconds apart, a snapshot waiting for a busy writer was replaced by the next one, or
    one was dropped for want of a free slot and taken again by the flush, and each of those
    sends a part alone, as it should (which the test above, training on, met under load)."""
    agent, controller, committer, _, _ = node
    sweep = agent.pool.sweep
    monkeypatch.setattr(agent.pool, "sweep", lambda older_than_s=60.0: sweep(older_than_s))
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [link(agent, min_shard_bytes=min_shard_bytes) for _ in workers]
    agent.expect(2, [0, 1])
    calls = controller.checkpoint_written.calls
    try:
        for step in (1, 2, 3, 4):
            for worker, hook in zip(workers, hooks):
                worker.train(step)
                hook.after_step(worker, step)
            for worker, hook in zip(workers, hooks):
                assert hook.flush(10, worker=worker)
            deadline = time.monotonic() + 10  # the report thread sends it, maybe after the flush
            while step > 1 and sorted(r for s, _, parts in calls if s == step for r in parts) != [0, 1] \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
        # Step 1 may go in two messages: until a rank's link has sent its first snapshot the
        # pool does not wait for it (it may be a hot spare's, see _NodePool._expected), and the
        # other's part then waits for step 2 (the first rank has no part of step 1 to come).
        later = [(s, world_size, sorted(parts)) for s, world_size, parts in calls if s > 1]
        assert later == [(s, 2, [0, 1]) for s in (2, 3, 4)]
        assert sorted(r for s, _, parts in calls if s == 1 for r in parts) == [0, 1]
    finally:
        for hook in hooks:
            hook.close()


def test_the_steps_a_gone_rank_leaves_waiting_are_sent_by_the_report_thread_in_order(node, monkeypatch):
    """Rank 1's link closes while rank 0's parts of steps 2 and 3 wait in the pool for it. The
    link's own thread sent them (every waiting step at once) while the report thread sent
    others, so two of the node's reports could reach the controller in the other order, and
    the committer, taking a rank's newer step as proof it skipped the older one, dropped the
    older step, which may be the newest step every rank wrote if the newer one never completes.
    Every report now leaves from the one report thread."""
    agent, controller, _, _, _ = node
    sweep = agent.pool.sweep
    monkeypatch.setattr(agent.pool, "sweep", lambda older_than_s=60.0: sweep(older_than_s))
    senders = []
    written = controller.checkpoint_written.fn
    controller.checkpoint_written.fn = lambda *a: (senders.append(threading.current_thread().name), written(*a))
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [link(agent) for _ in workers]
    agent.expect(2, [0, 1])
    calls = controller.checkpoint_written.calls
    try:
        for worker, hook in zip(workers, hooks):  # both linked and heard from: rank 1 is waited for
            worker.train(1)
            hook.after_step(worker, 1)
            assert hook.flush(10, worker=worker)
        for step in (2, 3):  # each written (a busy writer keeps only the newest snapshot)
            workers[0].train(step)
            hooks[0].after_step(workers[0], step)
            assert hooks[0].flush(10, worker=workers[0])
        time.sleep(0.3)  # the report thread has pooled them
        assert not [s for s, _, _ in calls if s > 1]
        hooks[1]._close_link()  # rank 1's end closes, as in its death
        deadline = time.monotonic() + 10
        while sorted(s for s, _, _ in calls if s > 1) != [2, 3] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [s for s, _, _ in calls if s > 1] == [2, 3]
        assert set(senders) == {"elastic-checkpoint agent reports"}, senders
    finally:
        for hook in hooks:
            hook.close()


def test_the_failure_of_a_write_under_way_when_its_rank_goes_is_reported(node, monkeypatch):
    """The rank's link closes (its process died) while the agent writes its snapshot, and the
    write then fails. The link was dropped from the pool, its events drained, before the write
    ended: the failure landed in a persister no one polled, and the run never heard of it."""
    agent, controller, _, _, _ = node
    started, release = threading.Event(), threading.Event()

    def failing_write(self, *args):
        started.set()
        release.wait(20)
        raise PermissionError("refused after the rank was gone")

    monkeypatch.setattr(CheckpointStore, "write_shard", failing_write)
    worker, hook = FakeWorker(rank=0, world_size=1), link(agent)
    worker.train(1)
    hook.after_step(worker, 1)
    assert started.wait(10)
    hook._close_link()  # the rank's end of the socket closes, as in its death
    time.sleep(0.2)  # the agent's connection thread sees the end and waits for the write in progress
    release.set()
    deadline = time.monotonic() + 10
    while not any(ev.get("event") == "checkpoint_failed" for _, ev in controller.events) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [ev["step"] for _, ev in controller.events if ev.get("event") == "checkpoint_failed"] == [1]


def test_a_link_the_agent_cannot_serve_costs_that_rank_its_agent_not_the_agents_accept_thread(node, monkeypatch):
    """A link whose thread cannot start (the process's thread limit) raised out of the accept
    loop: the agent still answered, but no rank could link to it again."""
    import elastic.checkpoint.agent as agent_module

    agent, _, _, _, (url, options) = node
    made = []
    real = agent_module._RankLink

    def link_or_fail(*args):
        made.append(args)
        if len(made) == 1:
            raise RuntimeError("can't start new thread")
        return real(*args)

    def in_process():
        return WorkerCheckpointer(url, options, RUN, 1)

    monkeypatch.setattr(agent_module, "_RankLink", link_or_fail)
    hooks = [link(agent, fallback=in_process)]
    try:
        deadline = time.monotonic() + 10
        while not made and time.monotonic() < deadline:
            time.sleep(0.01)
        assert made and agent.stats()["threads"]["accept"]
        hooks.append(link(agent))
        while len(made) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(made) == 2 and agent.stats()["links"] == 1  # the next rank links as before
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


@contextlib.contextmanager
def slot_keeping_agent():
    """An agent that takes the messages (the ops in ``received``) and answers flushes but hands
    no slot back. Yields (its address, received)."""
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

    threading.Thread(target=fake_agent, daemon=True).start()
    try:
        yield address, received
    finally:
        server.close()


def test_with_no_free_slot_the_rank_drops_the_snapshot_instead_of_waiting():
    """An agent that takes the messages but hands no slot back: after ``SLOTS`` snapshots the
    next ones are dropped, at once."""
    worker = FakeWorker(rank=0, world_size=1)
    with slot_keeping_agent() as (address, received):
        hook = AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"))
        try:
            t0 = time.monotonic()
            reports = []
            for step in range(1, 7):
                worker.train(step)
                reports.append(hook.after_step(worker, step))
            assert time.monotonic() - t0 < 5
            assert hook.dropped == 6 - AgentCheckpointer.SLOTS
            # The first drop is told at once, the next ones with the next event (at most one a minute).
            events = [e for r in reports for e in r["ckpt_events"]]
            assert [(e["event"], e["step"], e["dropped"]) for e in events] == [("checkpoint_snapshots_dropped", 4, 1)]
            assert hook.flush(5)
            assert received.count("snap") == AgentCheckpointer.SLOTS
            assert received.count("ring") == 1 and received.count("layout") == 1
        finally:
            hook.close()


def test_the_flush_report_counts_the_snapshots_the_rank_dropped_in_all(tmp_path):
    """``drain`` (what ``TrainWorker.flush_checkpoint`` returns) carries ``snapshots_dropped``,
    the rank's total: its drop events come at most once a minute and undercount a run's end."""
    worker = FakeWorker(rank=0, world_size=1)
    with slot_keeping_agent() as (address, _):
        hook = AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"))
        try:
            for total, steps in ((2, range(1, 6)), (3, [6])):  # SLOTS taken, then one dropped a step
                for step in steps:
                    worker.train(step)
                    hook.after_step(worker, step)
                assert hook.flush(5)
                assert hook.drain()["snapshots_dropped"] == total  # a total, not since the last flush
        finally:
            hook.close()
    in_process = WorkerCheckpointer(f"file://{tmp_path}", {}, RUN, every_n_steps=1, retry=FAST)
    try:
        in_process.after_step(worker, 6)
        assert in_process.flush(10)
        assert in_process.drain()["snapshots_dropped"] == 0  # its snapshot waits for the writer, never dropped
    finally:
        in_process.close()


def test_both_writers_rotate_the_duty_by_their_checkpoint_schedule(node, monkeypatch, tmp_path):
    # The writers' rotation follows the run's schedule (rank_share's every_n_steps): passed
    # nothing, it rotated by the step, and every 4 steps on 4 ranks rank 0 wrote every checkpoint.
    from elastic.checkpoint import store as store_module

    agent, _, _, _, (url, options) = node
    taken, of_state = [], store_module.Snapshot.of_state.__func__

    def spied(cls, *args, **kwargs):
        taken.append(kwargs.get("every_n_steps"))
        return of_state(cls, *args, **kwargs)

    monkeypatch.setattr(store_module.Snapshot, "of_state", classmethod(spied))
    worker = FakeWorker(rank=0, world_size=1)
    worker.train(4)
    for hook in (WorkerCheckpointer(f"file://{tmp_path}", {}, RUN, every_n_steps=4, retry=FAST),
                 link(agent, every=4)):
        try:
            hook.after_step(worker, 4)
            assert hook.flush(10)
        finally:
            hook.close()
    assert taken == [4, 4]


def test_a_dtype_the_agents_encoding_cannot_name_is_not_reported_as_the_agent_lost(node, monkeypatch):
    # The rank writes in its own process from then on, as it should; the event said the node's
    # agent was lost, a healthy one, and sent the user to look at the node.
    agent, _, committer, _, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent, fallback=lambda: WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST))
    monkeypatch.setattr(hook, "_layout_of", lambda tensors, world_size: None)  # as for complex64 where it has no name
    try:
        reports = run_training([worker], [hook], committer, [1])
        assert [e["event"] for e in reports[0]["ckpt_events"]] == ["checkpoint_dtype_in_process"]
        assert hook.fallback is not None and "dtype has no safetensors name" in reports[0]["ckpt_events"][0]["message"]
    finally:
        hook.close()


def test_a_nodes_milestone_parts_reach_the_controller_in_each_ranks_order(node):
    # Pooled, a part went when its step completed, aged (POOL_WAIT_S) or a link ended, in no
    # rank's order: rank 0's part of milestone 10 came after its part of 20, and the committer,
    # past 10 once 20 committed, dropped it for stale: milestone 10 never committed, no event.
    agent, controller, _, _, _ = node
    controller.checkpoint_written = _Calls(lambda *args: None)
    class Link:  # a rank's link, as the pool reads it (hashable, as links are)
        def __init__(self, rank):
            self.rank, self.world_size = rank, 2
            self.persister = SimpleNamespace(drain_events=lambda: [])

    for r in (0, 1):
        agent.pool.connect(Link(r))
    agent.expect(2, [0, 1])

    def arrive(rank, step):
        agent.reports.put(("part", (rank, 2, step, {"entries": [], "taken_at": time.time()}, True)))

    def settled(within_s=5.0):
        deadline = time.monotonic() + within_s
        while agent.reports.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the one the report thread took last

    arrive(1, 10)
    settled()
    agent.pool.sweep(0.0)  # as when a link on the node ends, or 2 s pass
    arrive(1, 20)
    arrive(0, 10)  # rank 0's slow write of milestone 10 lands
    arrive(0, 20)
    settled()
    agent.pool.sweep(0.0)
    order = {r: [step for step, _, parts in controller.checkpoint_written.calls if r in parts] for r in (0, 1)}
    assert order == {0: [10, 20], 1: [10, 20]}


def test_a_flushs_report_of_a_milestone_the_agent_sent_itself_says_so(node):
    # The agent sends a milestone's part itself; its flush's second report of it did not say
    # "sent", so the controller took it in without waiting for that push (_await_push), and
    # the milestone floor passed the rank's push of the milestone before, dropped as stale.
    agent, _, committer, _, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    hook = AgentCheckpointer(agent.address(), 1, lambda: pytest.fail("fell back"), 0, keep_every=2)
    try:
        run_training([worker], [hook], committer, [1, 2])
        assert hook.flush(10)
        (step, part), = hook.drain()["ckpt_done"]
        assert step == 2 and part["again"] and part["sent"]
        run_training([worker], [hook], committer, [3])
        assert hook.flush(10)
        (step, part), = hook.drain()["ckpt_done"]
        assert step == 3 and "sent" not in part  # a pooled step: another rank may send it
    finally:
        hook.close()


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
        for link_ in agent.pool.connected():
            link_.conn.shutdown(2)  # as if the agent's process died: its sockets close
        deadline = time.monotonic() + 5
        while agent.pool.connected() and time.monotonic() < deadline:
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
        for link_ in agent.pool.connected():
            link_.persister.close(0.1)  # drops whatever arrives from now on
        agent.shutdown()
        run_training([worker], [hook], committer, [2])  # handed over, never written
        for link_ in agent.pool.connected():
            link_.conn.shutdown(socket.SHUT_RDWR)
        assert hook.flush(10, worker=worker) and hook.fallback is not None
        commit_after_agent_loss(hook, worker, committer, store, 2)
    finally:
        hook.close()


@pytest.mark.parametrize("why", ["agent lost", "state the agent cannot take"])
def test_a_rank_writing_itself_beside_ranks_on_agents_reports_its_own_parts_and_steps_commit(tmp_path, why):
    """Two ranks of one group, each on its node's agent, with the group's part pool as a run
    has. One rank falls back to writing in its own process: its agent died, or its share of
    the state holds a dtype the agent's shard format has no name for. Its parts went to the
    pool, where they waited for the other rank's, which its agent reports directly: no step
    committed again. Now the fallback reports its own parts."""
    import torch.distributed as dist

    from elastic.actors.worker import TrainWorker
    from elastic.checkpoint.pool import PartPool

    url, options = f"file://{tmp_path}", {}
    store = CheckpointStore(url, RUN, options, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1, keep_last=2))
    controller = FakeController(committer)
    agents = [CheckpointAgent(url, options, RUN, controller) for _ in range(2)]
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # the group's store
    port = server.port  # bound by the store itself: no race for a port found free and then taken
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = []
    for w, agent in zip(workers, agents):
        w.part_pool = PartPool("127.0.0.1", port, 2)
        if why == "state the agent cannot take":
            w.model.register_buffer("counts", torch.zeros(3, dtype=torch.complex64))  # no name in our layout
        # As TrainWorker.configure_checkpoint builds it in a run with agents (the real method,
        # on this stand-in): the fallback the controller's message reaches through the notify.
        w._ckpt = None
        TrainWorker.configure_checkpoint(w, url, options, RUN, 1, False, controller, agent_address=agent.address(),
                                         agents_in_run=True)
        hooks.append(w._ckpt)

    def train(steps):
        for step in steps:
            for w, h in zip(workers, hooks):
                w.train(step)
                h.after_step(w, step)
            committer.set_meta(step, {"data": {"cursor": step}})

    try:
        train(range(1, 3))
        if why == "agent lost":
            assert hooks[0].flush(10) and hooks[1].flush(10)
            assert committer.flush(10) and committer.latest_committed == 2
            agents[0].shutdown()
            for link_ in agents[0].pool.connected():
                link_.conn.shutdown(socket.SHUT_RDWR)  # as if its process died: its sockets close
        train(range(3, 7))
        assert any(h.fallback is not None for h in hooks)
        assert [h.fallback is None for h in hooks].count(True) == 1  # the other rank stays on its agent
        for h in hooks:
            assert h.flush(10, worker=workers[hooks.index(h)])
        # Mid-run, before any end-of-run report: steps committed as they were written.
        deadline = time.monotonic() + 10
        while (committer.latest_committed or 0) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert committer.latest_committed == 6
        assert_same(store.read_state(6)[0], workers[0].get_state())
    finally:
        for h in hooks:
            h.close()
        for agent in agents:
            agent.shutdown()
        committer.close()
        del server


def recording_fallback(url: str, options: dict):
    """A ``fallback`` for ``link``: (the in-process writers it made, the factory)."""
    made = []

    def in_process():
        made.append(WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST))
        return made[-1]

    return made, in_process


def raising(exc: BaseException):
    """A stand-in for any call that raises ``exc``."""
    def call(*args, **kwargs):
        raise exc

    return call


@pytest.mark.parametrize("refused", ["ring", "layout"])
def test_shared_memory_this_process_cannot_make_is_not_reported_as_a_lost_agent(node, monkeypatch, refused):
    """A memfd refused here (the open-files limit) is the rank's own limit, not the agent's
    loss: the event names it, and the rank writes in its own process, which needs no memfd."""
    agent, controller, committer, store, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    fallbacks, in_process = recording_fallback(url, options)
    emfile = raising(OSError(errno.EMFILE, "Too many open files"))

    from elastic.checkpoint import worker_hook
    if refused == "ring":
        monkeypatch.setattr(worker_hook.SlotRing, "create", emfile)
    else:
        monkeypatch.setattr(worker_hook, "memfd_with", emfile)
    hook = link(agent, fallback=in_process)
    try:
        reports = run_training([worker], [hook], committer, [1, 2])
        assert fallbacks and hook.fallback is fallbacks[0]
        events = reports[0]["ckpt_events"]
        assert [e["event"] for e in events] == ["checkpoint_shared_memory_failed"]
        assert "Too many open files" in events[0]["message"] and "agent itself is not at fault" in events[0]["message"]
        assert not reports[1]["ckpt_events"]
        events = finish([worker], [hook], committer)
        assert not [e for e in events if e["event"] in ("checkpoint_failed", "checkpoint_agent_lost")]
        assert committer.latest_committed == 2
        assert_same(store.read_state(2)[0], worker.get_state())
    finally:
        hook.close()


def commit_after_agent_loss(hook, worker, committer, store, step: int) -> list:
    """The flushed rank's report after its agent died: the loss told, its parts committing
    ``step`` with the rank's state. Returns the parts."""
    out = hook.drain()
    assert [e["event"] for e in out["ckpt_events"]] == ["checkpoint_agent_lost"]
    for done_step, part in out["ckpt_done"]:
        committer.add(done_step, 0, 1, part["entries"], rng=part.get("rng"))
    assert committer.flush(10) and committer.latest_committed == step
    assert_same(store.read_state(step)[0], worker.get_state())
    return out["ckpt_done"]


@pytest.mark.parametrize("case", ["told and read", "part never reported", "told, unread"])
def test_an_agent_gone_after_writing_the_last_step_is_not_written_again_its_part_is_reported(node, monkeypatch,
                                                                                           case):
    """The agent tells the rank a step is written (with the slot's return) before it reports
    the part: if it dies before the flush, the rank reports that part itself instead of
    rewriting a file a committed manifest may name.
    - "part never reported": it died after telling the rank, before its report went out.
    - "told, unread": the rank had not read the agent's word when the flush found the agent
      gone (its first send failed): what the agent sent is read before the rank decides."""
    agent, controller, committer, store, (url, options) = node
    if case == "part never reported":
        monkeypatch.setattr(agent.pool, "add", lambda *a: None)
    worker = FakeWorker(rank=0, world_size=1)
    rewrites = []

    def in_process():
        hook = WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST)
        monkeypatch.setattr(hook, "snapshot", lambda *a: rewrites.append(a) or [])
        return hook

    hook = link(agent, fallback=in_process)
    try:
        run_training([worker], [hook], committer, [1])
        deadline = time.monotonic() + 10
        if case == "told, unread":
            while committer.latest_committed != 1 and time.monotonic() < deadline:
                time.sleep(0.02)  # the agent reported the part, after telling the rank
            assert committer.latest_committed == 1 and hook._written is None
        else:
            while (hook._written or (0,))[0] != 1 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    hook._poll(time.monotonic() + 0.1)  # the agent's word that step 1 is written
            assert hook._written[0] == 1
        for link_ in agent.pool.connected():
            link_.conn.shutdown(socket.SHUT_RDWR)  # the agent dies (whether or not it reported)
        assert hook.flush(10, worker=worker) and hook.fallback is not None
        assert rewrites == []
        ((step, part),) = commit_after_agent_loss(hook, worker, committer, store, 1)
        assert step == 1 and part["entries"] == hook._written[1]["entries"]
    finally:
        hook.close()


def test_an_agent_lost_mid_run_after_writing_a_step_it_never_reported_has_the_rank_report_it(node, monkeypatch):
    # The part waited in the node's pool (for the other ranks') when the agent died, and the rank
    # fell back at its next snapshot without a word of it: that step (a keep_every milestone)
    # never committed. Only a flush reported it before.
    agent, controller, committer, store, (url, options) = node
    monkeypatch.setattr(agent.pool, "add", lambda *a: None)  # the part never leaves the node's pool
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent, fallback=lambda: WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST))
    try:
        run_training([worker], [hook], committer, [1])
        deadline = time.monotonic() + 60  # loaded (the suite beside it, moto's S3): seconds
        while (hook._written or (0,))[0] != 1 and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                hook._poll(time.monotonic() + 0.1)  # the agent's word that step 1 is written
        assert hook._written is not None and hook._written[0] == 1
        for link_ in agent.pool.connected():
            link_.conn.shutdown(socket.SHUT_RDWR)  # the agent dies
        deadline = time.monotonic() + 5
        while agent.pool.connected() and time.monotonic() < deadline:
            time.sleep(0.01)
        (out,) = run_training([worker], [hook], committer, [2])
        assert hook.fallback is not None
        assert [s for s, _ in out["ckpt_done"]][:1] == [1]
        assert committer.flush(10) and 1 in store.committed_steps()
    finally:
        hook.close()


def test_a_flush_whose_retaken_snapshot_is_dropped_again_goes_on_without_waiting(node, monkeypatch):
    agent, controller, committer, store, _ = node
    with linked_after_step_one(agent, committer) as (worker, hook):
        worker.train(2)
        hook._dropped = 2  # as if step 2 found no free slot
        from elastic.checkpoint import worker_hook
        real = worker_hook.send_message

        def queue_full(sock, message, *args, **kwargs):
            if message.get("op") == "snap":
                raise BlockingIOError
            return real(sock, message, *args, **kwargs)

        monkeypatch.setattr(worker_hook, "send_message", queue_full)
        started = time.monotonic()
        assert hook.flush(10, worker=worker)
        assert time.monotonic() - started < 5  # not the flush's whole deadline
        assert hook._dropped == 2 and hook.fallback is None


def test_the_report_thread_survives_links_coming_and_going_and_a_failing_report(node, monkeypatch):
    """Links are added and dropped by the connection threads while the report thread works out
    whom a step waits for; before they shared the pool's lock that raised 'Set changed size
    during iteration' and ended the report thread, and no step of the node committed again."""
    import sys

    from elastic.checkpoint.agent import _NodePool

    class Link:
        def __init__(self, rank):
            self.rank = rank

    pool = _NodePool(lambda *a: None)
    pool.expect(4, {0, 1, 2, 3})
    for _ in range(50):
        pool.connect(Link(0))
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            link_ = Link(i % 4)
            pool.connect(link_)
            pool.drop(link_)
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for step in range(3000):
            pool.add(0, 4, step, {})
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)

    agent, controller, committer, store, _ = node
    failing = [True]
    failed, added = [], []  # the steps of the parts whose report failed, and of those added after
    real_add = agent.pool.add

    def add_once_failing(rank, world_size, step, part):
        if failing.pop() if failing else False:
            failed.append(step)
            raise RuntimeError("injected")
        added.append(step)
        return real_add(rank, world_size, step, part)

    monkeypatch.setattr(agent.pool, "add", add_once_failing)
    with linked_after_step_one(agent, committer) as (worker, hook):
        run_training([worker], [hook], committer, [2])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 2
    # The failure did happen, in the report thread, on step 1's part (the first it reported), and
    # that thread went on to report step 2, which committed: it is still running.
    assert failing == [] and failed == [1] and 2 in added
    assert agent.stats()["threads"] and all(agent.stats()["threads"].values())


def memfd_descriptors(name: str) -> list[str]:
    """This process's descriptors open on the memfd called ``name``."""
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith(f"/memfd:{name} "):
                found.append(entry)
        except OSError:  # closed meanwhile
            pass
    return found


def test_a_message_that_does_not_fit_or_is_not_json_is_refused_with_its_descriptors_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        name = f"elastic-test-{uuid.uuid4().hex}"
        fd = os.memfd_create(name)
        send_message(a, {"op": "x", "pad": "y" * 100}, fds=[fd])
        with pytest.raises(ValueError, match="cut short"):
            receive_message(b, buffer=bytearray(64))
        # The received descriptor is closed: only the sender's own still names the memfd. (Not
        # the whole fd table against a copy taken before: threads left by earlier tests, such as
        # an agent's or a committer's, open and close descriptors of their own meanwhile.)
        assert memfd_descriptors(name) == [str(fd)]
        os.close(fd)
        a.send(b"not json")
        with pytest.raises(json.JSONDecodeError):  # a ValueError
            receive_message(b, buffer=bytearray(64))
        send_message(a, {"op": "ok"})
        assert receive_message(b, buffer=bytearray(64)) == ({"op": "ok"}, [])
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def linked_after_step_one(agent, committer):
    """A rank linked to ``agent`` whose step 1 is written."""
    worker = FakeWorker(rank=0, world_size=1)
    hook = link(agent)
    try:
        run_training([worker], [hook], committer, [1])
        assert hook.flush(10)
        yield worker, hook
    finally:
        hook.close()


def test_a_rank_rolled_back_counts_its_steps_from_there_on_both_sides(node):
    """A rank that survives a rollback (it trained to step 6, the run went back to 3, its link
    kept) writes steps 4 and 5 again: its parts' progress and its writer's pacing follow it, not
    the old maximum (which inflated the commit lag and kept the writer hurried until training
    passed it), and the step the agent wrote last is 5 (a flush whose agent is gone then reports
    that part instead of writing the file again). Its parts carry the group generation it took
    them in, by which the controller drops a part from before the rollback that comes after it."""
    agent, controller, committer, store, _ = node
    with linked_after_step_one(agent, committer) as (worker, hook):
        worker.generation = 1  # as TrainWorker.join sets it
        run_training([worker], [hook], committer, [2, 3])
        at_3 = worker.get_state()
        run_training([worker], [hook], committer, [4, 5, 6])
        assert hook.flush(10, worker=worker)  # step 6 taken again if it found no free slot
        (link_,) = agent.pool.connected()
        assert link_.newest_step == 6 and hook._written[0] == 6
        worker.set_state(at_3)  # the rollback, as the controller carries it out
        committer.rewind(3)
        worker.generation = 2
        reported = len(controller.checkpoint_written.calls)
        run_training([worker], [hook], committer, [4, 5])
        finish([worker], [hook], committer)
        assert link_.newest_step == 5 and hook._written[0] == 5 and hook._written[1]["generation"] == 2
        calls = controller.checkpoint_written.calls[reported:]
        assert calls and all(parts[0]["generation"] == 2 for _, _, parts in calls)
        progress = {step: parts[0]["progress"] for step, _, parts in calls}
        assert progress.get(5) == 5 and all(step <= p <= 5 for step, p in progress.items())  # the newest then
        assert committer.latest_committed == 5
        assert_same(store.read_state(5)[0], worker.get_state())


def test_an_agent_lost_after_a_rollback_leaves_the_replayed_step_to_the_rank_not_the_old_generations_part(
        node, monkeypatch):
    """The agent wrote step 5 in generation 1; the run rolled back to 3 and replays 4 and 5 in
    generation 2, and the agent dies before writing them. The rank took step 5 for written (the
    same step number), reported generation 1's part, which the controller drops, and step 5 of
    generation 2 was never written: the run ended on checkpoint_incomplete."""
    agent, controller, committer, store, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    worker.generation = 1
    hook = link(agent, fallback=lambda: WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST))
    gate = threading.Event()
    try:
        run_training([worker], [hook], committer, [1, 2, 3])
        at_3 = worker.get_state()
        run_training([worker], [hook], committer, [4, 5])
        assert hook.flush(10, worker=worker) and hook._written[0] == 5
        worker.set_state(at_3)
        committer.rewind(3)
        worker.generation = 2
        write, writing = agent.store.write_shard, threading.Event()
        monkeypatch.setattr(agent.store, "write_shard",
                            lambda *a, **k: (writing.set(), gate.wait(20), write(*a, **k))[2])
        run_training([worker], [hook], committer, [4, 5])  # handed to the agent, which writes nothing yet
        assert writing.wait(10)  # the agent holds generation 2's first write
        for link_ in agent.pool.connected():
            link_.conn.shutdown(socket.SHUT_RDWR)  # the agent dies, generation 2's writes unwritten
        assert hook.flush(10, worker=worker)
        assert hook._orphans == []
        done = hook.drain()["ckpt_done"]
        assert [(step, part["generation"]) for step, part in done] == [(5, 2)]
        for step, part in done:
            committer.add(step, 0, 1, part["entries"], rng=part.get("rng"))
        assert committer.flush(10) and committer.latest_committed == 5
        assert_same(store.read_state(5)[0], worker.get_state())
    finally:
        gate.set()
        hook.close()


def test_a_killed_ranks_write_under_way_lands_before_the_restarted_group_writes_that_step_again(node, monkeypatch):
    """A restart from a checkpoint kills every rank; the agent dropped what waited but let the
    write under way go on, and the restarted rank writes the same step again to the same file
    name. An old write landing after the new one put a shard of the old state under a step that
    committed with the new one's checksum: resume then skipped the newest step as corrupt.
    ``settle`` (the controller's rewind) waits for it, and no old snapshot starts after it."""
    agent, controller, committer, store, _ = node
    release, entered = threading.Event(), threading.Event()
    write = store.write_shard.__func__
    writes = []

    def slow_write(self, step, rank, world_size, buffers):
        writes.append(step)
        if step == 2 and len(writes) == 2:  # the old group's step 2
            entered.set()
            release.wait(20)
        return write(self, step, rank, world_size, buffers)

    monkeypatch.setattr(CheckpointStore, "write_shard", slow_write)
    old, survivor = FakeWorker(rank=0, world_size=1), FakeWorker(rank=0, world_size=1)
    old.generation = survivor.generation = 1
    hook, other = link(agent), link(agent)
    try:
        run_training([old], [hook], committer, [1])
        assert hook.flush(10)
        run_training([old], [hook], committer, [2])
        assert entered.wait(10)
        hook.sock.close()  # the rank is killed: its link is gone with the write under way
        settled = []
        waiter = threading.Thread(target=lambda: settled.append(agent.settle(1, timeout_s=20)))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # waits for the old write
        release.set()
        waiter.join(10)
        assert settled == [[]]
        survivor.train(3)
        other.after_step(survivor, 3)  # an old-generation snapshot: not written
        assert other.flush(10, worker=survivor)
        assert 3 not in writes
        committer.rewind(1)
        new = FakeWorker(rank=0, world_size=1, seed=1)  # the new timeline's step 2: another state
        new.generation = 2
        new.train(1)
        new.train(2)
        assert not torch.equal(new.get_state()["model"]["0.weight"], old.get_state()["model"]["0.weight"])
        fresh = link(agent)
        try:
            committer.set_meta(2, {"data": {"cursor": 2}})
            add_parts(committer, new, fresh.after_step(new, 2))
            finish([new], [fresh], committer)
        finally:
            fresh.close()
        assert committer.latest_committed == 2
        assert_same(store.read_state(2)[0], new.get_state())  # verified: the old write did not land over it
        assert agent.settle(1, timeout_s=1) == []
    finally:
        release.set()
        other.close()


def test_a_rollbacks_fence_stops_only_the_steps_training_writes_again():
    """A rollback to step 5 (a late first-N replica's) keeps generation 3's snapshots of step 5
    and earlier: they are the history training goes on from, and nothing writes them again
    (fenced, a late replica's part of step 5 waiting in the pool was never written, and step 5
    never committed). A restore's fence stops every step of its generations."""
    from elastic.checkpoint.agent import _before_fence

    at = lambda generation, step: SimpleNamespace(generation=generation, step=step)  # noqa: E731
    rollback = [(3, 5)]
    assert not _before_fence(at(3, 5), rollback) and not _before_fence(at(2, 1), rollback)
    assert _before_fence(at(3, 6), rollback) and _before_fence(at(1, 9), rollback)
    assert not _before_fence(at(4, 9), rollback) and not _before_fence(at(None, 9), rollback)
    restore = rollback + [(4, None)]
    assert _before_fence(at(4, 1), restore) and _before_fence(at(3, 5), restore) and not _before_fence(at(5, 9), restore)


def test_a_snapshot_fenced_in_an_outage_does_not_say_the_storage_is_back(node, monkeypatch):
    """An outage, then a rewind fences the snapshot being retried: the writer's next try returns
    without a request. It used to end the outage with a false ``storage_recovered`` event that
    the next failed write reopened; now only a write that reached storage ends it."""
    from elastic.checkpoint.storage import StorageUnavailable

    agent, controller, committer, store, _ = node
    monkeypatch.setenv("ELASTIC_CKPT_RETRY_MIN_S", "0.01")
    monkeypatch.setenv("ELASTIC_CKPT_RETRY_MAX_S", "0.02")
    down, attempts = threading.Event(), []
    write = store.write_shard.__func__

    def flaky(self, step, rank, world_size, buffers):
        attempts.append(step)
        if down.is_set():
            raise StorageUnavailable("the endpoint is down")
        return write(self, step, rank, world_size, buffers)

    monkeypatch.setattr(CheckpointStore, "write_shard", flaky)
    down.set()
    worker = FakeWorker(rank=0, world_size=1)
    worker.generation = 1
    hook = link(agent)

    told = []  # the agent's events as they reach the controller: its pump, and the ranks' flushes

    def events_until(kinds: set, timeout_s: float = 10) -> list:
        deadline = time.monotonic() + timeout_s
        while True:
            seen = told + [e for _, e in controller.events]
            if kinds <= {e["event"] for e in seen} or time.monotonic() >= deadline:
                return sorted((e["time"], e["event"], e["step"]) for e in seen)
            time.sleep(0.02)

    try:
        run_training([worker], [hook], committer, [1])
        assert [e[1:] for e in events_until({"storage_outage"})] == [("storage_outage", 1)]
        assert agent.settle(1, timeout_s=5) == []  # generation 1 given up while storage is down
        assert hook.flush(10)  # the fenced snapshot is let go of, unwritten
        told.extend(hook.drain()["ckpt_events"])
        tried = len(attempts)
        time.sleep(0.7)  # past the agent's event pump (every 0.5 s)
        assert len(attempts) == tried and set(attempts) == {1}
        # Not "storage_recovered": nothing reached storage.
        assert [e[1:] for e in events_until(set(), 0)] == [("storage_outage", 1)]
        down.clear()
        worker.generation = 2
        run_training([worker], [hook], committer, [2])
        told.extend(finish([worker], [hook], committer))
        assert [e[1:] for e in events_until({"storage_recovered"})] == [("storage_outage", 1),
                                                                         ("storage_recovered", 2)]
        assert committer.latest_committed == 2
    finally:
        hook.close()


def test_a_bigger_snapshot_moves_to_a_new_ring_and_the_old_one_is_unmapped_once_free(node):
    agent, controller, committer, store, _ = node
    with linked_after_step_one(agent, committer) as (worker, hook):
        first = hook._ring_id
        bigger = hook._ring_for(hook._rings[first][0].slot_bytes + 1)
        assert bigger != first and first in hook._rings  # the old one waits for its slots
        hook._poll()
        assert first not in hook._rings and hook._ring_id == bigger  # all of its slots were back
        run_training([worker], [hook], committer, [2])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 2
        (link_,) = agent.pool.connected()
        assert set(link_.rings) == {bigger}  # the agent unmapped the old one too


class GrowingWorker(FakeWorker):
    """A model with a buffer one element longer at every step (a state that grows, a resized
    embedding): a tensor of the rank's share whose shape changes between checkpoints."""

    def train(self, step: int) -> None:
        super().train(step)
        self.model.register_buffer("seen", torch.arange(step, dtype=torch.float32))


def views_in_rings(hook: AgentCheckpointer) -> int:
    """The lists of views over a slot the rank's rings hold, one per (slot, layout)."""
    return sum(len(ring._views) for ring, _ in hook._rings.values())


@pytest.mark.parametrize("backend", ["file"], indirect=True)  # the storage plays no part
def test_layouts_and_slot_views_of_a_tensor_whose_shape_keeps_changing_stay_bounded(node):
    # A new shape is a new layout: before, each checkpoint added one on the rank, one at the
    # agent and views over the slot it went into, all kept for the whole run (60 of each here).
    agent, controller, committer, store, _ = node
    worker, hook = GrowingWorker(), link(agent)
    keep = AgentCheckpointer.FORGET_LAYOUTS_AFTER + worker.world_size
    try:
        for step in range(1, 61):
            run_training([worker], [hook], committer, [step])
            finish([worker], [hook], committer)
            assert committer.latest_committed == step
            # Every step's shard is whole: no layout was let go while a snapshot in it waited at the agent.
            assert_same(store.read_state(step)[0], worker.get_state())
            (agent_link,) = agent.pool.connected()
            assert len(hook._layouts) <= keep and views_in_rings(hook) <= keep
            # The agent's may lag by the slots in flight: it is told once they are back.
            assert len(agent_link.layouts) <= keep + hook.SLOTS
        assert len(hook._layouts) == keep  # the newest ones, not one per step
        assert hook._ring_id in hook._rings and len(hook._rings) == 1  # the views went with the layouts, not a new ring
    finally:
        hook.close()


class ReshapingWorker(FakeWorker):
    """Two buffers beside the model: ``big`` (the first writer's share, the largest tensor) and
    ``reshaped``, the second largest, so in the second share, which may take another shape of
    the same size every ``reshape_every`` steps (its bytes, and so the split into shares, stay)."""

    SHAPES = [(d, 240 // d) for d in range(1, 241) if 240 % d == 0]

    def __init__(self, rank: int, world_size: int, reshape_every: int = 0):
        super().__init__(rank, world_size)
        self.model.register_buffer("big", torch.zeros(2000))
        self.model.register_buffer("reshaped", torch.zeros(240))
        self.reshape_every = reshape_every

    def train(self, step: int) -> None:
        super().train(step)
        if self.reshape_every:
            shape = self.SHAPES[(step // self.reshape_every) % len(self.SHAPES)]
            self.model.reshaped = self.model.reshaped.reshape(shape)


@pytest.mark.parametrize("backend", ["file"], indirect=True)
@pytest.mark.parametrize("world_size,min_shard_bytes,reshape", [(1, 0, False), (20, 4000, False), (20, 4000, True)])
def test_a_steady_run_sends_each_layout_once_even_when_the_share_rotates(node, monkeypatch, world_size,
                                                                         min_shard_bytes, reshape):
    """Layouts let go of too soon would be worked out and sent to the agent again and again.
    ``min_shard_bytes=4000``: 3 ranks of 20 write the state, so rank 0 writes each of the 3
    shares once every 20 checkpoints, more than FORGET_LAYOUTS_AFTER apart. ``reshape``: the
    second share's layout is new at each of its turns; letting go of what is older than
    FORGET_LAYOUTS_AFTER then, the first share's layout (used 19 checkpoints before) went too,
    and was sent again at its next turn, every time."""
    agent, _, _, _, _ = node
    worker = ReshapingWorker(0, world_size, reshape_every=world_size if reshape else 0)
    hook = link(agent, min_shard_bytes=min_shard_bytes)
    sent, send_layout = [], hook._send_layout
    monkeypatch.setattr(hook, "_send_layout",
                        lambda layout: sent.append(frozenset(e["name"] for e in layout.entries)) or send_layout(layout))
    try:
        for step in range(1, 5 * world_size + 2 * AgentCheckpointer.FORGET_LAYOUTS_AFTER):
            worker.train(step)
            hook.after_step(worker, step)
            assert hook.flush(10)  # no snapshot dropped for want of a slot: each one's layout is sent
        shares = set(sent)
        assert len(shares) == (1 if world_size == 1 else 3)
        for share in shares:
            times = sent.count(share)
            if reshape and "model/reshaped" in share:
                assert times > 4  # a new shape at each of its turns
            else:
                assert times == 1, f"a layout of the steady share {sorted(share)[:3]}... was sent {times} times"
    finally:
        hook.close()


def test_a_snapshot_dropped_for_want_of_a_slot_is_taken_again_by_the_flush(node):
    """The run's last step must not be the one missing: dropped in the step, taken by the flush."""
    agent, controller, committer, store, _ = node
    with linked_after_step_one(agent, committer) as (worker, hook):
        ring, free = hook._rings[hook._ring_id]
        taken = set(free)
        free.clear()  # as if the agent's answers were not in yet
        worker.train(2)
        assert hook.after_step(worker, 2)["ckpt_events"][0]["event"] == "checkpoint_snapshots_dropped"
        committer.set_meta(2, {"data": {"cursor": 2}})
        free.update(taken)
        finish([worker], [hook], committer)  # flush(worker=...) as the worker calls it
        assert committer.latest_committed == 2
        assert_same(store.read_state(2)[0], worker.get_state())


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
        # A writer is hurried while the step it writes is behind its rank's newest snapshot.
        link = SimpleNamespace(persister=SimpleNamespace(inflight_step=5), newest_step=5, writer_tid=tid,
                               agent=SimpleNamespace(priority=priority))
        if may_restore:
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
            with priority.boosted():
                assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
            agent_module._RankLink._pace(link)  # caught up: stays in the background
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
            link.newest_step = 6
            agent_module._RankLink._pace(link)
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            with priority.boosted():  # a flush's end leaves a hurried writer at normal priority
                pass
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            link.persister.inflight_step = 6
            agent_module._RankLink._pace(link)
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        else:
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, tid) == 19
            with priority.boosted():
                assert os.getpriority(os.PRIO_PROCESS, tid) == 19
            link.newest_step = 6
            agent_module._RankLink._pace(link)  # nice 19 cannot be undone here: it stays
            assert os.getpriority(os.PRIO_PROCESS, tid) == 19
    finally:
        done.set()
        thread.join(10)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_both_rank_side_writers_refuse_an_every_n_steps_that_is_not_a_count(bad):
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 0"):
        WorkerCheckpointer("memory://x", None, "run", bad)
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 0"):
        AgentCheckpointer("/nonexistent/agent.sock", bad, fallback=lambda: None)


def test_a_rank_snapshots_every_nth_step_and_none_with_zero():
    from elastic.checkpoint.worker_hook import is_due

    assert [s for s in range(1, 11) if is_due(3, s)] == [3, 6, 9]
    assert [s for s in range(1, 4) if is_due(1, s)] == [1, 2, 3]
    assert not any(is_due(0, s) for s in range(1, 10))


class _FailingAccepts:
    """The agent's listening socket, whose next accepts fail with ``errors`` first."""

    def __init__(self, server: socket.socket, errors: list[int]):
        self._server, self.errors = server, list(errors)

    def accept(self):
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, os.strerror(code))
        return self._server.accept()

    def __getattr__(self, name):
        return getattr(self._server, name)


class _AgentOutOfDescriptors(CheckpointAgent):
    """An agent whose first accepts fail as at the descriptor limit, then as a rank gone first."""

    def _accept(self, *args):
        self._server = _FailingAccepts(self._server, [errno.EMFILE, errno.ENFILE, errno.ECONNABORTED])
        super()._accept(*args)


def test_an_accept_that_fails_does_not_stop_the_agent_taking_ranks(tmp_path):
    """Accepts refused (EMFILE, ENFILE, ECONNABORTED) used to end the accept thread while the
    socket stayed open: a rank linked later got no slot back and no step of it committed."""
    url, options = f"file://{tmp_path}", {}
    committer = CheckpointCommitter(CheckpointStore(url, RUN, options, retry=FAST),
                                    CheckpointConfig(every_n_steps=1, keep_last=2))
    agent = _AgentOutOfDescriptors(url, options, RUN, FakeController(committer))
    worker = FakeWorker(rank=0, world_size=1)
    hook = None
    try:
        deadline = time.monotonic() + 5
        while agent._server.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not agent._server.errors
        hook = link(agent)
        run_training([worker], [hook], committer, range(1, 5))
        assert hook.flush(2, worker=worker)  # before: no answer, every slot kept
        finish([worker], [hook], committer)
        assert committer.latest_committed == 4
        assert_same(CheckpointStore(url, RUN, options).read_state(4)[0], worker.get_state())
        assert agent.stats()["threads"] == {"accept": True, "reports": True}
    finally:
        if hook is not None:
            hook.close()
        agent.shutdown()
        committer.close()


class _StandInActor:
    """A Ray actor handle as ``NodeAgents`` uses one; ``.remote()`` answers at once and
    ``ray.get`` is the identity (``stand_in_ray``)."""

    def __init__(self, address: str, threads: dict | None = None):
        stats = {"pid": 1, "links": 0, "ranks": [], "written": {},
                 "threads": threads or {"accept": True, "reports": True}}
        self.stats = SimpleNamespace(remote=lambda: stats)
        self.address = SimpleNamespace(remote=lambda: address)
        self.checks: list[bool] = []  # warm_up's: its "ref" is this list
        self.warm_up = SimpleNamespace(remote=lambda check=False: self.checks.append(check) or self.checks)


@pytest.fixture
def stand_in_ray(monkeypatch):
    """``NodeAgents`` without a cluster: ``ray.get`` returns what it is given, ``ray.kill``
    records the actor, and an agent started on node N answers "new-N" (none on node "full":
    its agent's name stays taken, as when ``free_actor_name`` gives up)."""
    import ray

    from elastic.checkpoint.agent import NodeAgents

    killed: list = []
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))

    def start(self, node):
        if node == "full":
            raise ValueError(f"The name checkpoint-agent-{node} (namespace=None) is already taken.")
        return _StandInActor(f"new-{node}")

    monkeypatch.setattr(NodeAgents, "_start", start)
    return NodeAgents(None, RUN, None), killed


def test_an_agent_whose_threads_ended_is_replaced_like_one_that_does_not_answer(stand_in_ray):
    """The actor still answers ``stats`` when its accept or report thread ended; handing out its
    address again would leave the node's ranks with no slot back and no step reported."""
    agents, killed = stand_in_ray
    stuck, well = _StandInActor("old-a", {"accept": False, "reports": True}), _StandInActor("old-b")
    agents._agents = {"a": (stuck, "old-a"), "b": (well, "old-b")}
    assert agents.addresses({"a", "b"}) == {"a": "new-a", "b": "old-b"}
    assert killed == [stuck]


def test_a_node_whose_agent_cannot_start_gets_none_and_the_others_theirs(stand_in_ray):
    """The name of an earlier run's agent still taken after ``free_actor_name``'s wait: the
    ``ValueError`` no longer fails ``fit()``; that node's ranks write in their own processes."""
    agents, killed = stand_in_ray
    assert agents.addresses({"a", "full"}) == {"a": "new-a", "full": None}
    assert "full" not in agents._starting and not killed
    assert agents.addresses({"full"}) == {"full": None}  # tried again when asked again


def test_new_agents_that_never_answer_cost_one_start_timeout_not_one_each(stand_in_ray, monkeypatch):
    """Each new agent's address was waited for with a START_TIMEOUT_S of its own: K agents that
    never answer (their start hung, their node going away) held a recovery K times as long
    before their ranks wrote checkpoints themselves."""
    import ray

    agents, killed = stand_in_ray
    monkeypatch.setattr(NodeAgents, "START_TIMEOUT_S", 0.3)
    waits = []

    def never_answers(ref, timeout=None):
        waits.append(timeout)
        time.sleep(timeout)
        raise ray.exceptions.GetTimeoutError("no answer (test)")

    monkeypatch.setattr(ray, "get", never_answers)
    t0 = time.monotonic()
    assert agents.addresses({"a", "b", "c"}) == {"a": None, "b": None, "c": None}
    assert time.monotonic() - t0 < 0.6 and len(waits) == 3 and sum(waits) <= 0.31, waits
    assert len(killed) == 3


def test_at_the_start_a_new_agents_storage_refusal_ends_the_run_naming_the_node(stand_in_ray, monkeypatch):
    """``addresses(check_storage=True)`` (the run's start) waits for each new agent's storage
    check; a ConfigError from one (no credentials on its node) comes back as a ConfigError that
    names the node. Later (a spare's node, a replaced agent) the check is not waited for."""
    import ray

    from elastic.config import ConfigError

    agents, _ = stand_in_ray
    started: dict = {}
    start = NodeAgents._start

    def recording_start(self, node):
        started[node] = start(self, node)
        return started[node]

    monkeypatch.setattr(NodeAgents, "_start", recording_start)
    cause = ConfigError("RunConfig.storage='s3://b/runs': no AWS credentials found. Pass RunConfig.storage_options")
    identity = ray.get

    def get(ref, timeout=None):
        if "b" in started and ref is started["b"].checks:
            raise ray.exceptions.RayTaskError("warm_up", "Traceback ...", cause)
        return identity(ref, timeout)

    monkeypatch.setattr(ray, "get", get)
    assert agents.addresses({"a"}, check_storage=True) == {"a": "new-a"}
    assert started["a"].checks == [True]
    with pytest.raises(ConfigError, match=r"checkpoint agent on node b: .*no AWS credentials found.*driver's own check"):
        agents.addresses({"b"}, check_storage=True)
    assert agents.addresses({"c"}) == {"c": "new-c"} and started["c"].checks == [False]


@pytest.mark.parametrize("backend", ["file"], indirect=True)  # the storage plays no part
@pytest.mark.parametrize("refused", ["ring", "layout"])
def test_shared_memory_the_agent_cannot_map_sends_the_rank_to_its_own_process(node, monkeypatch, refused):
    """The agent cannot map a rank's ring (or read its layout): it used to log it and carry on,
    each later write failing with a KeyError as ``checkpoint_failed`` and no step committing.
    Now it tells the rank and ends the link; the rank writes in its own process, and the event
    says the agent's shared memory failed."""
    from elastic.checkpoint import agent as agent_module

    agent, controller, committer, store, (url, options) = node
    worker = FakeWorker(rank=0, world_size=1)
    fallbacks, in_process = recording_fallback(url, options)
    enomem = raising(OSError(errno.ENOMEM, "Cannot allocate memory"))

    monkeypatch.setattr(agent_module, "SlotRing" if refused == "ring" else "read_memfd", enomem)
    hook = link(agent, fallback=in_process)
    try:
        reports = run_training([worker], [hook], committer, [1, 2, 3])
        events = [e for r in reports for e in r["ckpt_events"]] + finish([worker], [hook], committer)
        events += controller.events
        assert fallbacks and hook.fallback is fallbacks[0]
        assert [e["event"] for e in events] == ["checkpoint_shared_memory_failed"]
        assert "checkpoint agent ended its link, as it cannot write for this rank" in events[0]["message"]
        assert f"the agent cannot take in the rank's {refused} " in events[0]["message"]  # the agent's error
        assert "(OSError: [Errno 12] Cannot allocate memory)" in events[0]["message"]
        assert committer.latest_committed == 3
        assert_same(store.read_state(3)[0], worker.get_state())
        deadline = time.monotonic() + 5
        while agent.pool.connected() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not agent.pool.connected()  # the agent ended the link
    finally:
        hook.close()


class _Linked:
    def __init__(self, rank: int | None, world_size: int | None):
        self.rank, self.world_size = rank, world_size


def test_a_hot_spares_link_does_not_hold_back_the_parts_of_the_nodes_ranks():
    """Rank 1 of the node writes in its own process (no link); a spare is linked, its rank
    unknown as it never snapshots. Rank 0's part goes at once, not after the POOL_WAIT_S sweep."""
    from elastic.checkpoint.agent import _NodePool

    reported = []
    pool = _NodePool(lambda step, world_size, parts: reported.append((step, sorted(parts))))
    pool.expect(2, {0, 1})
    pool.connect(_Linked(0, 2))
    without_spare = pool._expected(2)
    pool.connect(_Linked(None, None))  # the spare
    assert pool._expected(2) == without_spare == {0}
    pool.add(0, 2, 5, {"entries": []})
    assert reported == [(5, [0])]


def test_the_agent_never_replaces_a_snapshot_keep_every_keeps(node, monkeypatch):
    # The agent's writer keeps only the newest snapshot waiting: a keep_every step replaced there
    # was never written, and that milestone never committed.
    from elastic.checkpoint.agent import _RankLink

    agent, controller, committer, store, _ = node
    committer.keep_every = 2
    real = _RankLink._write_shard

    def slow_first(self, p):
        if p.step == 1:
            time.sleep(0.5)  # steps 2 and 3 arrive while step 1 is written
        return real(self, p)

    monkeypatch.setattr(_RankLink, "_write_shard", slow_first)
    worker = FakeWorker()
    hook = AgentCheckpointer(agent.address(), 1, lambda: pytest.fail("fell back"), 0, keep_every=2)
    try:
        run_training([worker], [hook], committer, [1, 2, 3])
        finish([worker], [hook], committer)
        assert committer.latest_committed == 3
        assert 2 in store.committed_steps()  # kept by keep_every, and written at all
    finally:
        hook.close()


def test_with_no_free_slot_a_step_keep_every_keeps_waits_for_one_and_others_drop_at_once(monkeypatch):
    # Dropped, a keep_every step was never written and the milestone never existed: it waits
    # (bounded) for the agent to hand a slot back; every other step still drops at once.
    monkeypatch.setattr(AgentCheckpointer, "MILESTONE_WAIT_S", 6.0)
    worker = FakeWorker(rank=0, world_size=1)
    with slot_keeping_agent() as (address, received):
        hook = AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"), keep_every=5)
        try:
            waits = {}
            for step in range(1, 7):
                worker.train(step)
                t0 = time.monotonic()
                hook.after_step(worker, step)
                waits[step] = time.monotonic() - t0
            # No slot ever comes back here: step 5 waits its whole bound, the others none of it (a
            # margin of seconds for a loaded machine's pauses).
            assert waits[5] >= 6.0 and waits[4] < 4.0 and waits[6] < 4.0
            assert hook.dropped == 3 and received.count("snap") == AgentCheckpointer.SLOTS
        finally:
            hook.close()


def test_a_state_no_checkpoint_can_store_ends_the_step_in_either_writer(tmp_path):
    # An optimizer that puts a set in its param group after the writer's set-up check: either
    # writer's snapshot of a step raises UnsaveableState naming the step (the run ends there,
    # where every later snapshot would fail alike), and nothing is handed to a writer.
    url = f"file://{tmp_path}"
    committer = CheckpointCommitter(CheckpointStore(url, RUN, {}, retry=FAST), CheckpointConfig(every_n_steps=1))
    agent = CheckpointAgent(url, {}, RUN, FakeController(committer))
    hooks = {"in_process": WorkerCheckpointer(url, {}, RUN, every_n_steps=1, retry=FAST), "agent": link(agent)}
    worker = FakeWorker()
    try:
        worker.train(1)
        worker.optimizer.param_groups[0]["tags"] = {"warm"}
        for name, hook in hooks.items():
            with pytest.raises(UnsaveableState, match=r"optimizer/param_groups/0/tags has a set; .*"
                                                      r"\(found in step 1's snapshot; "):
                hook.after_step(worker, 1)
            assert hook.flush(10), name
            assert hook.drain()["ckpt_done"] == [], name
    finally:
        for hook in hooks.values():
            hook.close()
        agent.shutdown()
        committer.close()


def test_a_step_keep_every_keeps_waits_for_room_in_the_agents_queue_and_is_told_when_dropped(node, monkeypatch):
    # The agent's queue full (it is far behind): any other step drops at once, but a keep_every
    # step was dropped at once too, and only counted in the once-a-minute drop event. It waits
    # for room (bounded, as for a slot), and one dropped all the same is an event of its own.
    from elastic.checkpoint import worker_hook

    agent, controller, committer, store, _ = node
    committer.keep_every = 2
    monkeypatch.setattr(AgentCheckpointer, "MILESTONE_WAIT_S", 1.0)
    real, full = worker_hook.send_message, {"refusals": 0}

    def queue_full(sock, message, *args, **kwargs):
        if message.get("op") == "snap" and full["refusals"]:
            full["refusals"] -= 1
            raise BlockingIOError
        return real(sock, message, *args, **kwargs)

    monkeypatch.setattr(worker_hook, "send_message", queue_full)
    worker = FakeWorker(rank=0, world_size=1)
    hook = AgentCheckpointer(agent.address(), 1, lambda: pytest.fail("fell back"), 0, keep_every=2)
    try:
        events = {}
        for step, refusals in ((1, 1), (2, 3), (3, 0), (4, math.inf)):  # step 4: refused for good
            full["refusals"] = refusals
            (report,) = run_training([worker], [hook], committer, [step])
            events[step] = report["ckpt_events"]
        # Step 1 (no milestone) dropped at the first refusal; step 2 sent after three; step 4
        # refused for longer than its wait: dropped, and said so.
        assert hook.dropped == 2 and hook._dropped == 4
        failed = [e for e in events[4] if e["event"] == "checkpoint_failed"]
        assert [(e["step"], e["error"]) for e in failed] == [(4, "milestone dropped")]
        assert not [e for e in events[1] if e["event"] == "checkpoint_failed"]
        full["refusals"] = 0
        finish([worker], [hook], committer)
        assert 2 in store.committed_steps() and committer.latest_committed == 4  # the flush takes step 4 again
    finally:
        hook.close()


@pytest.mark.parametrize("refused", ["layout", "ring"])
def test_a_step_keep_every_keeps_waits_for_room_to_send_its_new_layout_or_ring(monkeypatch, refused):
    # A keep_every step whose new layout (or new ring) the agent's full queue refused was dropped
    # at once, told as dropped "after 5s": its wait only waited for a free slot, a slot was free,
    # and the second try met the same full queue. It tries again until its bound, waiting for
    # room in the queue as well as for a slot; a plain step still drops at once.
    from elastic.checkpoint import worker_hook

    real, full = worker_hook.send_message, {"refusals": 0}

    def queue_full(sock, message, *args, **kwargs):
        if message.get("op") == refused and full["refusals"]:
            full["refusals"] -= 1
            raise BlockingIOError
        return real(sock, message, *args, **kwargs)

    monkeypatch.setattr(worker_hook, "send_message", queue_full)
    worker = FakeWorker(rank=0, world_size=1)
    with slot_keeping_agent() as (address, received):
        hook = AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"), keep_every=2)
        try:
            reports, waits = {}, {}
            for step, refusals in ((1, 1), (2, 2)):  # step 1 a plain step, step 2 a milestone
                full["refusals"] = refusals
                worker.train(step)
                t0 = time.monotonic()
                reports[step] = hook.after_step(worker, step)
                waits[step] = time.monotonic() - t0
            assert waits[1] < 4.0 and waits[2] < 4.0  # neither waits out the 5 s bound here
            assert hook.dropped == 1 and hook._handed == 2  # step 1 dropped, step 2 handed over
            assert [e["event"] for e in reports[1]["ckpt_events"]] == ["checkpoint_snapshots_dropped"]
            assert not [e for e in reports[2]["ckpt_events"] if e["event"] == "checkpoint_failed"]
            assert hook.flush(5)
            assert received.count("snap") == 1 and received.count(refused) == 1
        finally:
            hook.close()


def test_a_final_flush_that_times_out_is_an_event_of_its_own():
    # The rank's writes at the end did not finish within the flush's bound (slow storage): the
    # flush's False was dropped, and the controller only saw that a part never came
    # (checkpoint_incomplete), which points at the rank.
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    class SlowWrites:
        close_timeout_s = 30.0

        def flush(self, timeout_s=None, worker=None):
            return False

        def drain(self, events=None):
            return {"ckpt_done": [], "ckpt_events": list(events or [])}

    w = SimpleNamespace(_ckpt=SlowWrites(), completed_step=7, world_size=2)
    w._ckpt_report = lambda report: TrainWorker._ckpt_report(w, report)
    report = TrainWorker.flush_checkpoint(w)
    (event,) = report["ckpt_events"]
    assert event["event"] == "checkpoint_rank_flush_timeout" and event["step"] == 7
    assert "did not finish within 30s" in event["message"]


def test_a_rank_waits_on_its_agent_link_whatever_the_descriptor_number():
    # select() refuses a descriptor of 1024 or more (ValueError), and a rank links to its agent
    # after its process group, CUDA and data loaders opened theirs: a flush then raised past its
    # handlers, and a milestone waiting for room lost its slot for the rest of the run.
    import resource

    from elastic.checkpoint.worker_hook import _ready

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1100:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        high = socket.socket(fileno=os.dup2(a.fileno(), 1050))
        assert high.fileno() >= 1024
        assert _ready(high, True, 0.1)  # room to send
        assert not _ready(high, False, 0.05)  # nothing to read yet
        b.send(b"x")
        assert _ready(high, False, 1.0)
        high.close()
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_message_whose_descriptors_this_process_cannot_take_is_told_apart_from_a_malformed_one():
    # At its open-files limit the agent gets a rank's ring message whole, its memfd dropped by
    # the kernel (MSG_CTRUNC). Taken for a malformed stream, the link ended without a word and
    # the rank said "the checkpoint agent is gone"; now the agent refuses the link in order.
    import resource

    from elastic.checkpoint.agent import DescriptorsCut, receive_message, send_message

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        send_message(a, {"op": "ring", "ring": 1}, [r])
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:  # every descriptor this process may have, taken
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(DescriptorsCut) as cut:
            receive_message(b)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
    assert cut.value.message == {"op": "ring", "ring": 1} and "open-files limit" in str(cut.value)


def takes_on_a_dtype_no_checkpoint_can_hold(worker, hook) -> None:
    """Step 1 snapshots; then the optimizer takes on float8_e8m0fnu state, and step 2's snapshot
    must end the run (``UnsaveableState``) rather than be written."""
    worker.train(1)
    hook.after_step(worker, 1)
    worker.optimizer.state[next(worker.model.parameters())]["scales"] = torch.zeros(2, dtype=torch.float8_e8m0fnu)
    worker.train(2)
    with pytest.raises(UnsaveableState, match=r"is a torch.float8_e8m0fnu tensor, which a checkpoint .*found in "
                                              r"step 2's snapshot"):
        hook.after_step(worker, 2)


def test_a_dtype_no_checkpoint_can_hold_that_the_state_takes_on_later_ends_the_run_at_that_step(tmp_path):
    # An optimizer makes its state at its first step, after the check before any step: a
    # custom one's float8_e8m0fnu scales were written, committed, and read back as corrupt.
    from elastic.actors.worker import TrainWorker

    w = FakeWorker()
    w._ckpt = None
    TrainWorker.configure_checkpoint(w, f"file://{tmp_path}", {}, RUN, 1, False, None)
    try:
        takes_on_a_dtype_no_checkpoint_can_hold(w, w._ckpt)
    finally:
        w._ckpt.close()


def test_a_dtype_no_checkpoint_can_hold_that_the_state_takes_on_later_ends_the_run_on_a_node_agent(node):
    agent, *_ = node
    hook = link(agent)
    try:
        takes_on_a_dtype_no_checkpoint_can_hold(FakeWorker(), hook)
    finally:
        hook.close()


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float8_e8m0fnu])
def test_a_state_with_a_dtype_no_checkpoint_can_hold_is_refused_before_any_step(tmp_path, dtype):
    # The check before the first step read the state's structure only. With safetensors 0.8 a
    # complex128 tensor failed every write (no step ever committed), and a float8_e8m0fnu one was
    # written but read back as corrupt, so a resume started over from step 0.
    from elastic.actors.worker import TrainWorker

    w = FakeWorker()
    w.model.register_buffer("scales", torch.zeros(2, dtype=dtype))
    w._ckpt = None
    with pytest.raises(UnsaveableState, match=rf"model/scales is a {dtype} tensor, which a checkpoint \(safetensors "):
        TrainWorker.configure_checkpoint(w, f"file://{tmp_path}", {}, RUN, 1, False, None)
