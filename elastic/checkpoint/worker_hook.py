"""The worker side of checkpointing: after an optimizer step, copy this rank's share of the state to host
memory and hand it to a background writer.

Returns small, JSON-friendly reports (finished writes and storage events) for the controller. A
rank's report of a step is a part: ``{"entries": [file records], "taken_at": snapshot time}``,
plus ``"rng"`` when the rank wrote no file (no share of a small state), for the manifest.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

from elastic.checkpoint.agent import receive_message, send_message
from elastic.checkpoint.codec import canonical_json, capture_rng, host_copy, shard_layout
from elastic.checkpoint.persister import AsyncPersister
from elastic.checkpoint.shm import SlotRing
from elastic.checkpoint.staging import StagingBuffers
from elastic.checkpoint.storage import RetryPolicy
from elastic.checkpoint.store import CheckpointStore, Snapshot, rank_meta

logger = logging.getLogger(__name__)


def live_state(worker: Any) -> dict:
    """The same shape as ``TrainWorker.get_state()`` but referencing live tensors (no copies yet), so
    only this rank's share is ever copied."""
    return {
        "model": worker.model.state_dict(),
        "optimizer": worker.optimizer.state_dict(),
        "scheduler": worker.scheduler.state_dict() if getattr(worker, "scheduler", None) is not None else None,
        "completed_step": int(worker.completed_step),
    }


def take_snapshot(worker: Any, step: int, min_shard_bytes: int = 0, staging: StagingBuffers | None = None) -> Snapshot:
    """This rank's share of tensors (private host copies, in ``staging``'s recycled buffers when
    given), its RNG, and with the first share the state skeleton.

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
    return Snapshot.of_state(live_state(worker), step, int(worker.rank), int(worker.world_size), capture_rng(),
                             min_shard_bytes, copy=staging.copy if staging is not None else host_copy)


class WorkerCheckpointer:
    """Installed on a TrainWorker as ``worker._ckpt``; ``after_step`` runs after every optimizer step."""

    def __init__(self, url: str, storage_options: dict | None, run_name: str, every_n_steps: int,
                 blocking: bool = False, *, retry: RetryPolicy | None = None,
                 retry_min_s: float | None = None, retry_max_s: float | None = None,
                 close_timeout_s: float = 30.0, notify: Callable[..., Any] | None = None,
                 progress: Callable[[], int] | None = None, min_shard_bytes: int = 0):
        """``notify(step, world_size, parts)``: called from the writer thread once a step's parts are
        written, ``parts`` being ``{rank: {"entries", "taken_at", "progress"[, "rng"]}}`` (the worker sends it
        to the controller actor), so a commit never waits for the step results to travel back.
        Ranks of a group pool their parts (``elastic.checkpoint.pool``) and the rank that completes
        a step sends all of them; without a pool a rank sends its own part. Without ``notify``,
        finished writes ride on the step results (``after_step``'s report)."""
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps must be an integer >= 0, got {every_n_steps!r}")
        self.store = CheckpointStore(url, run_name, storage_options, retry=retry)
        self.every_n_steps = every_n_steps
        self.min_shard_bytes = min_shard_bytes
        self.close_timeout_s = close_timeout_s
        self._notify, self._progress = notify, progress
        self._last_pushed: tuple[int, dict] | None = None
        self._pool_error: str | None = None
        # The payload is (snapshot, the group's PartPool at snapshot time or None). Its host
        # copies go back to ``staging`` once the persister lets go of it.
        self.staging = StagingBuffers()
        self.persister = AsyncPersister(lambda payload: self._write(payload[0]), blocking=blocking,
                                        name="checkpoint write",
                                        retry_min_s=retry_min_s, retry_max_s=retry_max_s,
                                        on_done=self._push if notify is not None else None,
                                        on_release=lambda payload: self.staging.release(payload[0].tensors.values()))
        self.last_snapshot_s = 0.0
        self._snapshot_error: str | None = None

    def warm_up(self) -> None:
        """Open the storage client now, before training, with one cheap request. Why: an S3
        client (s3fs/aiobotocore) sets itself up on its first request, 0.43 s for the first
        0.8 MB PUT against moto on loopback where the next ones took 0.016 s, and in a
        rank's first checkpoint that delay is lag. A failure here is only logged: the writes
        retry and report an outage on their own."""
        try:
            self.store.storage.exists("", retry=RetryPolicy(attempts=1))
        except Exception as exc:  # noqa: BLE001 - storage may be down now; training must still start
            logger.warning("checkpoint storage %s did not answer a warm-up request: %s", self.store.location, exc)

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def after_step(self, worker: Any, step: int) -> dict:
        """Snapshot and submit when the step is due; always report what finished since the last call."""
        return self._report(self.snapshot(worker, step) if self.due(step) else [])

    def snapshot(self, worker: Any, step: int) -> list[dict]:
        """Snapshot ``step`` and hand it to the writer; the events of a snapshot that failed."""
        t0 = time.perf_counter()
        try:
            snapshot = take_snapshot(worker, step, self.min_shard_bytes, self.staging)
        except Exception as exc:  # noqa: BLE001 - a state we cannot save must not stop training
            text = f"{type(exc).__name__}: {exc}"
            if text != self._snapshot_error:  # log a repeating error once, not every step
                logger.exception("rank %s: cannot snapshot step %d for checkpointing", worker.rank, step)
                self._snapshot_error = text
            return [{"event": "checkpoint_failed", "what": "snapshot", "step": step, "time": time.time(),
                     "error": text[:300], "message": f"cannot snapshot step {step} for a checkpoint: {text[:300]}"}]
        self.last_snapshot_s = time.perf_counter() - t0
        self.persister.submit(step, (snapshot, getattr(worker, "part_pool", None)), light=not snapshot.writes_file)
        return []

    def _write(self, snapshot: Snapshot) -> dict:
        """The writer thread's job: write the shard (if this rank has one); returns the rank's part."""
        entries = self.store.write_snapshot(snapshot)
        part = {"entries": [e.to_dict() for e in entries], "taken_at": snapshot.taken_at}
        if not entries:
            part["rng"] = snapshot.rng
        return part

    def _push(self, step: int, payload: tuple, written: dict) -> None:
        snapshot, pool = payload
        self._last_pushed = (step, written)
        part = {**written, "progress": self._progress() if self._progress is not None else step}
        parts: dict[int, dict] | None = {snapshot.rank: part}
        if pool is not None:  # a group of more than one rank
            try:
                parts = pool.add(step, snapshot.rank, part)
            except Exception as exc:  # noqa: BLE001 - the group is gone or its store is down: report directly
                text = f"{type(exc).__name__}: {exc}"
                if text != self._pool_error:
                    logger.warning("rank %s: cannot pool checkpoint part of step %d (%s); reporting it directly",
                                   snapshot.rank, step, text[:300])
                    self._pool_error = text
            if parts is None:
                return  # another rank's part completes the step; that rank reports it
        self._notify(step, snapshot.world_size, parts)

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
        a second report of a part is harmless (the committer ignores steps it has already taken).
        The part carries the snapshot's time, so a step committed from it still says how long it
        took to persist."""
        out = self._report(extra_events)
        if self._last_pushed is not None:
            out["ckpt_done"].append(self._last_pushed)
        return out

    def flush(self, timeout_s: float | None = None, worker: Any = None) -> bool:
        """Wait for the pending write; at most ``timeout_s`` (default close_timeout_s) so an outage at
        the end of training cannot hang the worker. False if it timed out. (``worker``: for
        ``AgentCheckpointer``'s signature; a write in this process cannot be lost that way.)"""
        return self.persister.flush(self.close_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Write what is waiting (bounded by close_timeout_s) and stop the thread."""
        self.persister.close(self.close_timeout_s)


class AgentCheckpointer:
    """The rank's side of its node's checkpoint agent (``elastic.checkpoint.agent``), with the
    interface of ``WorkerCheckpointer``: inside the step, this rank's share is copied into a
    free slot of memory shared with the agent and one message says so; the agent writes it and
    reports it. Nothing of the checkpoint runs on a thread of this process.

    With no free slot (the agent is still busy with the previous snapshots), the step's snapshot
    is dropped rather than waited for: a newer one follows at the next step. If the agent is
    gone, or cannot take a snapshot (a dtype safetensors has no name for), this rank writes in
    process from then on (``fallback``, a ``WorkerCheckpointer``)."""

    SLOTS = 3  # one being written, one waiting, one being filled: as many as the in-process writer holds
    MAX_RINGS = 4  # shard layouts kept mapped (with fewer writers than ranks a rank's share rotates)

    def __init__(self, address: str, every_n_steps: int, fallback: Callable[[], WorkerCheckpointer],
                 min_shard_bytes: int = 0, close_timeout_s: float = 30.0):
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps must be an integer >= 0, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.min_shard_bytes = min_shard_bytes
        self.close_timeout_s = close_timeout_s
        self._make_fallback = fallback
        self.fallback: WorkerCheckpointer | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(address)
        self._rings: dict[tuple, int] = {}  # layout key -> ring id
        self._ring_of: dict[int, tuple[Any, set[int]]] = {}  # ring id -> (SlotRing, free slots)
        self._retired: set[int] = set()  # rings to unmap once the agent has handed all their slots back
        self._next_ring = 0
        self._events: list[dict] = []
        self._flushed: dict | None = None
        self._flush_id = 0
        self.dropped = 0  # snapshots dropped because no slot was free
        self.last_snapshot_s = 0.0

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def warm_up(self) -> None:
        """The agent opens the storage client; nothing to do here."""

    def after_step(self, worker: Any, step: int) -> dict:
        if self.fallback is not None:
            return self.fallback.after_step(worker, step)
        return self._report(self.snapshot(worker, step) if self.due(step) else [])

    def snapshot(self, worker: Any, step: int) -> list[dict]:
        """Snapshot ``step`` into a slot and hand it to the agent; the events of a failure."""
        if self.fallback is not None:
            return self.fallback.snapshot(worker, step)
        t0 = time.perf_counter()
        try:
            self._poll()
            snap = Snapshot.of_state(live_state(worker), step, int(worker.rank), int(worker.world_size),
                                     capture_rng(), self.min_shard_bytes)  # live tensors: copied into the slot
            message: dict[str, Any] = {"op": "snap", "step": step, "rank": snap.rank, "world_size": snap.world_size,
                                       "taken_at": snap.taken_at}
            slot = None
            if snap.writes_file:
                layout = shard_layout(snap.tensors)
                if layout is None:
                    return self._fall_back(worker, step, "a tensor's dtype has no safetensors name here")
                meta = canonical_json(rank_meta(step, snap.rank, snap.world_size, snap.tensors, snap.rng,
                                                snap.skeleton))
                ring_id = self._ring(layout, len(meta))
                ring, free = self._ring_of[ring_id]
                if not free:
                    self.dropped += 1
                    logger.debug("rank %s: no free snapshot slot at step %d; the agent is behind", snap.rank, step)
                    return []
                slot = free.pop()
                ring.copy_in(slot, snap.tensors)
                ring.put_meta(slot, meta)
                message.update(ring=ring_id, slot=slot, meta_len=len(meta))
            else:
                message["rng"] = snap.rng
            try:
                send_message(self.sock, message, block=False)
            except BlockingIOError:  # the agent's queue is full: it is far behind
                self.dropped += 1
                if slot is not None:
                    self._ring_of[message["ring"]][1].add(slot)
                return []
        except OSError as exc:
            return self._fall_back(worker, step, f"the checkpoint agent is gone ({type(exc).__name__}: {exc})")
        except Exception as exc:  # noqa: BLE001 - a state we cannot save must not stop training
            logger.exception("rank %s: cannot snapshot step %d for checkpointing", worker.rank, step)
            return [{"event": "checkpoint_failed", "what": "snapshot", "step": step, "time": time.time(),
                     "error": f"{type(exc).__name__}: {exc}"[:300],
                     "message": f"cannot snapshot step {step} for a checkpoint: {type(exc).__name__}: {exc}"[:400]}]
        self.last_snapshot_s = time.perf_counter() - t0
        return []

    def _ring(self, layout: list[dict], meta_len: int) -> int:
        """The id of a ring for ``layout`` with room for ``meta_len`` bytes of meta; a new one
        (sent to the agent) when there is none, or its meta room is too small."""
        key = tuple((e["name"], e["dtype"], tuple(e["shape"])) for e in layout)
        ring_id = self._rings.get(key)
        if ring_id is not None and self._ring_of[ring_id][0].meta_capacity >= meta_len:
            return ring_id
        if ring_id is not None:
            self._retire(ring_id)
        while len(self._rings) >= self.MAX_RINGS:
            self._retire(next(iter(self._rings.values())))
        ring = SlotRing.create(layout, self.SLOTS, meta_capacity=max(64 << 10, 2 * meta_len))
        ring_id, self._next_ring = self._next_ring, self._next_ring + 1
        fd = ring.take_fd()
        try:
            send_message(self.sock, {"op": "ring", "ring": ring_id, **ring.desc}, fds=[fd])
        except BaseException:
            ring.close()
            raise
        finally:
            os.close(fd)
        self._rings[key] = ring_id
        self._ring_of[ring_id] = (ring, set(range(self.SLOTS)))
        return ring_id

    def _retire(self, ring_id: int) -> None:
        self._rings = {k: v for k, v in self._rings.items() if v != ring_id}
        self._retired.add(ring_id)

    def _poll(self, block: bool = False) -> None:
        """Take in what the agent sent: slots handed back, a flush's answer."""
        while True:
            try:
                message, fds = receive_message(self.sock, block=block)
            except BlockingIOError:
                break
            for fd in fds:
                os.close(fd)
            if message is None:
                raise ConnectionResetError("the checkpoint agent closed the connection")
            if message.get("op") == "free" and int(message["ring"]) in self._ring_of:
                self._ring_of[int(message["ring"])][1].add(int(message["slot"]))
            elif message.get("op") == "flushed" and message.get("id") == self._flush_id:
                self._flushed = message  # (an answer to an earlier flush that timed out is dropped)
                if block:
                    break
        for ring_id in [r for r in self._retired if len(self._ring_of[r][1]) == self.SLOTS]:
            self._retired.discard(ring_id)
            ring, _ = self._ring_of.pop(ring_id)
            send_message(self.sock, {"op": "drop_ring", "ring": ring_id})
            ring.close()

    def _fall_back(self, worker: Any, step: int, why: str) -> list[dict]:
        logger.warning("rank %s: %s; writing checkpoints in this process from step %d on", worker.rank, why, step)
        self._close_link()
        self.fallback = self._make_fallback()
        events = [{"event": "checkpoint_agent_lost", "step": step, "time": time.time(), "error": why[:300],
                   "message": f"checkpoints of this rank are written in its own process from step {step} on: "
                              f"{why[:300]}"}]
        return events + self.fallback.snapshot(worker, step)

    def _report(self, extra_events: list[dict] | None = None) -> dict:
        events, self._events = self._events + list(extra_events or []), []
        return {"ckpt_done": [], "ckpt_events": events}

    def drain(self, extra_events: list[dict] | None = None) -> dict:
        """What the last flush brought back (the newest part the agent reported for this rank,
        and its events), with ``extra_events``; see ``WorkerCheckpointer.drain``."""
        if self.fallback is not None:
            events, self._events = self._events + list(extra_events or []), []
            return self.fallback.drain(events)
        out = self._report(extra_events)
        if self._flushed is not None:
            out["ckpt_done"] = [tuple(d) for d in self._flushed.get("done", [])]
            out["ckpt_events"] = list(self._flushed.get("events", [])) + out["ckpt_events"]
            self._flushed = None
        return out

    def flush(self, timeout_s: float | None = None, worker: Any = None) -> bool:
        """Wait until the agent has written (or given up on) every snapshot of this rank. If the
        agent is gone, the snapshots it had not written went with it: with ``worker`` (its
        state still that of its newest step) this rank snapshots that step again and writes it
        in process."""
        if self.fallback is not None:
            return self.fallback.flush(timeout_s)
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        self._flushed = None
        self._flush_id += 1
        try:
            send_message(self.sock, {"op": "flush", "id": self._flush_id, "timeout_s": timeout_s})
            self.sock.settimeout(timeout_s + 5.0)
            try:
                while self._flushed is None:
                    self._poll(block=True)
            finally:
                self.sock.settimeout(None)
        except TimeoutError:
            logger.warning("the checkpoint agent did not answer a flush within %.0fs", timeout_s + 5.0)
            return False
        except OSError as exc:
            if worker is None:
                return False
            self._events += self._fall_back(worker, int(worker.completed_step),
                                             f"the checkpoint agent is gone ({type(exc).__name__}: {exc})")
            return self.fallback.flush(timeout_s)
        return bool(self._flushed.get("ok"))

    def _close_link(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        for ring, _ in self._ring_of.values():
            ring.close()
        self._ring_of.clear()
        self._rings.clear()
        self._retired.clear()

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.close()
            return
        self.flush(self.close_timeout_s)
        self._close_link()
