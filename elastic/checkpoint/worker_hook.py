"""The worker side of checkpointing: after an optimizer step, copy this rank's share of the state to host
memory and hand it to a background writer.

Returns small, JSON-friendly reports (finished writes and storage events) for the controller. A
rank's report of a step is a part: ``{"entries": [file records], "taken_at": snapshot time}``,
plus ``"rng"`` when the rank wrote no file (no share of a small state), for the manifest, and
``"generation"``, the group generation the rank took the snapshot in (``group_generation``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import socket
import struct
import time
from typing import Any, Callable

from elastic.checkpoint.agent import MAX_MESSAGE, receive_message, send_message
from elastic.checkpoint.codec import (RawRng, SkeletonJson, UnsaveableValue, canonical_json, encoded_rng,
                                      host_copy, json_object_plus, shard_layout)
from elastic.checkpoint.compat import PARAM_NAMES_KEY, PARAM_ORDER_KEY, UnsaveableState
from elastic.checkpoint.persister import AsyncPersister
from elastic.checkpoint.pool import PoolRetired
from elastic.checkpoint.shm import SlotRing, memfd_with
from elastic.checkpoint.staging import StagingBuffers
from elastic.checkpoint.storage import RetryPolicy
from elastic.checkpoint.store import CheckpointStore, Snapshot, is_milestone, rank_meta

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0  # a rank's connect to its node's checkpoint agent (_connect_agent)


def _ready(sock: socket.socket, write: bool, timeout_s: float) -> bool:
    """Whether ``sock`` can be written (``write``) or read within ``timeout_s``, or has failed (the
    next call on it says how). poll, not select: select refuses a descriptor of 1024 or more
    (ValueError), and a rank links to its agent after its process group, CUDA and data loaders
    have opened theirs."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def live_state(worker: Any, canonical: bool = True) -> dict:
    """The same shape as ``TrainWorker.get_state()`` but referencing live tensors (no copies yet), so
    only this rank's share is ever copied. The optimizer's state is given in the canonical order
    of its parameters (``compat.canonical_param_names``), named so, where that differs from this
    process's order and the state can go by name: every rank then names each parameter's moments
    alike, and a step whose state several ranks write is one state, not a mix of their orders.
    ``canonical=False``: in this process's order (a resume's checks against a saved state)."""
    optimizer, names = worker.optimizer.state_dict(), param_names(worker)
    canonical = getattr(worker, "optimizer_canonical_names", None) if canonical else None
    if canonical is not None and names:
        if canonical == names[PARAM_NAMES_KEY]:
            names = {**names, PARAM_ORDER_KEY: "model"}
        else:
            from elastic.checkpoint.compat import state_by_name

            moved = state_by_name(optimizer, names[PARAM_NAMES_KEY], canonical,
                                  [len(g["params"]) for g in worker.optimizer.param_groups])
            if moved is not optimizer:  # else it cannot go by name: this process's order, unmarked
                optimizer, names = moved, {PARAM_NAMES_KEY: list(canonical), PARAM_ORDER_KEY: "model"}
    return {
        "model": worker.model.state_dict(),
        "optimizer": optimizer,
        "scheduler": worker.scheduler.state_dict() if getattr(worker, "scheduler", None) is not None else None,
        "completed_step": int(worker.completed_step),
        **scaler_state(worker),
        **names,
    }


def param_names(worker: Any) -> dict:
    """``{PARAM_NAMES_KEY: the model's names of the optimizer's parameters}`` (the worker's, taken
    when it built: ``compat.param_names_of``), for the resume's check that the saved optimizer
    state goes to the parameters it was saved from; nothing for a worker without them."""
    names = getattr(worker, "optimizer_param_names", None)
    return {} if names is None else {PARAM_NAMES_KEY: names}


def scaler_state(worker: Any) -> dict:
    """``{"scaler": its state}`` for a rank training in fp16 (``TrainWorker.scaler``: its loss
    scale and growth count are training state, since a replica or a resumed run with another
    scale would skip other steps), else nothing: the state of a run without one keeps the keys
    it always had."""
    scaler = getattr(worker, "scaler", None)
    return {} if scaler is None else {"scaler": scaler.state_dict()}


def take_snapshot(worker: Any, step: int, min_shard_bytes: int = 0, staging: StagingBuffers | None = None,
                  every_n_steps: int = 1) -> Snapshot:
    """This rank's share of tensors (private host copies, in ``staging``'s recycled buffers when
    given), its RNG (read now, encoded by the writer: ``RawRng``), and with the first share the
    state skeleton.

    Why the copies are made inside the step: CheckFreq pipelines them with the next step's
    forward and backward, since only the next optimizer step changes the parameters and optimizer
    state. That was tried here: a background thread copied those tensors (one
    ``torch._foreach_copy_``, so it took the GIL once), their version counters caught a tensor
    changed before its copy was whole, and the next optimizer step waited for the copy. With a
    core free (one rank, ``benchmarks/checkpoint_overhead.py --workers 1 --batch-per-worker
    256``, alternating runs) the mean step went from 12.16 and 11.24 ms to 11.46 and 10.65 ms.
    On the benchmark's default, 4 ranks on 2 cores, it went from 21.7 and 20.7 ms to 23.6 and
    24.0 ms, so it was not adopted. Where the ranks already fill the cores, a copy moved off the
    step's path still takes the same CPU; what costs the extra 2-3 ms there was not found.
    """
    try:
        return Snapshot.of_state(live_state(worker), step, int(worker.rank), int(worker.world_size), RawRng.take(),
                                 min_shard_bytes, copy=staging.copy if staging is not None else host_copy,
                                 every_n_steps=every_n_steps)
    finally:
        if staging is not None:
            staging.settle()  # its copies from a GPU are whole before anyone reads them


def group_generation(worker: Any) -> int | None:
    """The group generation ``worker`` takes a snapshot in, which its part carries: a part may
    reach the controller after a rollback (a write in flight, a node agent's pool), and the
    controller drops one taken in a generation the rollback left behind (``Controller._add_part``).
    None for a worker that never joined a group (a test's stand-in): its parts are not judged."""
    generation = getattr(worker, "generation", None)
    return None if generation is None else int(generation)


def checked_every_n_steps(every_n_steps: int) -> int:
    """``CheckpointConfig.every_n_steps`` as either rank-side writer takes it (0: never)."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
        raise ValueError(f"every_n_steps must be an integer >= 0, got {every_n_steps!r}")
    return every_n_steps


def is_due(every_n_steps: int, step: int) -> bool:
    """Whether a rank snapshots ``step``."""
    return every_n_steps > 0 and step % every_n_steps == 0


class SnapshotFailures:
    """The event of a snapshot that failed, for either writer; each distinct error is logged
    with its traceback once, not every step (one that repeats fails every step alike). Call it
    inside the ``except`` block. A state no checkpoint can store is not one of these: it ends the
    run (``UnsaveableState``), since no later step's snapshot could be taken either."""

    def __init__(self):
        self._last: str | None = None

    def __call__(self, worker: Any, step: int, exc: BaseException) -> list[dict]:
        text = f"{type(exc).__name__}: {exc}"
        if text != self._last:
            logger.exception("rank %s: cannot snapshot step %d for checkpointing", worker.rank, step)
            self._last = text
        return [{"event": "checkpoint_failed", "what": "snapshot", "step": step, "time": time.time(),
                 "error": text[:300], "message": f"cannot snapshot step {step} for a checkpoint: {text[:300]}"}]


class WorkerCheckpointer:
    """Installed on a TrainWorker as ``worker._ckpt``; ``after_step`` runs after every optimizer step."""

    def __init__(self, url: str, storage_options: dict | None, run_name: str, every_n_steps: int,
                 blocking: bool = False, *, retry: RetryPolicy | None = None,
                 retry_min_s: float | None = None, retry_max_s: float | None = None,
                 close_timeout_s: float = 30.0, notify: Callable[..., Any] | None = None,
                 progress: Callable[[], int] | None = None, min_shard_bytes: int = 0, pool_parts: bool = True,
                 keep_every: int = 0):
        """``notify(step, world_size, parts)``: called from the writer thread once a step's parts are
        written, ``parts`` being ``{rank: {"entries", "taken_at", "progress"[, "generation", "rng"]}}``
        (the worker sends it to the controller actor), so a commit never waits for the step
        results to travel back.
        Ranks of a group pool their parts (``elastic.checkpoint.pool``) and the rank that completes
        a step sends all of them; without a pool a rank sends its own part. Without ``notify``,
        finished writes ride on the step results (``after_step``'s report).

        ``pool_parts=False``: send this rank's own part, whatever the group's pool (always so
        with ``blocking``: see below). For a rank writing in its own process beside ranks whose
        node agents write theirs (its agent died, or never started): those ranks report through
        their agents and never add to the group's pool, so a pooled part of this rank would wait
        there for them forever, and no step would commit again.

        ``keep_every``: ``CheckpointConfig.keep_every``; such a step's snapshot is never replaced
        by a newer one while it waits for the writer (``is_milestone``)."""
        self.every_n_steps = checked_every_n_steps(every_n_steps)
        self.keep_every = keep_every
        self.store = CheckpointStore(url, run_name, storage_options, retry=retry)
        self.min_shard_bytes = min_shard_bytes
        # Blocking mode never pools: each rank reports its own parts. Why: a pooled step goes
        # to the controller from whichever rank completed it last, and Ray orders only one
        # submitter's calls, so step s+1 sent by rank 0 could overtake step s sent by rank 1. The
        # committer then took s for superseded (every rank's part of s+1 was in, and a rank
        # that reports a newer step without an older one skipped it) and never committed it,
        # though this mode promises every step on storage, in order. One rank's own reports
        # come in the order it wrote them, so an older step still incomplete when a newer one
        # completes was skipped by a rank (a failed write) and can be let go. The cost, a message
        # per rank a step instead of one, is small beside the write each step waits for here.
        self.pool_parts = pool_parts and not blocking
        self.close_timeout_s = close_timeout_s
        self._notify, self._progress = notify, progress
        # The newest part written, as the flush reports it again (drain): (step, part).
        self._last_pushed: tuple[int, dict] | None = None
        # The newest part added to the group's pool that did not complete its step there:
        # (step, world size, {rank: part}), reported on its own if the rank leaves the group first.
        self._pooled_waiting: tuple[int, int, dict] | None = None
        self._pool_error: str | None = None
        # The payload is (snapshot, the group's PartPool at snapshot time or None, the group
        # generation then). Its host copies go back to ``staging`` once the persister lets go of it.
        self.staging = StagingBuffers()
        self.persister = AsyncPersister(self._write, blocking=blocking,
                                        name="checkpoint write",
                                        retry_min_s=retry_min_s, retry_max_s=retry_max_s,
                                        on_done=self._push if notify is not None else None,
                                        on_release=lambda payload: self.staging.release(payload[0].tensors.values()),
                                        max_keep=2)  # whole host copies of the state (see AsyncPersister)
        self.last_snapshot_s = 0.0
        self._snapshot_failed = SnapshotFailures()

    def warm_up(self, check: bool = False) -> None:
        """Open the storage client now (``CheckpointStore.warm_up``, ``check`` as there)."""
        self.store.warm_up(check)

    def due(self, step: int) -> bool:
        return is_due(self.every_n_steps, step)

    def after_step(self, worker: Any, step: int) -> dict:
        """Snapshot and submit when the step is due; always report what finished since the last call."""
        return self._report(self.snapshot(worker, step) if self.due(step) else [])

    def snapshot(self, worker: Any, step: int, pooled: bool = True) -> list[dict]:
        """Snapshot ``step`` and hand it to the writer; the events of a snapshot that failed.
        Raises ``UnsaveableState`` for a state no checkpoint can store. ``pooled=False``: its
        part goes to the controller on its own, not through the group's pool (a snapshot off
        the schedule, whose step the group's other ranks never add there)."""
        t0 = time.perf_counter()
        try:
            snapshot = take_snapshot(worker, step, self.min_shard_bytes, self.staging, self.every_n_steps)
        except UnsaveableValue as exc:
            raise UnsaveableState(str(exc), step) from None
        except Exception as exc:  # noqa: BLE001 - a snapshot that failed must not stop training
            return self._snapshot_failed(worker, step, exc)
        self.last_snapshot_s = time.perf_counter() - t0
        # A keep_every milestone goes on its own too. Why: the committer takes an older milestone
        # still incomplete when a newer one completes as one that never will (a rank lost before
        # it wrote its part), which holds only if each rank's part of the older one came first.
        # Pooled, a milestone goes from whichever rank completed it, and Ray orders one sender's
        # calls only: milestone m sent by one rank could come after milestone m + keep_every
        # sent by another, and m was dropped, its directory swept. Milestones are few, so the
        # messages they add are too.
        milestone = is_milestone(self.keep_every, step)
        pool = getattr(worker, "part_pool", None) if self.pool_parts and pooled and not milestone else None
        self.persister.submit(step, (snapshot, pool, group_generation(worker)),
                              light=not snapshot.writes_file, keep=milestone)
        return []

    def _write(self, payload: tuple) -> dict:
        """The writer thread's job: write the shard (if this rank has one); returns the rank's part."""
        snapshot, _, generation = payload
        entries = self.store.write_snapshot(snapshot)
        part = {"entries": [e.to_dict() for e in entries], "taken_at": snapshot.taken_at}
        if not entries:
            part["rng"] = encoded_rng(snapshot.rng)
        if generation is not None:
            part["generation"] = generation
        return part

    def _push(self, step: int, payload: tuple, written: dict) -> None:
        snapshot, pool, _ = payload
        # With the snapshot's rank and world size: after a shrink renumbered the ranks, a part of
        # the old group's is another rank's, of another world size, than the rank the flush asks.
        again = {**written, "again": True, "rank": snapshot.rank, "world_size": snapshot.world_size}
        self._last_pushed = (step, again)
        part = {**written, "progress": self._progress() if self._progress is not None else step}
        parts: dict[int, dict] | None = {snapshot.rank: part}
        if pool is not None:  # a group of more than one rank
            # Set before the add: a leave() in between reports it (left_group), and the part
            # may then reach the controller twice, which the committer ignores.
            self._pooled_waiting = (step, snapshot.world_size, {snapshot.rank: part})
            try:
                parts = pool.add(step, snapshot.rank, part)
            except PoolRetired:
                pass  # never connected, and the rank left that group since: the part goes on its own
            except Exception as exc:  # noqa: BLE001 - the group is gone or its store is down: report directly
                text = f"{type(exc).__name__}: {exc}"
                if text != self._pool_error:
                    logger.warning("rank %s: cannot pool checkpoint part of step %d (%s); reporting it directly",
                                   snapshot.rank, step, text[:300])
                    self._pool_error = text
            if parts is None and pool.retired:
                # The rank left that group since the snapshot: the others may never add their
                # parts of the step (an evicted straggler), so this one goes on its own, as a
                # part left waiting does when the rank leaves (left_group).
                parts = {snapshot.rank: part}
            if parts is None:
                return  # another rank's part completes the step; that rank reports it
            self._pooled_waiting = None  # reported now, or superseded by this newer step
        again["sent"] = True  # by this rank: the controller may wait for it (Controller._await_push)
        self._notify(step, snapshot.world_size, parts)

    def left_group(self) -> None:
        """The rank left its group (``TrainWorker.leave``): its newest part still waiting in the
        group's pool for the other ranks' goes to the controller on its own. Why: some of them
        will never add theirs (an evicted straggler, a dead rank), and the others' are there
        already or come on their own too, so the step commits from the direct reports; left in
        the pool, it never did. A part whose step the pool completed meanwhile reaches the
        controller twice, which the committer ignores."""
        waiting, self._pooled_waiting = self._pooled_waiting, None
        if waiting is not None and self._notify is not None:
            if self._last_pushed is not None and self._last_pushed[0] == waiting[0]:
                self._last_pushed[1]["sent"] = True
            self._notify(*waiting)

    def _report(self, extra_events: list[dict] | None = None) -> dict:
        # Events carry no rank: the controller knows which rank it asked, and a rank field would
        # collide with the controller's own.
        done = self.persister.drain()  # [(step, part)]
        events = self.persister.drain_events() + list(extra_events or [])
        return {"ckpt_done": done, "ckpt_events": events}

    def drain(self, extra_events: list[dict] | None = None) -> dict:
        """What finished since the last call, without taking a snapshot (e.g. at the end of
        training), with ``extra_events`` (a final snapshot's, say) among the events.

        When parts are pushed to the controller, the newest one is reported again here: the push
        is a message that may still be on its way when the controller makes its final commit, and
        a second report of a part is harmless (the committer ignores steps it has already taken;
        where this rank sent the part itself, ``sent``, the controller waits for that message
        before it takes this one, so that it never comes before the rank's message of an earlier
        step: ``Controller._await_push``). The part carries the snapshot's time, so a step
        committed from it still says how long it took to persist."""
        out = self._report(extra_events)
        if self._last_pushed is not None:
            step, again = self._last_pushed
            out["ckpt_done"].append((step, dict(again)))
        out["snapshots_dropped"] = 0  # never: a snapshot here waits for the writer (see AgentCheckpointer.drain)
        return out

    def flush(self, timeout_s: float | None = None, worker: Any = None) -> bool:
        """Wait for the pending write; at most ``timeout_s`` (default close_timeout_s) so an outage at
        the end of training cannot hang the worker. False if it timed out. (``worker``: for
        ``AgentCheckpointer``'s signature; a write in this process cannot be lost that way.)"""
        return self.persister.flush(self.close_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Write what is waiting (bounded by close_timeout_s) and stop the thread."""
        self.persister.close(self.close_timeout_s)


class _NoSharedMemory(Exception):
    """This process could not make the shared memory a snapshot goes through (a memfd or its
    mapping refused: the open-files limit, ENOMEM, vm.max_map_count). Apart from the
    ``OSError`` of a socket whose agent is gone: the agent is fine, and the event says so.

    The rank still writes in its own process from then on, as for a lost agent: that writer
    needs no memfd, and a limit hit once is hit again at the next ring or layout."""

    @classmethod
    @contextlib.contextmanager
    def on_os_error(cls):
        try:
            yield
        except OSError as exc:
            raise cls(f"this process cannot make shared memory for its node's checkpoint agent "
                      f"({type(exc).__name__}: {exc}); the agent itself is not at fault") from exc


class _AgentRefused(ConnectionError):
    """The agent ended the link because it cannot write for this rank: its shared memory (a
    ring it could not map, a layout it could not read: its own open-files limit, ENOMEM,
    vm.max_map_count), or the link's writer thread died (``_RankLink.refuse``). Apart from a
    lost agent: the agent still runs, and the event (``checkpoint_shared_memory_failed``) names
    its error. This rank writes in its own process from then on, which needs no shared memory."""

    def __init__(self, error: str):
        super().__init__(f"the node's checkpoint agent ended its link, as it cannot write for this rank: "
                         f"{error}; the agent's process is at fault, not this one")


def _connect_agent(address: str) -> socket.socket:
    """A link to the node's checkpoint agent at ``address``; OSError if there is none, or if the
    process listening there is not this user's (``SO_PEERCRED``), so the rank writes in its
    own process instead.

    Why check the server: the agent's address is an abstract socket name, which file
    permissions do not guard, and any user of the node can bind it first (before the agent
    starts, or after it died). Linked to that process, the rank would hand it memfds holding
    its share of the model and optimizer (read, and never written) and take its reports of
    shards written for true. The agent checks its clients the same way (``agent._same_user``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # Bounded: a listener whose backlog is full (an agent that cannot accept, at its open-files
        # limit) leaves a blocking connect blocked for good, and the rank's set-up with it. Not
        # settimeout: that makes the socket non-blocking, and a non-blocking connect to a full
        # AF_UNIX backlog fails at once (EAGAIN) instead of waiting, so a backlog full for a
        # moment sent the rank to write in its own process. Tried again until the deadline; a
        # timeout is an OSError: the rank writes in its own process.
        sock.setblocking(False)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock.connect(address)
                break
            except (BlockingIOError, InterruptedError):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the checkpoint agent at {address!r} did not take the connection within "
                                       f"{CONNECT_TIMEOUT_S:g} s (its backlog is full)") from None
                time.sleep(0.02)
        sock.setblocking(True)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise PermissionError(f"the checkpoint agent's socket {address!r} is held by user {uid}, not "
                                  f"this rank's user {os.getuid()}")
    except BaseException:
        sock.close()
        raise
    return sock


class _Layout:
    """A shard layout a rank has met: ``codec.shard_layout``'s entries, the bytes of its data
    section, the id the agent knows it by (None until it is sent), and the snapshot that used
    it last (``AgentCheckpointer._snapshots``)."""

    __slots__ = ("entries", "nbytes", "id", "used")

    def __init__(self, entries: list[dict]):
        self.entries, self.nbytes, self.id, self.used = entries, sum(e["nbytes"] for e in entries), None, 0


class AgentCheckpointer:
    """The rank's side of its node's checkpoint agent (``elastic.checkpoint.agent``), with the
    interface of ``WorkerCheckpointer``: inside the step, this rank's share is copied into a
    free slot of memory shared with the agent and one message says so; the agent writes it and
    reports it. Nothing of the checkpoint runs on a thread of this process, and nothing here
    waits for the agent inside a step.

    With no free slot (the agent still busy with the previous snapshots, or its answers not in
    yet), the step's snapshot is dropped rather than waited for: a newer one follows. A flush
    (the end of the run, a recovery) takes again a dropped snapshot of the step the rank is at,
    so the last step is never the one missing. If the agent is gone, or cannot take a snapshot
    (a dtype safetensors has no name for), this rank writes in process from then on
    (``fallback``, a ``WorkerCheckpointer``)."""

    SLOTS = 3  # one being written, one waiting, one being filled: as many as the in-process writer holds
    DROP_EVENT_EVERY_S = 60.0
    # A step retention keeps waits this long for a free slot, or room in the agent's queue,
    # before it is dropped (_filled_within, _sent_within).
    MILESTONE_WAIT_S = 5.0
    # A layout no snapshot used in this many, plus the world size, is let go here and at the
    # agent (_forget_layouts). Why: a layout is kept per set of names, dtypes and shapes, so a
    # tensor whose shape changes (a buffer that grows, an embedding resized, optimizer state
    # changing shape) added one here, one at the agent and views over each slot it went into at
    # every checkpoint, for the whole run. Plus the world size: with fewer writers than ranks a
    # rank's share rotates (``codec.writer_slot``), each of its layouts coming back once every
    # world-size checkpoints, and let go sooner it would be worked out and sent again each time.
    # The in-process writer lets its staging buffers go the same way (StagingBuffers.FORGET_AFTER).
    FORGET_LAYOUTS_AFTER = 16

    def __init__(self, address: str, every_n_steps: int, fallback: Callable[[], WorkerCheckpointer],
                 min_shard_bytes: int = 0, close_timeout_s: float = 30.0, keep_every: int = 0):
        self.every_n_steps = checked_every_n_steps(every_n_steps)
        self.keep_every = keep_every  # a step it keeps goes to the agent marked "keep" (is_milestone)
        self.min_shard_bytes = min_shard_bytes
        self.close_timeout_s = close_timeout_s
        self._make_fallback = fallback
        self.fallback: WorkerCheckpointer | None = None
        self.sock = _connect_agent(address)
        self._ring_id: int | None = None  # the ring snapshots go into; older ones wait for their slots
        self._rings: dict[int, tuple[SlotRing, set[int]]] = {}  # ring id -> (ring, free slots)
        self._layouts: dict[tuple, _Layout] = {}  # (name, dtype, shape) of each tensor -> its layout
        self._snapshots = 0  # snapshots taken through the agent: the clock a layout ages by
        self._in_slots: dict[tuple[int, int], int] = {}  # (ring, slot) handed to the agent -> its layout's id
        self._forgotten: set[int] = set()  # ids of layouts let go here, of which the agent is still to be told
        self._skeleton_json = SkeletonJson()
        self._next_id = 0
        self._events: list[dict] = []
        self._flushed: dict | None = None
        self._flush_id = 0
        self._handed: int | None = None  # the newest step the agent was given
        self._written: tuple[int, dict] | None = None  # the step the agent wrote last (free's "written"), its part
        self._orphans: list[tuple[int, dict]] = []  # parts the agent wrote but may not have reported before it died
        self._rbuf = bytearray(MAX_MESSAGE)  # what the agent sends is received into this (receive_message)
        self._dropped: int | None = None  # the newest step dropped since, for want of a slot
        self.dropped = 0  # snapshots dropped, in all
        self._drops_told = (0, time.monotonic() - self.DROP_EVENT_EVERY_S)  # (count, when) of the last event
        self._snapshot_failed = SnapshotFailures()

    def due(self, step: int) -> bool:
        return is_due(self.every_n_steps, step)

    def left_group(self) -> None:
        """See ``WorkerCheckpointer.left_group``. Nothing waits here: the agent reports a part
        it pooled once its wait for the others' is over, and a fall-back writer reports its own
        (it does not pool: ``pool_parts``)."""
        if self.fallback is not None:
            self.fallback.left_group()

    def warm_up(self) -> None:
        """The agent opens the storage client (``CheckpointAgent.warm_up``)."""

    def after_step(self, worker: Any, step: int) -> dict:
        if self.fallback is not None:
            out = self.fallback.after_step(worker, step)
        else:  # a snapshot that loses the agent falls back, with the parts it leaves (_orphans)
            out = self._report(self.snapshot(worker, step) if self.due(step) else [])
        return self._with_orphans(out)

    def _with_orphans(self, out: dict) -> dict:
        """``out`` with the parts the agent wrote and told this rank of, which it may not have
        reported before it was lost (``_orphans``): reported twice if it did, which is harmless."""
        if self._orphans:
            out["ckpt_done"] = [tuple(d) for d in self._orphans] + list(out["ckpt_done"])
            self._orphans = []
        return out

    def snapshot(self, worker: Any, step: int, pooled: bool = True) -> list[dict]:
        """Snapshot ``step`` into a slot and hand it to the agent; the events of a failure.
        Raises ``UnsaveableState`` for a state no checkpoint can store. ``pooled``: for
        ``WorkerCheckpointer``'s signature; a node agent pools the parts it writes with a wait of
        its own, and reports what it holds after it."""
        if self.fallback is not None:
            return self.fallback.snapshot(worker, step, pooled)
        message: dict[str, Any] = {}
        try:
            self._poll()
            self._snapshots += 1
            rng = RawRng.take()
            snap = Snapshot.of_state(live_state(worker), step, int(worker.rank), int(worker.world_size),
                                     rng, self.min_shard_bytes,  # live tensors: copied into the slot
                                     every_n_steps=self.every_n_steps)
            message = {"op": "snap", "step": step, "rank": snap.rank, "world_size": snap.world_size,
                       "taken_at": snap.taken_at, "generation": group_generation(worker)}
            if is_milestone(self.keep_every, step):
                message["keep"] = True
            if snap.writes_file:
                layout = self._layout_of(snap.tensors, snap.world_size)
                if layout is None:
                    # Its own event: under the default (checkpoint_agent_lost) a healthy agent
                    # was reported lost, and the user sent to look at the node.
                    return self._fall_back(worker, step, "a tensor's dtype has no safetensors name here",
                                           event="checkpoint_dtype_in_process")
                meta = self._meta(snap)
                if not self._fill(message, layout, meta, snap.tensors, rng):
                    if not (message.get("keep") and self._filled_within(message, layout, meta, snap.tensors, rng,
                                                                        self.MILESTONE_WAIT_S)):
                        return self._drop(step, bool(message.get("keep")))
            else:
                message["rng"] = rng.encode()
            try:
                send_message(self.sock, message, block=False)
            except BlockingIOError:  # the agent's queue is full: it is far behind
                # A milestone waits for room as it waits for a slot (bounded, and only for it):
                # dropped, it was never written and never existed.
                if not (message.get("keep") and self._sent_within(message, self.MILESTONE_WAIT_S)):
                    self._give_back(message)
                    return self._drop(step, bool(message.get("keep")))
        except UnsaveableValue as exc:
            raise UnsaveableState(str(exc), step) from None
        except _NoSharedMemory as exc:
            return self._fall_back(worker, step, str(exc), event="checkpoint_shared_memory_failed")
        except OSError as exc:
            why, event = self._link_lost(exc)
            # A part the agent wrote and told of (a milestone's, waiting in the node's pool for
            # the other ranks') may have gone with it unreported: reported from here, or that
            # step never committed (retention's keep_every promise broken). The flush's path does
            # the same (``flush``); this is the agent lost mid-run.
            if self._written is not None and self._written[1].get("generation") == group_generation(worker):
                self._orphans.append(self._written)
            return self._fall_back(worker, step, why, event=event)
        except Exception as exc:  # noqa: BLE001 - a snapshot that failed must not stop training
            # Its slot, if it had one, is not the agent's: no send reached it (else no exception).
            with contextlib.suppress(KeyError):  # its ring is gone already
                self._give_back(message)
            return self._snapshot_failed(worker, step, exc)
        self._handed, self._dropped = step, None
        return []

    def _meta(self, snap: Snapshot) -> bytes:
        """The rank's meta for the slot: without the RNG, whose bytes follow it there (the agent
        splices it in), and with the skeleton's JSON mostly as it was last time (``SkeletonJson``)."""
        text = canonical_json(rank_meta(snap.step, snap.rank, snap.world_size, snap.tensors, None))
        if snap.skeleton is not None:
            text = json_object_plus(text, "state", self._skeleton_json.dumps(snap.skeleton))
        return text

    def _fill(self, message: dict, layout: "_Layout", meta: bytes, tensors: dict, rng: RawRng) -> bool:
        """Copy ``tensors``, ``meta`` and ``rng``'s blobs, one after another, into a free slot and
        name it in ``message``; False when no slot is free (or the agent cannot be told of a new
        ring or layout right now)."""
        if layout.id is None and not self._send_layout(layout):
            return False
        lengths = rng.lengths
        ring_id = self._ring_for(layout.nbytes + len(meta) + sum(lengths))
        if ring_id is None:
            return False
        ring, free = self._rings[ring_id]
        if not free:
            return False
        slot = free.pop()
        try:
            ring.copy_in(slot, layout.id, layout.entries, tensors)
            at = layout.nbytes
            for part in (meta, *rng.blobs):
                at += ring.put(slot, at, part)
        except BaseException:
            free.add(slot)
            raise
        message.update(ring=ring_id, slot=slot, layout=layout.id, meta_len=len(meta), rng_raw=rng.fields,
                       rng_lens=lengths)
        self._in_slots[(ring_id, slot)] = layout.id
        return True

    def _give_back(self, message: dict) -> None:
        if "slot" in message:
            self._rings[message["ring"]][1].add(message["slot"])
            self._in_slots.pop((message["ring"], message["slot"]), None)

    def _sent_within(self, message: dict, wait_s: float) -> bool:
        """``message`` sent once the agent's queue has room, within ``wait_s``; False if it never did."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            _ready(self.sock, True, min(left, 0.05))
            try:
                send_message(self.sock, message, block=False)
                return True
            except BlockingIOError:
                continue
        return False

    def _drop(self, step: int, milestone: bool = False) -> list[dict]:
        """No slot for ``step``: counted, told now and then, and taken again by a flush. A
        ``keep_every`` step (``milestone``) is told each time, as the in-process writer tells
        one it drops: retention promised to keep it."""
        self.dropped += 1
        self._dropped = step
        lost = [] if not milestone else [{
            "event": "checkpoint_failed", "what": "checkpoint agent", "step": step, "time": time.time(),
            "error": "milestone dropped",
            "message": f"snapshot of milestone step {step} dropped after {self.MILESTONE_WAIT_S:g}s: the checkpoint "
                       "agent had no room for it (keep_every asked to keep it)"}]
        told, when = self._drops_told
        if time.monotonic() - when < self.DROP_EVENT_EVERY_S:
            return lost
        self._drops_told = (self.dropped, time.monotonic())
        return lost + [{"event": "checkpoint_snapshots_dropped", "step": step, "time": time.time(),
                 "dropped": self.dropped - told,
                 "message": f"{self.dropped - told} snapshot(s) dropped (the newest at step {step}): the "
                            "checkpoint agent had no free slot, it is behind; newer steps are written instead"}]

    def _layout_of(self, tensors: dict, world_size: int) -> "_Layout | None":
        """Where ``tensors`` go in a shard (``codec.shard_layout``), worked out once per set of
        names, dtypes and shapes: a step's share is the same set as the last one's but for a
        rank whose share rotates (in a group of ``world_size``) or a tensor whose shape changed.
        None when a dtype has no safetensors name."""
        key = tuple((name, t.dtype, t.shape) for name, t in tensors.items())
        layout = self._layouts.get(key)
        if layout is None:
            entries = shard_layout(tensors)
            if entries is None:
                return None
            # Only when one is added: the layouts kept grow no other way, and a step whose
            # layout is known (every step of a steady run) looks at none of them.
            self._forget_layouts(self.FORGET_LAYOUTS_AFTER + world_size)
            layout = self._layouts[key] = _Layout(entries)
        layout.used = self._snapshots
        return layout

    def _forget_layouts(self, keep: int) -> None:
        """Let go of the layouts no snapshot used in the last ``keep`` (see FORGET_LAYOUTS_AFTER):
        their views over the slots now, and the agent's copy once it holds no slot they filled
        (``_tell_forgotten``)."""
        for key in [k for k, layout in self._layouts.items() if self._snapshots - layout.used >= keep]:
            layout = self._layouts.pop(key)
            if layout.id is not None:  # else it was never sent: the agent never had it, no slot views of it
                for ring, _ in self._rings.values():
                    ring.forget(layout.id)
                self._forgotten.add(layout.id)

    def _tell_forgotten(self) -> None:
        """Tell the agent to drop the layouts let go of here (``_forget_layouts``) that no slot it
        still holds was filled by. Why wait for those: the agent reads a snapshot's layout when
        it writes it, well after the message that handed the slot over, and one dropped before
        then would have it refuse the link (``_RankLink._write_shard``). A slot comes back
        (``free``) once the agent is done with it, written or replaced, and the agent takes this
        rank's messages in order, so a layout told now is named by no snapshot it still has."""
        held = set(self._in_slots.values())
        for layout_id in sorted(self._forgotten - held):
            try:
                send_message(self.sock, {"op": "forget_layout", "layout": layout_id}, block=False)
            except BlockingIOError:  # tell it next time
                break
            self._forgotten.discard(layout_id)

    def _send_layout(self, layout: "_Layout") -> bool:
        """Tell the agent ``layout`` (in a memfd of its own) under a new id; False if its queue is full."""
        text = json.dumps(layout.entries, separators=(",", ":")).encode()
        with _NoSharedMemory.on_os_error():
            fd = memfd_with(text)
        layout_id = self._new_id()
        try:
            send_message(self.sock, {"op": "layout", "layout": layout_id, "len": len(text)}, fds=[fd], block=False)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        layout.id = layout_id
        return True

    def _ring_for(self, nbytes: int) -> int | None:
        """The ring snapshots of ``nbytes`` go into: the current one, or a bigger one (told to
        the agent) when they outgrow it; the old ring is unmapped once all its slots are back."""
        if self._ring_id is not None and self._rings[self._ring_id][0].slot_bytes >= nbytes:
            return self._ring_id
        with _NoSharedMemory.on_os_error():
            ring = SlotRing.create(self.SLOTS, max(nbytes + (64 << 10), nbytes * 5 // 4))
        ring_id, fd = self._new_id(), ring.take_fd()
        try:
            send_message(self.sock, {"op": "ring", "ring": ring_id, **ring.desc}, fds=[fd], block=False)
        except BlockingIOError:  # the agent's queue is full: no ring this time
            ring.close()
            return None
        except BaseException:
            ring.close()
            raise
        finally:
            os.close(fd)
        self._rings[ring_id] = (ring, set(range(self.SLOTS)))
        self._ring_id = ring_id
        return ring_id

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _wait(self, deadline: float, write: bool = False) -> None:
        """Until the socket can be read (or written), or ``TimeoutError`` at ``deadline``.

        Why poll and not ``sock.settimeout``: a Python socket with a timeout polls before
        every call, ``MSG_DONTWAIT`` or not, so the step's non-blocking sends and receives
        would wait out the flush's timeout. The socket stays blocking without a timeout, and
        only the flush waits, here."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the checkpoint agent did not answer in time")
            if _ready(self.sock, write, left):
                return

    def _poll(self, deadline: float | None = None) -> None:
        """Take in what the agent sent: slots handed back, a flush's answer; unmap a ring that
        was outgrown once all its slots are back, and tell the agent of the layouts let go of
        that no slot in its hands uses any more. With ``deadline``, wait (until then) for one
        message first."""
        if deadline is not None:
            self._wait(deadline)
        while True:
            try:
                message, fds = receive_message(self.sock, block=False, buffer=self._rbuf)
            except BlockingIOError:
                break
            except ValueError as exc:  # a malformed message: the link is not to be trusted any more
                raise ConnectionResetError(f"the checkpoint agent sent a malformed message: {exc}") from exc
            for fd in fds:
                os.close(fd)
            if message is None:
                raise ConnectionResetError("the checkpoint agent closed the connection")
            if message.get("op") == "free" and int(message["ring"]) in self._rings:
                self._rings[int(message["ring"])][1].add(int(message["slot"]))
                self._in_slots.pop((int(message["ring"]), int(message["slot"])), None)
                # Told before the agent reports the part (its _release). The newest write is the
                # one told last: the agent writes this rank's snapshots one at a time, in the
                # order they were handed, and hands the slots back in that order. So after a
                # rollback a lower step than before is the newest (keeping the highest, a flush
                # whose agent died took it for the step written, not the one written since, and
                # wrote that step again over a file a manifest may name).
                written = message.get("written")
                if written:
                    self._written = (int(written[0]), written[1])
            elif message.get("op") == "flushed" and message.get("id") == self._flush_id:
                self._flushed = message  # (an answer to an earlier flush that timed out is dropped)
            elif message.get("op") == "refused":  # the agent's last word: the end of the stream follows
                raise _AgentRefused(str(message.get("error")))
        for ring_id in [r for r, (_, free) in self._rings.items() if r != self._ring_id and len(free) == self.SLOTS]:
            try:
                send_message(self.sock, {"op": "drop_ring", "ring": ring_id}, block=False)
            except BlockingIOError:  # tell it next time
                break
            self._rings.pop(ring_id)[0].close()
        if self._forgotten:
            self._tell_forgotten()

    def _link_lost(self, exc: OSError) -> tuple[str, str]:
        """Why the link to the agent failed with ``exc``, and the event that names it: the
        agent's refusal (``_AgentRefused``: it cannot use this rank's shared memory, and still
        runs) if it sent one, else a lost agent. What the agent sent is read first: it shuts
        the link right after its refusal, so a send of this rank may fail (EPIPE) before the
        refusal is read, and taken alone that failure would report a lost agent."""
        if not isinstance(exc, _AgentRefused):
            try:
                self._poll()
            except _AgentRefused as refused:
                exc = refused
            except OSError:
                pass  # the end of the stream, or a socket already closed: nothing more to learn
        if isinstance(exc, _AgentRefused):
            return str(exc), "checkpoint_shared_memory_failed"
        return f"the checkpoint agent is gone ({type(exc).__name__}: {exc})", "checkpoint_agent_lost"

    def _fall_back(self, worker: Any, step: int, why: str, snapshot: bool = True,
                   event: str = "checkpoint_agent_lost") -> list[dict]:
        """Write in this process from now on (and ``step`` now, if ``snapshot``); ``event`` names
        the cause: the agent lost, shared memory this process could not make, or a dtype the
        agent's encoding has no name for."""
        logger.warning("rank %s: %s; writing checkpoints in this process from step %d on", worker.rank, why, step)
        self._close_link()
        self.fallback = self._make_fallback()
        events = [{"event": event, "step": step, "time": time.time(), "error": why[:300],
                   "message": f"checkpoints of this rank are written in its own process from step {step} on: "
                              f"{why[:300]}"}]
        return events + (self.fallback.snapshot(worker, step) if snapshot else [])

    def _report(self, extra_events: list[dict] | None = None) -> dict:
        events, self._events = self._events + list(extra_events or []), []
        return {"ckpt_done": [], "ckpt_events": events}

    def drain(self, extra_events: list[dict] | None = None) -> dict:
        """What the last flush brought back (the newest part the agent reported for this rank,
        and its events), with ``extra_events``; see ``WorkerCheckpointer.drain``.
        ``snapshots_dropped``: this rank's snapshots dropped for want of a free slot since it
        was linked, in all (a total, not since the last drain: the drop events are sent at
        most once a minute, so they undercount a run's end; those before a fall-back included)."""
        if self.fallback is not None:
            events, self._events = self._events + list(extra_events or []), []
            out = self._with_orphans(self.fallback.drain(events))
            out["snapshots_dropped"] = self.dropped
            return out
        out = self._report(extra_events)
        if self._flushed is not None:
            out["ckpt_done"] = [tuple(d) for d in self._flushed.get("done", [])]
            out["ckpt_events"] = list(self._flushed.get("events", [])) + out["ckpt_events"]
            self._flushed = None
        out["snapshots_dropped"] = self.dropped
        return out

    def flush(self, timeout_s: float | None = None, worker: Any = None) -> bool:
        """Wait until the agent has written (or given up on) every snapshot of this rank.

        With ``worker``, the snapshot of its newest step (``completed_step``) is taken again
        first if it was dropped for want of a slot (waiting for one now: training waits for the
        flush anyway). If the agent is gone, what it had not written went with it, and the step
        it was given last (or dropped) is written again in this process only if it is that
        newest step, the one the rank's state still holds. A rank that trained past it
        (every_n_steps=10: handed step 100, now at 105) loses that step: its state is step
        105's, and written as step 100's part it would stand beside the other ranks' parts of
        step 100, a checkpoint that resumes this rank 5 steps ahead of the rest. Step 100 then
        never commits, and the run's commit stays on an older step."""
        if self.fallback is not None:
            return self.fallback.flush(timeout_s)
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s + 5.0
        self._flushed = None
        self._flush_id += 1
        try:
            if worker is not None and self._dropped is not None and self._dropped == int(worker.completed_step):
                self._take_again(worker, deadline)
            if self.fallback is not None:  # the agent went while the dropped step was taken again
                return self.fallback.flush(timeout_s)
            while True:
                try:
                    send_message(self.sock, {"op": "flush", "id": self._flush_id, "timeout_s": timeout_s},
                                 block=False)
                    break
                except BlockingIOError:
                    self._wait(deadline, write=True)
            while self._flushed is None:
                self._poll(deadline)
        except TimeoutError:
            logger.warning("the checkpoint agent did not answer a flush within %.0fs", timeout_s + 5.0)
            return False
        except OSError as exc:
            if worker is None:
                return False
            # What the agent sent before it died is still to be read (a failed send comes first):
            # its word that the step was written among it, or why it ended the link.
            why, event = self._link_lost(exc)
            step = int(worker.completed_step)
            # What the agent had not written went with it. The step it was last given (or that
            # was dropped) is taken again here, from the rank's state, only if that state is still
            # the step's (``step in (self._handed, self._dropped)``). A rank that trained past it
            # (handed 100, now at 105) loses it: written as step 100's part, state 5 steps on
            # would sit beside the other ranks' true step-100 parts and a resume there would mix
            # them. That step never commits; the run's commit stays on an older one.
            # A step it wrote (it said so before reporting it) is not written again, since a
            # committed manifest may name that file already; its part is reported from here, in
            # case the agent died before it did.
            # The same step of this generation: after a rollback the step written last may be one
            # of the generation left behind, which the controller drops (and the replayed step
            # was then never written).
            written = (self._written is not None and self._written[0] == step == self._handed
                       and self._written[1].get("generation") == group_generation(worker))
            if written:
                self._orphans.append(self._written)
            self._events += self._fall_back(worker, step, why, event=event,
                                            snapshot=not written and step in (self._handed, self._dropped))
            return self.fallback.flush(timeout_s)
        return bool(self._flushed.get("ok"))

    def _filled_within(self, message: dict, layout: "_Layout", meta: bytes, tensors: dict, rng: RawRng,
                       wait_s: float) -> bool:
        """``_fill`` tried again until it takes a slot, within ``wait_s``; False if it never did.
        Only for a step retention keeps (``store.is_milestone``): dropped, it was never written and
        the milestone never existed, so the rank waits for the agent there, once every
        ``keep_every`` steps and only when the agent is behind; every other step is dropped at
        once (a newer snapshot replaces it anyway).

        Why wait for room in the agent's queue as well as for a slot: ``_fill`` also fails when
        the message telling the agent of a new layout or a new ring is refused (the queue full),
        with a slot free. Waiting for a slot alone then returned at once, the next try met the
        same full queue, and the milestone was dropped at once (told as dropped after its wait)."""
        deadline = time.monotonic() + wait_s
        while deadline - time.monotonic() > 0:
            try:
                self._wait_for_slot(deadline)
            except TimeoutError:  # not the link's failure (an OSError the caller would fall back on)
                return False
            _ready(self.sock, True, min(deadline - time.monotonic(), 0.05))
            if self._fill(message, layout, meta, tensors, rng):
                return True
        return False

    def _wait_for_slot(self, deadline: float) -> None:
        """Until the current ring has a free slot (or there is no ring yet: the next snapshot
        makes one); ``TimeoutError`` at ``deadline``. The agent's writes in flight hand theirs back."""
        while self._ring_id is not None and not self._rings[self._ring_id][1]:
            self._poll(deadline)

    def _take_again(self, worker: Any, deadline: float) -> None:
        """Snapshot the dropped step once a slot is free (waiting until ``deadline`` at most),
        once: if it is dropped again (the agent's queue full) or fails, the flush goes on
        without it, as no slot may come back to wait for."""
        self._wait_for_slot(deadline)
        self._events += self.snapshot(worker, self._dropped)

    def _close_link(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        for ring, _ in self._rings.values():
            ring.close()
        self._rings.clear()
        self._ring_id = None
        self._in_slots.clear()
        self._forgotten.clear()

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.close()
            return
        self.flush(self.close_timeout_s)
        self._close_link()
