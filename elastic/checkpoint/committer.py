"""The controller side of checkpointing: collects every rank's written files per step and, once a step is
complete and its meta is known, writes its manifest in a background thread; retention and GC run on a
thread of their own.

Newer complete steps supersede older waiting ones; pending bookkeeping is bounded.

Why cleanup has its own thread: a retention pass or a sweep of uncommitted directories is a
listing, manifest reads and deletes, and on S3 under load one took 0.05-0.18 s, the first (which
lists what earlier runs left) 1.4 s (2-vCPU VM, moto on loopback), while a step is ~35 ms. Run
after each commit on the commit thread, it held the next commit back. Nothing a commit does
depends on cleanup, and cleanup only ever deletes steps older than ones committed, so they need
not wait for each other. Three alternating rounds of ``checkpoint_overhead.py --skip-raytrain``:
the S3 commit lag's maximum went from 19/20/24 steps to 4/6/7 (its p95, 2/3/4 against 3/3/4,
is set elsewhere), file's p95 from 2/2/2 to 1/1/2 and its maximum from 5/4/5 to 2/3/2.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterable

from elastic.checkpoint.persister import AsyncPersister
from elastic.checkpoint.storage import StorageError, StorageUnavailable
from elastic.checkpoint.store import CheckpointStore, CleanupReport, CorruptCheckpoint, FileEntry, is_milestone
from elastic.config import CheckpointConfig

logger = logging.getLogger(__name__)


def _named(entries: Iterable) -> frozenset:
    """The (path, sha256) of the files a commit names (FileEntry records or their dicts)."""
    return frozenset((f.path, f.sha256) for f in map(FileEntry.from_dict, entries))


class CheckpointCommitter:
    """Turns per-rank write reports into committed steps.

    ``add`` and ``set_meta`` return at once; the manifest write runs on one thread, retention and GC
    on another (module docstring).
    """

    # How long rewind() waits for a delete under way (one storage call, normally milliseconds),
    # and how long a suspect step's commit waits for it (on the commit thread, off training's path).
    FENCE_WAIT_S = 2.0
    SUSPECT_WAIT_S = 120.0

    def __init__(self, store: CheckpointStore, config: CheckpointConfig | None = None, *,
                 keep_last: int | None = None, keep_every: int | None = None,
                 latest_committed: int | None = None, retry_min_s: float | None = None,
                 retry_max_s: float | None = None, max_pending_steps: int = 10_000, max_events: int = 256,
                 gc_interval_s: float = 10.0, retention_interval_s: float = 1.0,
                 progress: Callable[[], int] | None = None):
        config = config or CheckpointConfig()
        self.store = store
        self.every_n_steps = config.every_n_steps
        # Blocking mode: every step's commit follows in order; none replaces a waiting one (they
        # queue, a bounded few). Why: there the ranks wait for each write inside the step, so the
        # user asked for every step on storage; a commit that outlasted a step (a slow manifest
        # write) used to be replaced by the next one, and the step it was for never committed.
        self.blocking = config.blocking
        self.keep_last = max(1, config.keep_last if keep_last is None else keep_last)
        self.keep_every = config.keep_every if keep_every is None else keep_every
        # Writes can lag training by many steps (slow storage, fast steps, an outage), and the meta of
        # the step a writer finally persists must still be here: the cap is generous and only a
        # backstop; steps that can no longer complete are pruned as soon as that is known.
        self.max_pending_steps = max_pending_steps
        self._lock = threading.Lock()
        self._reports: dict[int, dict] = {}  # step -> {"world_size": w, "ranks": {rank: [FileEntry]}}
        self._metas: dict[int, dict] = {}
        self._latest = latest_committed
        # The step this run (re)started from. Committed steps above it on storage belong to a
        # timeline this run left: steps resume skipped as corrupt, or steps a restart rolled back
        # past. They neither count toward ``keep_last`` nor are deleted for it (see ``_cleanup``).
        self._base = latest_committed
        # Steps known committed without this committer's commit: the one this run started from,
        # and each a restore loaded (``rewind(restored=True)``). Not ``_base``, which a rollback
        # moves to a step that may never have been written (``_newest_known_at_or_below``).
        self._restored_from: set[int] = {latest_committed} if latest_committed is not None else set()
        self._above_base: list[int] = []  # those steps, as found on storage (see _cleanup)
        # The newest step training is known to have finished: a commit's lag is measured against
        # it at the moment of the commit.
        self._progress = progress or (lambda: 0)
        self._submitted: int | None = None  # newest step handed to the commit thread
        # keep_every milestones. A milestone's parts may come in after a newer step's (the ranks
        # that pool their parts report each step from whichever rank finished it last, and Ray
        # does not order two senders' calls), and a newer step does not supersede a milestone:
        # retention promised it. So a milestone newer than the newest one handed to the commit
        # thread (_milestone_floor) is neither pruned nor stale, and its directory is no sweep's,
        # until a newer milestone is handed over (a milestone that never completes, a rank lost
        # before it wrote its part, then goes as any incomplete step does. That holds because a
        # rank's parts of milestones come from one sender, in order: the rank itself, never
        # through the group's pool (WorkerCheckpointer.snapshot), or its node's agent; so by then
        # its parts of older ones are in). Those handed over and
        # not yet on storage (_milestones_in_flight) are no sweep's either.
        self._milestone_floor = self._milestone_at_or_below(latest_committed)
        self._milestones_in_flight: set[int] = set()
        # Its own lock, taken last (never holding it while taking another): the persister lets go
        # of a payload (_let_go) also inside submit, which add() calls under self._lock.
        self._flight_lock = threading.Lock()
        # The step the commit thread is writing the manifest of: on storage, a listing may see it
        # before it is in ``_done`` (see _cleanup).
        self._committing: int | None = None
        # Timelines: every rewind() starts a new one. A commit handed to the commit thread before a
        # rewind may run (or finish) after it; ``_rewinds[t:]`` are the steps training went back
        # to since timeline ``t`` (None: the start), so such a commit knows whether its step is
        # still history both timelines share or state training threw away (``_left_behind``).
        self._rewinds: list[int | None] = []
        # rewind()s the cleanup thread has not applied yet, with the commits they left behind
        # (see rewind: it does not wait for a pass that holds the cleanup lock).
        self._pending_rewinds: list[tuple[int | None, list[int], bool]] = []  # (step, abandoned, restored)
        # Steps whose manifest a rewind left behind on storage, or may have: a commit that
        # landed after the rewind, or one that failed and so may or may not have landed. The
        # cleanup thread puts them with the steps above the base.
        self._left_on_storage: list[int] = []
        # Every step this run left on storage on a timeline it went back from: commits a rewind
        # abandoned or that landed after it, committed steps it rolled back past (its own, or
        # those it started from), deletes it had decided on and a rewind called off.
        # Passes delete them once the run commits past them; the run's end (close) deletes the
        # ones newer than its newest committed step (_delete_left_behind). Kept apart from
        # _above_base, which also holds earlier runs' steps (not this run's to delete) and drops
        # a step a later rewind goes back above.
        self._left_here: set[int] = set()
        # Steps whose manifest write failed: it may still have landed (an S3 PUT whose reply was
        # lost), and once a newer commit supersedes the step this committer cannot know whether
        # it is on storage. The cleanup thread reads the manifests of those below _latest (_confirm).
        # Each with the files that commit named, (path, sha256): a manifest of that step found
        # then is this commit's only if it names the same files (see _confirm).
        self._unconfirmed: dict[int, frozenset] = {}
        # Later steps a delete from before a rewind was still removing when the rewind returned
        # (see rewind): their commits wait for it and check their files first.
        self._suspect: set[int] = set()
        # Why this committer writes and deletes nothing more (``halt``), or None.
        self._halted: str | None = None
        # Whether storage is this run's to write now (``RunLease.current``): while False,
        # manifests and deletes wait (``gate``). None: always.
        self._gate: Callable[[], bool] | None = None
        self._events: deque = deque(maxlen=max_events)
        self._committed: list[int] | None = None  # committed steps on storage, as the cleanup thread knows them
        self._files: dict[int, list[str]] = {}  # step -> its files, for the steps this committer committed
        self._done: list[tuple[int, list[str]]] = []  # commits the cleanup thread has not taken in yet
        self.gc_interval_s = gc_interval_s
        self._last_gc = float("-inf")
        self.retention_interval_s = retention_interval_s
        self._last_retention = float("-inf")
        self._cleanup_lock = threading.Lock()  # a cleanup pass, or rewind()
        self._holds = 0  # holding_steps(): while above 0, cleanup passes delete nothing
        # The cleanup thread's schedule: woken by commits; flush() asks for a forced pass (one
        # that starts after the ask) and waits for it, at most as long as flush's timeout allows.
        self._cleanup_cv = threading.Condition()
        self._cleanup_due = False
        self._cleanup_stop = False
        self._forced_asked = 0
        self._forced_done = 0
        # reached_storage: a step a rewind left behind is returned with no entries, no request
        # made; taken as a success, it ended an outage ("storage is back") with storage still down.
        self._persister = AsyncPersister(self._commit, name="checkpoint commit",
                                         retry_min_s=retry_min_s, retry_max_s=retry_max_s, max_events=max_events,
                                         keep_done=False, reached_storage=bool, on_release=self._let_go,
                                         # Blocking mode hands every step over as a light payload,
                                         # each to be committed in order: with the default bound of
                                         # 32 a commit thread behind by more (an outage's backoff, a
                                         # suspect step's wait) dropped the oldest steps' commits.
                                         # A commit is a step number and its records: small.
                                         max_light=max_pending_steps)
        # Now, not at the first step's commit: add() hands a step over under self._lock, which
        # _commit takes too, so the persister's fallback for a thread that cannot start (writing
        # inline, in the caller's thread) would wait on that lock forever. A process at its thread
        # limit fails here, at set-up, as the cleanup thread below does.
        self._persister.start()
        self._cleanup_thread = threading.Thread(target=self._cleanup_loop, name="elastic-checkpoint cleanup",
                                                daemon=True)
        try:
            self._cleanup_thread.start()
        except BaseException:
            self._persister.abort()  # no committer to close it: its commit thread would stay
            raise

    # ---- reports ----------------------------------------------------------------------------
    def add(self, step: int, rank: int, world_size: int, entries: Iterable[FileEntry | dict],
            taken_at: float | None = None, rng: dict | None = None) -> None:
        """Rank ``rank`` of ``world_size`` finished writing ``entries`` for ``step``, whose snapshot it
        took at ``taken_at`` (wall clock; the commit event then says how long the step took to persist).
        A rank that wrote no file (no share of a small state) reports no entries and its ``rng``."""
        files = [FileEntry.from_dict(e) for e in entries]
        with self._lock:
            if self._is_stale(step):
                return
            record = self._reports.get(step)
            if record is None or record["world_size"] != world_size:
                if record is not None:
                    # Reports from two world sizes cannot form one checkpoint (the sharding differs);
                    # the newest world size is the one still training.
                    logger.warning("step %d: report from world size %d replaces reports from world size %d",
                                   step, world_size, record["world_size"])
                record = {"world_size": world_size, "ranks": {}}
                self._reports[step] = record
            record["ranks"][rank] = files
            if not files:
                record.setdefault("rng", {})[rank] = rng
            if taken_at is not None:
                record["taken_at"] = min(taken_at, record.get("taken_at", taken_at))
            if not is_milestone(self.keep_every, step):
                # A milestone's report says nothing of the steps before it: a rank never skips a
                # milestone, and reports it on its own while its parts of older steps may still
                # wait in the group's pool for a slower rank's (WorkerCheckpointer.snapshot).
                self._prune_skipped(step, rank)
            self._bound(self._reports)
            self._maybe_submit(step)

    def set_meta(self, step: int, meta: dict, force: bool = False) -> None:
        """The controller's data for ``step`` (data position, etc.); stored in the manifest.
        ``force``: a step ``every_n_steps`` skips that the ranks write all the same (the last)."""
        if self.every_n_steps > 0 and step % self.every_n_steps and not force:
            return  # not a checkpoint step: no rank will write it
        with self._lock:
            if self._is_stale(step):
                return
            self._metas[step] = dict(meta)
            self._bound(self._metas)
            self._maybe_submit(step)

    def rewind(self, step: int | None, restored: bool = False) -> None:
        """Training restarted from ``step``: forget reports and metas of later steps (their state
        is gone). A commit of a later step that is waiting is dropped, and one being written when
        this is called does not count as committed when it lands (``_commit``). ``restored``:
        ``step`` is a committed step a restore loaded, so the newest committed step is at least
        ``step``. Why: a restore can load a step whose manifest landed after an earlier rewind
        went back past it (left behind), and the newest committed step (the lag, the failure
        message's "latest committed checkpoint") stayed the older one until the next commit.

        Returns without waiting for a cleanup pass under way: a recovery rewinds right after a
        flush whose timeout let such a pass go on (a listing of storage that does not answer,
        which the store retries for minutes), and must not wait for it here instead. The pass
        holding the cleanup lock, or the next one, applies the rewind before anything else it
        does (``_apply_rewinds``); every delete happens in a pass, so none can come first."""
        later = lambda s: step is None or s > step  # noqa: E731
        with self._lock:
            # Restored steps past ``step`` are another timeline's (a restore of 100, then one of 90
            # found 100 corrupt): kept, a later rollback took 100 for committed, as _done's and
            # _committed's later steps are dropped below for the same reason.
            self._restored_from = {s for s in self._restored_from if not later(s)}
            if restored and step is not None:
                self._restored_from.add(step)
            for table in (self._reports, self._metas):
                for s in [s for s in table if later(s)]:
                    del table[s]
            if later(self._milestone_floor):  # the milestones up to the step gone back to were handed over
                self._milestone_floor = self._milestone_at_or_below(step)
            with self._flight_lock:
                self._milestones_in_flight = {s for s in self._milestones_in_flight if not later(s)}
            if self._submitted is not None and later(self._submitted):
                self._submitted = step
            if self._latest is not None and later(self._latest):
                # Later steps will be written again and committed over the old ones. The newest
                # committed step is now the newest at or below ``step`` this committer knows of:
                # ``step`` itself for a restore (it loaded its manifest), not for a rollback (a
                # first-N replica's state: step 15 with every_n_steps=10 was never written, and
                # the failure message, lag() and result's checkpoint said 15 where a resume
                # starts from 10). Lower than it may be is safe: the sweep deletes less.
                self._latest = step if restored else self._newest_known_at_or_below(step)
            elif (restored and step is not None and self._latest is not None and step > self._latest
                  and (self._submitted is None or self._submitted <= self._latest)):
                # Not before this run's first commit (flush() cleans up after one), nor while a
                # commit of a step between the two is on its way: the sweep takes every step
                # below the newest committed one for done, and would delete that one's files.
                self._latest = step
            self._rewinds.append(step)
            # Commits the cleanup thread has not taken in: later ones left this timeline too, and
            # so did failed ones (they may have landed) of later steps.
            abandoned = [s for s, _ in self._done if later(s)] + [s for s in self._unconfirmed if later(s)]
            self._done = [(s, files) for s, files in self._done if not later(s)]
            self._unconfirmed = {s: f for s, f in self._unconfirmed.items() if not later(s)}
            self._pending_rewinds.append((step, abandoned, restored))
        # No delete of a pass that began before this rewind starts after it (its picture of
        # storage is the old timeline's), and one under way is given FENCE_WAIT_S to finish.
        # One still running after that is a suspect: it may yet remove the directory of a later
        # step that training now writes again, so that step's commit first checks its files.
        still = self.store.fence(self.FENCE_WAIT_S)
        if still:
            with self._lock:
                self._suspect.update(s for s in still if later(s))
        if self._cleanup_lock.acquire(blocking=False):
            try:
                self._apply_rewinds()
            finally:
                self._cleanup_lock.release()

    def _apply_rewinds(self, taken: tuple[list, list] | None = None) -> None:
        """The cleanup side of ``rewind``, under the cleanup lock: the new base, and the steps of
        the timeline training left moved above it (``_take_in``). ``taken``: the pending rewinds
        and left-behind steps, taken from under the lock by the caller (``_take_rewinds``)."""
        if taken is None:
            with self._lock:
                taken = self._take_rewinds()
        pending, left = taken
        for step, abandoned, restored in pending:
            self._base = step
            # The step gone back to, when another timeline's manifest of it is on storage (above
            # the base, or left behind since the last pass): a restore took that manifest (it
            # checked out), so it is this timeline's from now on, counted, and retention deletes
            # it in its turn. A rollback (a first-N replica's state) goes on from state that
            # manifest does not hold, whose files may have been written again since: it stays
            # above the base, deleted once passed. Left out of both lists, either stayed on
            # storage for the rest of the run.
            above = step is not None and (step in self._above_base or step in left)
            adopted = restored and above
            if adopted:
                left = [s for s in left if s != step]
            later = lambda s: step is None or s > step  # noqa: E731
            # What this rewind leaves behind (not the _above_base steps past it: earlier runs' too).
            gone = {s for s in (self._committed or []) + abandoned if later(s)} | (
                {step} if above and not restored else set())
            self._above_base = sorted({s for s in self._above_base if later(s)} | gone)
            if self._committed is not None:
                self._committed = [s for s in self._committed if not later(s)]
                self._files = {s: f for s, f in self._files.items() if not later(s)}
                if adopted and step not in self._committed:
                    self._committed = sorted(self._committed + [step])
            # A later step whose delete was still to come (scheduled once passed, or failed and
            # waiting for its retry) is on storage yet: above the base again, deleted once passed
            # or committed over. Only forgotten, it was tracked nowhere and stayed for the rest of
            # the run (its manifest over files this timeline wrote again).
            waiting = self.store.forget_deletes_above(step)
            self._above_base = sorted(set(self._above_base) | set(waiting))
            # A delete this run had decided on (passed, retention's) is this run's to finish.
            self._left_here |= gone | set(waiting)
            if adopted:
                self._left_here.discard(step)
        # After the rewinds: these landed above the step the newest one went back to.
        self._above_base = sorted(set(self._above_base) | set(left))
        self._left_here |= set(left)

    def _newest_known_at_or_below(self, step: int | None) -> int | None:
        """The newest step known committed at or below ``step``: this run's commits (taken in
        by a cleanup pass or not yet) and the step it started from. Call under ``_lock``."""
        if step is None:
            return None
        known = [s for s, _ in self._done] + list(self._committed or []) + list(self._restored_from)
        return max((s for s in known if s <= step), default=None)

    def _take_rewinds(self) -> tuple[list, list]:
        """The rewinds no pass has applied yet and the steps left behind. Call under ``_lock``."""
        pending, self._pending_rewinds = self._pending_rewinds, []
        left, self._left_on_storage = self._left_on_storage, []
        return pending, left

    def _left_behind(self, step: int, timeline: int) -> bool:
        """Whether a rewind since ``timeline`` went back before ``step``: its state is not this
        timeline's. Call under the lock."""
        return any(r is None or step > r for r in self._rewinds[timeline:])

    def _milestone_at_or_below(self, step: int | None) -> int:
        """The newest milestone at or below ``step`` (-1: none, or no milestones)."""
        return -1 if step is None or self.keep_every <= 0 else step // self.keep_every * self.keep_every

    def _awaited(self, step: int) -> bool:
        """A milestone no newer one has superseded yet: its parts may still come (see __init__)."""
        return step > self._milestone_floor and is_milestone(self.keep_every, step)

    def _is_stale(self, step: int) -> bool:
        if self._awaited(step):
            return False
        return (self._submitted is not None and step <= self._submitted) or (
            self._latest is not None and step <= self._latest)

    def _prune_skipped(self, step: int, rank: int) -> None:
        """A rank writes its steps in order and skips superseded ones, so once it reports ``step``, every
        older pending step it has not reported can never complete. Not a milestone: a rank never
        skips one, and its report (each rank's own) can come after a newer step's pooled one."""
        for table in (self._reports, self._metas):
            for s in [s for s in table if s < step and not self._awaited(s)]:
                record = self._reports.get(s)
                if record is None or rank not in record["ranks"]:
                    table.pop(s, None)

    def _bound(self, table: dict) -> None:
        while len(table) > self.max_pending_steps:
            oldest = min(table)
            del table[oldest]
            logger.debug("dropping pending checkpoint bookkeeping for step %d (too many pending)", oldest)

    def _maybe_submit(self, step: int) -> None:
        record = self._reports.get(step)
        if record is None or step not in self._metas:
            return
        world_size = record["world_size"]
        if set(record["ranks"]) != set(range(world_size)):
            return
        entries = [e for rank in sorted(record["ranks"]) for e in record["ranks"][rank]]
        meta = self._metas[step]
        if is_milestone(self.keep_every, step):
            self._milestone_floor = max(self._milestone_floor, step)
            with self._flight_lock:
                self._milestones_in_flight.add(step)
        # Every rank writes in step order, so an older step that is still incomplete now never will be
        # (but for a milestone no newer one superseded, whose parts may yet come: see __init__).
        for table in (self._reports, self._metas):
            for s in [s for s in table if s == step or (s < step and not self._awaited(s))]:
                del table[s]
        self._submitted = step if self._submitted is None else max(self._submitted, step)
        # A step retention is to keep (keep_every) is never replaced by a newer one while its
        # manifest waits: replaced, it stayed on storage without one, the sweep deleted it as
        # uncommitted, and the milestone never existed. Blocking mode replaces nothing.
        self._persister.submit(step, (step, entries, world_size, meta, record.get("taken_at"), record.get("rng"),
                                      len(self._rewinds)), light=self.blocking, keep=is_milestone(self.keep_every, step))

    # ---- the commit thread ------------------------------------------------------------------
    def _let_go(self, payload: tuple) -> None:
        """The persister is done with a step's commit (on_release): committed, given up on
        (not this timeline's, its files gone, a bug), or dropped (close, abort). A milestone's
        directory is then no longer kept from the sweep for it (see __init__)."""
        with self._flight_lock:
            self._milestones_in_flight.discard(payload[0])

    def _commit(self, payload: tuple[int, list[FileEntry], int, dict, float | None, dict | None, int]
                ) -> list[FileEntry]:
        step, entries, world_size, meta, taken_at, rng, timeline = payload
        t0 = time.perf_counter()
        with self._lock:
            suspect = step in self._suspect
        if suspect and not self._files_survived(step, entries):
            return []
        if self._halted is None and self._gate is not None and not self._gate():
            # Retried by the persister as an outage is (the newest step replacing this one),
            # until a renewal of the lease says whether this run still holds storage. Halted (the
            # lease lost: the gate stays closed for good), the step is dropped just below.
            raise StorageUnavailable(f"the manifest of step {step} waits: the run's lease at {self.store.location} "
                                     "has not been renewed lately (storage cut off, or this process was "
                                     "suspended), and another run may have taken it over")
        with self._lock:
            if self._halted is not None:
                logger.info("checkpoint step %d not committed: %s", step, self._halted)
                return []
            if self._left_behind(step, timeline):
                # Handed over before a rewind to an earlier step (waiting, or retried through an
                # outage): its state is gone from training, and its shards are being written again.
                logger.info("checkpoint step %d not committed: training went back to an earlier step", step)
                return []
            self._committing = step
        try:
            self.store.commit(step, entries, world_size, meta, rng=rng)  # StorageError -> the persister retries
        except BaseException:
            with self._lock:
                self._committing = None
                # The manifest may have landed all the same (a reply lost): see _unconfirmed.
                if self._left_behind(step, timeline):
                    self._left_on_storage.append(step)
                else:
                    self._unconfirmed[step] = _named(entries)
            raise
        commit_s = time.perf_counter() - t0
        committed_at = time.time()
        lag = max(0, self._progress() - step)
        nbytes = sum(e.size for e in entries)
        with self._lock:
            self._committing = None  # in the same hold of the lock as the append below (see _cleanup)
            if self._left_behind(step, timeline):
                # A rewind came while this manifest was being written. The step is on storage but
                # not this timeline's: counted by retention (or as _latest) it could take the place
                # of the step training went back to, the newest whole one of this timeline, which
                # keep_last would then delete. It goes above the base, like a newer step a resume
                # skipped: committed over when training gets there again, deleted once passed.
                self._left_on_storage.append(step)
                self._events.append({"event": "checkpoint_left_behind", "step": step, "time": committed_at,
                                     "message": f"step {step}'s manifest landed after training went back to an "
                                                "earlier step; it is written again or deleted"})
                logger.info("checkpoint step %d landed after a rewind past it; not counted as committed", step)
                return entries
            if self._latest is None or step > self._latest:
                self._latest = step
            self._done.append((step, [e.path for e in entries]))
            self._unconfirmed.pop(step, None)  # failed before, landed now (earlier ones: _confirm)
            self._events.append({
                "event": "checkpoint_committed", "step": step, "time": committed_at, "files": len(entries),
                "lag": lag, **({"persist_s": round(committed_at - taken_at, 4)} if taken_at is not None else {}),
                "bytes": nbytes, "commit_s": round(commit_s, 4),
                "message": f"committed step {step} ({len(entries)} files, {nbytes / 1e6:.2f} MB)",
            })
        logger.info("committed checkpoint step %d to %s (%d files, %.3fs)", step, self.store.location,
                    len(entries), commit_s)
        with self._cleanup_cv:
            self._cleanup_due = True
            self._cleanup_cv.notify_all()
        return entries

    def _files_survived(self, step: int, entries: list[FileEntry]) -> bool:
        """A suspect step (``rewind``): wait for the old delete, then whether every file the ranks
        reported is still on storage. A manifest naming a deleted file would be a committed step
        that fails its checks on resume; without it the next step commits instead. A storage
        error here is the commit's, retried by the persister."""
        if not self.store.wait_deletes([step], timeout_s=self.SUSPECT_WAIT_S):
            # Still deleting (an outage's retries, a hung mount): checked now, the files could be
            # there and then go, under a manifest naming them, a committed step that is not on
            # storage. Raised as the commit's storage error: the step stays suspect, and the
            # persister tries it again (or a newer step supersedes it).
            raise StorageUnavailable(f"step {step}: a delete from before training went back to an earlier step "
                                     f"is still removing its directory after {self.SUSPECT_WAIT_S:g}s")
        missing = self.store.missing_file(step, entries)
        with self._lock:
            self._suspect.discard(step)
            if missing is not None:
                self._events.append({"event": "checkpoint_not_committed", "step": step, "time": time.time(),
                                     "path": missing,
                                     "message": f"step {step} not committed: {missing} was removed by a cleanup "
                                                "from before training went back to an earlier step"})
        if missing is not None:
            logger.warning("checkpoint step %d not committed: %s was removed by a cleanup from before the "
                           "rewind", step, missing)
        return missing is None

    # ---- the cleanup thread -----------------------------------------------------------------
    @contextmanager
    def holding_steps(self):
        """No committed step is deleted while this is held: retention and the sweep wait, and run
        once it is released. For a restore in the middle of a run (a restart, ranks restored
        from storage). Why: it lists the committed steps and then reads the newest for seconds
        (gigabytes on S3), while the parts of later steps still land; a step committed meanwhile
        let retention delete the one being read (with ``keep_last`` of 1 or 2, at once), the read
        found a file missing, took the step for corrupt, fell back to older steps already
        deleted, and the run started over from step 0. Taken after a pass under way ends."""
        with self._cleanup_lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._cleanup_lock:
                self._holds -= 1
            with self._cleanup_cv:
                self._cleanup_due = True
                self._cleanup_cv.notify_all()

    def _cleanup_loop(self) -> None:
        """Retention and GC after commits, off the commit thread (module docstring); each pass
        covers every commit since the last one. Passes stay batched by their intervals, except
        the one flush() asks for."""
        while True:
            with self._cleanup_cv:
                self._cleanup_cv.wait_for(lambda: self._cleanup_due or self._cleanup_stop)
                if self._cleanup_stop:
                    return
                self._cleanup_due = False
                forced = self._forced_asked
            try:
                self._cleanup_pass(force=forced > self._forced_done)
            except Exception:  # noqa: BLE001 - _cleanup never raises; nothing else may end this thread
                logger.exception("checkpoint cleanup pass failed; the next commit retries it")
            finally:
                with self._cleanup_cv:
                    self._forced_done = forced  # only this thread sets it, and asks only grow
                    self._cleanup_cv.notify_all()

    def _cleanup_pass(self, force: bool = False) -> None:
        """One pass (``_cleanup``), its deletes, failed deletes and skipped cleanups into the event log."""
        retention, gc = self._cleanup(force)
        now = time.time()
        with self._lock:
            for report, what in ((retention, "deleted checkpoint steps {} (retention)"),
                                 (gc, "removed uncommitted step directories {}")):
                if report.deleted:
                    self._events.append({"event": "checkpoint_deleted", "time": now, "deleted": sorted(report.deleted),
                                         "message": what.format(sorted(report.deleted))})
            for failed_step, error in {**retention.failed, **gc.failed}.items():
                self._events.append({"event": "checkpoint_delete_failed", "step": failed_step, "time": now,
                                     "error": error[:300],
                                     "message": f"could not delete step {failed_step} (will retry): {error[:300]}"})
            for error in (retention.error, gc.error):
                if error:
                    self._events.append({"event": "checkpoint_cleanup_failed", "time": now, "error": error[:300],
                                         "message": f"checkpoint cleanup skipped (will retry): {error[:300]}"})

    def _retain(self, epoch: int, force: bool = False) -> CleanupReport:
        """Retention from the committer's own list of committed steps, at most every
        ``retention_interval_s`` unless ``force``. Why batched: with short steps a delete after
        every commit is two requests a step on S3 (manifest, then files), which on the benchmark
        workload against moto cost ~20 ms of CPU a step (client and server) for what one bulk
        request per second does. Between passes up to a second's worth of steps beyond
        ``keep_last`` stay on storage; ``flush()`` (end of training, before a recovery) always
        runs a pass, so what is left afterwards is exactly what retention promises."""
        now = time.monotonic()
        if self._committed is None or not (force or now - self._last_retention >= self.retention_interval_s):
            return CleanupReport()
        self._last_retention = now
        retention = self.store.apply_retention(self.keep_last, self.keep_every, committed=self._committed,
                                               files=self._files, epoch=epoch)
        if retention.deleted:  # a failed delete stays on the list: the store retries it next time
            self._committed = [s for s in self._committed if s not in retention.deleted]
            kept = set(self._committed)
            self._files = {s: f for s, f in self._files.items() if s in kept}
            with self._lock:
                # A restored step deleted is no longer known committed: kept, a rollback below
                # the newest commit (rewind) took it for the newest committed step, and the
                # run's failure message and result named a step no longer on storage.
                self._restored_from -= set(retention.deleted)
        return retention

    def _take_in(self, on_storage: list[int]) -> None:
        """Split the committed steps found on storage: those at or below the step this run started
        from are ``_committed``, which retention counts and deletes; the newer ones are
        ``_above_base``. Why the newer ones are not counted: resume skips a newer step whose files fail their
        checksums, and a restart can roll back past newer steps; counted by step number they
        would hold ``keep_last``'s places, and every step this run commits below them would be
        deleted as it commits (with ``keep_last=1``, all of them). This run writes those step
        numbers again and commits over them, or deletes them once it commits past them (``_cleanup``)."""
        above = [s for s in on_storage if self._base is None or s > self._base]
        self._above_base = above
        self._committed = [s for s in on_storage if s not in above]

    def _cleanup(self, force: bool = False) -> tuple[CleanupReport, CleanupReport]:
        """Take in the commits since the last pass, then retention (``_retain``) and the
        storage-wide sweep for uncommitted directories (torn or superseded writes) below the
        newest committed step, each batched by its interval unless ``force``. Why batched:
        listing storage and reading every manifest after each commit costs more than the commit
        itself when steps are short (on S3, several HTTP requests a step). Never raises: the
        steps are committed, and a cleanup failure must not undo that; it comes back as the
        retention report's ``error`` and the next pass retries."""
        try:
            with self._cleanup_lock:
                if self._halted is not None or (self._gate is not None and not self._gate()):
                    return CleanupReport(), CleanupReport()  # a gate closed: the next commit asks again
                if self._holds:
                    # A restore is reading a committed step (holding_steps): nothing is taken in
                    # or deleted now; the release asks for the pass again.
                    return CleanupReport(), CleanupReport()
                epoch = self.store.epoch()  # before the rewinds are applied: rewind() fences after queueing its own
                self._apply_rewinds()
                first = self._committed is None
                if first:  # once: steps from earlier runs
                    self._take_in(self.store.committed_steps())
                # After the listing, so that a failed one leaves the commits for the next pass, and
                # every commit of this run it saw is among them or committed after them (then
                # _latest is below it, and it is not "passed" below before the next pass takes it).
                with self._lock:
                    done, self._done = self._done, []
                    # pending: steps still being written, and milestones until their manifest lands
                    # (their parts may come after a newer step's: see __init__)
                    step = self._latest
                    with self._flight_lock:
                        pending = set(self._reports) | self._milestones_in_flight
                    pending |= {s for s in self._metas if self._awaited(s)}
                    committing = self._committing
                    # Rewinds since this pass began, with the commits: they go first. Why: a
                    # rewind removes the later commits waiting in _done (its abandoned ones), so
                    # every commit in ``done`` is of the timeline after each of these rewinds. Left
                    # to the next pass, a rewind was applied to commits this pass took in, the new
                    # timeline's steps above the step it went back to, and they were deleted as
                    # passed (a run ended with steps 2, 3 and 6 of 6, keep_last=3).
                    rewinds = self._take_rewinds()
                self._apply_rewinds(rewinds)
                # This run's own commits, listed or committed over a step of an abandoned timeline,
                # are not above the base: they are this run's, and retention counts them.
                mine = {s for s, _ in done}
                self._above_base = [s for s in self._above_base if s not in mine]
                self._left_here -= mine
                # A step whose manifest the commit thread wrote while the listing ran, and has not
                # put in _done yet, is in the listing but not in ``done``: it is ``committing``
                # (cleared under the lock in the same hold as the append). It stays above the base
                # until the next pass takes it in (its commit may yet fail, and a step of that
                # number from an earlier timeline would then still be there), but it is no
                # earlier run's step to warn about.
                foreign = [s for s in self._above_base if s != committing]
                if first and foreign:
                    logger.warning("checkpoint steps %s on storage are newer than step %s this run started from; "
                                   "retention leaves them until this run commits past them", foreign, self._base)
                for s, files in done:
                    self._files[s] = files
                    if s not in self._committed:
                        self._committed.append(s)
                self._confirm()
                self._committed.sort()
                if step is None:
                    return CleanupReport(), CleanupReport()
                # Steps of the timeline this run left, now older than a step it committed: the
                # newer one supersedes them (and resume had skipped them, or rolled back past
                # them), so they go with the next retention pass. Without this a run that never
                # commits their exact numbers again (another every_n_steps) left them for good.
                # Not one being written again now (a milestone this run commits late: pending).
                passed = [s for s in self._above_base if s < step and s not in pending]
                if passed:
                    self._above_base = [s for s in self._above_base if s >= step]
                    self._left_here -= set(passed)
                    self.store.schedule_deletes(passed)
                retention = self._retain(epoch, force)
                # Steps known committed (and kept by retention) are never the sweep's, whatever
                # one manifest read says: a read that answers "not found" for a step this run
                # committed (an object store's lagging read, a cache) made the sweep delete a
                # step retention had promised to keep.
                return retention, self._sweep(step, pending | set(self._committed), epoch, force)
        except Exception as exc:  # noqa: BLE001
            logger.exception("checkpoint cleanup failed (retention and GC retry on the next pass)")
            return CleanupReport(error=f"{type(exc).__name__}: {exc}"), CleanupReport()

    def _confirm(self) -> None:
        """Steps whose commit failed and a newer one superseded (``_unconfirmed``): one whose
        manifest landed all the same is committed, and retention counts it like any other;
        without this it stayed on storage until the next run's first listing, past
        ``keep_last``. One that did not land is left to the sweep. A read that fails is tried
        again on the next pass.

        A manifest found is this commit's only if it names the files this commit named. Why: after
        a rewind, the step's manifest of the timeline left behind still checks out; taken for
        this commit's, a step whose files the new timeline rewrote (so resume finds it corrupt)
        took a ``keep_last`` place, and retention deleted a good older step for it. Such a step
        goes with the steps a rewind left on storage (deleted once passed)."""
        with self._lock, self._flight_lock:
            # Not a milestone the persister still retries: a newer step does not settle it (see __init__).
            steps = {s: f for s, f in self._unconfirmed.items() if self._latest is not None and s < self._latest
                     and s not in self._milestones_in_flight}
            for s in steps:
                del self._unconfirmed[s]
            timeline = len(self._rewinds)
        retry, foreign = {}, []
        for s, named in steps.items():
            try:
                manifest = self.store.load_manifest(s)
            except (FileNotFoundError, CorruptCheckpoint):
                continue
            except (StorageError, OSError) as exc:
                logger.warning("could not read checkpoint step %d's manifest to see whether its failed commit "
                               "landed (will retry): %s", s, exc)
                retry[s] = named
                continue
            if _named(manifest.get("files", [])) != named:
                logger.info("checkpoint step %d's commit had failed, and the manifest on storage names other files "
                            "(an earlier timeline's): not this run's commit", s)
                foreign.append(s)
                continue
            logger.info("checkpoint step %d's commit had failed, but its manifest is on storage and checks out", s)
            if s not in self._committed:
                self._committed.append(s)
        if retry or foreign:
            with self._lock:
                # A step a rewind since went back past is that timeline's: put back for another
                # read, it escaped the rewind (which forgets the later unconfirmed steps), and a
                # later read would find its old manifest naming the same files, though the new
                # timeline may have written them again, and count it for a keep_last place.
                gone = [s for s in retry if self._left_behind(s, timeline)]
                self._unconfirmed.update({s: f for s, f in retry.items() if s not in gone})
                self._left_on_storage.extend(foreign + gone)

    def _sweep(self, older_than: int, pending: set, epoch: int, force: bool = False) -> CleanupReport:
        """Remove uncommitted directories older than ``older_than`` (a committed step), at most
        every ``gc_interval_s`` unless ``force``; ``pending`` steps (still being written, or known
        committed) are left alone. Safe
        below a committed step: every rank writes its steps in order and was done with them
        before that step could commit, so none of them is still being written or can commit."""
        now = time.monotonic()
        if not (force or now - self._last_gc >= self.gc_interval_s):
            return CleanupReport()
        self._last_gc = now
        return self.store.gc_uncommitted(older_than=older_than, keep=pending, epoch=epoch)

    # ---- status -----------------------------------------------------------------------------
    def takes_parts(self, step: int) -> bool:
        """Whether a part of ``step`` handed over now would count (not stale: a newer step has
        not committed, or it is a milestone still awaited)."""
        with self._lock:
            return not self._is_stale(step)

    def holds(self, step: int, rank: int) -> bool:
        """Whether ``rank``'s part of ``step`` is in, or ``step`` needs no more parts (it was
        handed to the commit, or a newer step was)."""
        with self._lock:
            if self._is_stale(step):
                return True
            record = self._reports.get(step)
            return record is not None and rank in record["ranks"]

    @property
    def latest_committed(self) -> int | None:
        with self._lock:
            return self._latest

    def lag(self, current_step: int) -> int:
        """How many steps of training would be lost if everything failed now."""
        latest = self.latest_committed
        return max(0, current_step - (latest if latest is not None else 0))

    @property
    def in_outage(self) -> bool:
        return self._persister.in_outage

    def drain_events(self) -> list[dict]:
        """Commits, storage outages (start/end), failed deletes; oldest first. Never carries credentials."""
        with self._lock:
            own = list(self._events)
            self._events.clear()
        events = own + self._persister.drain_events()
        return sorted(events, key=lambda e: e.get("time", 0.0))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every complete step handed over so far is committed (or superseded), then
        apply retention and sweep uncommitted directories now (both are batched while training
        runs), so a finished or stopped run leaves exactly what retention promises. False when
        the steps are not committed within ``timeout_s``; a cleanup pass that outlasts it goes on
        in the background (a ``checkpoint_cleanup_late`` event) and the answer is still True."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._persister.flush(timeout_s):
            return False
        with self._lock:
            if self._latest is None:  # nothing committed by this run: nothing of it to clean up
                return True
        if not self._cleanup_thread.is_alive():  # closed: the pass runs here
            self._cleanup_pass(force=True)
            return True
        # The pass runs on the cleanup thread, and this waits for it no longer than the timeout:
        # a recovery flushes with one, and a pass stuck in a listing on storage that does not
        # answer (the store retries it) must not hold the recovery. It finishes in the background.
        with self._cleanup_cv:
            self._forced_asked += 1
            asked = self._forced_asked
            self._cleanup_due = True
            self._cleanup_cv.notify_all()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._cleanup_cv.wait_for(lambda: self._forced_done >= asked, timeout=left):
                return True
        logger.warning("checkpoint retention and GC still running after flush's %.1fs; they finish in the "
                       "background", timeout_s)
        with self._lock:
            self._events.append({"event": "checkpoint_cleanup_late", "time": time.time(),
                                 "message": f"checkpoint retention and GC still running after {timeout_s:g}s; "
                                            "all steps are committed, and they finish in the background"})
        return True

    def gate(self, current: Callable[[], bool]) -> None:
        """Write manifests and delete only while ``current()`` (``RunLease.current``); a manifest
        waits meanwhile, retried as in an outage, and cleanup passes are put off."""
        self._gate = current

    def halt(self, why: str) -> None:
        """Write and delete nothing more on storage: no manifest (a commit handed over, or being
        retried, is dropped), no retention or sweep, no delete at the end. Why: the run lost its
        storage to another run (``RunLease``), whose steps this run's retention and sweep would
        delete as its own. A delete under way is given ``FENCE_WAIT_S`` to finish
        (``CheckpointStore.fence``); none starts after. A manifest write under way lands, as
        one that had landed a moment before would have."""
        with self._lock:
            if self._halted is not None:
                return
            self._halted = why
            self._events.append({"event": "checkpoint_halted", "time": time.time(),
                                 "message": f"checkpoints stopped: {why}"})
        self._persister.wake()  # a commit waiting out the gate's backoff ends now, not in up to 5 s
        self.store.fence(self.FENCE_WAIT_S)
        logger.warning("checkpoint commits and deletes stopped: %s", why)

    @property
    def halted(self) -> str | None:
        return self._halted

    def close(self, timeout_s: float = 30.0) -> bool:
        done = self._persister.close(timeout_s)
        with self._cleanup_cv:
            self._cleanup_stop = True
            self._cleanup_cv.notify_all()
        self._cleanup_thread.join(timeout_s)
        self._delete_left_behind()
        return done

    def _delete_left_behind(self) -> None:
        """The run's end (``close``, after the final ``flush``): delete the steps this run left on
        storage on a timeline it went back from (``_left_here``) that are newer than the newest
        step it committed. Why: a pass deletes such a step only once the run commits past it, or
        the run commits over it, and a run that ends first left it the newest manifest on
        storage. A stop right after a restore went back to 110, while step 120's manifest landed
        (left behind): the result said step 110, and ``fit()`` again resumed from 120, on the
        history training had thrown away. Not earlier runs' steps above the one this run started
        from (a resume skipped them), nor a step this timeline may have committed (a failed
        commit that may have landed, one still being written): not this run's to delete. A
        delete that fails does not fail the run: the event log has it, and a warning names the
        step ``fit()`` again would resume from."""
        if self._halted is not None:
            return
        # A pass still running after close's join (storage that does not answer) holds the lock:
        # waited for briefly, as rewind() waits for a delete under way.
        if not self._cleanup_lock.acquire(timeout=self.FENCE_WAIT_S):
            logger.warning("checkpoint cleanup still running at close: steps of a timeline this run went back "
                           "from, newer than step %s it committed last, may stay on storage, and fit() again "
                           "would resume from the newest of them", self.latest_committed)
            return
        report, latest, doomed = CleanupReport(), None, []
        try:
            self._apply_rewinds()  # rewinds and left-behind landings since the last pass
            with self._lock:
                latest = self._latest
                keep = set(self._unconfirmed) | self._restored_from | {self._committing}
                doomed = sorted(s for s in self._left_here if (latest is None or s > latest) and s not in keep)
            # The store's own delete (manifest first, then the files), as retention's: a failure
            # leaves the step uncommitted or on its retry list, never half-committed.
            if doomed and self._gate is not None and not self._gate():
                report.failed = {s: "not tried: the run's lease was not renewed lately, and another run may hold "
                                    "the storage now" for s in doomed}
            else:
                report = self.store.delete_steps(doomed)
            self._left_here -= set(report.deleted)
        except Exception:  # noqa: BLE001 - the run ends all the same (close must not raise for this)
            logger.exception("could not delete the checkpoint steps of a timeline this run went back from "
                             "(newer than step %s it committed last)", latest)
        finally:
            self._cleanup_lock.release()
        now = time.time()
        failed = sorted(set(doomed) - set(report.deleted))
        with self._lock:
            if report.deleted:
                self._events.append({"event": "checkpoint_deleted", "time": now, "deleted": sorted(report.deleted),
                                     "message": f"deleted checkpoint steps {sorted(report.deleted)} of a timeline "
                                                f"training went back from, newer than step {latest} it ends on"})
            for step in failed:
                error = report.failed.get(step, "not tried")[:300]
                self._events.append({"event": "checkpoint_delete_failed", "step": step, "time": now, "error": error,
                                     "message": f"could not delete step {step} of a timeline training went back "
                                                f"from, newer than step {latest} the run ends on: {error}"})
        if report.deleted:
            logger.info("deleted checkpoint steps %s of a timeline training went back from, newer than step %s "
                        "the run ends on", sorted(report.deleted), latest)
        if failed:
            logger.warning("could not delete checkpoint steps %s of a timeline training went back from: fit() "
                           "again resumes from step %d if its files check out, not from step %s the run ends "
                           "on (delete the newer steps' directories at %s by hand)", failed, failed[-1],
                           latest, self.store.location)

    def __enter__(self) -> "CheckpointCommitter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
