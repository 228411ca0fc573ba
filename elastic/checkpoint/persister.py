"""Writes snapshots in one background thread so training never waits on storage.

At most one snapshot waits: a newer one replaces it. Light payloads (a rank's part of a step it
writes no file for: nothing to store, only to report) queue in order instead, a bounded few.
During a storage outage the thread keeps retrying with backoff, moving on to the newest snapshot
between tries, and records when the outage started and ended. Nothing here raises into the
training loop.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import Any, Callable

from elastic.checkpoint.storage import StorageError, StorageUnavailable
from elastic.config import env_number

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 300


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


class OutageTracker:
    """Turns a stream of storage failures and successes into outage start/end events.

    ``what``: the operation ("checkpoint write", "resume"); ``retrying``: what happens meanwhile,
    for the outage's message. A ``step`` of None is an operation of no one step (a resume)."""

    def __init__(self, events: deque, what: str, retrying: str = "retrying in the background"):
        self._events = events
        self._what = what
        self._retrying = retrying
        self.started_at: float | None = None
        self.failures = 0
        self.refused_logged = False  # one storage_refused event an outage (see failed)

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def _op(self, step: int | None) -> str:
        return self._what if step is None else f"{self._what} of step {step}"

    def failed(self, step: int | None, exc: BaseException) -> None:
        self.failures += 1
        # Storage that refuses (a permission, a missing bucket: what ``Storage`` does not retry)
        # is retried here all the same, since training goes on and a fixed policy or a recreated
        # bucket lets checkpoints catch up. But the user has to act on it, which an outage of
        # the endpoint does not ask: the event says so, and names the error.
        refused = isinstance(exc, StorageError) and not isinstance(exc, StorageUnavailable)
        if self.started_at is None:
            self.started_at = time.time()
            logger.warning("%s failed; storage outage started, %s: %s", self._op(step), self._retrying, _short(exc))
            self._events.append({"event": "storage_outage", "what": self._what, "step": step,
                                 "time": self.started_at, "error": _short(exc), "refused": refused,
                                 "message": f"storage outage: {self._op(step)} failed; "
                                            f"{self._retrying} ({_short(exc)})"})
        else:
            logger.debug("%s failed again: %s", self._op(step), _short(exc))
        if refused and not self.refused_logged:
            self.refused_logged = True
            self._events.append({"event": "storage_refused", "what": self._what, "step": step, "time": time.time(),
                                 "error": _short(exc),
                                 "message": f"storage refused {self._op(step)}, not a transient error: check the "
                                            f"credentials, the bucket and its permissions; {self._retrying} "
                                            f"({_short(exc)})"})
            logger.error("storage refused %s (not transient: check the credentials, the bucket and its "
                         "permissions); %s: %s", self._op(step), self._retrying, _short(exc))

    def succeeded(self, step: int | None) -> None:
        if self.started_at is None:
            return
        now = time.time()
        logger.warning("storage is back: %s succeeded after %.1fs and %d failed attempts",
                       self._op(step), now - self.started_at, self.failures)
        outage_s = round(now - self.started_at, 3)
        self._events.append({"event": "storage_recovered", "what": self._what, "step": step, "time": now,
                             "outage_s": outage_s, "failed_attempts": self.failures,
                             "message": f"storage is back after {outage_s:.1f}s: {self._op(step)} "
                                        f"succeeded after {self.failures} failed attempts"})
        self.started_at, self.failures, self.refused_logged = None, 0, False


# AsyncPersister's kinds of payload; LIGHT_KEEP: a milestone a rank writes no file for (its RNG)
NEWEST, REPORT, KEEP, LIGHT_KEEP = "newest", "report", "keep", "light-keep"


class AsyncPersister:
    """Runs ``write_fn(payload) -> entries`` for the newest submitted payload, one at a time.

    Light payloads (``submit(light=True)``) are never replaced by a newer one: they wait in
    order, up to ``max_light`` of them. Why: with ``CheckpointConfig.min_shard_bytes`` a rank
    writes a file only every few steps and in between merely reports its RNG. A report queued
    behind its own slow write must not be replaced by the next step's report, or every step
    that write overlapped could never complete (the committer needs every rank's part).

    Kept payloads (``submit(keep=True)``: a ``keep_every`` milestone) are never replaced either,
    nor skipped when an outage moves on to the newest snapshot: retention promises them. Their
    own bound is ``max_keep`` waiting; past it the oldest waiting one is dropped, and said so
    (``checkpoint_failed``). A rank's own writer, whose payloads are whole host copies of its
    state, keeps 2 (as light payloads they waited up to 32: with ``keep_every ==
    every_n_steps``, 33 full copies through an outage); the node agent's links, whose payloads
    sit in its bounded shared-memory slots, and the committer's manifests keep the default. A
    milestone that is also light (``keep=True, light=True``: a rank's RNG alone) is kept the
    same way but counts against ``max_light``, not ``max_keep``: it holds no copy of the state.

    ``submit`` returns at once (or writes inline when ``blocking``). ``drain`` hands back
    ``(step, entries)`` for every write completed since the last drain; ``drain_events`` the outage
    start/end and failure events.

    ``on_release(payload)`` is called exactly once for every submitted payload, when the persister
    lets go of it: after its write (and ``on_done``) succeeded or failed for good, when a newer
    snapshot replaced it, when the light queue overflowed, and when it was dropped at close. Never
    while the write function may still read it, so the caller may reuse the payload's memory then.
    """

    def __init__(self, write_fn: Callable[[Any], list], blocking: bool = False, name: str = "checkpoint write",
                 retry_min_s: float | None = None, retry_max_s: float | None = None, max_events: int = 256,
                 keep_done: bool = True, on_done: Callable[[int, Any, Any], None] | None = None,
                 max_light: int = 32, max_keep: int = 32, on_release: Callable[[Any], None] | None = None,
                 thread_init: Callable[[], None] | None = None, thread_exit: Callable[[], None] | None = None,
                 reached_storage: Callable[[Any], bool] | None = None):
        self._write_fn = write_fn
        # Whether what write_fn returned went to storage; only such a write ends an outage. The
        # agent's writer returns without a request for a snapshot a fence stopped: that says
        # nothing of the storage, and in an outage a "recovered" event for it would be false.
        self._reached_storage = reached_storage or (lambda entries: True)
        # Run first and last on the writer thread (its CPU priority, say).
        self._thread_init, self._thread_exit = thread_init, thread_exit
        self._on_release = on_release
        # Called from the writer thread with (step, payload, what write_fn returned) as each write finishes,
        # instead of keeping it for drain(): the worker pushes it straight to the controller.
        self._on_done = on_done
        self._keep_done = keep_done  # False when nobody calls drain(): the list must not grow forever
        self.blocking = blocking
        self.name = name
        self.retry_min_s = retry_min_s if retry_min_s is not None else env_number("ELASTIC_CKPT_RETRY_MIN_S", 0.5)
        # At most 5 s between tries in an outage (ELASTIC_CKPT_RETRY_MAX_S): checkpoints catch up
        # within seconds of the endpoint's return. With 30 s the tries of a 10 s outage had
        # backed off to 8-16 s, and the run went that long again on its old checkpoint with the
        # storage back, a node lost then costing those steps. A try a rank every 5 s is little
        # load for any store, and each try is itself retried by Storage (StoragePolicy).
        self.retry_max_s = retry_max_s if retry_max_s is not None else env_number("ELASTIC_CKPT_RETRY_MAX_S", 5.0)
        self._cond = threading.Condition()
        # (step, payload, kind), oldest first: kind NEWEST (at most one), REPORT, KEEP or LIGHT_KEEP
        self._queue: deque = deque()
        self.max_light, self.max_keep = max_light, max_keep
        self._inflight: int | None = None
        self._current: Any = None  # the payload the writer holds (``_persist`` may move on to a newer one)
        self._done: list[tuple[int, list]] = []
        self._events: deque = deque(maxlen=max_events)
        self._outage = OutageTracker(self._events, name)
        self._thread: threading.Thread | None = None
        self._inline_since = 0.0  # when the writer thread could not start (0: it could; see _start_thread)
        self._closing = False
        self._abort = False
        self._woken = False  # ``wake``: the backoff wait under way ends now
        self._died_of = False  # the writer thread ended on an error (_died)
        self.superseded = 0  # snapshots replaced before they were written

    # ---- caller side ------------------------------------------------------------------------
    def submit(self, step: int, payload: Any, light: bool = False, keep: bool = False) -> None:
        """Hand over a snapshot the caller already copied; the persister now owns it.
        ``light``: a report, waiting in order; ``keep``: a milestone (see the class)."""
        if self.blocking:
            try:
                self._write_inline(step, payload)
            finally:
                self._release(payload)
            return
        with self._cond:
            if self._closing:
                logger.debug("persister closed; dropping step %d", step)
                self._release(payload)
                return
            # A light milestone is kept as a milestone (never skipped in an outage) but bounded as
            # a report: counted against max_keep, whose 2 are whole host copies of the state on
            # a rank's own writer, a third RNG-only milestone waiting behind the rank's one slow
            # write pushed the oldest out, and that milestone never committed (every rank's
            # part is needed) with storage keeping up.
            kind = (LIGHT_KEEP if light else KEEP) if keep else REPORT if light else NEWEST
            if kind == NEWEST:
                replaced = [i for i in self._queue if i[2] == NEWEST]
                if replaced:  # one snapshot waits, never more: memory stays bounded
                    self._queue = deque(i for i in self._queue if i[2] != NEWEST)
                    self.superseded += len(replaced)
                    logger.debug("step %d replaces waiting step %s", step, [i[0] for i in replaced])
                    for item in replaced:
                        self._release(item[1])
            self._queue.append((step, payload, kind))
            kept = [i for i in self._queue if i[2] == KEEP]
            if len(kept) > self.max_keep:
                dropped = kept[0]
                self._unqueue(dropped)
                self.superseded += 1
                self._events.append({
                    "event": "checkpoint_failed", "what": self.name, "step": dropped[0], "time": time.time(),
                    "error": "milestone dropped", "message": f"{self.name} of milestone step {dropped[0]} dropped: "
                    f"{len(kept) - 1} milestones were already waiting for storage (keep_every)"})
                self._release(dropped[1])
            while sum(1 for i in self._queue if i[2] != KEEP) > self.max_light + 1:
                # The oldest report or snapshot; a light milestone only when none is left: kept
                # payloads are promised, and on an agent's link they once had max_keep's 32
                # places of their own, where reports took none.
                dropped = ([i for i in self._queue if i[2] in (REPORT, NEWEST)]
                           or [i for i in self._queue if i[2] == LIGHT_KEEP])[0]
                self._unqueue(dropped)
                self.superseded += 1
                # An event, as for a milestone: a light payload is never superseded by design, so
                # losing one is a failure to say (it was only a debug line).
                self._events.append({
                    "event": "checkpoint_failed", "what": self.name, "step": dropped[0], "time": time.time(),
                    "error": "milestone dropped" if dropped[2] == LIGHT_KEEP else "dropped",
                    "message": f"{self.name} of {'milestone ' if dropped[2] == LIGHT_KEEP else ''}step {dropped[0]} "
                    f"dropped: {self.max_light} later ones were already waiting for storage"})
                self._release(dropped[1])
            inline: list = []
            if self._thread is None and not self._start_thread():
                inline, self._queue = list(self._queue), deque()  # written below, outside the lock
            self._cond.notify_all()
        for step, payload, _ in inline:
            try:
                self._write_inline(step, payload)
            finally:
                self._release(payload)

    def start(self) -> None:
        """Start the writer thread now rather than at the first submit; raises RuntimeError where the
        process cannot start one. For an owner that submits under a lock its write function takes
        (the committer, whose commit reads its own tables): an inline write (``_start_thread``)
        there would wait on that lock forever. Started here, no submit ever writes inline."""
        with self._cond:
            if self._thread is None and not self.blocking:
                self._thread = self._started_thread()

    def _started_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"elastic-{self.name}", daemon=True)
        thread.start()
        return thread

    def _start_thread(self) -> bool:
        """Start the writer thread (under the lock); False if the process cannot start one.

        Why this is caught: ``Thread.start`` raises ``RuntimeError("can't start new thread")`` when
        the process is at its thread limit (``RLIMIT_NPROC``, a container's ``pids.max``), and the
        first submit is inside a training step, which storage must never stop. The caller then
        writes what waits inline, one try each, as ``blocking`` mode does, and the next submit
        tries to start the thread again: a limit that eases gives the background writer back.
        One event per such spell says training now waits on storage. (Never for an owner that
        called ``start``.)"""
        try:
            thread = self._started_thread()
        except RuntimeError as exc:
            if not self._inline_since:
                self._inline_since = time.time()
                logger.warning("%s: could not start the writer thread (%s); writing inline, so training "
                               "waits on storage, until a thread can start", self.name, _short(exc))
                self._events.append({
                    "event": "checkpoint_writer_inline", "what": self.name, "time": self._inline_since,
                    "step": self._queue[-1][0] if self._queue else None, "error": _short(exc),
                    "message": f"{self.name}: could not start the writer thread ({_short(exc)}); checkpoints "
                               f"are written inside the step (training waits on storage) until one can start"})
            return False
        if self._inline_since:
            logger.warning("%s: writer thread started after %.1fs of inline writes", self.name,
                           time.time() - self._inline_since)
            self._inline_since = 0.0
        self._thread = thread
        return True

    def drain(self) -> list[tuple[int, list]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def drain_events(self) -> list[dict]:
        with self._cond:
            events = list(self._events)
            self._events.clear()
        return events

    @property
    def waiting_step(self) -> int | None:
        with self._cond:
            return self._queue[-1][0] if self._queue else None

    @property
    def inflight_step(self) -> int | None:
        return self._inflight

    @property
    def died(self) -> bool:
        """The writer thread ended on an error (``_died``): nothing submitted is written any more."""
        return self._died_of

    @property
    def in_outage(self) -> bool:
        return self._outage.active

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is waiting or being written; False on timeout."""
        if self.blocking:
            return True
        with self._cond:
            done = self._cond.wait_for(lambda: not self._queue and self._inflight is None, timeout=timeout_s)
            return done and not self._died_of  # emptied by a dead thread: nothing was written

    def wake(self) -> None:
        """Try a write that is waiting out its backoff again now: what made it fail has changed
        (the committer halted, and its next try returns at once instead of in up to 5 s)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Write what is waiting (up to ``timeout_s``), then stop the thread. True if everything was written."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if self._died_of:
            return False
        clean = not thread.is_alive()
        if not clean:
            # Storage is still down: give up on the last snapshot rather than hang shutdown.
            with self._cond:
                dropped = self._queue[-1][0] if self._queue else self._inflight
            logger.warning("%s: gave up on step %s at close after %.1fs", self.name, dropped, timeout_s)
            self.abort(5.0)
        return clean

    def abort(self, timeout_s: float = 5.0) -> list[int]:
        """Stop without writing what waits (each released, not written); a write in progress
        finishes, an outage's retries end. Returns the steps dropped."""
        with self._cond:
            self._closing = self._abort = True
            dropped = [item[0] for item in self._queue]
            for item in self._queue:
                self._release(item[1])
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return dropped

    # ---- writer side ------------------------------------------------------------------------
    def _release(self, payload: Any) -> None:
        if self._on_release is None:
            return
        try:
            self._on_release(payload)
        except Exception:  # noqa: BLE001 - a release hook must not cost a write or the thread
            logger.exception("%s: releasing a payload failed", self.name)

    def _write_inline(self, step: int, payload: Any) -> None:
        """Blocking mode: one write (the storage layer retries transient errors); a failure is recorded,
        never raised, and the next step tries again."""
        try:
            entries = self._write_fn(payload)
        except StorageError as exc:
            with self._cond:
                self._outage.failed(step, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a checkpoint bug must not kill training
            self._record_failure(step, exc)
            return
        self._record_success(step, payload, entries)

    def _record_success(self, step: int, payload: Any, entries: Any) -> None:
        with self._cond:
            if self._reached_storage(entries):
                self._outage.succeeded(step)
            if self._keep_done and self._on_done is None:
                self._done.append((step, entries))
        if self._on_done is not None:
            try:
                self._on_done(step, payload, entries)
            except Exception:  # noqa: BLE001 - a lost report costs one commit, never the writer thread
                logger.exception("%s: reporting step %d failed", self.name, step)

    def _record_failure(self, step: int, exc: BaseException) -> None:
        logger.error("%s of step %d failed and is dropped: %s", self.name, step, _short(exc), exc_info=exc)
        with self._cond:
            self._events.append({"event": "checkpoint_failed", "what": self.name, "step": step,
                                 "time": time.time(), "error": _short(exc),
                                 "message": f"{self.name} of step {step} failed and was dropped: {_short(exc)}"})

    def _unqueue(self, item: tuple) -> None:
        """Take ``item`` out of the queue, by identity (``deque.remove`` would compare payloads)."""
        self._queue = deque(i for i in self._queue if i is not item)

    def _backoff_s(self, attempt: int) -> float:
        return min(self.retry_max_s, self.retry_min_s * (2 ** min(attempt, 30))) * random.uniform(0.5, 1.0)

    def _run(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            try:
                self._serve()
            finally:
                if self._thread_exit is not None:
                    self._thread_exit()
        except BaseException as exc:  # noqa: BLE001 - the thread ends here; said, not swallowed
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        """The writer thread ends on an error its handlers did not take (its ``thread_init``, a
        bug). Without this the payloads waiting were never written nor released (a node agent's
        memory slots never came back), every later one queued behind them, and ``close`` said
        all was written because the thread was gone. Now they are released, later submits are
        dropped (``_closing``), ``close`` says False, and one event says so."""
        logger.error("%s: the writer thread died: %s", self.name, _short(exc), exc_info=exc)
        with self._cond:
            self._closing = self._died_of = True
            dropped, self._queue = list(self._queue), deque()
            self._inflight, self._current = None, None
            self._events.append({
                "event": "checkpoint_failed", "what": self.name, "step": dropped[-1][0] if dropped else None,
                "time": time.time(), "error": _short(exc),
                "message": f"{self.name}: its writer thread died ({_short(exc)}); {len(dropped)} waiting "
                           "write(s) dropped, and no later one is written"})
            self._cond.notify_all()
        for item in dropped:
            self._release(item[1])

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closing)
                if not self._queue:
                    return  # closing and nothing left
                step, payload, kind = self._queue.popleft()
                self._inflight, self._current = step, payload
            try:
                self._persist(step, payload, kind)
            finally:
                # The payload _persist ended with (it may have moved on to a newer one, and
                # released this one): the one it holds now, also when it raised past its handlers.
                self._release(self._current)
                with self._cond:
                    self._inflight, self._current = None, None
                    self._cond.notify_all()

    def _persist(self, step: int, payload: Any, kind: str = NEWEST) -> None:
        """Write ``payload``, retrying through an outage. In an outage it moves on to the newest
        snapshot, or to a milestone queued before it (``_current`` then holds it), releasing the
        reports it skips; a milestone, retried or waiting, is neither skipped nor released."""
        attempt = 0
        while True:
            try:
                entries = self._write_fn(payload)
            except StorageError as exc:
                with self._cond:
                    self._outage.failed(step, exc)
                    # Sleep, but wake for close; a newer snapshot waits for the next try so an
                    # outage does not turn every training step into a storage request.
                    self._cond.wait_for(lambda: self._abort or self._woken, timeout=self._backoff_s(attempt))
                    self._woken = False
                    if self._abort:
                        return
                    heavy = [i for i in self._queue if i[2] == NEWEST]
                    if heavy and kind not in (KEEP, LIGHT_KEEP):
                        # Move on to the newest snapshot, or to a milestone queued before it:
                        # steps go to storage in order. Why: written after a newer step, a
                        # milestone reached the committer after that step had committed, and
                        # was taken for stale (never committed), or its commit raced the sweep
                        # of the directories below the newer commit. Reports older than the
                        # target are moot; the rest stay queued, in order.
                        self.superseded += 1
                        self._release(payload)
                        newest = heavy[-1]
                        target = next(i for i in self._queue if i[2] in (KEEP, LIGHT_KEEP) or i is newest)
                        before, rest = True, deque()
                        for item in self._queue:  # one pass: reports before it go, the rest stay in order
                            if item is target:
                                before = False
                            elif before and item[2] == REPORT:
                                self._release(item[1])
                            else:
                                rest.append(item)
                        self._queue = rest
                        step, payload, kind = target
                        self._inflight, self._current = step, payload
                attempt += 1
                continue
            except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                self._record_failure(step, exc)
                return
            self._record_success(step, payload, entries)
            return
