"""The checkpoint agent: one process per node that persists the snapshots of that node's ranks.

A rank copies its share of the state into a slot of memory it shares with the agent
(``elastic.checkpoint.shm``) inside the step and sends one small message on a Unix socket. The
agent writes the shard from that memory, hands the slot back, gathers the parts of the node's
ranks and sends the controller one message a step.

Why a process of its own and not a thread in each rank (as ``WorkerCheckpointer`` does): a
writer thread shares the rank's interpreter lock with training, and every time it takes the lock
back (after a write, a hash, a store round trip, a Ray call) it waits for the training thread to
hand it over. In one process, a Python thread spinning beside a thread doing TCP store round
trips cut those round trips from ~46,000/s to 193/s; on a GPU the training thread is the one
that launches the kernels. The agent does that work in a process that shares no lock with
training, with its writer threads on idle CPU (``WriterPriority``). CheckFreq (FAST'21)
persists from a separate process for the same reason, as does torch.distributed.checkpoint's
``AsyncCheckpointerType.PROCESS`` (one process per rank, each with torch, writing DCP's own
format; here one light process per node writes the safetensors shards and reports to the
committer, whose manifest, checksums and retention stay as they are).

What it does not do on the 2-vCPU benchmark VM: lower the checkpoint overhead. With the cores
full, wall time follows total CPU, and the work itself (hash, write, fsync of 3.25 MB a step, a
manifest, reports) is the same wherever it runs: alternating runs of the checkpoint benchmark
gave ratios of 1.533, 1.371, 1.448 with the in-process writer and 1.459, 1.517, 1.349 with the
agent; per process, the ranks' added CPU moved to the agent (benchmarks/checkpoint_overhead.py).

Messages are JSON on a ``SOCK_SEQPACKET`` socket (one message per datagram, in order); a
rank's ring of slots travels once as a file descriptor (``SCM_RIGHTS``). A rank never waits
for the agent inside a step: with no free slot it drops that step's snapshot (the newest
snapshot would have replaced a waiting one anyway). ``AgentCheckpointer`` is the rank's side.
"""

from __future__ import annotations

import array
import json
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from elastic.actors.names import free_actor_name
from elastic.actors.priority import can_restore_priority
from elastic.checkpoint.codec import RawRng, canonical_json, json_object_plus, safetensors_header
from elastic.checkpoint.persister import AsyncPersister
from elastic.checkpoint.shm import SlotRing, read_memfd
from elastic.checkpoint.store import CheckpointStore, shard_metadata, with_ages

logger = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20  # a message is a header, a ring's description or a small rank's RNG (a layout has a memfd)
MAX_FDS = 4
# How long a node's parts of a step wait for the node's other ranks before they go to the
# controller on their own (a rank that stopped writing, or one far behind in first-N).
POOL_WAIT_S = 2.0
# Said with a storage refusal on a node after the driver's check passed (``validate``).
ON_NODES = ("The driver's own check passed: its environment (AWS_* variables, ~/.aws, an instance role) is not "
            "the nodes'. Pass the credentials in RunConfig.storage_options, or set them up on every node.")


def refused_on_node(where: str, refusal: BaseException):
    """The ConfigError for a storage refusal met by ``where`` (a process on some node) at a run's
    start, after the driver's check had passed (``Storage.check_here``)."""
    from elastic.config import ConfigError

    return ConfigError(f"{where}: {refusal} {ON_NODES}")
# A writer this many steps behind its rank's newest snapshot runs at normal priority until it
# has caught up (WriterPriority.hurry).
HURRY_STEPS = 1
# A failed accept (the descriptor limit, say) is tried again after this pause, doubled while it
# fails up to ACCEPT_PAUSE_MAX_S, and logged at most every ACCEPT_LOG_EVERY_S (CheckpointAgent._accept).
ACCEPT_PAUSE_S = 0.05
ACCEPT_PAUSE_MAX_S = 0.2
ACCEPT_LOG_EVERY_S = 30.0


def send_message(sock: socket.socket, message: dict, fds: list[int] | None = None, block: bool = True) -> None:
    """One JSON message (and file descriptors); ``block=False`` raises ``BlockingIOError`` instead
    of waiting when the peer's queue is full. (Not ``socket.send_fds``: up to Python 3.12 it
    drops its ``flags``.)"""
    data = json.dumps(message, separators=(",", ":")).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary, 0 if block else socket.MSG_DONTWAIT)


class DescriptorsCut(ValueError):
    """A whole message whose file descriptors the kernel dropped (``MSG_CTRUNC``): the receiving
    process is at its open-files limit. ``message`` is the message, parsed."""

    def __init__(self, message: dict):
        super().__init__(f"the descriptors of a checkpoint agent message ({message.get('op')!r}) were dropped: the "
                         f"agent's process is at its open-files limit (or they were over {MAX_FDS})")
        self.message = message


def receive_message(sock: socket.socket, block: bool = True,
                    buffer: bytearray | None = None) -> tuple[dict | None, list[int]]:
    """``(message, fds)``; ``(None, [])`` when the peer closed. ``block=False`` raises
    ``BlockingIOError`` when nothing is waiting. ``buffer`` (``MAX_MESSAGE`` bytes, one per
    thread that receives): received into instead of a fresh 1 MiB allocation per message (an
    mmap and its page faults: ~46 against ~8 us on the rank's side, inside the step). A message
    that does not fit, or is no JSON, raises ``ValueError`` with its descriptors closed; a whole
    one whose descriptors did not fit in this process (``MSG_CTRUNC`` alone: its open-files
    limit), ``DescriptorsCut``."""
    fds = array.array("i")
    buffer = bytearray(MAX_MESSAGE) if buffer is None else buffer
    n, ancillary, flags, _ = sock.recvmsg_into([buffer], socket.CMSG_LEN(MAX_FDS * fds.itemsize),
                                               0 if block else socket.MSG_DONTWAIT)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        if flags & socket.MSG_TRUNC:
            raise ValueError(f"a checkpoint agent message was cut short (over {len(buffer)} bytes)")
        message = json.loads(bytes(buffer[:n])) if n else None
        if message is not None and not isinstance(message, dict):
            raise ValueError("a checkpoint agent message is not a JSON object")
        if flags & socket.MSG_CTRUNC:
            if message is None:
                raise ValueError(f"a checkpoint agent message carried over {MAX_FDS} descriptors")
            raise DescriptorsCut(message)
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    if message is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return message, list(fds)


class WriterPriority:
    """The writer threads' CPU priority: background while training runs, normal while a flush
    waits for them.

    Background is Linux ``SCHED_IDLE`` (a core runs the thread only when no other thread wants
    it) where this process may raise a thread back out of it (``can_restore_priority``), since
    a flush (end of training, a recovery) must not wait on threads that a busy node never runs;
    otherwise nice 19, which still gets a small share. Per thread: the agent's socket and Ray
    threads stay at normal priority, so slots go back to the ranks at once.

    On the checkpoint benchmark (4 ranks on 2 cores, alternating runs): mean steps of 31.3 and
    35.6 ms with ``SCHED_IDLE`` writers against 37.2 and 37.4 ms at normal priority (baselines
    22.3-25.2 ms); overhead ratios of 1.387 and 1.144 (file) against 1.528 and 1.455 at nice 19,
    which commits sooner (lag p95 0-1 steps against 2 on file, 2 against 3-4 on S3 with the moto
    server sharing the cores).

    So a writer that falls behind is hurried (``hurry``): once a rank's newest snapshot is
    ``HURRY_STEPS`` (1) past the step its writer is writing, the writer runs at normal priority
    until it has caught up. The writing is the same work either way; what changes is that it no
    longer waits for an idle core while snapshots pile up. Five alternating rounds of
    ``checkpoint_overhead.py --skip-s3 --skip-raytrain`` (2-vCPU VM, 2026-11-27): lag p95
    1/2/1/2/1 steps and persist p95 0.088-0.123 s hurried at 1 step behind, 2/2/2/2/3 and
    0.084-0.149 s at 2 behind, 3/2/2/2/1 and 0.071-0.169 s never; the overhead moved within the
    noise (1.26-1.56, 1.36-1.61, 1.34-1.64)."""

    def __init__(self, background: bool = True):
        self.background = background and sys.platform.startswith("linux")
        self.idle = self.background and hasattr(os, "SCHED_IDLE") and can_restore_priority()
        self._lock = threading.Lock()
        self._threads: set[int] = set()
        self._hurried: set[int] = set()  # writer threads at normal priority while they are behind (hurry)
        self._boosts = 0

    def enter(self) -> None:
        """Called first on each writer thread."""
        if not self.background:
            return
        tid = threading.get_native_id()
        with self._lock:
            self._threads.add(tid)
            if self._boosts == 0 and tid not in self._hurried:
                self._lower(tid)

    def leave(self) -> None:
        with self._lock:
            self._threads.discard(threading.get_native_id())
            self._hurried.discard(threading.get_native_id())

    def hurry(self, tid: int | None, on: bool) -> None:
        """One writer thread at normal priority (``on``) while its rank's snapshots pile up
        behind its write, back in the background once it has caught up. Only where the writers
        are idle-class and this process may raise them back (``idle``): at nice 19 they still
        get a share of a busy node."""
        if not self.idle or tid is None:
            return
        with self._lock:
            if on == (tid in self._hurried) or tid not in self._threads:
                return
            self._hurried ^= {tid}
            if self._boosts:
                return  # while boosted every writer is at normal priority already
            if on:
                self._set(tid, os.SCHED_OTHER)
            else:
                self._lower(tid)

    @contextmanager
    def boosted(self) -> Iterator[None]:
        """Writers at normal priority for the body (a flush waits on them), where that is allowed."""
        if not self.idle:
            yield
            return
        with self._lock:
            self._boosts += 1
            if self._boosts == 1:
                for tid in list(self._threads):
                    self._set(tid, os.SCHED_OTHER)
        try:
            yield
        finally:
            with self._lock:
                self._boosts -= 1
                if self._boosts == 0:
                    for tid in list(self._threads - self._hurried):
                        self._lower(tid)

    def _lower(self, tid: int) -> None:
        if self.idle:
            self._set(tid, os.SCHED_IDLE)
            return
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)  # Linux: nice is per thread
        except OSError as exc:
            logger.debug("checkpoint agent: cannot lower writer thread %d's priority: %s", tid, exc)

    def _set(self, tid: int, policy: int) -> None:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError as exc:  # the thread ended meanwhile
            logger.debug("checkpoint agent: writer thread %d: %s", tid, exc)
            self._threads.discard(tid)


class _Payload:
    """One snapshot handed to the agent: a slot of a ring (a shard to write) or an RNG alone."""

    __slots__ = ("step", "rank", "world_size", "taken_at", "generation", "ring", "slot", "layout", "meta_len", "rng",
                 "rng_raw", "rng_lens", "part", "keep")

    def __init__(self, m: dict):
        self.step, self.rank, self.world_size = int(m["step"]), int(m["rank"]), int(m["world_size"])
        self.taken_at = float(m["taken_at"])
        self.generation = m.get("generation")  # the rank's group generation then (worker_hook.group_generation)
        self.ring, self.slot, self.layout = m.get("ring"), m.get("slot"), m.get("layout")
        self.meta_len = int(m.get("meta_len", 0))
        self.rng = m.get("rng")  # encoded: a rank with no shard
        self.rng_raw, self.rng_lens = m.get("rng_raw"), m.get("rng_lens")  # RawRng's fields and blob sizes in the slot
        self.part: dict | None = None  # what it was written as, once written (a slot's: reported at its release)
        self.keep = bool(m.get("keep"))  # a step retention keeps (store.is_milestone): never replaced


def given_up(generation: Any, step: int, fences: list[tuple[int, int | None]]) -> bool:
    """Whether a snapshot of ``step`` taken in group ``generation`` is of a state training gave
    up: each fence (generation, through) gives up that group and older ones, for every step
    (``through`` None: a restore) or for the steps after ``through`` (a rollback to that step,
    on the history those groups trained). A snapshot without a generation, from a rank outside
    a group, never is. The one rule of the agents' write fence (``CheckpointAgent.settle``) and
    of the controller's parts (``Controller._add_part``)."""
    return generation is not None and any(
        int(generation) <= fenced and (through is None or step > through) for fenced, through in fences)


def _before_fence(p: _Payload, fences: list[tuple[int, int | None]]) -> bool:
    """Whether a fence (``CheckpointAgent.settle``) stops ``p`` (``given_up``)."""
    return given_up(p.generation, p.step, fences)


class _RankLink:
    """One rank's connection: its rings and layouts, its writer (one ``AsyncPersister``) and its
    newest part."""

    def __init__(self, agent: "CheckpointAgent", conn: socket.socket, number: int):
        self.agent, self.conn, self.number = agent, conn, number
        self.rings: dict[int, SlotRing] = {}
        self.layouts: dict[int, list[dict]] = {}
        self.rank: int | None = None
        self.world_size: int | None = None
        self.newest_step = 0
        self.last_part: tuple[int, dict] | None = None
        self.gone = False  # the rank closed the connection (or died): nothing of it is reported any more
        self.refused: str | None = None  # why this link ends from the agent's side (refuse)
        self.writer_tid: int | None = None
        self.persister = AsyncPersister(self._write, name=f"checkpoint write (agent link {number})",
                                        on_done=self._written, on_release=self._release,
                                        reached_storage=lambda part: "unwritten" not in part,
                                        thread_init=self._writer_enter, thread_exit=agent.priority.leave)

    def _pace(self) -> None:
        """The writer at normal priority while the step it writes is ``HURRY_STEPS`` or more
        behind this rank's newest snapshot, in the background otherwise (``WriterPriority``)."""
        writing = self.persister.inflight_step
        behind = writing is not None and self.newest_step - writing >= HURRY_STEPS
        self.agent.priority.hurry(self.writer_tid, behind)

    # ---- the writer thread ------------------------------------------------------------------
    def _writer_enter(self) -> None:
        self.writer_tid = threading.get_native_id()
        self.agent.priority.enter()

    def _write(self, p: _Payload) -> dict:
        if not self.agent.begin_write(self, p):
            return {"unwritten": "fenced"}
        try:
            return self._write_shard(p)
        finally:
            self.agent.end_write(self)

    def _write_shard(self, p: _Payload) -> dict:
        self._pace()  # the newest snapshot (the waiting one is always the newest): usually caught up
        if p.ring is None:
            return {"entries": [], "taken_at": p.taken_at, "rng": p.rng}
        ring, layout = self.rings.get(p.ring), self.layouts.get(p.layout)
        if ring is None or layout is None:
            # _handle takes no snapshot naming a ring or layout this link lacks, and a ring is
            # dropped only once all its slots are back, so this is a guard: were it let through
            # as a KeyError, every later step would fail alike and the rank would never know.
            self.refuse(f"the snapshot of step {p.step} names ring {p.ring} and layout {p.layout}, which the "
                        "agent does not hold")
            return {"unwritten": "refused"}
        nbytes = sum(e["nbytes"] for e in layout)
        meta = ring.read(p.slot, nbytes, p.meta_len)
        if p.rng_lens is not None:  # the rank's RNG as it read it, after the meta: encoded here, off its step
            blobs = ring.read(p.slot, nbytes + p.meta_len, sum(int(n) for n in p.rng_lens))
            rng = RawRng.from_bytes(p.rng_raw, blobs, p.rng_lens).encode()
            meta = json_object_plus(meta, "rng", canonical_json(rng))
        header = safetensors_header(layout, shard_metadata(meta))
        entry = self.agent.store.write_shard(p.step, p.rank, p.world_size, [header, ring.data(p.slot, nbytes)])
        return {"entries": [entry.to_dict()], "taken_at": p.taken_at}

    def _written(self, step: int, p: _Payload, part: dict) -> None:
        if self.gone or "unwritten" in part:
            # See serve(): a rank that died takes its unreported parts along, as in process. A
            # fenced snapshot (CheckpointAgent.settle), or one a refused link could not write
            # (refuse), was not written: nothing to report.
            return
        part = {**part, "progress": self.newest_step}
        if p.generation is not None:
            part["generation"] = p.generation
        # A flush's report of it (``flushed``) names the snapshot's rank and world size, as the
        # in-process writer's does (``again``): after a shrink renumbered the ranks, the rank the
        # flush asks is another one, of another world size, and the part was filed there: it
        # replaced the old world's reports of the step, which then never committed.
        # A milestone's part this agent sends itself (_pump), in the rank's order: marked sent,
        # so the controller waits for that push before it takes this second report in
        # (Controller._await_push), as for a rank's own milestones. Taken in first, it moved the
        # milestone floor past the rank's push of the milestone before, then dropped as stale.
        self.last_part = (step, {**part, "again": True, "rank": p.rank, "world_size": p.world_size,
                                 **({"sent": True} if p.keep else {})})
        if p.ring is None:
            self.agent.reports.put(("part", (p.rank, p.world_size, step, part, p.keep)))
        else:
            p.part = part  # reported once the rank is told, with the slot's return (_release)

    def _release(self, p: _Payload) -> None:
        """The slot goes back to the rank, with the part it was written as (if it was), and only
        then is the part reported: one queue, emptied in order by one thread (the normal-priority
        report thread; the writer thread may be idle-class), so the rank hears that the step is
        written before the part can reach the controller. A rank whose agent dies then knows the
        step is on storage and reports the part itself instead of writing the same file again: a
        rewrite in place would replace a shard a committed manifest may name already, with other
        header bytes (its checksum no longer matching) or torn. (The persister releases a written
        payload right after ``_written``, on the same thread.)"""
        if p.ring is None:
            return
        message: dict[str, Any] = {"op": "free", "ring": p.ring, "slot": p.slot}
        if p.part is not None:
            message["written"] = [p.step, p.part]
        self.agent.reports.put(("send", (self, message)))
        if p.part is not None:
            self.agent.reports.put(("part", (p.rank, p.world_size, p.step, p.part, p.keep)))

    def send(self, message: dict) -> None:
        """From the report thread, the only one that writes to the rank (no lock needed)."""
        try:
            send_message(self.conn, message)
        except OSError:
            pass  # the rank is gone; its loop ends on its own

    def refuse(self, why: str) -> None:
        """End this link from the agent's side: the agent cannot use the rank's shared memory
        (a ring it could not map: the agent's open-files limit, ENOMEM, vm.max_map_count; a
        layout it could not read). Every later snapshot of the rank would name that ring or
        layout, so carrying on would fail each of its writes, the slots would come back as if
        written-and-freed, and the rank would never stop handing snapshots to a link that
        writes none. Instead the rank is told why (``refused``), then the connection is shut:
        the rank reads the refusal before the end of the stream, and writes in its own
        process from then on (``AgentCheckpointer``; its event names the agent's error).

        Both go through the report queue, behind the slots already handed back, from the one
        thread that writes to the rank; the shutdown wakes ``serve``, whose ``finally`` ends the
        link as for a rank that left. Until then nothing more of the rank is taken (``_handle``)."""
        if self.refused is not None:
            return
        self.refused = why
        logger.warning("checkpoint agent: ends link %d (rank %s), which writes in its own process from now on: %s",
                       self.number, self.rank, why)
        self.agent.reports.put(("send", (self, {"op": "refused", "error": why[:500]})))
        self.agent.reports.put(("end", self))

    def end(self) -> None:
        """From the report thread, after the refusal (``refuse``)."""
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the rank closed it first

    # ---- the connection's thread ------------------------------------------------------------
    def serve(self) -> None:
        buffer = bytearray(MAX_MESSAGE)
        try:
            while True:
                try:
                    message, fds = receive_message(self.conn, buffer=buffer)
                except OSError:
                    break
                except DescriptorsCut as cut:
                    # The message is whole, its ring or layout lost: the link ends in order (the
                    # rank is told why and writes on its own), not as a malformed stream would,
                    # which the rank took for a lost agent while this one was at its fd limit.
                    self.refuse(str(cut))
                    continue
                except ValueError:
                    logger.exception("checkpoint agent: a malformed message from rank %s ends its link", self.rank)
                    break
                if message is None:
                    break
                try:
                    self._handle(message, fds)
                except Exception:  # noqa: BLE001 - a bad message must not end the rank's link (see refuse)
                    logger.exception("checkpoint agent: cannot handle %r from rank %s", message.get("op"), self.rank)
        finally:
            # The rank closed its end: after a flush at the end of a run (nothing waits), or in
            # its death. What still waits then is not written: in process it would have died with
            # the rank, and a write landing after a recovery rolled the run back could put an
            # old shard under a step number the new group writes again.
            dropped = self.close()
            if dropped:
                logger.info("checkpoint agent: rank %s is gone; its snapshots of steps %s are not written",
                            self.rank, dropped)

    def close(self, timeout_s: float = 5.0) -> list[int]:
        """Tear the link down: its writes stopped, its events reported, its memory and connection
        closed. Returns the steps whose snapshots it dropped."""
        self.gone = True
        # Abort first: a write under way finishes inside it, and its events (a failure, an
        # outage starting or ending) are drained once forgotten. The other way round they landed
        # in a persister no one polled any more, and a failed last write went unsaid.
        dropped = self.persister.abort(timeout_s)
        self.agent.forget(self)
        for ring in self.rings.values():
            ring.close()
        # Shut, not closed: the report thread may be sending on it (a slot's return the abort
        # above queued), and a descriptor closed here could be reused by a rank linked next, to
        # which that send would hand another rank's slot. The report thread closes it once it
        # has sent what was queued before (``_forget``, queued behind them).
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the rank closed it first
        return dropped

    def _handle(self, m: dict, fds: list[int]) -> None:
        op = m.get("op")
        try:
            if self.refused is not None:
                return  # the link is ending (refuse): what the rank still sends is not taken
            if op in ("ring", "layout"):
                try:
                    self._take_memory(op, m, fds)
                except Exception as exc:  # noqa: BLE001 - the rank is told and falls back (refuse)
                    self.refuse(f"the agent cannot take in the rank's {op} {m.get(op)} ({type(exc).__name__}: {exc})")
            elif op == "drop_ring":
                ring = self.rings.pop(int(m["ring"]), None)
                if ring is not None:
                    ring.close()
            elif op == "forget_layout":
                # A layout the rank let go of (AgentCheckpointer._forget_layouts). Why: each one
                # stayed here for the life of the link, so a tensor whose shape changed every
                # checkpoint added one each time, for the whole run. The rank says so only once
                # every slot it filled is back, so no snapshot waiting here names it; a later
                # one that does is refused ("snap" below), as for any layout never received.
                self.layouts.pop(int(m["layout"]), None)
            elif op == "snap":
                p = _Payload(m)
                if p.ring is not None and (p.ring not in self.rings or p.layout not in self.layouts):
                    # A rank sends a ring and a layout before any snapshot in them, on this
                    # ordered socket: one missing is one refused above (or a rank out of step).
                    self.refuse(f"the snapshot of step {p.step} names ring {p.ring} and layout {p.layout}, which "
                                "the agent does not hold")
                    return
                if self.persister.died:
                    # Its writer thread is gone (``AsyncPersister._died``): every later snapshot
                    # would come back unwritten, and the rank would hand them over for good, no
                    # step of it committing again. Told, it writes in its own process.
                    self.refuse("the agent's writer thread for this rank died")
                    return
                self.rank, self.world_size = p.rank, p.world_size
                # The newest snapshot is the one sent last: a rank snapshots its steps in order,
                # so one at or below the step before means training went back (a rollback), and
                # the pacing and the parts' progress follow it there (with the old maximum the
                # writer stayed hurried, and the commit lag inflated, until training passed it).
                self.newest_step = p.step
                self.persister.submit(p.step, p, light=p.ring is None, keep=p.keep)
                self._pace()
            elif op == "flush":
                threading.Thread(target=self._flush, args=(m.get("id"), float(m.get("timeout_s", 30.0))),
                                 name="elastic-checkpoint agent flush", daemon=True).start()
            else:
                logger.warning("checkpoint agent: unknown message %r from a rank", op)
        finally:
            for fd in fds:
                os.close(fd)

    def _take_memory(self, op: str, m: dict, fds: list[int]) -> None:
        """A rank's new ring of slots, or a layout of its shard (each in the first of ``fds``)."""
        if op == "ring":
            ring = SlotRing(fds[0], m)  # it closes the descriptor once mapped; if it raises, the finally does
            fds.pop(0)
            self.rings[int(m["ring"])] = ring
        else:
            layout, length = int(m["layout"]), int(m["len"])  # parsed first: a bad one leaves fds to the finally
            self.layouts[layout] = json.loads(read_memfd(fds.pop(0), length))

    def _flush(self, flush_id: Any, timeout_s: float) -> None:
        # What this rank wrote last goes back in the answer (the controller adds it with the
        # flush's result), so a part still waiting in the pool for another rank is not lost.
        with self.agent.priority.boosted():
            ok = self.persister.flush(timeout_s)
        # Through the report thread, behind the slots the flushed writes handed back: the rank
        # has them all when it reads the answer.
        self.agent.reports.put(("send", (self, {
            "op": "flushed", "id": flush_id, "ok": ok, "done": [list(self.last_part)] if self.last_part else [],
            "events": self.persister.drain_events()})))


class _NodePool:
    """Parts of this node's ranks, one message to the controller per step once every rank of
    the node in that world size has written it (the controller also takes parts one by one)."""

    def __init__(self, report):
        self._report = report
        self._lock = threading.Lock()
        self._waiting: dict[tuple[int, int], dict] = {}  # (world size, step) -> {"ranks": {rank: part}, "since"}
        self._told: dict[int, set[int]] = {}  # world size -> this node's ranks in it, as the controller said
        self.links: set[_RankLink] = set()  # the connected ranks; changed only under the lock (connect, drop)

    def expect(self, world_size: int, ranks: set[int]) -> None:
        """The controller formed a group of ``world_size`` with ``ranks`` on this node."""
        with self._lock:
            self._told.pop(world_size, None)
            self._told[world_size] = set(ranks)
            while len(self._told) > 4:
                self._told.pop(next(iter(self._told)))

    def connect(self, link: _RankLink) -> None:
        with self._lock:
            self.links.add(link)

    def connected(self) -> list[_RankLink]:
        with self._lock:
            return list(self.links)

    def drop(self, link: _RankLink) -> None:
        with self._lock:
            self.links.discard(link)
        self.sweep(0.0)  # the others' parts of its steps go on their own

    def _expected(self, world_size: int) -> set[int]:
        """The ranks the controller said are here, less any with no link that has sent a
        snapshot (it writes in its own process); else those that have sent a snapshot of that
        world size. Either way a part may go before a slower rank's first one: harmless, only
        one more message.

        Why a link not yet heard from counts for no rank: it may be a hot spare's, and a spare
        is linked from its start but sends nothing until it is promoted. Taken as "any of the
        told ranks" (as it once was), a spare's link kept every told rank expected, so once one
        of them wrote in its own process each step of the node waited the full POOL_WAIT_S
        sweep for it, every step.

        Called under the lock, which ``links`` changes under too: the connection threads add and
        drop links while the report thread reads them."""
        if world_size in self._told:
            return self._told[world_size] & {link.rank for link in self.links if link.rank is not None}
        return {link.rank for link in self.links if link.world_size == world_size and link.rank is not None}

    def add(self, rank: int, world_size: int, step: int, part: dict) -> None:
        out = []
        with self._lock:
            entry = self._waiting.setdefault((world_size, step), {"ranks": {}, "since": time.monotonic()})
            entry["ranks"][rank] = part
            # A rank writes its steps in order: an older step it has no part of never completes.
            for key in [k for k in self._waiting if k[0] == world_size and k[1] < step
                        and rank not in self._waiting[k]["ranks"]]:
                out.append((key, self._waiting.pop(key)))
            if set(entry["ranks"]) >= self._expected(world_size):
                out.append(((world_size, step), self._waiting.pop((world_size, step))))
        for (w, s), e in out:
            self._report(s, w, e["ranks"])

    def sweep(self, older_than_s: float = POOL_WAIT_S) -> None:
        """Send what has waited longer than ``older_than_s`` for a rank that did not come."""
        now = time.monotonic()
        with self._lock:
            keys = [k for k, e in self._waiting.items() if now - e["since"] >= older_than_s]
            out = [(k, self._waiting.pop(k)) for k in keys]
        for (w, s), e in out:
            self._report(s, w, e["ranks"])


class CheckpointAgent:
    """One node's agent (``address()`` is its socket); on Ray, ``AgentActor`` hosts it."""

    def __init__(self, url: str, storage_options: dict | None, run_name: str, controller: Any,
                 background: bool = True, close_timeout_s: float = 30.0):
        self.store = CheckpointStore(url, run_name, storage_options)
        self.controller = controller
        self.priority = WriterPriority(background)
        self.close_timeout_s = close_timeout_s
        self.pool = _NodePool(self._report)
        # Written parts and messages to the ranks (slots back, flush answers), handled by a thread
        # of normal priority: the writers may be idle-class, and one preempted while it holds
        # this process's GIL in a Ray call would hold up every other thread here.
        self.reports: queue.SimpleQueue = queue.SimpleQueue()
        self._address = f"\0elastic-checkpoint-{uuid.uuid4().hex}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self._address)
        self._server.listen(64)
        self._closed = False
        # The write fence (``settle``): snapshots of this generation or older are not written,
        # and ``_writing`` is each link's write under way (a link the rank has left included).
        self._fence_lock = threading.Condition()
        self._fences: list[tuple[int, int | None]] = []  # (generation, through step) of each settle()
        self._writing: dict[_RankLink, _Payload] = {}
        self._threads = {"accept": threading.Thread(target=self._accept, name="elastic-checkpoint agent", daemon=True),
                         "reports": threading.Thread(target=self._pump, name="elastic-checkpoint agent reports",
                                                     daemon=True)}
        for thread in self._threads.values():
            thread.start()

    def address(self) -> str:
        return self._address

    def expect(self, world_size: int, ranks: list[int]) -> None:
        """The ranks of a new group of ``world_size`` that run on this node (see ``_NodePool``)."""
        self.pool.expect(world_size, set(ranks))

    def warm_up(self, check: bool = False) -> None:
        """Open the storage client now (``CheckpointStore.warm_up``, ``check`` as there)."""
        self.store.warm_up(check)

    def stats(self) -> dict:
        """What the agent holds, and ``threads``: whether its accept and report threads still
        run. ``NodeAgents.addresses`` takes an agent with either one ended for dead, since the
        actor would still answer while no rank could get a slot back or a step report out."""
        links = self.pool.connected()
        return {"pid": os.getpid(), "links": len(links),
                "ranks": sorted(link.rank for link in links if link.rank is not None),
                "written": {link.rank: link.last_part[0] for link in links if link.last_part is not None},
                "threads": {name: thread.is_alive() for name, thread in self._threads.items()}}

    def settle(self, generation: int, timeout_s: float, through: int | None = None) -> list[tuple[int | None, int]]:
        """Training went back to an earlier step, giving up the state of group ``generation``
        and older: no snapshot of those generations is written from now on, and the writes of
        them under way are waited for, up to ``timeout_s``. Returns (rank, step) of those still
        under way then. ``through``: training went back to that step, on the history those
        generations trained (a rollback to a survivor's step), so their snapshots of it and of
        earlier steps are that history's and still written; None: every step (a restore).

        Why: a rank killed in a restart leaves its write under way (``serve`` drops only what
        waits), and the group that restarts from the checkpoint writes the same step numbers
        again, to the same file names, on this node or another. A late old write landing over
        the new shard of a committed step would fail that step's checksum on resume. After this
        returns no old write can land (unless it outlasted the wait: the controller logs that);
        the controller drops old parts by generation already (``Controller._add_part``)."""
        fence = (int(generation), through)
        with self._fence_lock:
            self._fences.append(fence)
            old = {link: p for link, p in self._writing.items() if _before_fence(p, [fence])}
            self._fence_lock.wait_for(lambda: not any(self._writing.get(link) is p for link, p in old.items()),
                                      timeout=timeout_s)
            return [(p.rank, p.step) for link, p in old.items() if self._writing.get(link) is p]

    def begin_write(self, link: _RankLink, p: _Payload) -> bool:
        """A link's writer is about to write ``p``: False when a fence stops it (``settle``)."""
        with self._fence_lock:
            if _before_fence(p, self._fences):
                return False
            self._writing[link] = p
            return True

    def end_write(self, link: _RankLink) -> None:
        with self._fence_lock:
            self._writing.pop(link, None)
            self._fence_lock.notify_all()

    def shutdown(self) -> None:
        """Take no more connections (a test aid: on Ray the controller kills the actor)."""
        self._closed = True
        self._server.close()

    # ---- inside -----------------------------------------------------------------------------
    def _accept(self, pause_s: float = ACCEPT_PAUSE_S) -> None:
        """Take the ranks' connections until ``shutdown``. An accept that fails while the agent
        is open (EMFILE or ENFILE: the descriptor limit; ENOMEM, ENOBUFS; ECONNABORTED: a rank
        gone before it was taken) ends nothing: the listening socket stays open and the
        controller keeps handing out its address, so with this thread ended new ranks would
        still connect (the backlog), hand over three snapshots, get no slot back and drop every
        later one, and no step of theirs would commit. The error is logged (at most every
        ACCEPT_LOG_EVERY_S) and the next accept follows a pause, doubled while it fails up to
        ``ACCEPT_PAUSE_MAX_S``: descriptors and memory come back as links end, and the waiting
        connections are taken then (a limit hit does not spin this thread)."""
        number = 0
        pause, failures, logged_at = pause_s, 0, float("-inf")
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError as exc:
                if self._closed:
                    return  # shutdown() closed the socket under the accept
                failures += 1
                if time.monotonic() - logged_at >= ACCEPT_LOG_EVERY_S:
                    logged_at = time.monotonic()
                    logger.warning("checkpoint agent: cannot accept a rank's connection (%s; %d failure(s) in a "
                                   "row); trying again", exc, failures)
                time.sleep(pause)
                pause = min(pause * 2, ACCEPT_PAUSE_MAX_S)
                continue
            if failures:
                logger.info("checkpoint agent: accepting connections again after %d failure(s)", failures)
                pause, failures = pause_s, 0
            if not _same_user(conn):
                conn.close()
                continue
            number += 1
            link = None
            try:
                link = _RankLink(self, conn, number)
                self.pool.connect(link)
                threading.Thread(target=link.serve, name=f"elastic-checkpoint agent link {link.number}",
                                 daemon=True).start()
            except Exception as exc:  # noqa: BLE001 - one rank's link, not the agent (see below)
                # A thread that cannot start (the process's thread limit) ended this loop before:
                # the agent still answered, but no rank could link to it again. This rank finds
                # its connection closed and writes its checkpoints in its own process.
                logger.warning("checkpoint agent: cannot serve a rank's connection (%s: %s); that rank writes "
                               "its checkpoints itself", type(exc).__name__, exc)
                if link is not None:
                    link.close(0.0)  # never served: no write, event or memory of its own yet
                else:
                    conn.close()

    def forget(self, link: _RankLink) -> None:
        """``link`` ended: its waiting steps go to the controller, with its last events. On the
        report thread, behind what the link put there before. Why not here, on the link's own
        thread: this sends every waiting step at once (``_NodePool.drop``), and it raced the
        report thread sending others, so two of this node's reports could reach the controller
        in the other order. The committer reads a rank's report of a step as proof that the
        rank skipped its older pending steps (it writes them in order) and drops them, so an
        older step arriving second never committed. (Agents run only in background mode, where
        a rank's steps wait here together when it writes faster than a slower rank of the node,
        for up to ``POOL_WAIT_S``.) The newer step supersedes the older one only once it commits
        itself; until then the older one may be the newest step every rank wrote, and if the
        newer one never completes (a rank or node lost before writing it), a resume went back
        to a step older still. One thread sends them in the order they were taken. After
        ``shutdown`` (a test aid) the report thread forgets what waits when it stops, and once
        it has stopped this runs here, the only sender left."""
        if self._closed and not self._threads["reports"].is_alive():
            self._forget(link)
        else:
            self.reports.put(("forget", link))

    def _forget(self, link: _RankLink) -> None:
        try:
            self.pool.drop(link)
            self._send_events([(link.rank, ev) for ev in link.persister.drain_events()])
        finally:
            link.conn.close()  # its sends are done: queued before this (_RankLink.close)

    def _report(self, step: int, world_size: int, parts: dict) -> None:
        try:
            self.controller.checkpoint_written.remote(step, world_size, with_ages(parts))
        except Exception as exc:  # noqa: BLE001 - the controller is gone: the run is over
            logger.warning("checkpoint agent: cannot report step %d: %s", step, exc)

    def _send_events(self, events: list) -> None:
        if events:
            try:
                self.controller.checkpoint_events.remote(events)
            except Exception as exc:  # noqa: BLE001
                logger.warning("checkpoint agent: cannot report events: %s", exc)

    def _pump(self, every_s: float = 0.5) -> None:
        """Slots back to their ranks and written parts into the node's pool, as they come; every
        ``every_s`` the parts that waited too long and the storage events (outages, failed
        writes) with their rank. Nothing that goes wrong here ends the thread: without it no
        step of this node would commit, and the ranks would not notice."""
        last = time.monotonic()
        while not self._closed:
            try:
                kind, item = self.reports.get(timeout=every_s)
            except queue.Empty:
                kind = item = None
            try:
                if kind == "send":
                    link, message = item
                    link.send(message)
                elif kind == "end":
                    item.end()
                elif kind == "part":
                    rank, world_size, step, part, keep = item
                    if keep:
                        # A keep_every milestone goes on its own, as a rank's own writer sends
                        # it (WorkerCheckpointer.snapshot): the committer takes an older
                        # milestone still incomplete when a newer one completes for one that
                        # never will, which holds only if each rank's parts of milestones come
                        # in order. The pool sends an entry when it completes, ages (POOL_WAIT_S)
                        # or a link ends, in no rank's order: a rank's part of milestone m
                        # could follow its part of m + keep_every, and m was dropped, swept
                        # as uncommitted, with no event. This queue is in each rank's order.
                        self._report(step, world_size, {rank: part})
                    else:
                        self.pool.add(rank, world_size, step, part)
                elif kind == "forget":
                    self._forget(item)
                if time.monotonic() - last >= every_s:
                    last = time.monotonic()
                    self.pool.sweep()
                    self._send_events([(link.rank, ev) for link in self.pool.connected()
                                       for ev in link.persister.drain_events()])
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("checkpoint agent: reporting failed; going on")
        # Shut down (a test aid): the links forgotten before it still leave the pool (forget).
        while True:
            try:
                kind, item = self.reports.get_nowait()
            except queue.Empty:
                return
            if kind == "forget":
                self._forget(item)


def _same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end runs as this one's user (``SO_PEERCRED``): the
    socket's name is abstract, so file permissions cannot keep other users from writing shards."""
    try:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):
        return False
    if uid != os.getuid():
        logger.warning("checkpoint agent: refused a connection from user %d", uid)
        return False
    return True


class AgentActor(CheckpointAgent):
    """The agent as the run's Ray actor (one per node; ``num_cpus=0``)."""

    def __init__(self, *args, **kwargs):
        from elastic.checkpoint import memory

        memory.join_run()  # memory:// is the run's shared copy here, as in the ranks
        super().__init__(*args, **kwargs)


def agent_name(node_id: str) -> str:
    """The Ray actor name of the agent on ``node_id`` (in the run's namespace, beside "rank-3")."""
    return f"checkpoint-agent-{node_id[:12]}"


class NodeAgents:
    """The controller's side: one ``CheckpointAgent`` per node that hosts a rank or a spare of
    the run, started when a member there first needs it and killed when the run ends."""

    START_TIMEOUT_S = 60.0

    def __init__(self, store: CheckpointStore, run_name: str, controller: Any, namespace: str | None = None,
                 background: bool = True):
        self.store, self.run_name, self.controller, self.background = store, run_name, controller, background
        self.namespace = namespace  # the run's actors' namespace: agents are "checkpoint-agent-<node>" in it
        self._agents: dict[str, tuple[Any, str]] = {}  # node id -> (actor, socket address)
        self._starting: dict[str, tuple[Any, Any]] = {}  # node id -> (actor, ref of its address)

    def start(self, node_ids: set[str]) -> None:
        """Start agents where there is none yet, without waiting for them (``addresses`` does).
        A node whose agent cannot be started (its name still held by an earlier run's agent
        after ``free_actor_name`` gave up: ``ValueError``; Ray refusing the actor) is left out and
        logged: it gets no address, and its ranks write checkpoints in their own processes, as
        for an agent that starts but never answers. Raising instead would fail the caller's
        ``fit()`` with an error its retry does not expect, for want of an optional agent."""
        for node in node_ids:
            if node not in self._agents and node not in self._starting:
                actor = None
                try:
                    actor = self._start(node)
                    self._starting[node] = (actor, actor.address.remote())
                except Exception as exc:  # noqa: BLE001 - see the docstring
                    logger.warning("cannot start a checkpoint agent on node %s (%s: %s); its ranks write "
                                   "checkpoints in their own processes", node, type(exc).__name__, exc)
                    if actor is not None:
                        _kill_quietly(actor)

    def addresses(self, node_ids: set[str], check_storage: bool = False) -> dict[str, str | None]:
        """Each node's agent address, starting agents where there is none or it died; None for a
        node whose agent does not start (its ranks then write checkpoints in their own processes).

        ``check_storage``: at the run's start, wait for each new agent's storage check
        (``CheckpointStore.warm_up``) and raise ConfigError, naming the node, when the storage
        refuses the agent: the agent writes its node's checkpoints, with the node's credentials."""
        import ray

        pings = {node: self._agents[node][0].stats.remote() for node in node_ids if node in self._agents}
        deadline = time.monotonic() + 10  # all asked at once: one wait, not one per node
        for node, ref in pings.items():
            try:
                stats = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - dead or unreachable: start another
                self._kill(node)
                continue
            # An agent whose accept or report thread ended answers all the same, but takes no new
            # rank or hands no slot back and reports no step: as good as dead, so replaced too.
            stopped = [name for name, alive in stats.get("threads", {}).items() if not alive]
            if stopped:
                logger.warning("the checkpoint agent on node %s lost its %s thread(s); starting another",
                               node, " and ".join(stopped))
                self._kill(node)
        self.start(node_ids)
        checks = {}
        # One deadline for all, as the pings above: one wait each, K agents that never answer
        # held a recovery K x START_TIMEOUT_S before their ranks wrote for themselves.
        started_by = time.monotonic() + self.START_TIMEOUT_S
        for node in [n for n in node_ids if n in self._starting]:
            actor, ref = self._starting.pop(node)
            try:
                self._agents[node] = (actor, ray.get(ref, timeout=max(0.0, started_by - time.monotonic())))
                checks[node] = actor.warm_up.remote(check_storage)
            except Exception as exc:  # noqa: BLE001 - the ranks fall back to writing themselves
                logger.warning("no checkpoint agent on node %s (%s); its ranks write checkpoints in their own "
                               "processes", node, exc)
                ray.kill(actor, no_restart=True)
        if check_storage:
            self._checked(checks)
        return {node: self._agents[node][1] if node in self._agents else None for node in node_ids}

    def _checked(self, checks: dict) -> None:
        """Wait for the agents' storage checks (node id -> ref of ``warm_up(True)``), all at once.
        A refusal raises ConfigError naming the node. An agent that dies or does not answer in
        time is the ranks' to replace (they write in their own processes, and check there)."""
        import ray

        from elastic.config import ConfigError

        deadline = time.monotonic() + self.START_TIMEOUT_S
        for node, ref in checks.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, ConfigError):
                    raise refused_on_node(f"the checkpoint agent on node {node}", exc.cause) from None
                logger.warning("the checkpoint agent on node %s failed its storage check: %s", node, exc.cause)
            except Exception as exc:  # noqa: BLE001 - dead or slow: see the docstring
                logger.warning("the checkpoint agent on node %s did not finish its storage check (%s); its ranks "
                               "write checkpoints in their own processes if it is lost", node, type(exc).__name__)

    def settle(self, generation: int, timeout_s: float, through: int | None = None) -> list[tuple[int | None, int]]:
        """``CheckpointAgent.settle`` on every node's agent, all at once; the (rank, step) of
        old writes still under way after ``timeout_s``. An agent that does not answer is
        skipped: a dead one writes nothing."""
        import ray

        refs = [actor.settle.remote(generation, timeout_s, through) for actor, _ in self._agents.values()]
        stuck: list[tuple[int | None, int]] = []
        deadline = time.monotonic() + timeout_s + 5.0
        for ref in refs:
            try:
                stuck.extend(tuple(x) for x in ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - dead or unreachable: it writes nothing more
                logger.debug("a checkpoint agent did not answer settle()", exc_info=True)
        return stuck

    def expect(self, world_size: int, members: list) -> None:
        """Tell each node's agent which ranks of a group forming now are on its node."""
        by_node: dict[str, list[int]] = {}
        for m in members:
            by_node.setdefault(m.info.get("node_id"), []).append(m.rank)
        for node, ranks in by_node.items():
            if node in self._agents:
                self._agents[node][0].expect.remote(world_size, ranks)

    def _start(self, node: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = dict(name=agent_name(node), namespace=self.namespace, num_cpus=0, max_restarts=0,
                       max_concurrency=4, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        args = (self.store.url, self.store.storage_options, self.run_name, self.controller, self.background)
        try:
            return ray.remote(AgentActor).options(**options).remote(*args)
        except ValueError:
            # The name is taken: an agent of an earlier run of this name, whose controller is gone
            # (the trainer runs one controller per run name) and whose kill has not landed yet.
            free_actor_name(agent_name(node), self.namespace)
            return ray.remote(AgentActor).options(**options).remote(*args)

    def _kill(self, node: str) -> None:
        actor, _ = self._agents.pop(node)
        _kill_quietly(actor)

    def shutdown(self) -> None:
        import ray

        for node in list(self._agents):
            self._kill(node)
        for actor, _ in self._starting.values():
            ray.kill(actor, no_restart=True)
        self._starting.clear()


def _kill_quietly(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
