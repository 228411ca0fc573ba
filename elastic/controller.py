"""The controller: an explicit state machine that drives every step and carries out decisions.

It sends each step to the workers, collects per-rank results, asks the policies what to do, and
acts on the answer: rebuild the ring with spares, shrink, wait for capacity, restart from a
checkpoint, evict a straggler, or fail. Every transition and decision lands in the event log.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable

import ray

from elastic.actors.cluster_fit import check_cluster_fits
from elastic.actors.protocol import CollectiveError, PackedSpec, StepResult, StopRequested, TrainingSpec, WorkerError
from elastic.actors.sends import max_trail
from elastic.actors.worker_group import (Member, PlacementTimeout, WorkerGroup, describe_worker_failure,
                                         unreachable_nodes, wait_refs)
from elastic.checkpoint import shm
from elastic.checkpoint.agent import NodeAgents, given_up, refused_on_node
from elastic.checkpoint.compat import UnsaveableState
from elastic.checkpoint.store import taken_at_here
from elastic.config import ConfigError, FailureConfig, RunConfig, ScalingConfig
from elastic.redact import redact_urls_in
from elastic.data import BatchSchedule, DataPosition, SampleLedger, ShardPlan, epoch_order_digest
from elastic.policies import (
    Continue,
    EvictStraggler,
    Fail,
    FailurePolicy,
    FailureView,
    ReplaceWithSpares,
    RestartFromCheckpoint,
    Shrink,
    StragglerPolicy,
    WaitForCapacity,
)

logger = logging.getLogger(__name__)


class State(enum.Enum):
    SCHEDULING = "scheduling"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    STOPPED = "stopped"  # asked to stop before its last step (Ctrl-C, ``ray job stop``)
    ERRORED = "errored"

    @property
    def is_terminal(self) -> bool:
        return self in (State.FINISHED, State.STOPPED, State.ERRORED)


class TrainingFailed(RuntimeError):
    """The run stopped. The message says why and names the latest committed checkpoint, if any."""


class ReplicaDivergence(TrainingFailed):
    """Replicas that must be identical are not. Never ignored. A TrainingFailed too, so that
    ``except TrainingFailed`` around ``fit()`` still catches every way the run itself gives up
    (the user's own code raising is a ``WorkerError``, a setting a ``ConfigError``)."""


# Event kinds logged every step or every few steps: the log keeps the newest ROUTINE_EVENTS_KEPT
# of each, and every event of any other kind (transitions, decisions, failures, recoveries). Why:
# with a checkpoint every step the commit and retention events alone were ~1 KB a step, and the
# controller grew without end on a long run.
# Kinds that can come every step (or every retention pass) for as long as a run lasts: a state
# that cannot be snapshotted, a bucket that forbids deletes, an agent that keeps dropping.
ROUTINE_KINDS = frozenset({"checkpoint_commit", "checkpoint_retention", "checksum", "checkpoint_failed",
                           "checkpoint_delete_failed", "checkpoint_cleanup_failed", "checkpoint_snapshots_dropped"})
ROUTINE_EVENTS_KEPT = 1000
# A recovery's decision whose carrying out failed on a Ray error with no other rank lost (a GCS
# call refused for a moment) is decided again this many times before the run fails (``_recover``).
REBUILD_RETRIES = 3
# Step records the controller keeps (the newest; ``Result.history``), while the run's totals
# (``RunTotals``) count every step. Why: a record is ~330 bytes in the controller and its dict
# ~400 more in the result (tracemalloc, 4 ranks), so a long run of short steps (40 a second for
# a week: 24M steps) would have grown the controller by ~8 GB and sent it all to the driver.
HISTORY_KEPT = 100_000
# Spares in a row that may fail before they are ready (died building, or built a dataset that
# differs from the ranks') before the controller stops refilling the pool on its own. Why stop:
# a spare that fails for a reason of its node or its dataset_fn fails again the same way, and
# refilling without end would start (and kill) a process every few seconds beside the ranks.
# A spare that becomes ready ends the streak; a recovery that waits for capacity still asks.
SPARE_START_ATTEMPTS = 3
# How often (in steps) the controller looks after the spare pool while ranks train: spares that
# finished building join it, dead ones leave it, and missing ones are asked for.
SPARE_CHECK_EVERY = 10


@dataclass
class Event:
    time: float
    step: int
    kind: str
    message: str
    details: dict = field(default_factory=dict)


@dataclass
class Failure(Exception):
    """Ranks lost during a step, found by the controller's gather."""

    dead: set[int]
    kind: str
    detect_s: float = 0.0
    # The broken window's results from the ranks that returned it before the failure was seen
    # (rank -> its results): a first-N fast rank, or a rank whose call ended before a peer died.
    results: dict = field(default_factory=dict)
    # The refs of the windows queued behind it (the look-ahead): fast first-N replicas may
    # finish one without the lost rank.
    queued: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.kind}: ranks {sorted(self.dead)}"


@dataclass
class StepRecord:
    """One completed step. ``step_time_s``: its wall time as the controller saw it (a window's
    wall split over its steps by the workers' own step times, ``_split_wall``). ``controller_time_s``: the
    controller's busy time for it (dispatch, bookkeeping, policies, checkpoint commits), not
    counting the time it waited on the workers: an equal share of its window's, known once the
    window's bookkeeping is done, so an ``on_step`` callback (called during it) still reads 0.0."""

    step: int
    epoch: int
    loss: float
    step_time_s: float
    controller_time_s: float
    world_size: int
    samples: int
    dropped: int = 0
    ranks: list[int] = field(default_factory=list)
    grad_norm: float | None = None  # the averaged gradient's 2-norm before clipping (with max_grad_norm)
    update_skipped: bool = False  # fp16: the gradient overflowed, so no replica stepped (the loss scale backed off)
    # False for a step kept after a failure whose result no rank still had: its loss is NaN for
    # "unknown", where a True one's NaN is the model's (a diverged run).
    loss_known: bool = True


@dataclass
class RunTotals:
    """Sums over step records, kept exact while the records themselves are trimmed. A step
    with no wall time (kept from before a failure, not timed) counts as a step, not in the rate."""

    steps: int = 0
    timed_steps: int = 0
    time_s: float = 0.0
    timed_samples: int = 0
    dropped: int = 0
    skipped_updates: int = 0

    def add(self, records: list[StepRecord]) -> "RunTotals":
        for h in records:
            self.steps += 1
            self.dropped += h.dropped
            self.skipped_updates += h.update_skipped
            if h.step_time_s > 0:
                self.timed_steps += 1
                self.time_s += h.step_time_s
                self.timed_samples += h.samples
        return self


class Controller:
    """Drives one run. ``worker_group_cls`` is the seam tests use to put in a fake group."""

    worker_group_cls = WorkerGroup
    # How long a rollback waits for the nodes' checkpoint agents to finish writes of the state
    # it gives up (_rewind): one storage call each, normally milliseconds.
    SETTLE_TIMEOUT_S = 30.0
    # How long a flush's second report of a part the rank sent itself waits for that message to be
    # taken in first (_await_push): the checkpoint thread's backlog, normally none.
    PUSH_WAIT_S = 5.0
    # How often a wait for capacity takes in what the storage said meanwhile (_wait_for_spares).
    CAPACITY_LOOK_UP_S = 5.0
    FORM_ATTEMPTS = 3  # rendezvous a group gets while every rank is alive (_form_group)
    JOIN_GRACE_S = 30.0  # a join's wait beyond the group's own timeout, which the worker's join has too

    def __init__(self, spec: TrainingSpec | PackedSpec, scaling: ScalingConfig, run: RunConfig, failure: FailureConfig,
                 global_batch_size: int, checkpoint_store=None, metrics=None, fault_plan: list | None = None,
                 on_step: Callable[[StepRecord, "Controller"], None] | None = None, requeue_dropped: bool = False,
                 batch_schedule: dict[int, int] | None = None):
        self.spec = spec
        self.scaling = scaling
        self.run_config = run
        self.failure_config = failure
        self.global_batch_size = global_batch_size  # step 1's; each step's: self.batches (Trainer.batch_schedule)
        self.batches = BatchSchedule(global_batch_size, batch_schedule)
        self.store = checkpoint_store
        self.metrics = metrics
        self.fault_plan = list(fault_plan or [])
        self.on_step = on_step
        self.state = State.SCHEDULING
        self.events: list[Event] = []
        self._routine_counts: dict[str, int] = {}  # events of each ROUTINE_KINDS kind in self.events
        self._log_lock = threading.Lock()  # log() runs on the step thread and the checkpoint thread
        self.history: list[StepRecord] = []  # the newest HISTORY_KEPT (plus up to a tenth) steps
        self._trimmed = RunTotals()  # the steps trimmed from the history
        self._trimmed_through = 0  # the newest step trimmed
        self._resume_outage: Any = None  # the OutageTracker of the newest resume (see _restore_latest)
        self._lease = None  # the run's storage lease (``_take_lease``), held until the run's end
        # What the run waits on before any rank exists, said in status() (``elastic status``
        # showed "still placing workers" through a lease's watch of up to 30 s): None otherwise.
        self._waiting_for: str | None = None
        self._lease_lost_why: str | None = None  # set by the lease's thread (``_lease_lost``)
        self.ledger = SampleLedger()
        self.failure_policy = FailurePolicy(failure, scaling.num_workers, global_batch_size)
        self.straggler_policy = StragglerPolicy(failure.straggler_factor, failure.straggler_window,
                                                failure.evict_stragglers, failure.straggler_warmup_steps)
        self.group: Any = None
        self.generation = 0
        self.step = 0  # last completed step
        self.failures = 0
        self.recoveries: list[dict] = []
        self.plan: ShardPlan | None = None
        self.committer = None
        self._agents: Any = None  # NodeAgents: the nodes' checkpoint writers (elastic/checkpoint/agent.py)
        self.dataset_size = 0
        self._split = 0  # the ranks a step's global batch is split over (fewer after a shrink)
        # first-N: a late rank's window result, not waited for -> (rank, time it was late from, its steps)
        self._lagging: dict[Any, tuple[int, float, int]] = {}
        self._late_done_at: dict[int, float] = {}  # first-N: when each rank last handed back a late window
        self._checksums: dict[int, dict[int, int]] = {}  # step -> rank -> parameter checksum, until all agree
        self._last_results: dict[int, Any] = {}
        # The newest step each rank has returned (first-N: a late replica's trails the run's).
        self._rank_done: dict[int, int] = {}
        # Each rank's newest computed step time since the group formed, from whichever window
        # brought it (``_note_rank_done``): what the per-rank gauge and `elastic status` show.
        # Why not the last window's results alone: a first-N replica late every window is never
        # among them, so the rank the panel is for showed no step time for the whole run.
        self._step_time_of: dict[int, float] = {}
        # The straggler whose eviction is held back, and why (see _note_held_back).
        self._eviction_held: tuple[int, str] | None = None
        self._env_failure: str | None = None  # a start's runtime-env error, ended on its repeat (_count_start_loss)
        # An eviction decided while the next window was queued on the workers: carried out once
        # that window's results are in (see _after_step).
        self._evict_after_window: EvictStraggler | None = None
        self._spare_failures_in_row = 0  # spares that failed before they were ready (SPARE_START_ATTEMPTS)
        self._refill_stop_logged = False
        # Ranks lost after the last step (the final flush, the end's checksums): left out of the end.
        # Name -> True for one that answered nothing (_stuck_at_end), False for one found dead.
        self._lost_at_end: dict[str, bool] = {}
        self._answered_at_end: list = []
        self._replica_sums: list[int] | None = None  # verify_replicas at the run's end (run_for)
        # Nodes a straggler was evicted from -> time.monotonic() until which spares refilling the
        # pool are kept off them while another node can host one (WorkerGroup.request_spare), so
        # a node that is slow (a throttled GPU, a noisy neighbour) does not get the next spare.
        # For FailureConfig.straggler_node_avoid_s: a neighbour that left frees the node again.
        self._straggler_nodes: dict[str, float] = {}
        self._last_beat: dict[int, float] = {}
        self.restored_from: int | None = None
        self.total_steps = 0
        self._stop_reason: str | None = None  # set from another thread by request_stop()
        self._stop_asked = threading.Event()  # ... and this, which ends the controller's waits early
        self._stopped_while: str | None = None  # what the run was waiting for when a stop ended it
        self._stop_holder: tuple[Member, int] | None = None  # ... and the rank whose weights it hands back
        self._unhealed: tuple[int, ...] = ()  # ranks lost and not yet replaced or shrunk away
        # The end of a recovery's wait for capacity (capacity_timeout_s from its start), kept
        # while its decision is tried again after a Ray error (_recover, REBUILD_RETRIES).
        self._capacity_deadline: float | None = None
        # Members that hold no state of the run (names): spares promoted into a rank (a fresh
        # model) and survivors a shrink stood by as spares (the state from before that). The
        # state sync gives them the state and never takes it, nor a rollback point, from them.
        self._stateless: set[str] = set()
        # A restart from the checkpoint under way (_restart_all): what it saw of the old group (the
        # steps begun, the fast sets) until it is done. A rank of its new group lost before then
        # (its storage check, its restore) restarts it again (_decide_and_apply): the new ranks
        # hold no state, and the state sync's rule for survivors would end the run when nothing
        # is committed yet (no holder, no checkpoint), where the restart goes back to step 0.
        self._restarting: tuple[int, Any] | None = None
        # The newest step a holder of the state reported finished in a recovery pass, past the
        # run's step and not kept yet: if that holder is lost before the pass keeps them, a later
        # pass that restores an older state counts them as recomputed (_sync_state, _restart_all).
        self._held_through = 0
        self._state_sent_to: set[int] = set()  # the ranks the last state sync brought up to date
        # The failure being healed: its broken window's results and its queued windows, read for
        # the steps the state sync keeps (_results_of), once.
        self._arrived: Failure | None = None
        self._snapshot_last = False  # late replicas were released at the end: snapshot the last step again
        self._ended = threading.Event()  # set on the transition into a terminal state
        # Names of the actors the controller killed as hung. Names, not ranks: a spare takes the
        # rank over, and a rank number kept here hid that spare's own hang from _check_late_hung.
        self._hung: set[str] = set()
        self.recomputed = 0  # steps begun on some rank and thrown away by a failure (trained again)
        self.late_gradients = 0  # first-N: gradients a rank computed that came too late to be used
        # Snapshots each worker (by its actor, _actor_key) dropped for want of a free slot in its
        # node's checkpoint agent: its running total as of its newest flush, and its drop events.
        self._snapshot_drops: dict[str, int] = {}  # actor key -> its total at the end's drain
        self._snapshot_drops_told: dict[str, int] = {}  # actor key -> what its drop events said
        self.agreed_steps = 0  # first-N: steps whose fast set was agreed on the store (the rest were known)
        self._planned: dict[int, tuple[int, list[list[int]]]] = {}  # step -> (epoch, shards) handed out
        self._positions: dict[int, dict] = {}  # step -> sampler position right after that step
        # first step of a window -> (refs, ranks, dispatch time, steps in the window)
        self._inflight: dict[int, tuple[list, list[int], float, int]] = {}
        self._window = max(1, self.scaling.steps_per_dispatch)  # steps per call; tuned when automatic
        self._step_times: deque = deque(maxlen=16)
        self._window_typical: float | None = None  # the median step time the window was last tuned by
        self._waited_s = 0.0  # time the current step spent blocked on the workers
        self._last_done = 0.0  # when the newest window's results came in (_window_wall)
        self._last_done_generation = -1  # ... in that group generation
        self._configured: set[str] = set()  # actors with a checkpoint writer
        self._worker_progress = 0  # newest step a rank reported finished with a checkpoint part
        # (generation, through step or None: every step) of each rollback or restore: a part taken
        # in that generation or an older one, of a later step, is dropped (_given_up, _add_part).
        self._given_up_parts: list[tuple[int, int | None]] = []
        self._parts_lock = threading.Lock()  # parts come in on the checkpoint thread, rollbacks on the step thread
        # (step, rank) -> the generation whose snapshot of that step writes the rank's file again
        # after an eviction (_snapshot_after_evict): an older actor's part of it is dropped.
        self._written_again: dict[tuple[int, int], int] = {}
        # rank -> (group generation, step) of the newest part the rank pushed that the
        # checkpoint thread took in (checkpoint_written), for _await_push; its condition.
        self._pushed: dict[int, tuple[int, int]] = {}
        self._pushed_cv = threading.Condition()
        try:  # inside the controller actor: ranks report checkpoint parts straight to it
            self._self_handle = ray.get_runtime_context().current_actor
        except Exception:  # a driver-side controller (tests): reports ride on step results
            self._self_handle = None
        self.requeue_dropped = requeue_dropped

    # ---- event log and state machine ------------------------------------------------------
    def redact(self, text: str) -> str:
        """``text`` without credentials: the storage's (its options' secrets, its URL's userinfo,
        see ``Redactor``), and any URL's userinfo and query string. Everything the run shows
        passes here (events, the log, an error sent back to the driver): the messages come from
        exceptions of any part (a worker, Ray, the storage), and the storage's own are redacted
        already, but nothing else is known to be."""
        storage = getattr(getattr(self, "store", None), "storage", None)
        return storage.redact(text) if storage is not None else redact_urls_in(text)

    def redacted(self, text: Any, limit: int) -> str:
        """``str(text)`` redacted, then cut to ``limit`` characters: in that order, since a URL
        cut inside its user:password@, or a secret cut short, is no longer found, and would
        show the secret's first characters."""
        return self.redact(str(text))[:limit]

    def first_line(self, exc: BaseException, default: str = "") -> str:
        """The first line of ``str(exc)``, redacted whole first (as ``redacted``): a secret of
        several lines (a PEM key in a token dict) is found only whole, and its line alone would
        show."""
        lines = self.redact(str(exc)).splitlines()
        return lines[0] if lines else default

    def log(self, kind: str, message: str, **details) -> None:
        message = self.redact(message)
        details = {k: self.redact(v) if isinstance(v, str) else v for k, v in details.items()}
        with self._log_lock:
            self.events.append(Event(time.time(), self.step, kind, message, details))
            if kind in ROUTINE_KINDS:
                count = self._routine_counts[kind] = self._routine_counts.get(kind, 0) + 1
                if count > ROUTINE_EVENTS_KEPT + ROUTINE_EVENTS_KEPT // 10:
                    self._drop_oldest(kind, count - ROUTINE_EVENTS_KEPT)
        logger.info("[%s] step %d %s: %s", self.run_config.name, self.step, kind, message)

    def _drop_oldest(self, kind: str, n: int) -> None:
        """Let the ``n`` oldest events of a routine kind go (see ROUTINE_KINDS). Done once a tenth
        of the bound has piled up, so the cost per event stays constant."""
        kept = []
        for e in self.events:
            if n and e.kind == kind:
                n -= 1
                self._routine_counts[kind] -= 1
            else:
                kept.append(e)
        self.events = kept

    def transition(self, new: State, reason: str) -> None:
        old = self.state
        self.state = new
        self.log("transition", f"{old.value} -> {new.value}: {reason}", old=old.value, new=new.value)
        self._publish_membership()
        if new.is_terminal:
            if self.metrics is not None:
                self.metrics.close()  # its gauges leave the endpoint (RunMetrics)
            self._ended.set()

    def _publish_membership(self) -> None:
        """The group's size and spare pool to the dashboard (``RunMetrics.on_membership``)."""
        if self.metrics is not None and self.group is not None:
            self.metrics.on_membership(self._world_size, len(self.group.spares), self.group.pending_spares)

    def wait_ended(self, timeout_s: float) -> dict | None:
        """``status()`` once the run has reached a terminal state (its checkpoints are committed
        by then); None if it has not within ``timeout_s``. Why a wait and not polling: the driver
        takes the final weights and ends the controller right after, so a poller can miss the
        final state."""
        return self.status() if self._ended.wait(timeout_s) else None

    # ---- lifecycle --------------------------------------------------------------------------
    def run_for(self, steps: int | None = None, epochs: int | None = None) -> None:
        """Train until ``steps`` steps (or ``epochs`` epochs) are complete, counting resumed ones."""
        try:
            self._schedule()
            if self.store is not None:
                # Once a run, before any rank starts: storage this controller cannot use, or a
                # live run of this name in it, ends the run here (a ConfigError), not after the
                # ranks have started and built their models.
                self._check_storage_here()
                self._take_lease()
            self._start()
            total_steps = steps if steps is not None else self.batches.steps_for_epochs(self.plan.num_samples, epochs)
            self.total_steps = total_steps
            self.transition(State.RUNNING, f"{len(self.group.members)} ranks joined generation {self.generation}; "
                            f"training to step {total_steps}")
            if self.step >= total_steps:
                self.log("resume", f"the run is already at step {self.step}, at or past the {total_steps} asked for: "
                         f"nothing to train (ask for more steps or epochs to continue it)", step=self.step)
            stopping = False  # a requested stop has set its last step
            while self.step < self.total_steps:
                if self._stop_reason is not None and not stopping:
                    self._stop_after_dispatched()
                    stopping = True
                    continue
                self._check_lease()
                before = self.step
                self._run_one_step()
                if stopping and self.step < before:
                    # A heal went back (a restart, or a restore from a checkpoint): the stop's
                    # last step was the newest dispatched before it, and training back up to it
                    # would run past the stop by every step the heal lost (every_n_steps=500: up
                    # to 499, past the driver's stop_timeout_s). End at what the heal restored.
                    self._stop_after_dispatched()
            self._settle_deferred_eviction()  # the run's end came first: named, not carried out
            with self._beating_at_the_end():
                self._finish_late()
                self._finish_checkpoints()
                self._check_lease()  # lost as the run ended: its last commits were not made
                # The replicas' check before the run's terminal state, not in result() after it:
                # wait_ended (``elastic stop``) answered "finished" for a run whose check then
                # failed (ReplicaDivergence), and `elastic stop RUN && next` went on.
                if self.group is not None and self.group.members:
                    self._replica_sums = self.verify_replicas()
            if stopping and self.step < total_steps:
                self.transition(State.STOPPED, f"stopped after step {self.step} of {total_steps} on request: "
                                f"{self._stop_reason}")
            else:
                self.transition(State.FINISHED, f"completed {self.step} steps")
        except StopRequested as stop:
            try:
                self._settle_deferred_eviction()  # named as the run's stopping, not carried out
                self._stop_in_wait(str(stop))
            except BaseException as exc:  # the run must still end: ``elastic stop`` waits for it
                self._errored(exc)
                raise
        except BaseException as exc:
            if isinstance(exc, (WorkerError, UnsaveableState)):
                self._commit_before_user_error(exc)
            self._errored(exc)
            raise
        finally:
            if self.committer is not None:
                self.committer.close()
                # Its close deletes the steps of a timeline the run went back from that are newer
                # than its last commit (or says it could not): into the run's log with the rest.
                try:
                    self._drain_storage_events()
                except Exception:  # noqa: BLE001 - the run's own end (or error) stands
                    logger.exception("could not log the checkpoint events of the run's end")
            if self._lease is not None:
                # After the committer's end (its last commit and deletes were this run's).
                self._lease.release()

    @contextlib.contextmanager
    def _beating_at_the_end(self):
        """The ranks' heartbeats asked every ``heartbeat_interval_s`` while the run's end waits
        (the late replicas, the final flush, the checksums; a stop's flush in a wait, and the one
        before a user's error, each up to ``heartbeat_timeout_s`` a rank), on a thread of their own. Why: the
        steps' waits ask them, and nothing else does; a final flush to slow storage showed every
        rank past ``heartbeat_timeout_s`` in ``elastic status`` and on the heartbeat-age gauge
        (its alert firing) while the run was healthy and still running. A rank that answers
        nothing still ages, as it should. Heartbeats run in each rank's control group, so a rank
        busy with the end's calls answers them."""
        if self.group is None or not self.group.members:
            yield
            return
        done = threading.Event()
        interval = self.failure_config.heartbeat_interval_s

        def beat() -> None:
            while not done.wait(interval):
                try:
                    self._ask_heartbeats_once(min(interval, self.failure_config.heartbeat_timeout_s))
                except Exception:  # noqa: BLE001 - only the gauge and status() read these; the end goes on
                    logger.debug("heartbeats at the run's end failed", exc_info=True)

        thread = threading.Thread(target=beat, name="elastic-end-heartbeats", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=interval + self.failure_config.heartbeat_timeout_s)

    def _ask_heartbeats_once(self, wait_s: float) -> None:
        """Ask every rank not lost for a heartbeat, wait up to ``wait_s`` for the answers, note
        those that came (``_last_beat``), and publish every rank's heartbeat age."""
        members = self._counted_members()
        refs = {m.actor.heartbeat.remote(): m for m in members}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        now = time.time()
        for ref in ready:
            m = refs[ref]
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                continue  # dead: its end's call says so
            if m in self.group.members:  # read at answer time: a released late replica renumbers the rest
                self._last_beat[m.rank] = now
        if self.metrics is not None:
            # Only those still in the group, by their numbers when published (read under the
            # metrics' lock, see on_heartbeats): a late replica released meanwhile
            # (``_finish_late``) kept its old number, and published after the new group's
            # ``on_group`` had forgotten it, a rank that no longer exists aged on the gauge
            # until the run ended (its alert firing at a slow final flush).
            def ages() -> dict[int, float]:
                now_in = [m for m in members if m in self.group.members]
                return {m.rank: now - self._last_beat.get(m.rank, now) for m in now_in}

            self.metrics.on_heartbeats(ages)

    def _commit_before_user_error(self, exc: BaseException) -> None:
        """The user's error ends the run (``WorkerError``, ``UnsaveableState``): the ranks are
        alive and have answered, so what their writers still held of the steps before it (the
        background writer's default) is committed first, as a stop's is. Without this, the
        newest committed step, where ``fit()`` again resumes once the error is fixed, depended
        on how far the writers had got. A failure here is logged: the run ends with the user's
        error, not with this."""
        if self.committer is None or self.group is None:
            return
        try:
            with self._beating_at_the_end():  # as the run's own end: the ranks' heartbeats meanwhile
                self._commit_what_ranks_wrote(None, 30, f"checkpoints of the steps before the {type(exc).__name__}",
                                              lost_ok=True)
        except Exception as failed:  # noqa: BLE001 - the user's error is what the run ends with
            self.log("checkpoint_failed", f"the steps before the {type(exc).__name__} could not be committed: "
                     f"{type(failed).__name__}: {self.redacted(failed, 300)}")

    def _errored(self, exc: BaseException) -> None:
        if not self.state.is_terminal:
            self.transition(State.ERRORED, f"{type(exc).__name__}: {self.first_line(exc)}")

    def request_stop(self, reason: str) -> None:
        """End the run early but cleanly (called from another thread): the steps already handed
        to the workers complete, the last one's checkpoint commits, and ``run_for`` returns with
        the state STOPPED. A later ``fit()`` of the same run continues right after that step."""
        if self._stop_reason is None:
            self._stop_reason = self.redacted(reason, 200)
        self._stop_asked.set()

    def _interrupted(self) -> bool:
        return self._stop_asked.is_set()

    def _check_stop(self, waiting_for: str) -> None:
        """Raise ``StopRequested`` if a stop came while the controller waited for ``waiting_for``
        (``TrainingFailed`` once the run's lease is lost)."""
        self._check_lease()
        if self._stop_asked.is_set():
            raise StopRequested(f"stopped while {waiting_for}")

    def _stop_in_wait(self, why: str) -> None:
        """A stop that came while the run waited (placement, spares or capacity, storage): end it
        now, STOPPED, with what its ranks have written committed, instead of when the wait runs
        out, often after the driver's ``stop_timeout_s`` has killed the run and its checkpoints
        with it. The steps of this fit() (none, while starting) were committed as they trained;
        the weights handed back are those of the rank holding the newest step (``result``).

        That rank may have finished steps whose results never came back (a survivor of a broken
        group, in the queued window): they are kept and booked, as a state sync would, so that
        the step the run reports is the step of the weights it hands back.
        """
        self._stopped_while = why
        # Not while the run starts (a retried start too): a rank holding a step then holds the checkpoint
        # it was reading, nothing this fit() trained. Taken for a survivor's steps, its step
        # became the run's (steps=C beside restored_from=None, "the checkpoints on storage were
        # not read"), with an event of C steps "completed on a survivor".
        holder = self._stop_holder = self._newest_live_member() \
            if self.group is not None and self.state not in (State.SCHEDULING, State.STARTING) else None
        if holder is not None and holder[1] > self.step:
            try:
                self._keep_steps_held_by(*holder, "completed on a survivor before the stop")
            except ray.exceptions.RayError:  # it died since it answered: no weights, steps as they were
                self._stop_holder = None
        self.log("stop", f"stop requested ({self._stop_reason}): {why}; ending the run at step {self.step}",
                 step=self.step)
        if self.committer is not None and self.group is not None:
            with self._beating_at_the_end():  # as the run's own end: the ranks' heartbeats meanwhile
                self._commit_what_ranks_wrote(None, 30, "checkpoints of the steps before the stop", lost_ok=True)
        self._check_lease()  # lost meanwhile: the commits were not made, and fit() again would not resume there
        self.transition(State.STOPPED, f"{why}, at step {self.step}: {self._stop_reason}")

    def _stop_after_dispatched(self) -> None:
        """Training thread: end after the last step already dispatched. Why not at once: a
        window queued on the workers runs anyway (their calls are in flight), so stopping short
        of it would only throw that work away; it is at most one dispatch window
        (``dispatch_target_s``) plus the look-ahead one."""
        self.total_steps = min(self.total_steps, self._last_dispatched())
        self.log("stop", f"stop requested ({self._stop_reason}): finishing the steps already dispatched, up to "
                 f"step {self.total_steps}, then committing its checkpoint", step=self.total_steps)

    def _last_dispatched(self) -> int:
        """The newest step sent to the workers: the last of the windows queued on them, else the
        step the run is at."""
        return max([self.step] + [first + k - 1 for first, (*_, k) in self._inflight.items()])

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                ray.get([m.actor.shutdown.remote() for m in self.group.members], timeout=10)
            except Exception:
                logger.debug("worker shutdown failed", exc_info=True)
            self.group.shutdown()
        if self._agents is not None:
            self._agents.shutdown()

    def _schedule(self) -> None:
        # Only the ranks must fit now; spares may wait for capacity an autoscaler will add.
        check_cluster_fits(self.scaling, self.scaling.num_replicas)
        self.log("schedule", f"placing {self.scaling.num_replicas} rank(s) and {self.scaling.num_hot_spares} "
                 f"spare(s), strategy {self.scaling.placement_strategy}", bundle=self.scaling.bundle())

    def _start(self) -> None:
        """Start the ranks, resume, and form the first group. A rank lost on the way (its
        process or node died while it built its model, read the checkpoint or joined) starts
        it all again, counted as a failure: no step has trained, so nothing is lost but time,
        and a half-built start has no consistent state to heal from (the rank reading the
        checkpoint may be the lost one, and its peers then hold a fresh model at step 0)."""
        self.transition(State.STARTING, "placement ready, starting worker actors")
        while True:
            try:
                self._start_once()
                return
            except (ray.exceptions.RayError, TimeoutError) as exc:
                lost = self._lost_while_starting(exc)
                if not lost:
                    raise
                self._count_start_loss(exc, "failure_during_start", lost, "the run started", "starting it again")
                self._abandon_start()

    def _lost_while_starting(self, exc: BaseException) -> list[int] | str | None:
        """The ranks lost (a list), "a rank" when the group was still building (it has no
        members yet to name), or None when every rank is alive (the error is no loss)."""
        members = self.group.members if self.group is not None else []
        if members:
            dead = self._probe_dead()
            return sorted(dead) if dead else None
        return "a rank" if actor_lost(exc) else None

    def _abandon_start(self) -> None:
        """Undo a start that lost a rank, so the next try starts clean: the committer, the nodes'
        checkpoint agents and the group (its placement groups too) go, and the step and the
        actors' checkpoint writers with them."""
        if self.committer is not None:
            self.committer.close()
            self.committer = None
        if self._agents is not None:
            self._agents.shutdown()
            self._agents = None
        self.group.shutdown()
        self._forget_old_actors()
        self.step, self.restored_from = 0, None

    def _forget_old_actors(self) -> None:
        """Every rank is new (a restart, a start begun again): none stood by, none has its
        checkpoint writer, and none was killed as hung (by name: the new actors take the old
        names again)."""
        self._stateless.clear()
        self._configured.clear()
        self._hung.clear()

    def _count_start_loss(self, exc: BaseException, kind: str, lost: list[int] | str, while_: str,
                          then: str) -> None:
        """One failure for a rank lost while every rank (re)started; ``TrainingFailed`` past
        ``max_failures``, with the error (a crash that repeats on every start ends there). A
        runtime environment that could not be set up ends the run at once: Ray has retried its
        set-up already, and every start again ran pip (minutes) to fail the same way; once more, as
        it may pass, then the same error ends it."""
        who = f"rank(s) {lost}" if isinstance(lost, list) else lost
        # Its first line and its last: Ray's text of a start that failed says what failed first
        # ("Failed to set up runtime environment.") and why last (pip's error), with a
        # traceback between them. The first line alone sent the user to the controller's traceback.
        # Redacted whole, once, before any cut (``redacted``).
        lines = [line.strip() for line in self.redact(str(exc)).splitlines() if line.strip()] or [""]
        said = lines[0] if len(lines) == 1 else f"{lines[0][:200]} ... {lines[-1]}"
        error = f"{type(exc).__name__}: {said[:400]}"
        if isinstance(exc, ray.exceptions.RuntimeEnvSetupError) or "failed to set up runtime environment" in \
                lines[0].lower():
            # Once more, in case it passes (a working_dir a new node could not fetch yet, the
            # runtime-env agent's timeout, a blip at the package index); the same error again
            # ends the run.
            if error == self._env_failure:
                raise TrainingFailed(self._fail_message(
                    f"the ranks' runtime environment could not be set up while {while_}, twice ({error}): fix the "
                    "job's runtime_env (its pip or conda packages, working_dir, py_modules) and start again")) from exc
            self._env_failure = error
        self._count_failure(kind)
        if self.failures > self.failure_config.max_failures:
            raise TrainingFailed(self._fail_message(
                f"{who} lost while {while_} ({error}), and failure {self.failures} exceeds "
                f"FailureConfig.max_failures={self.failure_config.max_failures}")) from exc
        self.log("failure", f"{who} lost while {while_} ({type(exc).__name__}); {then}",
                 ranks=lost if isinstance(lost, list) else [])

    def _start_once(self) -> None:
        self._new_group()
        self.group.start(self.scaling.num_replicas)
        self._note_ready_spares(log=False)
        self._check_stop("starting the ranks")
        self._log_spare_problems()
        for m in self.group.members:
            self.log("placed", f"rank {m.rank} on node {m.info.get('node_ip')} (node rank {m.node_rank}, "
                     f"local rank {m.local_rank})", rank=m.rank, node_id=m.info.get("node_id"))
        self.log("spares", f"{len(self.group.spares)} hot spare(s) ready", ready=len(self.group.spares))
        self.dataset_size = self.group.dataset_size  # every rank's, compared when they were built
        # A step hands every replica a shard (first-N's late ones too). Checked here, the moment the
        # size is known: with fit(epochs=...) a smaller dataset meant 0 steps an epoch, and the run
        # "finished" untrained; with fit(steps=...) the plan refused at the first step.
        need = self.scaling.num_replicas * (self.batches.largest // self.scaling.num_workers)
        if self.dataset_size < need:
            # Every size is checked, reached or not (total_steps is known only later): a step that
            # could not be handed out would fail far into the run.
            field = ("Trainer.global_batch_size" if self.batches.largest == self.global_batch_size else
                     f"Trainer.batch_schedule[{self.batches.first_step_of(self.batches.largest)}]")
            raise ConfigError(
                f"the dataset has {self.dataset_size} samples, fewer than one step hands out ({need}: "
                f"{self.scaling.num_replicas} replicas x {need // self.scaling.num_replicas} samples): lower "
                f"{field}, or use a larger dataset.")
        self._setup_data_and_checkpoints()
        self._form_group("initial rendezvous")
        self._apply_fault_plan()

    def _new_group(self) -> None:
        self.group = self.worker_group_cls(self.scaling, self.spec, f"elastic-{self.run_config.name}")
        self.group.interrupted = self._interrupted  # its placement and spare waits end on a stop
        self.group.nodes_to_avoid = self._nodes_to_avoid

    def _setup_data_and_checkpoints(self) -> None:
        position = None
        if self.store is not None:
            self._check_storage_shared()
        if self._agents_wanted():
            # Started now, so their processes come up while the resume reads storage.
            self._agents = NodeAgents(self.store, self.run_config.name, self._self_handle,
                                      namespace=f"elastic-{self.run_config.name}")
            self._agents.start({m.info.get("node_id") for m in self._all_actors()})
        if self.store is not None:
            position = self._restore_latest()
        self._split = self.scaling.num_workers
        self._replan(position, self.step)
        if self.store is not None:
            from elastic.checkpoint import CheckpointCommitter

            self.committer = CheckpointCommitter(self.store, self.run_config.checkpoint,
                                                 latest_committed=self.restored_from, progress=self._progress_step)
            if self._lease is not None:
                self.committer.gate(self._lease.current)
            if self._lease_lost_why is not None:  # lost while the run started (_lease_lost found no committer)
                self.committer.halt(self._lease_lost_why)
            self._configure_checkpoints(self._all_actors(), check_storage=True)

    def _check_storage_here(self) -> None:
        """The storage, checked from the controller's process before the resume reads it: a
        refusal (no credentials here, no write access) ends the run with a ConfigError. Why:
        the controller is a Ray actor, with its node's environment, not the driver's that
        ``Storage.validate`` checked with; without credentials its resume took the refusals for
        an outage and waited ``resume_timeout_s`` for them to pass."""
        try:
            self.store.warm_up(check=True)
        except ConfigError as exc:
            raise refused_on_node(f"the run's controller (on node {ray.util.get_node_ip_address()})", exc) from None

    def _check_storage_shared(self) -> None:
        """Local storage (``file://``, a plain path) must be one directory on every node of the
        run: the controller writes a marker file there, and one actor on each node looks for it;
        a node that does not see it ends the run with a ConfigError, before any step. Why: the
        ranks (or their node's agent) write their shards on their own node, and the controller
        writes the manifest on its own, so on disks that are not shared every node kept its own
        checkpoints, retention deleted only the controller's, and a resume found no step whose
        files were all there, with nothing said. Ray Train checks its storage path the same way.
        Checked again by a restart (its group may stand on other nodes); spares started later
        are not checked: a run is training by then."""
        import uuid

        storage = self.store.storage
        if not storage.is_local:
            return
        by_node: dict = {}
        for m in self._all_actors():
            by_node.setdefault(m.info.get("node_id"), m)
        marker = f".elastic-shared-{uuid.uuid4().hex}"
        storage.write_bytes(marker, b"the run's controller wrote this; every node must see it")
        try:
            path = storage.full_path(marker)
            asked = [(m, m.actor.sees_file.remote(path)) for m in by_node.values()]
            timeout = self.failure_config.collective_timeout_s
            ready, _ = ray.wait([ref for _, ref in asked], num_returns=len(asked), timeout=timeout)
            for m, ref in asked:
                if ref not in ready:
                    # Its control thread stuck in the filesystem call: a hung mount, most likely. Said
                    # so, where killing it as hung started the run again with no word about storage.
                    raise ConfigError(
                        f"node {m.info.get('node_ip')} ({m.name}) did not answer within {timeout:g}s whether it "
                        f"sees RunConfig.storage={storage.location!r} (a hung mount?): every node must reach "
                        "the checkpoint directory. Check the mount there, or use an object store (s3://...).")
                if not ray.get(ref):  # a dead actor raises here: a loss at the start, healed as one
                    raise ConfigError(
                        f"RunConfig.storage={storage.location!r} is a path on each node's own disk, and node "
                        f"{m.info.get('node_ip')} ({m.name}) does not see the file the run's controller (on node "
                        f"{ray.util.get_node_ip_address()}) wrote there: every node would keep its own "
                        "checkpoints, and a resume could not find them. Mount one shared filesystem at that path "
                        "on every node, or use an object store (s3://...).")
        finally:
            try:
                storage.delete(marker)
            except Exception as exc:  # noqa: BLE001 - a stray marker is harmless
                logger.debug("could not delete the storage marker %s: %s", marker, exc)

    def _configure_checkpoints(self, members: list[Member], check_storage: bool = False) -> None:
        """Give actors their checkpoint writer (once each; a spare started later gets it when it
        first joins). Inside the controller actor, ranks report written parts straight to it,
        and unless writes block the step, each node's agent writes them (``NodeAgents``).

        ``check_storage``: the run's start. Whatever writes a node's checkpoints (its agent, or
        ranks writing in their own processes) checks the storage from there, and a refusal ends
        the run with a ConfigError that names the node, before any step: the driver's check
        (``Storage.validate``) used the driver's credentials. Later (a spare, a restart) a
        refusal is left to the writes, which retry and report it: the run is training by then."""
        todo = [m for m in members if m.name not in self._configured]
        if self.store is None or not todo:
            return
        ckpt = self.run_config.checkpoint
        addresses: dict = {}
        if self._agents is not None:
            addresses = self._agents.addresses({m.info.get("node_id") for m in todo}, check_storage)
            self.log("checkpoint_agents", f"{sum(a is not None for a in addresses.values())} of {len(addresses)} "
                     f"node(s) write checkpoints through a checkpoint agent",
                     nodes={node: a is not None for node, a in addresses.items()})
        refs = [(m, m.actor.configure_checkpoint.remote(self.store.url, self.store.storage_options,
                                                        self.run_config.name, ckpt.every_n_steps, ckpt.blocking,
                                                        self._self_handle, ckpt.min_shard_bytes,
                                                        addresses.get(m.info.get("node_id")), self._agents is not None,
                                                        ckpt.keep_every, check_storage))
                for m in todo]
        spares = {m.name for m in self.group.spares}
        failed: list[str] = []
        deadline = time.monotonic() + self.failure_config.collective_timeout_s
        for m, ref in refs:
            try:
                self._answer(m, ref, deadline - time.monotonic(), "its checkpoint writer's setup")
            except ray.exceptions.RayError as exc:
                if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, ConfigError):
                    if _unsaveable(exc) is not None:
                        raise exc.cause from None  # the run's state, the same on every rank: no node to name
                    raise refused_on_node(f"{m.name} on node {m.info.get('node_ip')}", exc.cause) from None
                if m.name not in spares:
                    raise  # a rank: the caller's failure handling finds it lost
                # A spare: not worth the run (a start, a restart from the checkpoint) it was set up
                # for. A dead one is dropped from the pool (and replaced); a live one stays
                # unconfigured and gets its writer when it is promoted (_form_group), as a spare
                # started later does.
                failed.append(m.name)
                logger.warning("spare %s could not set up its checkpoint writer: %s", m.name, exc)
        self._configured.update(m.name for m in todo if m.name not in failed)
        if failed:
            self._refresh_spares(wait=True)

    def _agents_wanted(self) -> bool:
        """Nodes' checkpoint agents write the snapshots: storage, writes in the background (not
        ``blocking``), a controller actor for them to report to, and memfds (Linux)."""
        ckpt = self.run_config.checkpoint
        return (self.store is not None and self._self_handle is not None and not ckpt.blocking
                and ckpt.every_n_steps > 0 and shm.supported())

    def checkpoint_events(self, events: list) -> None:
        """Storage events of the nodes' checkpoint agents: ``[(rank, event), ...]``."""
        for rank, ev in events:
            self._log_storage_event(ev, rank)

    def checkpoint_written(self, step: int, world_size: int, parts: dict) -> None:
        """From a rank's writer thread, through the controller actor's "checkpoint" thread: ``parts``
        is ``{rank: {"entries", "taken_at", "progress", "generation"[, "rng"]}}``, every rank's part
        of ``step`` when the ranks pooled them (one message a step), else the sender's own."""
        if self.committer is None:
            return
        for rank, part in parts.items():
            self._add_part(step, int(rank), world_size, part)
        with self._pushed_cv:
            for rank, part in parts.items():
                key = (int(part.get("generation") or 0), step)
                self._pushed[int(rank)] = max(self._pushed.get(int(rank), key), key)
            self._pushed_cv.notify_all()

    def _add_part(self, step: int, rank: int, world_size: int, part: dict) -> None:
        """A rank's written part to the committer, unless the rank took its snapshot in a group
        generation a rollback left behind (``_rewind``). Why: such a part can come after the
        rollback (a write in flight, a node agent's pool sending what waited), of a step the
        ranks train and write again from the state gone back to. The committer judges a part by
        its step alone, so with the other ranks' new parts of that step it would complete the
        step, and its manifest would record the checksum of a file the rank's rewrite replaces.
        Every rollback comes before the rendezvous that lets training go on, in a new
        generation, so the generation tells the two apart, whatever the step. Under the lock
        ``_rewind`` takes too: a part is either in before a rollback (which forgets its step
        with the later ones) or judged against it."""
        with self._parts_lock:
            generation = part.get("generation")
            if self._given_up(generation, step):
                logger.info("rank %d's checkpoint part of step %d was taken in generation %s, before a rollback; "
                            "dropped", rank, step, generation)
                return
            again = self._written_again.get((step, rank))
            if generation is not None and again is not None and int(generation) < again:
                logger.info("rank %d's checkpoint part of step %d was taken in generation %s; the rank's new actor "
                            "writes that file again (generation %d), so its part stands instead", rank, step,
                            generation, again)
                return
            if "progress" in part:
                # Not past a rollback's step for a part of a generation it fenced: the part of the
                # step gone back to stands, but the steps its rank had finished since (a lost fast
                # replica's, pushed late by its node's agent) are of the history given up, and
                # counted, they inflated the checkpoint lag that _rewind's reset is there to keep true.
                progress = min([int(part["progress"])] + [
                    through for fenced, through in self._given_up_parts
                    if generation is not None and through is not None and int(generation) <= fenced])
                self._worker_progress = max(self._worker_progress, progress)
            self.committer.add(step, rank, world_size, part["entries"], taken_at=taken_at_here(part),
                               rng=part.get("rng"))

    def _rewind(self, step: int | None, restored: bool = False) -> None:
        """Training goes back to ``step`` (None: to before any checkpoint): the committer forgets
        the later steps, and the ranks' progress is that step again. Why reset it: a rank that
        survives the rollback reports its new steps from there, and the commit lag measured from
        the old maximum stayed inflated until training passed it again. ``restored``: ``step``
        is a committed step a restore loaded (``CheckpointCommitter.rewind``)."""
        if self.committer is None:
            return
        # A rollback (not a restore) goes back on the history the old generations trained: their
        # parts of the step gone back to and earlier ones are of it, and nothing writes those
        # steps again. Dropped too (every step of those generations, as after a restore), a late
        # first-N replica's part of the step it held, still on its way when the fast replicas
        # were lost, never came again, and that step and older ones waiting for it never
        # committed: the next failure or resume went back further.
        through = None if restored else step
        with self._parts_lock:
            self._given_up_parts.append((self.generation, through))  # the state gone back from
            self._worker_progress = step or 0
            self.committer.rewind(step, restored=restored)
        if self._agents is not None:
            # The later steps are written again, to the same file names: a write of the old
            # state still under way in an agent (a killed rank's) must land first, and no waiting
            # one may start (CheckpointAgent.settle).
            stuck = self._agents.settle(self.generation, self.SETTLE_TIMEOUT_S, through)
            if stuck:
                self.log("checkpoint_writes_unsettled", f"checkpoint writes of the state gone back from still under way "
                         f"after {self.SETTLE_TIMEOUT_S:g}s (rank, step): {stuck}; a step they overwrite fails "
                         "its checksum and resume skips it", stuck=[list(x) for x in stuck])

    def _given_up(self, generation: Any, step: int) -> bool:
        """Whether a part of ``step`` snapshotted in group ``generation`` is of a state a
        rollback or restore gave up (``_rewind``), by the agents' own rule (``given_up``)."""
        return given_up(generation, step, self._given_up_parts)

    def _progress_step(self) -> int:
        """The newest step training is known to have finished: ours, or a rank's newer report."""
        return max(self.step, self._worker_progress)

    def _restore_latest(self, fast: dict[int, list[int]] | None = None) -> DataPosition | None:
        """``_restore_latest_once(fast)``, waiting out a storage outage (``_through_outage``).
        Why wait: without the list of committed steps the run cannot know where to resume, and
        starting fresh would train over a checkpoint that exists."""
        return self._through_outage(lambda: self._restore_latest_once(fast), "resume", "find the step to resume from",
                                    "looked for the step to resume from")

    def _through_outage(self, call: Callable[[], Any], what: str, to: str, while_: str) -> Any:
        """``call()``, waiting out a storage outage for up to ``CheckpointConfig.resume_timeout_s``
        (``TrainingFailed`` after it). Why: each storage call already retries for a second or
        two, so a longer blip at start (or during a restart from a checkpoint) failed the whole
        run. The wait is logged, and ``status()`` shows it."""
        from elastic.checkpoint.persister import OutageTracker
        from elastic.checkpoint.storage import RetryPolicy

        timeout = self.run_config.checkpoint.resume_timeout_s
        events: deque = deque()
        outage = self._resume_outage = OutageTracker(
            events, what, retrying=f"waiting up to {timeout:g}s for it to {to}")
        backoff, deadline = RetryPolicy(base_s=0.5, max_s=10.0), time.monotonic() + timeout
        while True:
            try:
                answer = call()
            except Exception as exc:
                unavailable = _storage_unavailable(exc)
                if unavailable is None:
                    raise
                if time.monotonic() >= deadline:
                    raise TrainingFailed(
                        f"checkpoint storage {self.store.location} did not answer for "
                        f"CheckpointConfig.resume_timeout_s={timeout:g}s while the run {while_}: "
                        f"{unavailable}") from None
                outage.failed(None, unavailable)
                self._log_outage_events(events)
                self._stop_asked.wait(min(backoff.delay_s(outage.failures), max(0.0, deadline - time.monotonic())))
                self._check_stop(f"waiting for checkpoint storage {self.store.location} to answer")
                continue
            outage.succeeded(None)
            self._log_outage_events(events)
            return answer

    def _take_lease(self) -> None:
        """Hold the run's storage lease (``RunLease``) before anything of this run reads or
        writes there: another live run of this name in this storage (on another Ray cluster; on
        this one the name's claim refused it) is a ``LeaseHeld`` ConfigError. Renewed on a thread of its own from then on; lost to
        another run, the committer halts at once and the run fails at its next step
        (``_lease_lost``)."""
        from elastic.checkpoint.lease import RunLease

        if self._lease is not None or self.store.storage.protocol == "memory":
            # memory:// is the driver's own memory (elastic.checkpoint.memory): no other driver
            # reaches it, and a lease left there by a killed run would only be waited out.
            return
        lease = RunLease.for_this_process(self.store.storage, self.run_config.name)

        def watching(message: str) -> None:
            self._waiting_for = message
            self.log("lease", message)

        try:
            took = self._through_outage(lambda: lease.acquire(on_watch=watching), "lease", "take the run's lease",
                                        "took the run's lease")
        finally:
            self._waiting_for = None
        self._lease = lease
        if took:
            self.log("lease", took)
        lease.start_renewing(self._lease_lost, on_event=lambda kind, message: self.log(kind, message))

    def _lease_lost(self, why: str) -> None:
        """The lease thread: another run holds this run's storage now. Nothing more is committed
        or deleted (``CheckpointCommitter.halt``), and the training thread fails the run at its
        next step or wait (``_check_lease``)."""
        self._lease_lost_why = why
        self.log("lease_lost", why)
        committer = self.committer  # read once: a start begun again sets it None meanwhile
        if committer is not None:
            committer.halt(why)

    def _check_lease(self) -> None:
        """``TrainingFailed`` once the run's lease is lost (``_lease_lost``)."""
        if self._lease_lost_why is not None:
            raise TrainingFailed(self._fail_message(
                f"{self._lease_lost_why}; this run stopped, and commits and deletes nothing more there, so the two "
                "runs' checkpoints do not mix"))

    RESTORE_NOTE_S = 60.0  # how often a long checkpoint read is logged as still under way

    def _await_restore(self, ref: Any, step: int) -> Any:
        """The reading rank's answer to ``restore_checkpoint`` of ``step``, waited for in slices
        so that a stop breaks in (``StopRequested``), logging every RESTORE_NOTE_S that the read
        is still under way. Why no deadline: a read that is slow (gigabytes from S3) cannot be
        told from one that hangs (a stuck mount) from here, and each storage call already has its
        retries and their bounds; a read that fails raises, and one that never returns is in the
        event log and stoppable."""
        t0 = noted = time.monotonic()
        while True:
            ready, _ = ray.wait([ref], timeout=1.0, fetch_local=False)
            if ready:
                return ray.get(ref)
            self._check_stop(f"reading checkpoint step {step}")
            now = time.monotonic()
            if now - noted >= self.RESTORE_NOTE_S:
                noted = now
                self.log("checkpoint", f"still reading checkpoint step {step} from {self.store.location} after "
                         f"{now - t0:.0f}s", step=step, reading_s=round(now - t0, 1))

    def _log_outage_events(self, events: deque) -> None:
        """An OutageTracker's start/end events, as events of their own kind."""
        while events:
            ev = events.popleft()
            self.log(ev["event"], ev["message"], **{k: v for k, v in ev.items() if k not in ("event", "message")})

    def _steps_held(self):
        """The committer's ``holding_steps`` (no committed step deleted while held), or nothing
        without checkpoints."""
        return self.committer.holding_steps() if self.committer is not None else contextlib.nullcontext()

    def _restore_latest_once(self, fast: dict[int, list[int]] | None = None) -> DataPosition | None:
        """Load the newest committed step that checks out into every rank; its data position.

        One rank reads it from storage, verifying every file's checksum as it reads, and the
        others receive its state through the object store, as in a peer's state sync. Why not
        every rank from storage: each read is the whole replicated state, so N ranks read N
        times what one read gives, and before this the controller read everything once more to
        verify it (N + 1 reads of a checkpoint that may be gigabytes on S3). A step found corrupt
        while it is read is skipped with an event naming the file, and the next older one is
        tried; the reading rank's state is untouched until a whole step checked out.
        """
        from elastic.checkpoint import CorruptCheckpoint
        from elastic.checkpoint.compat import CheckpointMismatch
        from elastic.checkpoint.store import unreadable_newer

        reader, rest = self.group.members[0], self.group.members[1:]
        meta = None
        refused: list = []  # steps whose manifest cannot be read here (committed_steps)
        # Retention deletes nothing while the step is listed and read (holding_steps).
        with self._steps_held():
            for step in reversed(self.store.committed_steps(refused)):
                # Not below a step this elastic cannot read (a newer elastic's, one storage
                # refuses): the newer steps tried turned out corrupt, and resuming from an older
                # one trained over it, as committed_steps refuses when it is the newest.
                newer = [exc for r, exc in refused if r > step]
                if newer:
                    raise unreadable_newer(newer[-1], "the readable committed steps newer than it did not check "
                                                      "out (the skipped steps' events name their files)")
                ref = reader.actor.restore_checkpoint.remote(self.store.url, self.store.storage_options,
                                                             self.run_config.name, step)
                try:
                    meta = self._await_restore(ref, step)
                    break
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, CheckpointMismatch):
                        # A configuration problem, not a fault: the ConfigError reaches the user without a traceback.
                        raise ConfigError(str(cause)) from None
                    if not isinstance(cause, CorruptCheckpoint):
                        raise
                    logger.warning("%s; trying an older step", cause)
                    self.log("checkpoint", f"skipped committed step {step}: {cause}; trying an older step",
                             step=step, path=cause.path, corrupt=True)
        if meta is None:
            if refused:  # every readable step was corrupt: starting fresh trains over the unreadable ones
                raise unreadable_newer(refused[-1][1], "no readable committed step checked out, and starting "
                                                       "fresh would train over it")
            self.log("checkpoint", f"no committed checkpoint under {self.store.location}; starting fresh")
            return None
        if rest:
            self._send_state(reader, rest, "the checkpoint's state")
        # Committed before their results reached us (ranks report written parts directly): the
        # checkpoint proves those steps finished, so they are kept, not replayed.
        # First-N: ``fast`` is what the old members recorded of those steps (asked before the
        # restore by _restart_all, _restore_members_from_checkpoint); the ranks that restored know none.
        # Their results, where a rank still had them (the failure's, a survivor's), are booked too.
        kept = [done for done in range(self.step + 1, step + 1) if done in self._planned]
        self._keep_completed_steps(kept, "committed before its results came back", fast,
                                   self._results_of(kept[0], kept[-1]) if kept else None)
        self.step = step
        self.restored_from = step
        self.log("resume", f"resumed from committed step {step} at {self.store.location} (read by rank "
                 f"{reader.rank}{f', sent to {len(rest)} more through the object store' if rest else ''})",
                 step=step, read_by=reader.rank)
        return self._resumable_position(step, meta)

    def _resumable_position(self, step: int, meta: dict) -> DataPosition:
        """The checkpoint's data position, if this run's sample order is the checkpointed one.

        An epoch's order comes from (seed, epoch, dataset size), through numpy. When a resumed run
        has another dataset size or seed (the user added data, say), or the same ones give another
        order (another numpy: ``order_digest``), the saved cursor points into an order this run
        does not have: continuing there would silently use some samples of the epoch twice and
        others never. So the run starts the next epoch instead, and says so. The weights and
        optimizer still come from the checkpoint. Manifests written before these fields were
        recorded are taken as they are."""
        position = DataPosition.from_dict(meta["data_position"])
        trained_at = meta.get("global_batch_size")
        # The schedule each checkpoint keeps (``BatchSchedule.pairs``); none in one written before.
        saved_schedule = BatchSchedule.from_pairs(meta.get("batch_schedule"))
        later = saved_schedule.first_difference(self.batches, step) if saved_schedule is not None else None
        if type(trained_at) is int and trained_at != self.batches.size_at(step):
            # Sample-exact either way (the sampler's place counts samples), and a schedule may be
            # changed on purpose; but a run resumed without its schedule would go on at another
            # batch size with nothing said.
            self.log("batch_size_changed",
                     f"checkpointed step {step} trained at a global batch of {trained_at}, and this run's "
                     f"Trainer.global_batch_size/batch_schedule give it {self.batches.size_at(step)}: the run "
                     f"goes on at this run's sizes", step=step, saved=trained_at, now=self.batches.size_at(step))
        elif later is not None:
            # The same size at the checkpointed step, but not after it: a run stopped at 1500 of a
            # schedule that doubles the batch at 2000, resumed without it, trained at the old size
            # from 2000 on with nothing said (only the checkpointed step's size was compared).
            at, saved_size, now_size = later
            self.log("batch_size_changed",
                     f"the checkpoint's batch schedule (from step {step}) trains step {at} at a global batch of "
                     f"{saved_size}, and this run's Trainer.global_batch_size/batch_schedule give it {now_size}: "
                     f"the run goes on at this run's sizes", step=step, at=at, saved=saved_size, now=now_size)
        saved = {"dataset_size": meta.get("dataset_size"), "seed": meta.get("seed")}
        now = {"dataset_size": self.dataset_size, "seed": self.run_config.seed}
        changed = {k: (saved[k], now[k]) for k in now if saved[k] is not None and saved[k] != now[k]}
        if not changed and meta.get("order_digest") is not None:
            digest = epoch_order_digest(self.dataset_size, self.run_config.seed, position.epoch)
            if digest != meta["order_digest"]:
                changed = {"order_digest": (meta["order_digest"], digest)}
        size = self.dataset_size
        if not changed and not (position.epoch >= 0 and 0 <= position.cursor <= size
                                and all(0 <= i < size for i in position.requeued)):
            # A manifest written before dataset_size was recorded checks nothing above, and its
            # indices went to the ranks as they were: past the dataset's end, an IndexError in a
            # step read as the user's error.
            changed = {"position": (position.to_dict() if len(position.requeued) <= 16 else
                                    {"epoch": position.epoch, "cursor": position.cursor}, f"within {size} samples")}
        if not changed:
            return position
        what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        logger.warning("[%s] resuming from step %d with another sample order (%s)", self.run_config.name, step, what)
        self.log("data_order_changed",
                 f"checkpointed step {step} was sampled with another order ({what}): its epoch "
                 f"{position.epoch} cannot be continued sample-exactly, so sampling starts epoch {position.epoch + 1}",
                 step=step, changed={k: list(v) for k, v in changed.items()})
        return DataPosition(epoch=position.epoch + 1)

    def _fresh_rank_views(self, ranks: Iterable[int] | None = None) -> None:
        """What the dashboard and `elastic status` show of rank numbers that now name another
        actor: ``ranks`` (a promoted spare's), or every rank (None: survivors renumbered by a
        shrink, a new rendezvous), stale numbers dropped. Each is heard from now, at the run's
        step, with no step time yet.

        Why: ranks are numbers. A promoted spare, or a survivor renumbered by a shrink, took over
        its predecessor's heartbeat time, step and step time: a fresh spare looked hung, and an
        evicted straggler's step time stood against its replacement. Done when the number changes
        hands (``_replace``, ``_shrink``), not only at the rendezvous after the state sync: the
        sync can take minutes, and a second failure during it showed the dead predecessor's age."""
        now = time.time()
        if ranks is None:
            members = [m.rank for m in self.group.members]
            # New dicts, not cleared ones: the status thread reads them without a lock.
            self._rank_done = {r: self.step for r in members}
            self._last_beat = {r: now for r in members}
            self._step_time_of = {}
            return
        for r in ranks:
            self._rank_done[r] = self.step
            self._last_beat[r] = now
            self._step_time_of.pop(r, None)

    def _all_actors(self) -> list[Member]:
        return list(self.group.members) + list(self.group.spares)

    def _form_group(self, reason: str, attempt: int = 1) -> None:
        """New rendezvous (fresh port, fresh store) and every current rank joins it.

        Rank 0 binds the store first (``host_rendezvous``, on a port the kernel picks), so the
        port the group is told is already its store's. A group that still fails to form while
        every rank is alive (a connection refused or reset on a loaded node, a peer's join that
        timed out) is formed again, on a fresh store, up to ``FORM_ATTEMPTS`` times: such a
        failure ended the run (at its start, in a recovery, in an eviction), where the same error
        in a step was healed."""
        self.generation += 1
        self._fresh_rank_views()  # every rank joins at the run's step; its join is its answer
        self._last_results = {}
        self._configure_checkpoints(self.group.members)  # a promoted spare started after the run began
        head = self.group.members[0]  # hosts the fresh TCP store: its node IP and the port it bound
        # The group's timeout, as every other rank's store has (``join``): rank 0 waits on its
        # own store, and with first-N's longer timeout a resting rank 0 gave up on the fast N's
        # step after collective_timeout_s and took the store, and the group, with it.
        port_ref = head.actor.host_rendezvous.remote(self._group_timeout_s())
        addr, port = head.info["node_ip"], self._answer(head, port_ref, self.failure_config.collective_timeout_s,
                                                        "for a rendezvous store")
        world = len(self.group.members)
        if self._agents is not None:
            self._agents.expect(world, self.group.members)
        first_n = self.scaling.aggregation == "first_n"
        t0 = time.time()
        refs = [m.actor.join.remote(m.rank, world, addr, port, self.generation, self._group_timeout_s(), not first_n,
                                    self.scaling.num_workers if first_n else 0,
                                    self.failure_config.checksum_every_n_steps,
                                    self.scaling.late_backoff_steps)
                for m in self.group.members]
        try:
            ray.get(refs, timeout=self._group_timeout_s() + self.JOIN_GRACE_S)
        except ray.exceptions.GetTimeoutError:
            # A join past its own timeout (the group's, inside the worker) is stuck outside
            # Python (NCCL's communicator set-up, a stopped process) while its control thread
            # still answers heartbeats: killed as hung, as ``_answer`` kills a recovery's silent
            # member, so the recovery's probe finds it lost and heals it. Left alive, the probe
            # found no one lost and the run ended.
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            self._kill_hung({ref: m.rank for ref, m in zip(refs, self.group.members) if ref not in ready},
                            f"did not finish joining generation {self.generation} within "
                            f"{self._group_timeout_s() + self.JOIN_GRACE_S:g}s")
            raise
        except ray.exceptions.RayTaskError as exc:
            user = self._user_join_error(refs)
            if user is not None:
                raise user from exc
            if attempt >= self.FORM_ATTEMPTS or self._probe_dead():
                raise
            cause = getattr(exc, "cause", exc)
            self.log("rendezvous", f"generation {self.generation} did not form with every rank alive "
                     f"({type(cause).__name__}: {self.redacted(cause, 200)}); a fresh rendezvous, attempt {attempt + 1} of "
                     f"{self.FORM_ATTEMPTS}", generation=self.generation, retry=attempt + 1)
            self._form_group(reason, attempt + 1)
            return
        self._lagging.clear()  # windows of the old generation
        self._checksums.clear()  # they may name actors that just left
        self.straggler_policy.reset()
        if self._evict_after_window is not None:
            # A failure's rebuild came first. The straggler's evidence is the old group's: it
            # is watched afresh in the new one (the reset above), and evicted if still slow.
            r, self._evict_after_window = self._evict_after_window.rank, None
            self.log("decision", f"Continue: the eviction of straggler rank {r} is dropped: the group was "
                     "rebuilt before it; its step times are watched afresh", decision="Continue", rank=r)
        if self.metrics is not None:
            self.metrics.on_group([m.rank for m in self.group.members])
        backend = "/".join(sorted({m.info.get("backend", "?") for m in self.group.members}))
        self.log("rendezvous", f"generation {self.generation}: {world} rank(s) on {backend} at {addr}:{port} "
                 f"({reason})", generation=self.generation, world_size=world, backend=backend,
                 seconds=time.time() - t0)

    def _user_join_error(self, refs: list) -> WorkerError | None:
        """A failed ``join`` as the user's error, or None. The rule of a step's results: a rank
        whose join raised anything but a CollectiveError (the worker's name for a failure of the
        group itself) raised in its own setup of the model (DDP refusing it, say); with every rank
        alive that is a WorkerError naming the rank, with the worker's exception and traceback.
        A broken group or a lost peer is left to recovery."""
        for m, ref in zip(self.group.members, refs):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as failed:
                if not isinstance(getattr(failed, "cause", None), CollectiveError) and not self._probe_dead():
                    return WorkerError(m.rank, describe_worker_failure(failed, "could not join the process group"))
        return None

    def _apply_fault_plan(self) -> None:
        """Deterministic fault injection keyed by (rank, step): a test, benchmark and demo aid."""
        for fault in self.fault_plan:
            if fault["kind"] == "kill_spare":
                continue  # applied by _maybe_kill_spare_during_recovery
            m = self.group.members[fault["rank"]]
            if fault["kind"] == "slow":
                ray.get(m.actor.inject_slowdown.remote(fault.get("factor", 1.0), fault["from_step"],
                                                        fault.get("delay_s", 0.0)))
                pace = f"+{fault['delay_s']} s a step" if fault.get("delay_s") else f"{fault['factor']}x"
                what = f"slowed {pace} from step {fault['from_step']}"
            elif fault["kind"] == "kill":
                after = bool(fault.get("after_update"))
                ray.get(m.actor.inject_kill.remote(fault["at_step"], after, fault.get("mark") or None))
                what = f"SIGKILLs itself {'right after' if after else 'in'} step {fault['at_step']}"
            else:
                ray.get(m.actor.inject_hang.remote(fault["at_step"]))
                what = f"hangs in step {fault['at_step']}"
            self.log("fault_injection", f"rank {fault['rank']} ({m.name}) {what} (test/demo aid)",
                     fault=dict(fault), worker=m.name)

    # ---- one step ---------------------------------------------------------------------------
    def _run_one_step(self) -> None:
        if self._evict_after_window is not None and not self._inflight:
            self._settle_deferred_eviction()  # the window it waited for is in: a step of its own
            return
        step = self.step + 1
        t0, self._waited_s = time.perf_counter(), 0.0
        try:
            done = self._step_all(step)
        except Failure as failure:
            self._recover(failure)
            return
        for i, (record, results) in enumerate(done):
            self.step = record.step
            self._add_history(record)
            self._last_results = results
            # Policies decide once per window, after its last step: an eviction rebuilds the
            # group, and the window's other steps are already done on every rank.
            self._after_step(record, decide_steps=len(done) if i == len(done) - 1 else 0)
        busy = max(0.0, time.perf_counter() - t0 - self._waited_s) / len(done)
        for record, _ in done:
            record.controller_time_s = busy

    def _shards_for(self, step: int, n: int) -> tuple[int, list[list[int]]]:
        """The step's shards. A replayed step reuses the exact samples it was first given."""
        if step in self._planned:
            epoch, shards = self._planned[step]
            if len(shards) != n:  # shrunk: the same global batch, split over fewer ranks
                flat = [i for s in shards for i in s]
                per = len(flat) // n
                # _shrink only shrinks to a size the global batch divides over (and never a
                # first-N group), so no sample is left out of the split; a remainder would
                # vanish from the epoch uncounted.
                assert per * n == len(flat), f"step {step}: {len(flat)} samples do not split over {n} ranks"
                shards = [flat[i * per:(i + 1) * per] for i in range(n)]
                # The step is booked as it is trained: with the first split kept, the ledger
                # said the shards of ranks past the new size were dropped (and counted them).
                self._planned[step] = (epoch, shards)
            return epoch, shards
        epoch, shards = self.plan.take(n, self.batches.size_at(step) // self._split)
        self._planned[step] = (epoch, shards)
        # The sampler's place right after this step: a checkpoint of this step must carry it,
        # not the place after the look-ahead step already handed out.
        self._positions[step] = self.plan.position.to_dict()
        return epoch, shards

    @property
    def _first_n(self) -> bool:
        return self.scaling.aggregation == "first_n"

    @property
    def _look_ahead(self) -> bool:
        """Requeued samples go into the next step's batch, so with ``requeue_dropped`` a step is
        planned only once the previous step's drops are known: one step per call, none queued."""
        return not (self._first_n and self.requeue_dropped)

    def _window_at(self, first: int) -> int:
        window = self._window if self._look_ahead else 1
        return max(1, min(window, self.total_steps - first + 1))

    def _dispatch_all(self, first: int) -> None:
        """Hand steps ``first``.. (one window) to every rank; each step's shards planned here.

        First-N: every one of the M replicas gets a shard every step; the shards of the ranks
        that turn out late are the step's dropped samples.
        """
        members = self.group.members
        k = self._window_at(first)
        plans = [self._shards_for(first + i, len(members))[1] for i in range(k)]
        if self.committer is not None and self._look_ahead:
            # Known now, so a step can commit the moment its parts are written, whenever its
            # results come back. First-N too: the sampler's place after a step does not depend on
            # which ranks were fast (a late rank's shard is dropped, not handed out again). Only
            # with requeueing does it (the drops go back into the sampler), and then a window is
            # one step and its meta is set from its results (``_after_step``). Why it matters:
            # with the meta set from results, a window's steps reached the committer all at
            # once when its results came back, each superseding the one before, so one commit
            # in ~15 steps landed (39 of 200 on the benchmark workload, lag p95 13).
            for i in range(k):
                position = self._positions.get(first + i)
                if position is not None:
                    self.committer.set_meta(first + i, self._checkpoint_meta(first + i, position))
        refs = [m.actor.train_steps.remote(first, [p[i] for p in plans], self.generation)
                for i, m in enumerate(members)]
        self._inflight[first] = (refs, [m.rank for m in members], time.perf_counter(), k)

    def _step_all(self, first: int) -> list[tuple[StepRecord, dict]]:
        """One window of steps (one step unless ``steps_per_dispatch`` says more), with the
        next window already queued on the workers. Returns a record and the per-rank results for
        every step, in order.

        Why the look-ahead: a Ray round trip per call leaves every worker idle while results
        travel back and the next call travels out (4-5 ms on a loaded 2-core machine, 10% of a
        40 ms step). Queuing the next window behind this one hides it. It is safe because every
        call names the group generation it belongs to: after a failure, a queued step finds its
        group gone (or blocks in a collective its peers have left) and raises without touching
        the model, and its samples stay planned for the replay. Steps of a window that finished
        before a failure are kept (see ``_sync_state``).

        First-N: the window is done once N ranks have returned it (each result names every
        step's fast set); a rank still busy with it is late, and its result is collected in a
        later window (see ``_collect_late``) without anyone waiting for it.
        """
        if first not in self._inflight:
            self._dispatch_all(first)
        refs, ranks, t_dispatch, k = self._inflight.pop(first)
        # Not while an eviction waits for this window: the next one is sent to the new group.
        if self._look_ahead and self._evict_after_window is None and first + k <= self.total_steps \
                and first + k not in self._inflight:
            self._dispatch_all(first + k)
        self._check_late_hung()
        lagging = self._lagging_ranks()
        need = self.scaling.num_workers if self._first_n else None
        try:
            got = self._gather(refs, ranks, need=need, lagging=lagging)
        except Failure as failure:
            # Queued steps of the broken generation fail on their own, or finish (first-N
            # replicas that need no lost rank): their results are read if the steps are kept.
            failure.queued = [ref for refs, *_ in self._inflight.values() for ref in refs]
            self._inflight.clear()
            raise
        now = time.perf_counter()
        per_rank = {r: got[ref] for ref, r in zip(refs, ranks) if ref in got}
        for r, res in per_rank.items():
            self._note_rank_done(r, res)
        for ref, r in zip(refs, ranks):
            if ref not in got:
                self._lagging[ref] = (r, time.time(), k)
        for ref in lagging:
            if ref in got:
                self._collect_late(self._lagging.pop(ref)[0], got[ref])
        wall = self._window_wall(t_dispatch, now)
        steps_out = []
        worker_times = [max(res[i].step_time_s for res in per_rank.values()) for i in range(k)]
        for i, step_time in enumerate(_split_wall(wall, worker_times)):
            results = {r: res[i] for r, res in per_rank.items()}
            steps_out.append((self._record_step(first + i, results, step_time), results))
        self._tune_window(worker_times)
        return steps_out

    def _window_wall(self, t_dispatch: float, now: float) -> float:
        """A window's wall time, up to ``now`` (its results in): from the previous window's
        results when it was of the same group generation, else from its dispatch.

        Why from the previous results: that is what the run spent on it, the controller's own
        time between the windows included. With the look-ahead the window was sent before then,
        and the same start was taken (the later of the two); without it (first-N with
        requeueing sends one step at a time, after the previous step's bookkeeping), taking the
        later one, the dispatch, left the controller's time between steps out, and such runs'
        samples_per_s read higher than the wall clock. After a recovery or a regroup (a new
        generation) the time before the dispatch is the recovery's, not a step's."""
        start = self._last_done if self._last_done_generation == self.generation else t_dispatch
        self._last_done, self._last_done_generation = now, self.generation
        return now - start

    def _record_step(self, step: int, results: dict, step_time_s: float) -> StepRecord:
        """Ledger, straggler timings and the step's record, from the results in hand."""
        for r, res in results.items():
            self._observe(r, res)
        return self._record_from(step, results, step_time_s)

    def _record_from(self, step: int, results: dict, step_time_s: float) -> StepRecord:
        """Ledger and the step's record from the results of the ranks that returned them (rank
        -> result): every rank's from a gather; a kept step's from those that still had theirs.

        First-N: every returned rank names the same fast set (they read it from the same store
        key) and holds the same averaged loss, so any one gives the step's. Plain sync: every
        rank's gradient made the step (DDP's all-reduce has every rank or none), and the loss is
        the mean of the ranks' own losses: of every rank's from a gather, of those returned for
        a kept step."""
        if self._first_n:
            some = next(iter(results.values()))
            used, loss = some.extra["fast"], some.loss
            self.agreed_steps += bool(some.extra.get("agreed"))
        else:
            used, loss = range(len(self._planned[step][1])), statistics.fmean(res.loss for res in results.values())
        record = self._book_step(step, used, loss, step_time_s)
        # Every replica clipped the same averaged gradient, so any one's norm is the step's.
        record.grad_norm = next((res.extra["grad_norm"] for res in results.values() if "grad_norm" in res.extra), None)
        record.update_skipped = any(res.extra.get("update_skipped") for res in results.values())
        return record

    def _book_step(self, step: int, used, loss: float, step_time_s: float) -> StepRecord:
        """Ledger rows for a planned step (its ``used`` ranks' shards used, the rest dropped and,
        if asked, requeued) and the step's record. ``used=None``: a first-N step whose fast set
        nobody knows (``_keep_completed_steps``): N shards' worth used, which ones unknown, so
        its rows say ``used=None`` and nothing is requeued."""
        epoch, shards = self._planned[step]
        known = used is not None
        used = set(used) if known else set()
        dropped = 0
        for r, shard in enumerate(shards):
            self.ledger.record(step, epoch, r, shard, used=(r in used) if known else None)
            if known and r not in used:
                dropped += len(shard)
                if self.requeue_dropped:
                    self.plan.requeue(shard, epoch)
        if not known:  # every rank's shard is the same size (_shards_for): all but N of them dropped
            dropped = sum(len(shard) for shard in shards[self.scaling.num_workers:])
        elif self.requeue_dropped and dropped and step in self._positions:
            # The place recorded at dispatch predates these drops. Requeueing sends one step at a
            # time, so the plan's place now is this step's, drops included: a rollback to this
            # step (_sync_state) replans from it and must not lose them.
            self._positions[step] = self.plan.position.to_dict()
        return StepRecord(step, epoch, loss, step_time_s, 0.0, len(shards),
                          sum(len(shard) for shard in shards) - dropped, dropped, sorted(used))

    def _observe(self, rank: int, res: StepResult) -> None:
        """A rank's step timing for the straggler policy, and its checksum if it sent one."""
        if res.extra.get("computed", True):  # a late first-N rank that skipped has no timing
            self.straggler_policy.observe(rank, res.extra.get("local_time_s", res.compute_time_s))
            if "fast" in res.extra and rank not in res.extra["fast"]:
                self.late_gradients += 1
        if "checksum" in res.extra:
            self._note_checksum(res.step, rank, res.extra["checksum"])

    def _note_rank_done(self, rank: int, results: list[StepResult]) -> None:
        if results:
            self._rank_done[rank] = max(self._rank_done.get(rank, 0), results[-1].step)
        # A step a late first-N replica sat out took no compute: its time says nothing of its speed.
        for res in reversed(results):
            if res.extra.get("computed", True):
                self._step_time_of[rank] = res.step_time_s
                break

    def _collect_late(self, rank: int, results: list[StepResult]) -> None:
        """A window a late rank finished after the others: its timings, checksums, checkpoint parts."""
        self._late_done_at[rank] = time.time()  # on to its next window, if late on more (_late_clocks)
        self._note_rank_done(rank, results)
        for res in results:
            self._observe(rank, res)
            self._merge_ckpt(rank, res)
        # How late it is now, for the decision after this window: a replica that sat the window
        # out (no timing: observe() never ran) kept the late stretch _check_late_hung measured
        # before the gather, and that stale stretch counted again as fresh evidence.
        self._note_lateness([rank])

    def _note_lateness(self, ranks) -> None:
        """How long each of ``ranks`` has been late, to the straggler policy: since it started
        on its oldest window still out (``_late_clocks``; 0: none is out). Why not since that
        window went late: a rank working off a backlog started it later, when it handed back the
        one before. A promoted spare whose cold first step left windows behind (they went late
        while it was in that step) was then scored, right after the step, by the whole cold
        stretch again, counted in full now that it had a step behind it, and evicted while it
        caught up. A slow rank's windows still take it long, and its step times say so too."""
        now = time.time()
        clocks = self._late_clocks()
        for r in ranks:
            self.straggler_policy.observe_pending(r, now - clocks[r][0] if r in clocks else 0.0)

    def _set_meta_after_results(self, step: int) -> None:
        """First-N with requeueing: a step's checkpoint meta is set once its results (or, for a
        step kept in a recovery or a stop, its fast set) are booked, not at dispatch: the
        sampler's current place holds this step's drops and nothing later, one step being sent
        at a time. Other runs set it at dispatch (``_dispatch_all``)."""
        if self.committer is not None and not self._look_ahead:
            self.committer.set_meta(step, self._checkpoint_meta(step, self._position_after(step)))

    def _force_meta(self, step: int) -> None:
        """The committer's meta for ``step``, a step the ranks snapshot off the ``every_n_steps``
        schedule (the run's last, the step after an eviction)."""
        self.committer.set_meta(step, self._checkpoint_meta(step, self._position_after(step)), force=True)

    def _position_after(self, step: int) -> dict:
        """The sampler's place right after ``step``: as recorded when it was handed out (with its
        drops, requeueing: ``_book_step``), else the plan's now. Not the plan's now when it is
        recorded, in either mode: a later step may be handed out already. With requeueing one
        step is sent at a time, yet the step a rank died in stays handed out (kept for the
        replay); a stop seen then ended on the step before, and its checkpoint held the place
        after the lost step. A resume skipped that step's samples (and the requeued drops it
        had taken) for the rest of the epoch."""
        position = self._positions.get(step)
        return position if position is not None else self.plan.position.to_dict()

    def _checkpoint_meta(self, step: int, position: dict) -> dict:
        return {"data_position": position, "world_size": len(self.group.members),
                "global_batch_size": self.batches.size_at(step),
                "batch_schedule": self.batches.pairs(), "generation": self.generation,
                "dataset_size": self.dataset_size, "seed": self.run_config.seed,
                "order_digest": self.plan.digest(int(position["epoch"]))}

    def _check_late_hung(self) -> None:
        """First-N never waits for a late rank, so a rank that stopped making progress would go
        unnoticed: feed how long each has been late to the straggler policy, and kill one whose
        oldest late window has run past ``step_timeout_s`` a step (``_late_clocks``; its death
        then shows up on its refs)."""
        if not self._first_n:
            return
        self._note_lateness([m.rank for m in self.group.members])
        now = time.time()
        timeout = self.failure_config.step_timeout_s
        for r, (start, k) in self._late_clocks().items():
            if now - start > timeout * k and self.group.members[r].name not in self._hung:
                stuck = self._lagging_ranks(only=r)
                if ray.wait(list(stuck), num_returns=1, timeout=0)[0]:
                    # It finished a window since the clock was read (a rank runs its windows in
                    # order: the oldest one is done); the next gather collects it.
                    continue
                self._kill_hung(stuck, f"made no progress: its oldest late window ({k} step(s)) ran past "
                                       f"step_timeout_s={timeout:g}s a step")

    def _lagging_ranks(self, only: int | None = None, exclude: int | None = None) -> dict[Any, int]:
        """The late windows' refs -> their rank (``only``: that rank's; ``exclude``: but its)."""
        return {ref: r for ref, (r, *_) in self._lagging.items()
                if (only is None or r == only) and r != exclude}

    def _late_clocks(self, exclude: int | None = None) -> dict[int, tuple[float, int]]:
        """Each late rank's oldest window still out: since when the rank has been on it, and its
        steps. A rank runs its windows in order, so it started on that one when the fast N were
        done with it or when it handed back the one before (``_collect_late``), whichever came
        later. It may take ``step_timeout_s`` a step of it: when the fast N finish a window of k
        steps, a slow replica may have all k still to run. Why not its whole backlog: each
        window the fast N finish adds one, faster than a hung rank's time runs, so it would
        never be found."""
        clocks: dict[int, tuple[float, int]] = {}
        # In the order the windows went late; a copy: status() reads this from another thread
        # while the training thread changes _lagging.
        for r, since, k in list(self._lagging.values()):
            if r != exclude and r not in clocks:
                clocks[r] = (max(since, self._late_done_at.get(r, 0.0)), k)
        return clocks

    def _late_wait_s(self) -> float:
        """How long ``_wait_late`` waits: ``step_timeout_s``, or on a stop a quarter of the
        driver's ``stop_timeout_s`` at most. Why: the driver kills a stop that outlasts
        stop_timeout_s (60 s by default), and with it the last step's commit and weights; a late
        replica's backlog could take step_timeout_s (120 s) alone, then the release's regroup
        and the final flush."""
        wait = self.failure_config.step_timeout_s
        if self._stop_reason is not None:
            wait = min(wait, self.run_config.stop_timeout_s / 4)
        return wait

    def _wait_late(self, exclude: int | None = None) -> dict[int, BaseException | None]:
        """Let late ranks (but ``exclude``) finish their windows, for up to ``step_timeout_s`` in
        all, and take in those that did. Returns the ranks whose windows did not: rank -> its
        error, or None for one still busy (its windows stay in ``_lagging``). Before an
        eviction these are left alone (a death or a broken group shows up on the rank's next
        call); at the end of the run ``_finish_late`` releases them. Why one timeout in all, not
        one a step as a hang is judged (``_late_clocks``): the fast ranks are done, and waiting
        for a slow replica to work off its backlog (up to the send limit's 64 steps) would only
        delay the end; released, it costs a regroup and the last step's snapshot again."""
        refs = list(self._lagging_ranks(exclude=exclude))
        if not refs:
            return {}
        # In slices: an eviction's wait (``exclude``) ends when a stop comes. The eviction is
        # then given up (``_evict``) and the run's end waits for the late ranks itself; waited
        # out here first, the stop's end came up to step_timeout_s later, past the driver's
        # stop_timeout_s, whose kill took the stop's commit with it.
        wait_s, t0 = self._late_wait_s(), time.monotonic()
        ready = wait_refs(refs, wait_s, self._interrupted)
        if exclude is None and len(ready) < len(refs) and self._interrupted():
            # The run's end: a stop that comes during the wait shortens what is left of it to
            # the stop's share (``_late_wait_s``). Waited out whole (step_timeout_s, 120 s), it
            # outlasted the driver's stop_timeout_s (60 s), whose kill took the last step's
            # commit and the weights with it.
            left = min(wait_s - (time.monotonic() - t0), self._late_wait_s())
            ready += wait_refs([ref for ref in refs if ref not in ready], left)
        unfinished: dict[int, BaseException | None] = {}
        for ref in refs:
            r = self._lagging[ref][0]
            if ref not in ready:
                unfinished.setdefault(r, None)
                continue
            del self._lagging[ref]
            try:
                self._collect_late(r, ray.get(ref))
            except ray.exceptions.RayError as exc:
                # The rank's first failure: its windows run in the order of ``refs``, and one
                # whose loss_fn raised leaves its group, so the next fails as stale (a
                # CollectiveError). Kept last, that took the user's error's place, and the
                # replica was let go as one that lost its group. A window still running before
                # it (None) gives way: the rank's death or error says more than "busy".
                if unfinished.get(r) is None:
                    unfinished[r] = exc
        return unfinished

    @staticmethod
    def _raise_user_errors(unfinished: dict[int, BaseException | None]) -> None:
        """``WorkerError`` for the first rank of ``unfinished`` (``_wait_late``) whose window
        failed in the user's code; deaths, broken groups and busy ranks are the caller's."""
        for r, exc in sorted(unfinished.items()):
            if isinstance(exc, ray.exceptions.RayTaskError) and \
                    not isinstance(getattr(exc, "cause", None), CollectiveError):
                raise _user_failure(r, exc) from None

    def _finish_late(self) -> None:
        """At the end of a run: let late first-N replicas finish their windows, and let go of one
        that cannot. Every step is applied on the fast ranks by now, and nothing more is sent to a
        late replica, so a death or a broken group in its last window would otherwise only show at
        the final checkpoint flush or the replica check: the finished run failed there, or waited
        forever on a hung one (those calls queue behind its window). A replica that died, broke its
        group or is still busy after ``step_timeout_s`` is released and the run ends without it;
        its user error is the user's (WorkerError), as in a step."""
        t0 = time.monotonic()
        unfinished = self._wait_late()
        # What the wait was, as it went: a stop during it shortened it (``_wait_late``).
        waited, limit = time.monotonic() - t0, self._late_wait_s()
        self._lagging.clear()
        self._raise_user_errors(unfinished)
        busy = (f"still busy after step_timeout_s={limit:g}s" if limit == self.failure_config.step_timeout_s
                else f"still busy after {waited:.3g}s, the stop's share (a quarter) of RunConfig.stop_timeout_s")
        gone: dict[int, str] = {}
        for r, exc in unfinished.items():
            if exc is None:
                gone[r] = busy
            elif actor_lost(exc):
                gone[r] = "died"
            elif not isinstance(exc, ray.exceptions.RayTaskError):
                raise exc
            else:  # a broken group: the user's own errors were raised above
                gone[r] = "lost its group"
        if gone:
            self.log("late_released", "late replica(s) " + ", ".join(f"{r} ({why})" for r, why in sorted(gone.items()))
                     + " did not finish the run's last window; released, the run ends without them",
                     ranks=sorted(gone))
            self._release_at_end(gone)
            if self.committer is not None and self.group.members:
                # The others' snapshots still count the released replicas (rank and world size
                # are the group's), so the steps those had not reached can never commit, the
                # last one included. A group without them takes the last step's snapshot again.
                try:
                    while found := self._settle_survivors(set()):
                        # Dead too (its leave said so): out of the group like the released ones,
                        # or the final flush would ask it and fail the finished run.
                        self.log("late_released", f"rank(s) {sorted(found)} found dead as the group re-formed; "
                                 "released too", ranks=sorted(found))
                        self._release_at_end(found)
                    if not self.group.members:
                        raise TrainingFailed("no replica is left to re-form the group")
                    self._form_group(f"late replica(s) {sorted(gone)} released: the last step's checkpoint "
                                     "is taken without them")
                    self._snapshot_last = True
                except (ray.exceptions.RayError, TimeoutError, TrainingFailed) as exc:
                    # The run's steps are done: end it on the checkpoints it has (checkpoint_incomplete
                    # says which) rather than fail it here.
                    self.log("late_released", f"could not re-form the group without the released replica(s) "
                             f"({type(exc).__name__}); the last steps' checkpoints may not commit", ranks=sorted(gone))

    def _release_at_end(self, ranks) -> None:
        """``ranks`` out of the group at the run's end, and the gauges told of the rest, renumbered.
        Why tell them now: left to a group formed after it, the released numbers aged on the
        gauges until the run ended where none forms (no checkpoint storage, or a re-form that
        fails); one that forms tells them again."""
        self.group.remove_ranks(sorted(ranks))
        if self.metrics is not None:
            self.metrics.on_group([m.rank for m in self.group.members])

    def _tune_window(self, worker_times: list[float]) -> None:
        """Automatic ``steps_per_dispatch``: one call spans about ``dispatch_target_s``.

        Measured from the workers' own step times after a few single-step windows; capped at 16
        steps so decisions (eviction, checkpoint commits) are never long behind the workers.
        """
        if self.scaling.steps_per_dispatch or not self._look_ahead:
            return  # fixed by the user, or one step a call (_window_at): nothing to tune or to log
        self._step_times.extend(worker_times)
        if len(self._step_times) >= 4:
            typical = statistics.median(self._step_times)
            # Retune on a real change only: the median step time a quarter or more from the one
            # the window was tuned by (steps wobble on a busy machine). Why not a quarter of the
            # window: for windows under 8 that bar is one step, so a median wobbling by a
            # fraction of a percent around a boundary (0.25 s, 0.125 s, 0.1 s ... for a 0.5 s
            # target) flipped the window on nearly every window (2,1,2,1 ... or 4,5,4,5 ...),
            # each flip an event kept for the whole run: ~1,000 in 20,000 steps at 2-5% jitter.
            tuned = self._window_typical
            if tuned is not None and abs(typical - tuned) < tuned / 4:
                return
            self._window_typical = typical
            window = max(1, min(16, int(self.scaling.dispatch_target_s / max(typical, 1e-6))))
            if window != self._window:
                self._window = window
                self.log("dispatch", f"{window} step(s) per call (median step {typical * 1e3:.1f} ms, "
                         f"target {self.scaling.dispatch_target_s:g} s a call)", steps_per_dispatch=window)

    def _merge_ckpt(self, rank: int, result: Any) -> None:
        extra = result.extra if hasattr(result, "extra") else (result or {})
        if self.committer is None or not extra:
            return
        for step, part in extra.get("ckpt_done", []):
            r, world_size = rank, extra.get("world_size", len(self.group.members))
            if part.get("again"):
                # A second report of a part the rank pushed: as the push named it, by the rank and
                # world size of its snapshot (the rank asked, after a shrink, may be another one).
                r, world_size = int(part.get("rank", r)), int(part.get("world_size", world_size))
                if part.get("sent"):
                    self._await_push(step, r, part.get("generation"))
            self._add_part(step, r, world_size, part)
        for ev in extra.get("ckpt_events", []):
            self._log_storage_event(ev, rank)

    def _await_push(self, step: int, rank: int, generation: int | None) -> None:
        """Wait, at most ``PUSH_WAIT_S``, until the checkpoint thread has taken in ``rank``'s own
        push of its part of ``step`` (``checkpoint_written``), before a flush's second report of
        that part (``WorkerCheckpointer.drain``) is added. For a part the rank sent itself
        (``sent``): every part in blocking mode, a keep_every milestone's in any mode, a pooled
        step the rank completed. Not one another rank was to send: that one may never come.

        Why: the pushes are taken in on the checkpoint thread, the flush's report on this one.
        In blocking mode, taken in first, the rank's part of step s made its push of step s-1,
        still queued there, look skipped (a rank that reports a newer step without an older one
        skipped it), and once s completed, s-1 was stale and never committed, though this mode
        promises every step. A milestone taken in first moved the milestone floor past the
        rank's push of the one before, which was then dropped.

        Why waiting for the push itself holds: a rank's pushes come from one submitter to an
        actor without max_concurrency, which Ray runs in the order sent, so once this one is in
        (or a newer one, or one of a newer group generation: the rank moved on), every earlier
        one is. Not the committer's state: a step another rank's failed write left incomplete
        is never held, and the wait ran out for every rank. A part of a generation a rollback
        left behind is dropped anyway (``_add_part``): no wait."""
        if self._given_up(generation, step):
            return
        want = (int(generation or 0), step)
        with self._pushed_cv:
            came = self._pushed_cv.wait_for(lambda: self._pushed.get(rank, (-1, -1)) >= want,
                                            timeout=self.PUSH_WAIT_S)
        if not came:
            logger.warning("rank %d's checkpoint push of step %d did not come within %gs; taking the part from "
                           "its final report", rank, step, self.PUSH_WAIT_S)

    def _actor_key(self, rank: int) -> str:
        """The actor that holds ``rank`` now, as a key that outlives it (its Ray actor ID): a
        restart gives a new actor the old one's name."""
        # One read of the list: the checkpoint thread calls this while a shrink or a restart may
        # replace it on the training thread (an IndexError between a length check and the index).
        members = self.group.members if self.group is not None else []
        m = members[rank] if 0 <= rank < len(members) else None
        if m is None:
            return f"rank-{rank}"
        actor_id = getattr(m.actor, "_actor_id", None)
        return actor_id.hex() if actor_id is not None else f"{m.name}@{id(m.actor)}"

    def _log_storage_event(self, ev: dict, rank: int | None = None) -> None:
        details = {k: v for k, v in ev.items() if k not in ("message", "rank")}
        if ev.get("event") == "checkpoint_snapshots_dropped" and rank is not None:
            # What a rank said it dropped, as it goes: a rank lost, evicted or restarted before
            # the end's drain (_commit_what_ranks_wrote) would otherwise not be counted at all.
            key = self._actor_key(rank)
            self._snapshot_drops_told[key] = self._snapshot_drops_told.get(key, 0) + int(ev.get("dropped") or 0)
        if ev.get("event") == "checkpoint_committed":
            details.setdefault("lag", max(0, self.step - int(ev["step"])))
            self.log("checkpoint_commit", ev.get("message", ""), **details)
            if self.metrics is not None:
                persist = ev.get("persist_s")
                self.metrics.on_checkpoint(None if persist is None else float(persist),
                                           lag=self.committer.lag(self._progress_step()) if self.committer else None)
        elif ev.get("event") == "checkpoint_deleted":
            self.log("checkpoint_retention", ev.get("message", ""), **details)
        else:
            # Under its own name (storage_outage, storage_refused, checkpoint_agent_lost, ...), as
            # the README names them and as a resume's wait logs its outage (_log_outage_events).
            details.pop("event", None)
            self.log(ev.get("event") or "checkpoint_storage", ev.get("message", str(ev)), rank=rank, **details)

    # ---- gathering and failure detection ----------------------------------------------------
    def _gather(self, refs: list, ranks: list[int], need: int | None = None,
                lagging: dict | None = None) -> dict[Any, Any]:
        """Wait for results; return when ``need`` (default all) of ``refs`` arrived. Raise
        ``Failure`` on loss. Results are keyed by ref.

        ``lagging`` (first-N): refs of earlier windows still running on late ranks, ref -> rank.
        They are watched alongside, so a late rank's death or error is seen here, and their
        results come back if they are ready, but they are never waited for.

        Deaths are seen through the refs (Ray reports a dead actor in tens of milliseconds). A
        hang is seen through heartbeats answered from a separate thread, and through the step
        timeout; a hung actor is killed so its peers' sockets close and they unblock.
        """
        need = len(refs) if need is None else need
        required = set(refs)
        pending = {**dict(zip(refs, ranks)), **(lagging or {})}
        rank_of = dict(pending)
        results: dict[Any, Any] = {}
        got = 0
        dead: set[int] = set()
        collective_failed: set[int] = set()
        user_error: tuple[int, Exception] | None = None  # the first rank whose user code raised, what to raise
        cfg = self.failure_config
        # t0: the step timeout's clock, restarted after a kill and whenever a rank this wait
        # needs reports a step finished (``_check_heartbeats``): the timeout is a step's, and a
        # window of k healthy steps may take k times as long.
        t0 = dispatched = time.time()
        first_problem: float | None = None
        beats: dict[int, Any] = {}
        done_seen: dict[int, int] = {}  # each rank's completed step, as its heartbeats said
        node_suspect = False
        released = aborted = False
        while pending:
            # A heartbeat interval, cut short at the step timeout's and a broken collective's
            # deadlines: a wait of the whole interval checked them only after it, so with
            # heartbeat_interval_s=300 a hung step was killed after 300 s, not step_timeout_s.
            ends = [t0 + cfg.step_timeout_s] + ([first_problem + cfg.collective_timeout_s] if first_problem is not None else [])
            timeout = max(0.01, min(cfg.heartbeat_interval_s, min(ends) - time.time()))
            t_wait = time.perf_counter()
            want = len(pending) if (dead or collective_failed or user_error) else max(1, need - got)
            ready, _ = ray.wait(list(pending), num_returns=min(want, len(pending)), timeout=timeout)
            self._waited_s += time.perf_counter() - t_wait
            if not (dead or collective_failed or user_error) and got + len(ready) >= need:
                # Late windows that finished meanwhile come along for free.
                others = [r for r in pending if r not in ready and r not in required]
                if others:
                    more, _ = ray.wait(others, num_returns=len(others), timeout=0)
                    ready = list(ready) + list(more)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    results[ref] = ray.get(ref)
                    got += ref in required
                except ray.exceptions.RayError as exc:
                    if actor_lost(exc):
                        self._lost(r, dead)
                        node_suspect = node_suspect or _looks_like_node_death(exc)
                    elif isinstance(exc, ray.exceptions.RayTaskError):
                        cause = exc.cause if hasattr(exc, "cause") else None
                        if isinstance(cause, CollectiveError):
                            collective_failed.add(r)
                        else:
                            user_error = user_error or (r, _user_failure(r, exc))
                    else:
                        raise
                if (dead or collective_failed or user_error) and first_problem is None:
                    first_problem = time.time()
            if (dead or collective_failed or user_error) and self._first_n and not released:
                # Survivors may wait on a first-N agreement that the dead can no longer make
                # (fewer than N replicas left); no socket of theirs closes to wake them. A live
                # rank that failed (a broken link, the user's error) has left the group and will
                # not arrive either: left waiting, the survivors sat out collective_timeout_s and
                # one of them was killed as hung. Every survivor, not only those this wait still
                # has a result of: one whose result is in already runs the next window, queued
                # behind it (the look-ahead), where it would wait the same way, and none of this
                # wait's refs would show it.
                released = True
                for m in self.group.members:
                    if m.rank not in dead:
                        m.actor.abandon_first_n.remote(self.generation)
            if (dead or collective_failed or user_error) and not aborted and self._on_nccl():
                # A survivor waiting on NCCL never sees a peer's death: its kernel waits on the
                # GPU for data that will not come, and no socket closes to wake it as on gloo.
                # Its communicators are aborted from its control thread, so its blocking wait
                # raises and it leaves the group like a gloo rank (TrainWorker.abort_collectives).
                aborted = True
                self._abort_collectives(dead | collective_failed | ({user_error[0]} if user_error else set()))
            if not (dead or collective_failed or user_error) and got >= need:
                now = time.time()
                for ref in results:
                    self._last_beat[rank_of[ref]] = now
                return results  # first-N: the caller keeps the late refs
            if not pending:
                break
            now = time.time()
            if first_problem is not None and now - first_problem > cfg.collective_timeout_s:
                # A rank still in its own code (a long forward, a step_fn's micro-batches) has
                # not reached the broken collective yet and fails at it on its own: blamed only
                # once it has been in its code past step_timeout_s. Killed as hung, every
                # survivor still computing went with the dead peer, and the recovery had no one
                # holding the state (a restart from the checkpoint, or without one, no run).
                # Nor one in its collective for less than the group's timeout: it raises there on
                # its own (a peer lost with its node, whose sockets never close, on gloo). Blamed
                # as the last to enter, the survivor that had been computing was killed one check
                # later instead.
                self._kill_hung(self._culprits(pending, own_for_s=cfg.step_timeout_s,
                                               waiting_for_s=self._group_timeout_s()),
                                "did not leave a broken collective", gone=dead)
                first_problem = time.time()
                continue
            if now - t0 > cfg.step_timeout_s:
                if self._progressed(pending, set(ranks), done_seen):
                    t0 = time.time()  # a step of the window finished since the last answer: not hung
                    continue
                # Once something broke, with the broken collective's limits above: a survivor in
                # its collective for less than the group's timeout raises there on its own. Blamed
                # as the last to enter, a healthy survivor was killed when the step timeout came
                # before the group's (step_timeout_s at or under collective_timeout_s, or a long
                # compute before the collective): two ranks lost for one node, as a "hang".
                limits = {} if first_problem is None else {"own_for_s": cfg.step_timeout_s,
                                                           "waiting_for_s": self._group_timeout_s()}
                self._kill_hung(self._culprits(pending, **limits), f"step exceeded step_timeout_s={cfg.step_timeout_s:g}",
                                gone=dead)
                t0 = time.time()  # the peers of a killed rank get a fresh step timeout to fail over
                continue
            if not ready and now - t0 > cfg.heartbeat_interval_s:
                if self._check_heartbeats(pending, beats, done_seen) & set(ranks):
                    t0 = time.time()
        if user_error is not None and not dead:
            raise user_error[1]
        if not dead and not collective_failed:
            return results
        # Late windows that came back in this gather hold steps the fast N finished: their
        # timings, checksums and checkpoint parts count, whatever broke now. Dropped with the
        # failure, a divergence their checksums showed went unseen until a later check, and
        # their parts of those steps never reached the committer.
        for ref, res in results.items():
            if ref not in required and ref in self._lagging:
                self._collect_late(self._lagging.pop(ref)[0], res)
        if not dead:
            # A collective broke but no actor was seen dying: ask who is alive. If everyone is,
            # the group itself broke (a dropped link): rebuild it with the same members.
            dead = self._probe_dead()
        down: set = set()
        if dead:
            # Down only for certain (marked dead, unknown, refusing): a raylet whose connect only
            # timed out may be healthy (one SYN lost), and every rank on its node was killed
            # with it as a node lost. Such a node is suspect: its ranks are settled on their
            # heartbeats while it is asked again (_co_located_losses).
            suspect = unreachable_nodes({self.group.members[r].info.get("node_id") for r in dead}, certain=down)
            lost, down = self._co_located_losses(dead, down, settle=node_suspect or bool(suspect), suspect=suspect)
            dead |= lost
        if not dead:
            kind = "collective"
        elif down:
            # Before the hang check: a crashed host's ranks miss their heartbeats and are killed
            # as hung (_check_heartbeats), mostly before the GCS marks their node dead, and the
            # node lost was told as a hang in the recoveries, the failures metric and the events.
            kind = "node_lost"
        elif any(self.group.members[r].name in self._hung for r in dead):
            kind = "hang"
        else:
            kind = "actor_died"
        raise Failure(dead, kind, detect_s=(first_problem or time.time()) - dispatched,
                      results={rank_of[ref]: res for ref, res in results.items() if ref in required})

    def _group_timeout_s(self) -> float:
        """The process group's (and its store's) timeout: ``collective_timeout_s``, or with
        first-N the larger of it and ``step_timeout_s``. Why: a resting first-N replica posts its
        wait for the update as soon as it applied the last one, so it waits out the fast N's
        whole step, where a DDP rank's collective only waits out its peers' lag. Bounded by
        collective_timeout_s alone, a step longer than that broke the group at every rest, one
        recovery after another. A dead peer still fails the wait at once (its sockets close), and
        a hang is the step timeout's."""
        timeout_s = self.failure_config.collective_timeout_s
        if self._first_n:
            timeout_s = max(timeout_s, self.failure_config.step_timeout_s)
        return timeout_s

    def _on_nccl(self) -> bool:
        return any(m.info.get("backend") == "nccl" for m in self.group.members)

    def _abort_collectives(self, but: set[int]) -> None:
        """Abort this generation's NCCL communicators on every rank not in ``but``, from their
        control threads (``TrainWorker.abort_collectives``); fire and forget."""
        for m in self.group.members:
            if m.rank not in but:
                m.actor.abort_collectives.remote(self.generation)

    def _co_located_losses(self, dead: set[int], down: set, settle: bool,
                           suspect: set = frozenset()) -> tuple[set[int], set]:
        """Other ranks lost with the same node, so a node loss is healed in one rebuild.

        When a raylet dies, its workers do not all die at the same instant: one may still answer
        (or even fail its collective like a survivor) a moment before it exits, and the GCS marks
        the node dead only seconds later. So the node's raylet is asked directly: a raylet that
        refuses connections (or a node the GCS marks dead or does not know) means the node is
        gone, and every rank on it is lost now, alive or not (a worker without its raylet has no
        object store and exits). A raylet that answers means a single process died, the common
        case, and costs one local TCP connect. A raylet that does not answer within a second is
        only suspect (``unreachable_nodes``' ``certain``): one SYN lost to a healthy raylet fails
        a 1 s connect, and taken for a node's death, every healthy rank on that node was killed
        with the one that died. If the death otherwise looks like a node's, or its node is
        suspect (``settle``), wait up to ``node_settle_s`` for the node's other ranks to be
        confirmed dead or alive, asking the raylet again meanwhile (a suspect node with no other
        rank on it too). A node whose raylet timed out every time it was asked, and whose ranks
        answered no heartbeat in the settle (or that has none left), is gone with them: a
        crashed host drops packets (nothing refuses), and the GCS marks it dead only after its
        health checks, ~15 s; left alive, they were found only once their leave() ran out, a
        group timeout later. A rank that answered is alive (a SYN lost).
        ``down`` are the dead ranks' nodes down for certain, ``suspect`` those whose raylet did
        not answer (probed once by the caller); returns the ranks lost with them and the nodes
        found down, settling included.
        """
        nodes = {self.group.members[r].info.get("node_id") for r in dead}
        others = [m for m in self.group.members if m.rank not in dead and m.info.get("node_id") in nodes]
        lost: set[int] = set()
        answered: set[int] = set()
        # Raylets that answered at least once, the caller's probe included. Why not the last
        # probe alone: a raylet that answered mid-settle is up, and a healthy rank on NCCL can be
        # silent for the whole settle (its communicators are aborted on its one control thread,
        # which takes seconds); one SYN lost on the last probe had it killed as a node lost.
        heard = nodes - suspect
        settle = settle or bool(down)
        deadline = time.time() + (self.failure_config.node_settle_s if settle else 0.0)
        while True:
            gone = [m for m in others if m.info.get("node_id") in down]
            for m in gone:
                lost.add(m.rank)
                ray.kill(m.actor, no_restart=True)
            others = [m for m in others if m not in gone]
            # A dead rank's node whose raylet has only timed out so far is asked again even with
            # no other rank of its own on it (every one dead, or one rank per node): left
            # unasked, a crashed host was never found down, and its rank killed for missed
            # heartbeats was told as a hang.
            doubtful = (nodes & suspect) - down - heard
            if not (others or doubtful) or time.time() >= deadline:
                break
            if others:
                refs = {m.actor.heartbeat.remote(): m for m in others}
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.3)
                for ref in ready:
                    try:
                        ray.get(ref)
                        answered.add(refs[ref].rank)
                    except ray.exceptions.RayError:
                        lost.add(refs[ref].rank)
                others = [m for m in others if m.rank not in lost]
            time.sleep(0.1)
            asked = {m.info.get("node_id") for m in others} | doubtful
            suspect = unreachable_nodes(asked, certain=down)
            heard |= asked - suspect
        # Raylets that timed out every time they were asked, on nodes where no rank answered (none
        # left on it at all included): gone, with their silent ranks. A rank that answered shows
        # its host up, and a silent one beside it (its NCCL abort holding its control thread) is
        # left to the rebuild's own checks, not killed as a node lost.
        never = (nodes & suspect) - down - heard - {m.info.get("node_id") for m in others if m.rank in answered}
        silent = [m for m in others if m.info.get("node_id") in never]
        for m in silent:
            lost.add(m.rank)
            ray.kill(m.actor, no_restart=True)
        down |= never
        if lost:
            self.log("node_lost", f"rank(s) {sorted(lost)} went with the node of rank(s) {sorted(dead)}",
                     ranks=sorted(lost))
        return lost, down

    def _culprits(self, pending: dict, own_for_s: float | None = None, waiting_for_s: float | None = None) -> dict:
        """Which pending ranks are stuck in their own code rather than waiting on a peer.
        ``own_for_s``: a rank in its own code is blamed only once it has been in that phase
        longer (else nobody is: it holds the others up, and may yet reach its collective);
        ``waiting_for_s`` the same for the rank waiting on its peers that would be blamed.

        A rank that never reached its collective (phase "compute") holds everyone else up; a
        rank that does not answer its heartbeat is stuck outright. If every pending rank waits
        on its peers (a dead link, say), the one that entered its collective last is blamed.

        Waiting on peers: a collective ("allreduce", "backward+allreduce"), and with first-N a
        step's arrival at the store ("arrive") and a late or resting replica's wait for the
        fast set's update ("late"). Why the last two: taken for a rank's own code, a healthy
        resting replica was killed as hung beside the fast rank that hung in its forward (two
        ranks to heal for one hang: with one spare, a wait for capacity), or instead of a fast
        rank stuck in its collective.

        A rank whose heartbeat says it is gone (``actor_lost``) is no culprit: it is dead, not
        hung, and its pending calls fail on their own, as a death (killed as hung, the failure's
        kind read "hang" and the event said it did not leave the collective). It is killed all
        the same (``_lost``): an ``ActorUnavailableError`` may report an actor that lives, whose
        calls would then never fail. Nobody else is blamed then: its peers wait in
        their collective for it, and the one that entered last would be killed as hung beside it.
        """
        refs = {ref: r for ref, r in pending.items()}
        info, gone = self._heartbeat_answers(refs.values())
        if gone:
            return {}
        return _blamed(refs, info, own_for_s, waiting_for_s)

    def _heartbeat_answers(self, ranks: Iterable[int]) -> tuple[dict, set[int]]:
        """The heartbeats of ``ranks``, asked now and waited for up to ``heartbeat_timeout_s``:
        rank -> its answer (a rank that did not answer is missing), and the ranks whose heartbeat
        says they are gone (``actor_lost``; killed, ``_lost``)."""
        beats = {r: self.group.members[r].actor.heartbeat.remote() for r in ranks}
        ready, _ = ray.wait(list(beats.values()), num_returns=len(beats),
                            timeout=self.failure_config.heartbeat_timeout_s)
        info, gone = {}, set()
        for r, b in beats.items():
            if b in ready:
                try:
                    info[r] = ray.get(b)
                except ray.exceptions.RayError as exc:
                    if actor_lost(exc):
                        self._lost(r, gone)
        return info, gone

    def _lost(self, r: int, dead: set[int]) -> None:
        """Rank ``r``'s call says it is lost (``actor_lost``): into ``dead``, and killed. Why kill
        it: ``ActorUnavailableError`` (a network blip, a raylet restarting) reports an actor
        that may still live, with its sockets open; its peers then waited out the collective
        timeout for it, a healthy survivor was killed as the hung one, and the rank could run
        its next queued window against the survivors' earlier step. Killing a dead one is a no-op."""
        dead.add(r)
        with contextlib.suppress(Exception):
            ray.kill(self.group.members[r].actor, no_restart=True)

    def _kill_hung(self, pending: dict, why: str, gone: Iterable[int] = ()) -> None:
        """Kill the ranks in ``pending`` (ref -> rank) as hung. ``gone``: ranks known dead or
        evicted, which must not be asked to reap them."""
        avoid = {self.group.members[g].name for g in gone}
        # Once a rank: a late first-N replica has several windows pending, each a ref, and one
        # hung rank made as many "hang" events, kills and reaps.
        for r in dict.fromkeys(pending.values()):
            self.log("hang", f"rank {r} {why}; killing it so its peers unblock", rank=r)
            self._hung.add(self.group.members[r].name)
            ray.kill(self.group.members[r].actor, no_restart=True)
            self._reap(self.group.members[r], avoid=avoid)

    def _answer(self, m: Member, ref: Any, timeout_s: float, what: str) -> Any:
        """``ray.get(ref)`` of a recovery's call to ``m``, bounded by ``timeout_s``. A member that
        does not answer in time is killed as hung and the GetTimeoutError raised, for the
        recovery to heal it: its heartbeat (on its control thread) may still answer while its
        main thread is stuck (a deadlock in a leaked DDP reducer, a stopped process), so without
        the kill the recovery's probe found no one lost and the run ended. Before these waits
        had bounds, such a survivor held the run in RECOVERING for good."""
        try:
            return ray.get(ref, timeout=max(0.0, timeout_s))
        except ray.exceptions.GetTimeoutError:
            if m in self.group.members:
                self._kill_hung({ref: m.rank}, f"did not answer {what} within {timeout_s:g}s")
            else:
                ray.kill(m.actor, no_restart=True)
            raise
        except ray.exceptions.ActorUnavailableError as exc:
            # Unavailable (a network blip, its raylet restarting): it may live on, and its
            # heartbeat answer again by the recovery's probe, which then found no rank lost and
            # ended the run ("rebuild failed without a lost rank"). In a recovery, killed and
            # counted lost, as a step's gather does (_lost): healed with the next pass. Not
            # another actor's unavailability passed on through an argument (a state sync's
            # source: Ray raises it as a RayTaskError that is also an ActorUnavailableError):
            # every healthy receiver was killed in the source's place. Nor outside a recovery
            # (the start, the run's end), where nothing heals a rank killed: raised as before.
            if (self.state is State.RECOVERING and m in self.group.members
                    and not isinstance(exc, ray.exceptions.RayTaskError)):
                self.log("rank_lost", f"rank {m.rank} ({m.name}) was unavailable when asked {what}; killed, to be "
                         "healed as lost", rank=m.rank)
                self._hung.add(m.name)
                with contextlib.suppress(Exception):
                    ray.kill(m.actor, no_restart=True)
            raise

    def _send_state(self, source: Member, receivers: list[Member], what: str) -> None:
        """``source``'s state to ``receivers`` through the object store; raises the first error,
        once each receiver was waited for. A receiver that took it is no longer stateless.

        The source is waited for first, bounded on its own (``_state_send_s``): no receiver can
        begin before its ``get_state`` has made the state, and with one deadline for the whole
        sync a source slow to copy a large state used up the receivers' time, and they were
        killed as hung while it was the one behind. A source that makes no state in time is
        killed as hung. The receivers' deadline starts once the state exists (``fetch_local=
        False``: the controller never pulls the state itself)."""
        state_ref = source.actor.get_state.remote()
        sets = [(m, m.actor.set_state.remote(state_ref)) for m in receivers]
        bound = self._state_send_s()
        made, _ = ray.wait([state_ref], timeout=bound, fetch_local=False)
        if not made:
            if source in self.group.members:
                self._kill_hung({state_ref: source.rank}, f"did not make its state for {what} within {bound:g}s")
            raise ray.exceptions.GetTimeoutError(f"rank {source.rank} did not make its state for {what} within "
                                                 f"{bound:g}s")
        failed = None
        deadline = time.monotonic() + bound
        for m, ref in sets:
            try:
                self._answer(m, ref, deadline - time.monotonic(), what)
                # Holds the state now, whatever another member does: a spare that took it
                # must count as a holder if the next pass (a loss while healing) finds no one else.
                self._stateless.discard(m.name)
            except ray.exceptions.RayError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _state_send_s(self) -> float:
        """How long members may take to receive a state (of any size) in a recovery: as long as
        a step may take, at least a collective's timeout."""
        return max(self.failure_config.step_timeout_s, self.failure_config.collective_timeout_s)

    def _reap(self, hung: Member, avoid: set[str] = frozenset()) -> None:
        """SIGKILL a hung rank's process from a live actor on its node (not one named in
        ``avoid``, nor one killed as hung: a dead actor's reap would never run).

        Why on top of ``ray.kill``: that asks the process to exit and force-kills it only after
        Ray's ``kill_worker_timeout_milliseconds`` (5 s by default). A process that answers
        nothing (stopped, stuck in the kernel) costs those seconds, and its peers stay blocked on
        its open sockets meanwhile. A survivor or spare on the same node kills it at once from its
        control thread; with none there, ``ray.kill`` alone finishes the job.
        """
        node, pid = hung.info.get("node_id"), hung.info.get("pid")
        if not node or not pid:
            return
        for other in self._all_actors():
            if other is not hung and other.info.get("node_id") == node and other.name not in self._hung \
                    and other.name not in avoid:
                other.actor.reap.remote(pid)  # fire and forget: the death shows up on the refs
                return

    def _check_heartbeats(self, pending: dict, beats: dict, done_seen: dict[int, int]) -> set[int]:
        """Ask the ranks of ``pending`` for a heartbeat (one in flight per rank, in ``beats``);
        kill one that has not answered within ``heartbeat_timeout_s``. Returns the ranks whose
        answer shows a step finished since what the wait last heard (``_advanced``)."""
        cfg = self.failure_config
        advanced: set[int] = set()
        for ref, r in pending.items():
            if r not in beats:
                beats[r] = (self.group.members[r].actor.heartbeat.remote(), time.time())
        for r, (bref, sent) in list(beats.items()):
            ready, _ = ray.wait([bref], timeout=0)
            if ready:
                if self._beat_advanced(r, bref, done_seen):
                    advanced.add(r)
                del beats[r]
            elif time.time() - sent > cfg.heartbeat_timeout_s:
                stuck = {k: v for k, v in pending.items() if v == r}
                self._kill_hung(stuck, f"missed heartbeats for {cfg.heartbeat_timeout_s:g}s")
                del beats[r]
        if self.metrics is not None:
            now = time.time()
            self.metrics.on_heartbeats({r: now - self._last_beat.get(r, now) for r in set(pending.values())})
        return advanced

    def _progressed(self, pending: dict, needed: set[int], done_seen: dict[int, int]) -> set[int]:
        """The ranks of ``needed`` still in ``pending`` whose completed step is past what the wait
        last heard (``done_seen``, else the step the controller last collected of them), asked
        now. Why at the step timeout: the heartbeats' answers are read once an interval, so
        with ``heartbeat_interval_s`` near ``step_timeout_s`` the answer that showed a window's
        step finishing came after the timeout, and a healthy window of slow steps was killed as
        hung. A hung rank's control thread still answers, with the step it stopped at; a stopped
        process answers nothing, and is killed after this wait of 2 s at most."""
        refs = {self.group.members[r].actor.heartbeat.remote(): r for r in set(pending.values()) & needed}
        if not refs:
            return set()
        ready, _ = ray.wait(list(refs), num_returns=len(refs),
                            timeout=min(self.failure_config.heartbeat_timeout_s, 2.0))
        return {refs[ref] for ref in ready if self._beat_advanced(refs[ref], ref, done_seen)}

    def _beat_advanced(self, r: int, ref: Any, done_seen: dict[int, int]) -> bool:
        """Rank ``r``'s heartbeat ``ref``, answered: the rank is heard from (``_last_beat``), and
        whether its completed step is past what the wait last heard (``_advanced``). An answer
        that is an error is no progress: the rank's death shows on its step's ref."""
        try:
            done = ray.get(ref).get("completed_step")
        except ray.exceptions.RayError:
            return False
        self._last_beat[r] = time.time()
        return self._advanced(r, done, done_seen)

    def _advanced(self, r: int, done: Any, done_seen: dict[int, int]) -> bool:
        """Whether rank ``r``'s heartbeat's completed step ``done`` is past what the wait last
        heard of it (``done_seen``, kept up to date here), or before any answer the step the
        controller last collected of it. Why not the first answer as the baseline: with an
        interval near the step timeout, the first answer came with the timeout, and a step
        finished before it was never seen as progress."""
        if not isinstance(done, int):
            return False
        base = done_seen.get(r, self._rank_done.get(r))
        done_seen[r] = done if base is None else max(base, done)
        return base is not None and done > base

    def _probe_dead(self) -> set[int]:
        """The ranks lost: those whose heartbeat does not answer within ``heartbeat_timeout_s``,
        and those killed as hung, asked nothing. ``ray.kill`` returns before the process is gone,
        and a heartbeat (answered on the control thread) could come back from a rank killed a
        moment before: on a loaded node the recovery that had just killed it then found no rank
        lost and failed the run ("rebuild failed without a lost rank")."""
        killed = {m.rank for m in self.group.members if m.name in self._hung}
        refs = {m.actor.heartbeat.remote(): m.rank for m in self.group.members if m.rank not in killed}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.failure_config.heartbeat_timeout_s)
        dead = set(refs.values()) | killed
        for ref in ready:
            try:
                ray.get(ref)
                dead.discard(refs[ref])
            except ray.exceptions.RayError:
                pass
        return dead

    # ---- recovery ---------------------------------------------------------------------------
    def _recover(self, failure: Failure) -> None:
        """Heal the ring: decide, change membership, sync state, rendezvous. No survivor restarts.

        A second failure while healing (a spare or survivor dying during state sync or the new
        rendezvous) goes round the loop again with the newly lost ranks, and counts as a failure.
        """
        t0 = time.time()
        recomputed_before = self.recomputed
        lost = tuple(sorted(failure.dead))
        healed = set(lost)
        kind = failure.kind
        self._arrived = failure  # its results and queued windows, for the steps the state sync keeps (_results_of)
        self.transition(State.RECOVERING, f"{kind} of rank(s) {list(lost)} in step {self.step + 1}")
        if self.metrics is not None:
            self.metrics.on_rebuild(lost=set(lost))
        retries = 0  # of a decision for the same lost ranks that failed on a Ray error (below)
        while True:
            found = self._settle_survivors(set(lost))
            if found and retries:  # lost as the decision is tried again: a failure of its own
                retries, kind = 0, "failure_during_recovery"
            if not retries:  # a pass tried again for the same lost ranks is no new failure
                self._count_failure(kind)
                # A new wait for capacity for a new failure; a retry waits out what is left of
                # its pass's: restarted each time, a Ray error late in each wait stretched it to
                # (1 + REBUILD_RETRIES) x capacity_timeout_s.
                self._capacity_deadline = None
            if found:
                self.log("failure", f"rank(s) {sorted(found)} lost too as the survivors left the group "
                         "(dead, or killed as hung)", ranks=sorted(found))
                lost = tuple(sorted(set(lost) | found))
            healed |= set(lost)
            self._show_lost(lost)
            self._unhealed = lost  # until the decision is carried out: not in world_size
            # The lost ranks out of the group on the dashboard now: published before only at
            # the transition, with them still in, and not again until the run went on, so for
            # the whole rebuild the dashboard showed the group whole and the spare not yet taken.
            self._publish_membership()
            try:
                # Inside the try: a restart from the checkpoint builds and restores a whole new
                # group, and a rank of it lost meanwhile is healed by this loop like any other.
                self._decide_and_apply(lost, kind)
                self._unhealed = ()
                self._maybe_kill_spare_during_recovery()
                self._sync_state()
                self._form_group(f"recovered from {kind}")
                break
            except (ray.exceptions.RayError, TimeoutError) as exc:
                # The ranks the decision was for are still members (killed) until it is carried
                # out, and their heartbeats do not answer: not lost again. Counted as lost while
                # healing, a Ray error in carrying the decision out (a GCS call of a spare's
                # request in the wait for capacity) was a second failure, and with
                # max_failures=1 one lost rank ended the run.
                pending = set(self._unhealed)
                newly = self._probe_dead() - pending
                if not newly and not pending:
                    raise TrainingFailed(self._fail_message(f"rebuild failed without a lost rank: {exc}")) from exc
                if not newly:
                    retries += 1
                    if retries > REBUILD_RETRIES:
                        raise TrainingFailed(self._fail_message(
                            f"rebuild for rank(s) {list(lost)} failed {retries} times without another rank lost: "
                            f"{type(exc).__name__}: {exc}")) from exc
                    self.log("decision", f"carrying out the decision for rank(s) {list(lost)} failed "
                             f"({type(exc).__name__}: {exc}); no other rank was lost: deciding again "
                             f"({retries} of {REBUILD_RETRIES})", lost=list(lost))
                    continue
                retries = 0
                lost, kind = tuple(sorted(newly | pending)), "failure_during_recovery"
                self.log("failure", f"rank(s) {sorted(newly)} lost while healing: {type(exc).__name__}",
                         ranks=sorted(newly))
        seconds = time.time() - t0
        self._held_through = 0
        self._arrived = None
        self.recoveries.append({"kind": failure.kind, "ranks": sorted(healed), "detect_s": failure.detect_s,
                                "rebuild_s": seconds, "step": self.step + 1,
                                "recomputed": self.recomputed - recomputed_before})
        if self.metrics is not None:
            self.metrics.on_recovery(failure.kind, seconds)
        self._refill_spares()
        self.transition(State.RUNNING, f"rebuilt in {seconds:.2f}s; resuming at step {self.step + 1}")

    def _show_lost(self, lost: tuple[int, ...]) -> None:
        """The lost ranks' heartbeat ages on the dashboard, from their last answers, growing from
        now on. Why: ``on_rebuild`` keeps the age only of a lost rank it still shows, so one found
        lost later in the same recovery (as the survivors left the group, or while healing), or
        lost in an eviction (which had already cleared the ring), left the endpoint instead of
        raising the alert on it."""
        if self.metrics is not None:
            now = time.time()
            self.metrics.on_heartbeats({r: now - self._last_beat.get(r, now) for r in lost})

    def _count_failure(self, kind: str) -> None:
        self.failures += 1
        if self.metrics is not None:
            self.metrics.on_failure(kind)

    def _decide_and_apply(self, lost: tuple[int, ...], kind: str) -> None:
        waited = False
        while True:
            self._refresh_spares(wait=True)
            view = FailureView(lost, kind, len(self.group.members), len(self.group.spares),
                               self.group.pending_spares, self.failures, waited)
            decision = self.failure_policy.decide(view)
            if self._restarting is not None and not isinstance(decision, Fail):
                decision = RestartFromCheckpoint(f"rank(s) {list(lost)} lost while every rank restarted from the "
                                                 "checkpoint; the restart starts again")
            self.log("decision", f"{type(decision).__name__}: {decision.reason}", decision=type(decision).__name__,
                     lost=list(lost))
            if isinstance(decision, ReplaceWithSpares):
                self._replace(lost)
                return
            if isinstance(decision, WaitForCapacity):
                if self._capacity_deadline is None:
                    self._capacity_deadline = time.time() + decision.timeout_s
                deadline = self._capacity_deadline
                missing = len(lost) - len(self.group.spares) - self.group.pending_spares
                for _ in range(max(0, missing)):
                    self.group.request_spare(avoid_nodes=self._nodes_to_avoid())
                self._publish_membership()  # the lost ranks out, the spares asked for building
                self._wait_for_spares(len(lost), deadline)
                self._log_spare_problems()
                self._note_ready_spares()
                self._check_stop(f"waiting for capacity to replace rank(s) {list(lost)}")
                # The wait ends early when a spare it waits for dies or is refused while building
                # (nothing left pending). Decided again with time left, the policy asks for
                # another (or, waiting on spares already building, falls back now that they are
                # fewer); only a wait that ran its course is reported as "no capacity came".
                waited = time.time() >= deadline
                if not waited and self.group.pending_spares == 0 and len(self.group.spares) < len(lost):
                    time.sleep(min(1.0, max(0.0, deadline - time.time())))  # a spare that fails at once: no spin
                continue
            if isinstance(decision, Shrink):
                if decision.replace:
                    self._replace(decision.replace)
                self._shrink(tuple(r for r in lost if r not in decision.replace), decision.size)
                return
            if isinstance(decision, RestartFromCheckpoint):
                self._restart_all()
                return
            raise TrainingFailed(self._fail_message(decision.reason))

    def _wait_for_spares(self, needed: int, deadline: float) -> None:
        """Wait until ``needed`` spares are ready, none is pending any more, a stop comes or
        ``deadline`` passes; every ``CAPACITY_LOOK_UP_S`` take in what the storage said meanwhile.
        Why: a wait for capacity can last minutes, and the survivors' last parts still commit
        during it. Their commits (and outages) were read only after the wait, so the event log
        said nothing of them until then, and the checkpoint-lag gauge held the lag from before
        the failure for the whole wait."""
        while True:
            left = deadline - time.time()
            self.group.collect_spares(block=True, timeout_s=max(0.0, min(left, self.CAPACITY_LOOK_UP_S)),
                                      enough=needed)
            self._drain_storage_events()
            if (len(self.group.spares) >= needed or not self.group.pending_spares
                    or time.time() >= deadline or self._interrupted()):
                return

    def _drain_storage_events(self) -> None:
        """The committer's events (commits, deletions, outages) into the run's log and metrics."""
        if self.committer is not None:
            for ev in self.committer.drain_events():
                self._log_storage_event(ev)

    def _maybe_kill_spare_during_recovery(self) -> None:
        """Fault injection: a promoted spare dies while healing (a double-fault test aid)."""
        for fault in self.fault_plan:
            if fault["kind"] == "kill_spare" and fault.get("recovery", 1) == len(self.recoveries) + 1 \
                    and not fault.get("_done"):
                fault["_done"] = True
                victim = self.group.members[fault["rank"]]
                self.log("fault_injection", f"killing {victim.name}, now rank {victim.rank}, while healing "
                         "(test aid)", rank=victim.rank)
                ray.kill(victim.actor, no_restart=True)
                # ray.kill goes through the GCS while calls go straight to the actor: the sync
                # right after could still be answered, and the fault land after the rebuild.
                _wait_dead(victim.actor, timeout_s=self.failure_config.heartbeat_timeout_s)

    def _fail_message(self, reason: str) -> str:
        latest = self.committer.latest_committed if self.committer is not None else None
        where = (f"latest committed checkpoint: step {latest} at {self.store.location}" if latest is not None
                 else "no checkpoint was committed")
        return f"training stopped at step {self.step}: {reason}; {where}"

    def _settle_survivors(self, dead: set[int]) -> set[int]:
        """Make every survivor leave the broken group (they are unblocked by now), and evict the
        lost. Returns the ranks that leave found dead too, or killed as hung.

        Ranks that die together (a node going, a step that kills two) are not always seen
        together: one whose call was queued behind a late first-N window, or that died a moment
        after the first, shows its death only on its next call, and this is that call. Taken
        in here, they are healed with the others in one decision, not in a second round after
        the rebuild has failed on them.

        A survivor whose leave() is not back within the group's timeout and a margin (longer for
        one whose heartbeat shows it still in its step: ``_ask_to_leave``) is stuck in its own
        code (a hang in a call queued ahead of the leave: a collective would have been broken by
        the loss). It is killed as hung and healed in the same decision, as an eviction does
        with a survivor that does not leave: failing the run for it would turn one lost node
        into a restart from the last checkpoint.
        """
        survivors = [m for m in self.group.members if m.rank not in dead]
        refs, stuck, extra_s = self._ask_to_leave(survivors)
        if stuck:
            self._kill_hung(stuck, f"did not leave the broken group within {self._leave_wait_text(extra_s)}",
                            gone=dead)
        found: set[int] = set(stuck.values())
        for m, ref in zip(survivors, refs):
            if m.rank in found:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError:  # dead, or could not leave its group: lost either way
                found.add(m.rank)
        dead = dead | found
        for m in self.group.members:
            if m.rank in dead:
                self.group.evict(m)
        self._lagging.clear()
        return found

    def _ask_to_leave(self, survivors: list[Member]) -> tuple[list, dict, float]:
        """Ask ``survivors`` to leave the group and wait up to the group's timeout and a margin,
        then up to ``_leave_extension_s`` more for those whose heartbeat shows them still in the
        call queued ahead of the leave, within its limits. Returns the calls' refs, in order,
        those not back by then (ref -> rank): stuck in a call queued ahead of the leave, and the
        seconds the wait was extended by."""
        refs = [m.actor.leave.remote() for m in survivors]
        # The group's timeout and a margin: a call queued ahead of the leave (a join, a step)
        # ends by the group's timeout after it began, then tears its group down; without the
        # margin a survivor whose join waited on a spare that died in the rendezvous could be
        # killed as stuck a moment before its join gave up.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self._group_timeout_s() + LEAVE_MARGIN_S)
        late = {ref: m.rank for m, ref in zip(survivors, refs) if ref not in ready}
        extra_s = self._leave_extension_s(late) if late else 0.0
        if extra_s > 0:
            more, _ = ray.wait(list(late), num_returns=len(late), timeout=extra_s)
            late = {ref: r for ref, r in late.items() if ref not in more}
        return refs, late, extra_s

    def _leave_extension_s(self, late: dict) -> float:
        """How much longer to wait for the leaves of ``late`` (ref -> rank), not back by the
        group's timeout and a margin: long enough for each rank whose heartbeat shows it within
        its call's limits (in its own code for up to ``step_timeout_s``, in a collective for up
        to the group's timeout and the margin) to reach them, at most one more group timeout and
        margin; 0 when no rank is (silent, or past them: stuck, killed now).

        Why: gloo's timeout counts from when a collective was issued, not from when the leave
        was asked. A step queued ahead of it (the look-ahead) issues its collective only after
        its forward and backward: with 25 s of compute and a host gone (no socket closes), a
        leave asked at T+15 ran out at T+85 while the survivors' collective, issued at T+25,
        raised only then; every survivor was killed as hung, no one held the state, and the run
        went back to its checkpoint. The margin counts in the collective's limit for the same
        reason the wait has it: the raise, the group's teardown and the leave come after it."""
        cfg = self.failure_config
        group_s = self._group_timeout_s()
        info, _ = self._heartbeat_answers(late.values())
        need = 0.0
        for ref, r in late.items():
            if r not in info or _blamed({ref: r}, {r: info[r]}, own_for_s=cfg.step_timeout_s,
                                        waiting_for_s=group_s + LEAVE_MARGIN_S):
                continue  # silent, or past its call's limits: stuck
            age = _phase_age(info[r])
            # In a collective: it raises by the group's timeout after it entered. In its own
            # code: it reaches the broken collective by step_timeout_s, and raises there.
            left = group_s - age if _waits_on_peers(info[r]["phase"]) else cfg.step_timeout_s - age + group_s
            need = max(need, left + LEAVE_MARGIN_S)
        return min(need, group_s + LEAVE_MARGIN_S)

    def _leave_wait_text(self, extra_s: float = 0.0) -> str:
        """The wait for survivors' leaves (``_ask_to_leave``), in words: its seconds and the
        settings they come from. The messages said "within collective_timeout_s=60", where with
        first-N the group's timeout is step_timeout_s when that is longer, and the margin and an
        extension came on top."""
        cfg = self.failure_config
        group_s = self._group_timeout_s()
        setting = (f"step_timeout_s={cfg.step_timeout_s:g}, first-N's group timeout"
                   if group_s > cfg.collective_timeout_s else f"collective_timeout_s={cfg.collective_timeout_s:g}")
        more = (f"; extended by {extra_s:.0f}s for the survivors whose heartbeat showed them still in their step"
                if extra_s > 0 else "")
        return f"{group_s + LEAVE_MARGIN_S:g}s ({setting}, + a margin of {LEAVE_MARGIN_S:g}s{more})"

    def _collect_spares(self) -> None:
        """Take in spares that finished building, and say so in the event log."""
        self.group.collect_spares()
        self._log_spare_problems()
        self._note_ready_spares()

    def _note_ready_spares(self, log: bool = True) -> None:
        """Spares the group built since the last call (``take_newly_ready``, whichever collect
        took them in: a wait for capacity's too): each ends a streak of failed spare starts, and
        (with ``log``) is said to be ready."""
        for m in self.group.take_newly_ready():
            self._spare_failures_in_row, self._refill_stop_logged = 0, False
            if log:
                background = bool(m.info.get("started_in_background"))
                self.log("spares", f"{m.name} ready on node {m.info.get('node_ip')}" +
                         (" (built on idle CPU)" if background else ""), spare=m.name, node_id=m.info.get("node_id"),
                         started_in_background=background, ready=len(self.group.spares))

    def _log_spare_problems(self) -> None:
        """Log what the group noted about spares. One that failed before it was ready (lost or
        rejected) counts toward SPARE_START_ATTEMPTS; a note that a spare was asked for again
        without avoiding nodes does not."""
        for kind, message in self.group.take_spare_notes():
            if kind in ("spare_lost", "spare_rejected"):
                self._spare_failures_in_row += 1
            self.log(kind, message)

    def _tend_spares(self) -> None:
        """While ranks train: take in spares that are built, drop dead ones, ask for missing ones.
        Never blocks."""
        self._refresh_spares()
        self._refill_spares()

    def _refill_spares(self) -> None:
        """Ask for as many spares as the pool lacks (``num_backups``/``num_spares``), built in the
        background, unless the last SPARE_START_ATTEMPTS spares all failed before they were ready:
        then say once that the pool stays short."""
        missing = self.scaling.num_hot_spares - len(self.group.spares) - self.group.pending_spares
        if missing <= 0:
            return
        if self._spare_failures_in_row >= SPARE_START_ATTEMPTS:
            if not self._refill_stop_logged:
                self._refill_stop_logged = True
                self.log("spares", f"not starting more spares: the last {SPARE_START_ATTEMPTS} failed before they "
                         f"were ready (see the spare_lost and spare_rejected events); the pool stays at "
                         f"{len(self.group.spares)} of {self.scaling.num_hot_spares}",
                         ready=len(self.group.spares), wanted=self.scaling.num_hot_spares)
            return
        for _ in range(missing):
            avoided = self.group.request_spare(background=True, avoid_nodes=self._nodes_to_avoid())
            where = f" off node(s) {', '.join(n[:12] for n in avoided)}, where a straggler was evicted" \
                if avoided else ""
            self.log("spares", "requested a replacement spare in the background" + where, avoid_nodes=avoided)

    def _refresh_spares(self, wait: bool = False) -> None:
        """Take in spares that are built and drop dead ones (``WorkerGroup.watch_spares``):
        without ``wait`` never blocking, while ranks train; with it, before a recovery uses the
        pool, waiting up to ``heartbeat_timeout_s`` for every spare's answer."""
        self._collect_spares()
        for m, why in self.group.watch_spares(self.failure_config.heartbeat_timeout_s, wait=wait):
            self.log("spare_lost", f"spare {m.name} {why}; dropping it", spare=m.name)

    def _replace(self, lost: tuple[int, ...]) -> None:
        for r in lost:
            spare = self.group.promote_spare(r, avoid_nodes=self._nodes_to_avoid())
            self._stateless.add(spare.name)
            self.straggler_policy.forget(r)
            self._fresh_rank_views([r])
            self.log("replace", f"spare {spare.name} takes rank {r} on node {spare.info.get('node_ip')}",
                     rank=r, spare=spare.name)
        self._unhealed = tuple(r for r in self._unhealed if r not in lost)  # their spares hold them: counted
        self._publish_membership()  # the spares taken out of the pool (an eviction's too)

    def _shrink(self, lost: tuple[int, ...], size: int) -> None:
        """Go on with ``size`` ranks: the lost ones are dropped, and survivors beyond ``size`` (the
        highest ranks, those holding no state first; the policy chose the largest size the global
        batch divides over) stand by as hot spares. They are healthy and warm, so the next failure
        is healed by them instead of shrinking again (or failing below ``min_workers``)."""
        if self.scaling.aggregation == "first_n":
            raise TrainingFailed(self._fail_message("shrinking is not supported with aggregation='first_n'"))
        if size < 1 or self.global_batch_size % size:
            raise TrainingFailed(self._fail_message(
                f"cannot shrink to {size} workers: global batch {self.global_batch_size} is not divisible"))
        # Those holding no state stand by first (a spare promoted in a pass of this recovery that
        # failed): the survivors holding the state must stay, or the sync finds no one to take it from.
        survivors = sorted((m.rank for m in self.group.members if m.rank not in lost),
                           key=lambda r: self.group.members[r].name in self._stateless)
        standby = survivors[size:]
        names = [self.group.members[r].name for r in standby]
        self.group.remove_ranks(list(lost), stand_by=standby)
        self._unhealed = ()  # gone with remove_ranks: counted again, world_size read by status() went below 0
        self._fresh_rank_views()
        self._publish_membership()  # the group shrunk, the survivors standing by counted as spares
        self._stateless.update(names)
        self._split = size
        for r in (*lost, *standby):
            self.straggler_policy.forget(r)
        self.log("shrink", f"continuing with {size} worker(s), {self.global_batch_size // size} samples each" +
                 (f"; {', '.join(names)} stand(s) by as hot spare(s)" if names else ""),
                 world_size=size, standby=names)

    def _restart_all(self) -> None:
        if self.store is None:
            raise TrainingFailed(self._fail_message("restart asked for but RunConfig.storage is not set"))
        if self._restarting is None:
            # A stop asked for before the restart (or while the survivors left the group, which
            # can take the group's timeout): the run ends here, with the survivors' weights and
            # steps (_stop_in_wait). Seen only inside the new group's start, it came after the
            # survivors were killed: every step past the last commit lost, no weights handed
            # back, and a whole group built while the driver's stop_timeout_s ran.
            self._check_stop("deciding to restart every rank from the checkpoint")
        if self.committer is not None:
            self.committer.flush(timeout_s=30)
        if self._restarting is None:
            lost_up_to = max(self._begun_by_survivors(), self.step, self._held_through)
            # Asked before the survivors go: a checkpoint newer than our step keeps the steps it proves.
            fast = self._members_fast_sets(self.group.members, self.step + 1, lost_up_to) if self._first_n else None
            self._restarting = (lost_up_to, fast)
        else:  # again, after a rank of the new group was lost: the old group's members are gone
            lost_up_to, fast = self._restarting
        while True:
            self._unhealed = ()  # the lost ranks go with the old group (before it empties: world_size)
            self.group.shutdown()
            self._new_group()
            try:
                self.group.start(self.scaling.num_replicas)
                break
            except PlacementTimeout as exc:
                # The cluster that is left cannot hold a whole group (a node gone, no spare):
                # the run ends here, saying it was a restart and what checkpoint it has.
                raise TrainingFailed(self._fail_message(f"the restart could not be placed: {exc}")) from None
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    # No rank lost: a rank's own code raised as it was built (the model_fn), as
                    # the start's own check tells them apart (_lost_while_starting). Raised, as
                    # the start raises it; counted as a rank lost, the same error restarted every
                    # rank until max_failures was used up, and the run ended saying ranks were lost.
                    raise
                # A rank lost while the new group builds (the flapping node that chose the
                # restart): the group holds no members yet, so the recovery loop could not name
                # the lost rank. Start them all again, as one more failure.
                self._count_start_loss(exc, "failure_during_recovery", "a rank", "every rank restarted",
                                       "starting them all again")
        self._check_dataset_unchanged()
        self._note_ready_spares(log=False)  # built: they end a streak of failed spare starts
        self._forget_old_actors()
        self._check_storage_shared()  # the new group may stand on nodes the run had not used
        self._split = self.scaling.num_workers
        self._configure_checkpoints(self._all_actors())
        with self._steps_held():  # until the rewind: see _restore_members_from_checkpoint
            position = self._restore_latest(fast)
            if position is None:
                # Back to the start, and no longer descended from an earlier resume's restore
                # (as _abandon_start): kept, the checkpoints of steps up to it were skipped
                # (_finish_checkpoints, _snapshot_after_evict) and result() named that restore.
                self.step, self.restored_from = 0, None
            self._replan(position, self.step)
            # Not below 0: the restored step can be past the controller's (parts reported mid-window).
            self.recomputed += max(0, lost_up_to - self.step)
            self._held_through = 0
            # Steps after the restored one will be trained (and committed) again.
            self._rewind(self.step if position is not None else None, restored=position is not None)
        self._truncate_history(self.step)
        self._restarting = None
        self.log("restart", f"every rank restarted from step {self.step}")

    def _check_dataset_unchanged(self) -> None:
        """A restart built every rank again, and so the dataset: it must be the one the run's
        sample order and data positions index into. The new ranks agree among themselves
        (``WorkerGroup._check_same_dataset``), but nothing compared them with the run's, so a
        ``dataset_fn`` reading a directory that grew or shrank meant indices past its end (an
        IndexError read as the user's) or, grown, new samples never used and old indices naming
        other samples, in silence."""
        size = self.group.dataset_size
        if None not in (size, self.dataset_size) and size != self.dataset_size:
            raise ConfigError(
                f"after a restart dataset_fn built a dataset of {size} samples, where the run's has "
                f"{self.dataset_size}: every start must build the same dataset (the sample order and the "
                "checkpoints' data positions index into it). fit() again resumes from the latest committed "
                "checkpoint and, the dataset having changed, starts a new epoch on it.")

    def _begun_by_survivors(self) -> int:
        """Newest step any reachable rank began (0 if none answers): work a restart throws away."""
        return max((begun for _, (_, begun) in self._ask_progress(self.group.members)), default=0)

    def _ask_progress(self, members: list[Member]) -> list[tuple[Member, tuple[int, int]]]:
        """(member, (newest step completed, newest begun)) of those that answer within
        ``heartbeat_timeout_s``; a lost rank is left out (its work is gone either way)."""
        refs = [m.actor.progress.remote() for m in members]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.failure_config.heartbeat_timeout_s)[0])
        out = []
        for m, ref in zip(members, refs):
            if ref in ready:
                try:
                    out.append((m, ray.get(ref)))
                except ray.exceptions.RayError:
                    pass
        return out

    def _committed_after(self, step: int) -> bool:
        """Whether a checkpoint newer than ``step`` is committed (those in flight first finish)."""
        if self.committer is None:
            return False
        self.committer.flush(timeout_s=30)
        latest = self.committer.latest_committed
        return latest is not None and latest > step

    def _restore_members_from_checkpoint(self) -> None:
        if self.store is None:
            raise TrainingFailed(self._fail_message("no surviving rank holds the training state and "
                                                    "RunConfig.storage is not set"))
        if self.committer is not None:
            self.committer.flush(timeout_s=30)
        fast = self._members_fast_sets(self.group.members, self.step + 1, max(self._planned, default=self.step)) \
            if self._first_n else None  # the ranks that load the checkpoint know none (_restore_latest_once)
        # Held from the listing until the committer has rewound. Why: the old group's parts of
        # later steps still land while the step is read (a flush that timed out, agents
        # finishing writes), and a step they commit made the first pass after the read (still
        # the old timeline's picture) delete the step just restored, with keep_last=1: the newest
        # committed step of the timeline training goes on from.
        with self._steps_held():
            position = self._restore_latest(fast)
            if position is None:
                raise TrainingFailed(self._fail_message("no surviving rank holds the training state and "
                                                        "no checkpoint is committed"))
            self._replan(position, self.step)
            self._rewind(self.step, restored=True)
        self._truncate_history(self.step)
        self.log("state_sync", f"no peer held the state: every rank loaded committed step {self.step}")

    def _replan(self, position: DataPosition | None, step: int) -> None:
        """Training goes on from ``step`` (a start, a loaded checkpoint, a rollback): sample from
        ``position``, the data's place right after it; nothing planned is pending.

        ``step``'s own position is kept, so that a rollback can come back to it: a first-N
        replica late since this step holds its state and no later one (see ``_sync_state``).
        Without it, losing every fast replica before the first position was recorded (the late
        one still at the start) ended a run that a survivor could carry on."""
        self.plan = ShardPlan(self.dataset_size, self.run_config.seed, position)
        self._planned.clear()
        self._positions.clear()
        self._inflight.clear()
        self._positions[step] = self.plan.position.to_dict()

    def _add_history(self, record: StepRecord) -> None:
        self.history.append(record)
        if len(self.history) > HISTORY_KEPT + HISTORY_KEPT // 10:  # trimmed a tenth at a time
            old = self.history[:len(self.history) - HISTORY_KEPT]
            self._trimmed.add(old)
            self._trimmed_through = max(self._trimmed_through, max(h.step for h in old))
            del self.history[:len(old)]

    def totals(self) -> RunTotals:
        """Sums over every step of the run, the trimmed ones included."""
        return replace(self._trimmed).add(self.history)

    def _truncate_history(self, step: int) -> None:
        """After a restart from a checkpoint, steps past it are trained again: forget them once."""
        if step == 0:
            self._trimmed, self._trimmed_through = RunTotals(), 0
        elif step < self._trimmed_through:
            # The restored step is older than every kept record (a checkpoint more than
            # HISTORY_KEPT steps behind): the trimmed sums cannot be taken apart by step.
            self.log("history", f"restarted from step {step}, older than the step records kept; the run's "
                     f"totals still count the steps after it up to {self._trimmed_through}, which are "
                     f"trained again", step=step, trimmed_through=self._trimmed_through)
        self.history = [h for h in self.history if h.step <= step]
        self.ledger.truncate(step)
        if self.metrics is not None:
            self.metrics.on_rewind(step, self.committer.lag(self._progress_step()) if self.committer else None)

    def _sync_state(self) -> None:
        """Bring every rank to the newest state a survivor holds, through the object store.

        Work thrown away is counted here, from what the ranks themselves report (newest step
        begun, newest completed), not from what the controller handed out: with step t+1
        queued behind step t, a failure can land after a survivor finished step t (kept) but
        began t+1 (lost), or before the queued step began at all (nothing lost).
        """
        self._state_sent_to = set()  # set once every member holds the run's state (below)
        # Each rank that answers forgets its begun-and-lost step as it answers; the work is counted
        # here even if another rank fails this call, so a failure while healing (this runs again)
        # counts it once. (Counting twice happened when a spare died after this call succeeded.)
        refs = [m.actor.progress.remote(True) for m in self.group.members]
        held, error = [], None  # (member, (completed, begun)) of the members holding the run's state
        deadline = time.monotonic() + self.failure_config.collective_timeout_s
        for m, ref in zip(self.group.members, refs):
            try:
                done = self._answer(m, ref, deadline - time.monotonic(), "the recovery's progress call")
                if m.name not in self._stateless:
                    held.append((m, done))
            except ray.exceptions.RayError as exc:
                error = error or exc
        begun = max((started for _, (_, started) in held), default=0)
        newest = max((done for _, (done, _) in held), default=0)
        # Steps a holder finished in an earlier pass of this recovery that failed before keeping
        # them, and that no member holds now, were thrown away with that holder: counted as if
        # begun. This pass's up to ``newest`` are the next pass's to count, until kept below.
        begun = max(begun, self._held_through)
        self._held_through = newest
        if error is not None:
            self.recomputed += max(0, begun - newest)
            raise error
        rewound = False  # by a rollback, below: once is enough (the agents' settle waits)
        if newest < self.step or not held:
            # Nobody holds the run's step. A committed checkpoint newer than what is held loses
            # less than a rollback; with no holder at the start of a run, it is newer than the
            # spares' fresh models (ranks report their parts mid-window).
            newer_checkpoint = self._committed_after(newest)
            lost_up_to = max(begun, self.step)
            if held and newest in self._positions and not newer_checkpoint:
                # Every holder of the current state died, but a survivor holds an older one: a
                # first-N replica that was late, still waiting for an update the dead leader
                # never sent. Roll back to its step and replay from there, with the data as it
                # stood after that step.
                self.log("state_sync", f"no survivor holds step {self.step}; rolling back to step {newest}, "
                         f"the newest a survivor holds", step=newest)
                self._replan(DataPosition.from_dict(self._positions[newest]), newest)
                self._rewind(newest or None)  # 0: the start, no checkpoint of it
                rewound = True
                # Before the history's rewind, which sets the lag gauge against the step training
                # is at (_progress_step): with the old step it read the steps given up as lag.
                self.step = newest
                self._truncate_history(newest)
                begun = lost_up_to
            elif newest < self.step or newer_checkpoint:
                # No member holds a state training can go on from: fall back to the newest
                # committed checkpoint, and replay from there.
                self._restore_members_from_checkpoint()
                self._stateless -= {m.name for m in self.group.members}
                self.recomputed += max(0, lost_up_to - self.step)  # the restored step may be past ours
                self._held_through = 0
                return
        self.recomputed += max(0, begun - newest)
        if self._first_n and self.committer is not None and not rewound:
            # The run goes on from ``newest`` in a new generation. A fast replica lost in this
            # recovery may have finished later steps than any survivor, and written its parts
            # of them (a node's agent outlives the rank): those steps are trained again here,
            # differently, and its old part beside a survivor's new one completed a step whose
            # manifest mixed the two histories (or whose checksum then failed on resume). Given
            # up as a rollback gives them up: no step past ``newest`` can have committed, since
            # that needs a survivor's part. Not with data parallel: no rank finishes a step its
            # peers have not.
            self._rewind(newest or None)
        current = [m for m, (done, _) in held if done == newest]
        # No holder at all only at the run's start (a failure in step 1 that took every rank):
        # the spares' fresh models are the start, and one of them gives its state to the others.
        source = current[0] if current else self.group.members[0]
        behind = [m for m in self.group.members if m is not source and m not in current]
        if behind:
            self._send_state(source, behind, "the state sync")
            self.log("state_sync", f"rank {source.rank} sent step-{newest} state to rank(s) "
                     f"{[m.rank for m in behind]} through the object store", source=source.rank)
        self._stateless -= {m.name for m in self.group.members}
        # A step that finished on a survivor before the failure stands: it is accounted, not
        # replayed. (An eviction leaves none: its queued window is booked first, _after_step.)
        self._keep_steps_held_by(source, newest, "completed on a survivor before the rebuild")
        self._held_through = 0
        self._inflight.clear()
        self._state_sent_to = {m.rank for m in behind}

    def _keep_steps_held_by(self, holder: Member, newest: int, how: str) -> None:
        """``holder`` finished the steps after the run's up to ``newest`` (their results never
        came back): book them as done, with the ranks whose gradients made each (first-N, the
        holder's record), and make ``newest`` the run's step."""
        fast = self._fast_sets(holder, newest) if self._first_n else {}
        first = self.step + 1
        self._keep_completed_steps(list(range(first, newest + 1)), how, fast, self._results_of(first, newest))
        self.step = newest

    def _results_of(self, first: int, last: int) -> dict[int, dict[int, StepResult]]:
        """The results of steps ``first``..``last`` that never came back through a gather (step
        -> rank -> result): the broken window's from the ranks that returned it before the failure
        was seen (``Failure.results``), those of the windows queued behind it that finished
        (``Failure.queued``), and those each member finished in a call that then failed
        (``TrainWorker.unreported_results``). Best effort: a member that does not answer within
        ``heartbeat_timeout_s`` is left out, and its steps are kept without its results."""
        failure, self._arrived = self._arrived, None
        if last < first:
            return {}
        # The spares too: a survivor a shrink stood by left the members before this runs. The
        # generation is the broken group's: the rebuild's rendezvous comes after this.
        generation = self.generation
        lists = self._answers(self.group.members + self.group.spares,
                              lambda actor: actor.unreported_results.remote(first, last, generation),
                              self.failure_config.heartbeat_timeout_s)
        if failure is not None:
            lists += failure.results.values()
            # Done by now, if ever: a member runs its calls in order (one thread for the
            # default group), and its unreported_results above came after them.
            for ref in ray.wait(failure.queued, num_returns=len(failure.queued), timeout=0)[0] if failure.queued else []:
                try:
                    lists.append(ray.get(ref))
                except ray.exceptions.RayError:
                    continue
        out: dict[int, dict[int, StepResult]] = {}
        for results in lists:
            for res in results:
                if first <= res.step <= last:
                    out.setdefault(res.step, {})[res.rank] = res
        return out

    @staticmethod
    def _answers(members: list[Member], call: Callable[[Any], Any], timeout_s: float) -> list:
        """What each of ``members`` answers to ``call(actor)`` (one remote call each), all waited
        for together up to ``timeout_s``; one that is dead, gone with its node or slower is left out."""
        refs = []
        for m in members:
            try:
                refs.append(call(m.actor))
            except ray.exceptions.RayError:
                continue
        out = []
        # In the members' order: ray.wait keeps its input's order.
        for ref in ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0] if refs else []:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError:
                continue
        return out

    def _fast_sets(self, holder: Member, newest: int) -> dict[int, list[int]]:
        """First-N: which ranks made each step after the run's up to ``newest``. The holder's
        record first; the other members' fill what it lacks. Why: a spare that took the state in
        a recovery pass that then failed can be the holder of the next pass, and it computed none
        of those steps, so it knows none of their fast sets (every replica's shard of them was
        then booked as used). The holder must answer; the others may not."""
        first = self.step + 1
        fast = dict(self._answer(holder, holder.actor.fast_sets.remote(first, newest),
                                 self.failure_config.collective_timeout_s, "for its first-N fast sets"))
        if len(fast) < newest - first + 1:
            others = [m for m in self.group.members if m.name != holder.name]
            for step, ranks in self._members_fast_sets(others, first, newest).items():
                fast.setdefault(step, ranks)
        return fast

    def _members_fast_sets(self, members: list[Member], first: int, last: int) -> dict[int, list[int]]:
        """First-N: the fast sets of steps first..last that any of ``members`` recorded; a member
        that cannot answer (dead, or gone with its node) is skipped."""
        fast: dict[int, list[int]] = {}
        if last < first:
            return fast
        for answer in self._answers(members, lambda actor: actor.fast_sets.remote(first, last),
                                    self.failure_config.collective_timeout_s):
            for step, ranks in answer.items():
                fast.setdefault(step, ranks)
        return fast

    def _keep_completed_steps(self, steps: list[int], how: str, fast: dict[int, list[int]] | None = None,
                              results: dict[int, dict[int, StepResult]] | None = None) -> None:
        """Account ``steps`` (finished, their results never came back through a gather) as
        done, with one event for all of them: a rebuild in the middle of a dispatch window keeps
        up to a window of steps. ``fast``: first-N, the ranks whose gradients made each step
        (the survivor's record). ``results``: those of the steps' results that some rank still
        had (``_results_of``); a step with any is booked from them (its loss, as
        ``_record_from`` takes it, and time), one with none with a NaN loss and no time."""
        unknown, with_results, booked = [], [], []
        for step in steps:
            if step not in self._planned:
                continue
            booked.append(step)
            got = (results or {}).get(step)
            if got:
                # Their checksums are compared as a gather's are (_observe), before the group is
                # formed again (_form_group forgets what was noted). Never noted, two replicas
                # that diverged at a checksum step were told only at a later check or the run's end.
                for r, res in got.items():
                    if "checksum" in res.extra:
                        self._note_checksum(step, r, res.extra["checksum"])
                # The time of a rank that computed the step: a first-N replica that sat it out
                # or was late spent its time waiting for the update.
                computed = [res.step_time_s for res in got.values() if res.extra.get("computed", True)]
                record = self._record_from(step, got, max(computed or [res.step_time_s for res in got.values()]))
                with_results.append(step)
            else:
                ranks = (fast or {}).get(step)
                if ranks is None and self._first_n:
                    # No replica left knows which N gradients made it (the holder a spare that
                    # computed none of it, the old members gone): booked as unknown, not as all used.
                    unknown.append(step)
                elif ranks is None:
                    ranks = range(len(self._planned[step][1]))  # plain sync: every rank's gradient
                record = self._book_step(step, ranks, float("nan"), 0.0)
                record.loss_known = False
            # Without this, with requeueing a kept step never had meta, so it could not
            # commit: a stop in a wait ended on the step before, and a resume replayed it.
            self._set_meta_after_results(step)
            self._add_history(record)
            if self.metrics is not None:
                self.metrics.on_kept_step(record)
            del self._planned[step]
        if steps:
            which = "booked" if with_results == booked else f"{len(with_results)} of them booked"
            also = f"; {which} with the results that the ranks that finished them still had" if with_results else ""
            self.log("step_kept", f"{_steps_text(steps)} {how}; not replayed{also}", kept=steps,
                     with_results=with_results)
        if unknown:
            which = _steps_text(unknown)
            lost = "not requeued: which of them to requeue is not known" if self.requeue_dropped else "counted"
            self.log("fast_set_unknown", f"{which} kept, but no replica left knows which {self.scaling.num_workers} "
                     f"ranks' gradients made it: its ledger rows say used=None, and its dropped samples are "
                     f"{lost}", steps=unknown)

    # ---- after each step --------------------------------------------------------------------
    def _forget_positions(self, step: int) -> None:
        """Drop the sampler positions recorded for steps no survivor can be back at after ``step``.

        Kept as far back as a first-N survivor may be behind: as far as a late replica may trail
        (``max_trail``: each rank that leads may hold sends to it, so it grows with the world),
        plus a dispatch window; a rollback to that survivor must know where its data stood. With
        a fixed 128 (one leader's 64 sends and a window), a replica late on two leaders' sends
        was past the positions kept, and the loss of every replica ahead of it failed the run
        (or rolled it back to the last commit) while a survivor held a newer state."""
        kept = max_trail(len(self.group.members)) + self._window
        # Positions go in at dispatch in step order (a replan clears them all), so the oldest is first.
        while self._positions and next(iter(self._positions)) < step - kept:
            del self._positions[next(iter(self._positions))]

    def _after_step(self, record: StepRecord, decide_steps: int = 1) -> None:
        """Bookkeeping after a step. ``decide_steps``: on a window's last step, the window's
        length (the straggler policy decides over that many steps); 0 on its other steps."""
        self._planned.pop(record.step, None)
        self._forget_positions(record.step)
        if self.committer is not None:
            for r, res in self._last_results.items():
                self._merge_ckpt(r, res)
            self._drain_storage_events()
            self._set_meta_after_results(record.step)
        if self.metrics is not None:
            self.metrics.on_step(record, self, per_rank=bool(decide_steps))
        # None while an eviction waits for the queued window: the group is about to change, and
        # the policy starts over with the new one (_form_group).
        decision = self.straggler_policy.decide(len(self.group.spares), steps=decide_steps) \
            if decide_steps and self._evict_after_window is None else None
        if isinstance(decision, EvictStraggler) and self._inflight and self._too_late_to_evict(decision) is None:
            # The next window is queued on the workers (the look-ahead). Carried out once its
            # results are in (_run_one_step), so its steps are booked as steps: their loss,
            # timings, checksums and checkpoint parts. Why not wait for it here, as the rebuild
            # did: its results were never read, and the steps the survivors finished in it were
            # then kept by the state sync (_keep_completed_steps) as steps of a failure are, with
            # a NaN loss, no timings, and their checksums compared only at the next checksum
            # step. It costs nothing: the rebuild waited for that window anyway.
            self._evict_after_window = decision
        elif isinstance(decision, EvictStraggler):
            t_evict, waited = time.perf_counter(), self._waited_s
            self._evict_unless_too_late(decision)
            # Its waits (the late windows, the leaves, the state's transfer, the rendezvous) are
            # the workers', not controller time (StepRecord.controller_time_s). Set, not added
            # to: the late windows' gathers inside it count their own waits.
            self._waited_s = waited + time.perf_counter() - t_evict
        elif decision is not None:
            self._note_held_back(decision)
        if self.on_step is not None:
            self.on_step(record, self)
        if self.step % SPARE_CHECK_EVERY == 0:
            self._tend_spares()

    def _too_late_to_evict(self, decision: EvictStraggler) -> Continue | None:
        """``Continue`` naming the straggler when nothing is left for the swap to speed up (the
        run is stopping, or its last step is taken or already sent), else None.

        Why not evict then: it would cost. A stop's rebuild (its waits bounded by step_timeout_s
        and collective_timeout_s, not the stop's) could outlast stop_timeout_s, and the driver's
        kill would take the last commit with it; a first-N victim evicted after the last step
        leaves that step's checkpoint without its part (the promoted spare never snapshots it).
        The end releases a late replica."""
        if self._stop_reason is not None:
            why = "the run is stopping"
        elif self.step >= self.total_steps:
            why = "the run has taken its last step"
        elif self._last_dispatched() >= self.total_steps:
            why = "the run's last step is already sent to the ranks"
        else:
            return None
        return Continue(f"rank {decision.rank} is a persistent straggler, but {why}: not evicted",
                        straggler=decision.rank)

    def _settle_deferred_eviction(self) -> None:
        """The eviction that waited for the queued window (``_after_step``), now that it is in:
        carried out, or named with ``Continue`` if the run's end or a stop came meanwhile."""
        decision, self._evict_after_window = self._evict_after_window, None
        if decision is not None:
            self._evict_unless_too_late(decision)

    def _evict_unless_too_late(self, decision: EvictStraggler) -> None:
        """Evict ``decision``'s straggler, or name it with ``Continue`` when nothing is left for
        the swap to speed up (``_too_late_to_evict``)."""
        late = self._too_late_to_evict(decision)
        if late is not None:
            self._note_held_back(late, why="too_late")
        else:
            self._evict(decision)

    def _note_held_back(self, decision: Continue, why: str = "no_spare") -> None:
        """A persistent straggler the policy would evict but no spare is ready for (the pool is
        refilling, or spares went to failures), or ``why="too_late"`` (``_too_late_to_evict``):
        logged when it starts, not every window. Keyed by the reason too: a straggler held back
        for want of a spare and then found too late to evict was left with the word that it
        would be evicted once a spare was ready."""
        reason = decision.reason
        if why == "no_spare" and self._refill_stop_logged:
            # The refill asks for no more spares (_refill_spares said so in a spares event): "it
            # is evicted once one is ready" alone promised an eviction that would not come. A
            # new reason too, so a straggler already held back hears it when the refill stops.
            reason += f"; the spare refill has stopped after {SPARE_START_ATTEMPTS} failed starts: see the spares event"
            why = "no_spare_refill_stopped"
        held = None if decision.straggler is None else (decision.straggler, why)
        if held is not None and self._eviction_held != held:
            self.log("decision", f"Continue: {reason}", decision="Continue", rank=decision.straggler)
        self._eviction_held = held

    def _note_checksum(self, step: int, rank: int, checksum: int) -> None:
        """Every K steps each replica reports a parameter checksum with its step result (late
        replicas when they get there). A mismatch is an error, never ignored."""
        seen = self._checksums.setdefault(step, {})
        seen[rank] = checksum
        if len(set(seen.values())) > 1:
            raise ReplicaDivergence(f"replicas differ after step {step}: checksums by rank {dict(sorted(seen.items()))}")
        if len(seen) == len(self.group.members):
            del self._checksums[step]
            self.log("checksum", f"all {len(seen)} replicas identical after step {step}", step=step)

    def verify_replicas(self) -> list[int]:
        """Every live replica's parameter checksum at the end, equal or ReplicaDivergence. A rank
        lost after the last step is left out (logged): the others hold the run's weights. So is
        one that does not answer within ``step_timeout_s`` (``_stuck_at_end``): a checksum costs
        less than a step, and without a bound a rank stuck in its own code or on a wedged device
        hung the finished run's end for good."""
        sums, self._answered_at_end = [], []
        refs = [(m, m.actor.param_checksum.remote()) for m in self.group.members if m.name not in self._lost_at_end]
        deadline = time.monotonic() + self.failure_config.step_timeout_s
        for m, ref in refs:
            try:
                sums.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                self._stuck_at_end(m.rank, m.name, f"its replica's checksum within step_timeout_s="
                                   f"{self.failure_config.step_timeout_s:g}s")
                continue
            except ray.exceptions.RayError as exc:
                if not actor_lost(exc):
                    raise
                self._lost_after_end(m.rank, m.name, ", before the replicas' checksums", exc)
                continue
            self._answered_at_end.append(m)
        if not sums:
            stuck = [m.rank for m in self.group.members if self._lost_at_end.get(m.name)]
            why = (f"did not answer within step_timeout_s={self.failure_config.step_timeout_s:g}s (stuck: rank(s) "
                   f"{stuck}) or was lost" if stuck else "was lost")
            raise TrainingFailed(f"every rank {why} after the last step ({self.step}); no weights to hand back")
        if len(set(sums)) != 1:
            raise ReplicaDivergence(f"replicas differ at step {self.step}: checksums {sums}")
        self.log("checksum", f"all {len(sums)} replicas identical at the end (step {self.step})", step=self.step)
        return sums

    def _stuck_at_end(self, rank: int, name: str, what: str) -> None:
        """A rank that answered nothing at the run's end, where no step is running: stuck in its
        own code (a late window's loss_fn) or on a wedged device. Left out of the end as a rank
        lost there is (``_lost_at_end``): the others hold the run's weights, and asking it
        again (the checksums after the final flush) would only wait out another bound. The
        group's shutdown kills it."""
        self._lost_at_end[name] = True
        self.log("hang", f"rank {rank} ({name}) did not answer {what} after the last step ({self.step}): "
                 "left out of the run's end (its replica is not checked; the others hold the weights)", rank=rank)

    def _lost_after_end(self, rank: int, name: str, when: str, exc: BaseException) -> None:
        """A rank found dead after the last step (the end's flush or checksums, a stop): left
        out of the end, its weights and checksum not asked for (``_lost_at_end``)."""
        self._lost_at_end[name] = False
        self.log("rank_lost", f"rank {rank} ({name}) was lost after the last step{when}: "
                 f"{self.first_line(exc, type(exc).__name__)}", rank=rank)

    def _evict(self, decision: EvictStraggler) -> None:
        r = decision.rank
        # The pool is watched only every few steps while ranks train: a spare that died since
        # must not be the one the straggler is swapped for (the victim would be gone first).
        if self._held_back_without_spare(r, "no live spare is ready (the pool lost one)"):
            return
        node = self.group.members[r].info.get("node_id")
        self.transition(State.RECOVERING, f"evicting straggler rank {r}: {decision.reason}")
        if self.metrics is not None:
            self.metrics.on_rebuild(lost=set())
        self.log("decision", f"EvictStraggler: {decision.reason}", decision="EvictStraggler", rank=r, node_id=node)
        t0 = time.time()
        # No window is queued (_after_step waits for it to be booked first). Let the late ranks
        # but the victim finish theirs, so they hold the newest state, then rebuild. First-N
        # survivors never need the victim to finish.
        # A late replica's own error (its loss_fn raised in the window it was late with) is the
        # user's, as in a step or at the run's end: ignored here, the run went on without a word.
        self._raise_user_errors(self._wait_late(exclude=r))
        # The pool again: the waits above can take seconds, and a spare that died meanwhile was
        # promoted, its death then counted as the run's failure (and with no other spare, handed
        # to when_no_spare) for an eviction that was optional. Held back instead, as when no
        # spare was ready to begin with; the group is as it was, so training goes on in it.
        if self._stop_reason is not None:
            # A stop came during the waits: the swap would speed up nothing, and its rebuild
            # (bounded by step_timeout_s and collective_timeout_s, not the stop's) could outlast
            # the driver's stop_timeout_s (``_too_late_to_evict``, which saw no stop yet).
            self._note_held_back(Continue(f"rank {r} is a persistent straggler, but the run is stopping: not "
                                          "evicted", straggler=r), why="too_late")
            self._eviction_given_up(r, "the run is stopping")
            return
        if self._held_back_without_spare(r, "its spare died while the eviction waited for the ranks' windows"):
            self._eviction_given_up(r, "no live spare")
            return
        self._lagging.clear()
        victim = self.group.members[r]
        self._avoid_node(node)
        self.group.evict(victim)
        if self._on_nccl():
            # A survivor in an NCCL kernel with the victim (a first-N leader's bounded send to
            # it) never sees it die: abort the group's communicators so its leave() can run, as
            # a failure's gather does.
            self._abort_collectives({r})
        stuck: dict = {}
        asked = time.time()
        try:
            # Bounded like any group change: a survivor stuck in its own code (a hang in the
            # window it still held) never runs its queued leave(), and nothing else would catch it
            # here. It is killed as hung, and the recovery loop heals it with the victim's rank.
            refs, stuck, extra_s = self._ask_to_leave([m for m in self.group.members if m.rank != r])
            if not stuck:
                ray.get(refs)
                self._replace((r,))
                self._sync_state()
                self._form_group(f"evicted straggler rank {r}")
        except (ray.exceptions.RayError, TimeoutError) as exc:
            # A rank or the promoted spare died while the ring was rebuilt: a failure like any
            # other, healed (and counted against max_failures) by the recovery loop, which
            # rebuilds the ring again from whoever is alive. The victim is already gone.
            newly = self._probe_dead()
            unreplaced = self.group.members[r] is victim  # the rebuild failed before the spare took rank r
            lost = newly - {r} if unreplaced else newly  # the victim was killed on purpose: not a loss
            if not lost:
                raise TrainingFailed(self._fail_message(f"rebuild after evicting rank {r} failed without a "
                                                        f"lost rank: {exc}")) from exc
            self.log("failure", f"rank(s) {sorted(lost)} lost while evicting straggler rank {r}: "
                     f"{type(exc).__name__}", ranks=sorted(lost))
            self._recover(Failure(lost | ({r} if unreplaced else set()), "failure_during_recovery"))
            self._count_eviction(t0)
            return
        if stuck:  # out of the try: a Ray error in this recovery is its own, not the eviction's
            self._kill_hung(stuck, f"did not leave the group within {self._leave_wait_text(extra_s)} while "
                                   f"straggler rank {r} was evicted", gone=(r,))
            # Found by the wait for its leave: detected that long after it was asked.
            self._recover(Failure(set(stuck.values()) | {r}, "hang", detect_s=time.time() - asked))
            self._count_eviction(t0)
            return
        self._count_eviction(t0)
        self._snapshot_after_evict()
        self._refill_spares()
        self.transition(State.RUNNING, f"rank {r} replaced by a spare in {time.time() - t0:.2f}s")

    def _count_eviction(self, t0: float) -> None:
        """An eviction begun at ``t0`` is carried out: the straggler is gone and the group trains
        again. Counted (kind ``straggler``) with its seconds from the decision to now, whether the
        rebuild went through or a failure in it (the promoted spare lost, a survivor hung) was
        healed by the recovery loop. Why the second too: that recovery is counted under its own
        kind, and the eviction, which ``evictions_carried_out`` finds in the events, went
        uncounted. A recovery that failed the run raised before this: no eviction was finished."""
        if self.metrics is not None:
            self.metrics.on_recovery("straggler", time.time() - t0)

    def _eviction_given_up(self, r: int, why: str) -> None:
        """Back to training in the group as it was, after ``_evict`` gave rank ``r``'s eviction up
        past its waits (``why``)."""
        if self.metrics is not None:
            self.metrics.on_group([m.rank for m in self.group.members])  # the ring on_rebuild cleared
            # No group formed, so no rank answered just now (on_group's age of 0): each age is
            # when it was last heard from. Left at 0, a rank silent through the wait for the late
            # windows (up to step_timeout_s) looked freshly heard from.
            now = time.time()
            self.metrics.on_heartbeats({m.rank: now - self._last_beat.get(m.rank, now) for m in self.group.members})
        # Its waits (spares, the late ranks' windows: up to step_timeout_s) are not the next
        # window's step time, as a carried-out eviction's are not (a new generation).
        self._last_done_generation = -1
        self.transition(State.RUNNING, f"eviction of rank {r} {EVICTION_HELD_BACK} {why}")

    def _held_back_without_spare(self, r: int, why: str) -> bool:
        """The spare pool looked at now (``_refresh_spares``); with no live spare, the eviction of
        straggler ``r`` is held back (``_note_held_back``, saying ``why``) and True is returned."""
        self._refresh_spares(wait=True)
        if self.group.spares:
            return False
        self._last_done_generation = -1  # the wait is not the next window's step time (_eviction_given_up)
        self._note_held_back(Continue(f"rank {r} is a persistent straggler, but {why}; it is evicted once one is "
                                      "ready", straggler=r))
        return True

    def _snapshot_after_evict(self) -> None:
        """With ``every_n_steps`` > 1, have the new group checkpoint the step it starts from.

        Why: a step commits once every rank's part of it is in. A first-N victim trailing the
        fast N never wrote its part of the due steps it had not reached, and the spare in its
        place got the state after them, so those steps never commit and the newest checkpoint
        stays up to ``every_n_steps`` behind until the next due step (a DDP victim's writer was
        killed mid-persist the same way). A step that was due needs the parts of the members
        that took the state in the rebuild (``_state_sent_to``: the spare, and a first-N replica
        still late when the survivors left, which never trained it either); the others wrote
        theirs as they trained it. Another step needs every rank's. The snapshots persist in the
        background as any step's, and their parts come back with later results. With
        ``every_n_steps`` = 1 the next step commits anyway."""
        every = self.run_config.checkpoint.every_n_steps
        if self.committer is None or every <= 1 or self.step <= (self.restored_from or 0):
            return
        step = self.step
        self._force_meta(step)
        due = step % every == 0
        # The spare is among them: it starts with no state, so the sync always sends it the state.
        members = [m for m in self.group.members if not due or m.rank in self._state_sent_to]
        if due:
            with self._parts_lock:
                # Not a rank whose part is in already (a DDP victim wrote it before it left): the
                # step's manifest names that file, with its checksum, and a snapshot would write
                # it again (same name) with other bytes (the new actor's RNG state), so a step
                # that committed would fail its checksum on resume. The ranks asked write their
                # file anew, and a part of it that the rank's old actor sends later is dropped
                # (_add_part): the committer keeps a rank's newest report, which would name the
                # old bytes. (A write of the old actor still under way in a node agent when the
                # new one lands can still replace the file: resume then finds the step's
                # checksum wrong and takes the previous commit.)
                members = [m for m in members if not self.committer.holds(step, m.rank)]
                # Added to, not replaced: an earlier eviction's step may not have committed yet,
                # and its old actor's part may still wait in a node agent's pool. A step the
                # committer takes no more parts of (a newer step committed; not a milestone still
                # awaited) goes, which keeps the table as small as the steps in flight.
                self._written_again = {key: gen for key, gen in self._written_again.items()
                                       if self.committer.takes_parts(key[0])}
                self._written_again.update({(step, m.rank): self.generation for m in members})
        refs = [(m.rank, m.actor.snapshot_checkpoint.remote(step)) for m in members]
        for rank, ref in refs:
            try:
                self._merge_ckpt(rank, ray.get(ref, timeout=self.failure_config.heartbeat_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                if _unsaveable(exc) is not None:
                    raise exc.cause from None  # as in a step: no later snapshot could be taken either
                # A lost rank shows in the next step, which heals it; this step then stays
                # uncommitted, as it would have without the snapshot.
                self.log("checkpoint_failed", f"rank {rank} did not snapshot step {step} after the eviction: "
                         f"{type(exc).__name__}", step=step, rank=rank)

    def _avoid_node(self, node: str | None, now: float | None = None) -> None:
        """Keep refill spares off ``node`` for ``straggler_node_avoid_s`` from now (again, if it
        is avoided already: its newest straggler counts)."""
        avoid_s = self.failure_config.straggler_node_avoid_s
        if node and avoid_s > 0:
            self._straggler_nodes[node] = (time.monotonic() if now is None else now) + avoid_s

    def _nodes_to_avoid(self, now: float | None = None) -> set[str]:
        """The nodes spares stay off now; a node whose time is up is dropped, with an event."""
        now = time.monotonic() if now is None else now
        for node, until in list(self._straggler_nodes.items()):
            if now >= until:
                del self._straggler_nodes[node]
                self.log("spares", f"node {node[:12]} may host spares again: a straggler was evicted from it "
                         f"{self.failure_config.straggler_node_avoid_s:g}s ago (straggler_node_avoid_s)",
                         node_id=node)
        return set(self._straggler_nodes)

    def _avoided_for(self, now: float) -> dict[str, float | None]:
        """For status(): the nodes spares stay off at ``now``, read only (``_nodes_to_avoid``
        drops expired ones), with the seconds left; None for the rest of the run."""
        return {node: None if until == math.inf else until - now
                for node, until in self._straggler_nodes.copy().items() if until > now}  # copy: the step thread edits

    def _finish_checkpoints(self) -> None:
        """Commit what the ranks have written, and the last step even when ``every_n_steps``
        skips it: a run that finishes or is stopped at step 37 with ``every_n_steps=10`` ends
        on a committed step 37, so ``fit()`` again continues from there instead of replaying
        seven steps (or, first-N, replaying them on other fast sets)."""
        if self.committer is None:
            return
        final = None
        every = self.run_config.checkpoint.every_n_steps
        if (every == 0 or self.step % every or self._snapshot_last) and self.step > (self.restored_from or 0):
            final = self.step
            self._force_meta(final)
        if self._commit_what_ranks_wrote(final, 60, "final checkpoint") and \
                (self.committer.latest_committed or 0) < self.step and self.step > (self.restored_from or 0):
            # Every handed-over step is committed, yet not the last: some rank's part of it never
            # came. Known case: a late first-N replica released at the end (late_released) took
            # its part of the steps it had not reached, and the others' snapshots still count it.
            self.log("checkpoint_incomplete", f"the run ends at step {self.step}, but its newest committed checkpoint "
                     f"is step {self.committer.latest_committed}: a rank's part of the later steps never came; "
                     f"fit() again resumes from step {self.committer.latest_committed}",
                     step=self.step, latest=self.committer.latest_committed)

    def _commit_what_ranks_wrote(self, final: int | None, timeout_s: float, what: str, lost_ok: bool = False) -> bool:
        """Have every rank finish its pending writes (and snapshot ``final``, see
        ``TrainWorker.flush_checkpoint``), then commit every complete step; False if storage did
        not take them within ``timeout_s``. ``lost_ok``: a rank that does not answer within
        ``heartbeat_timeout_s`` (lost in a recovery, or still busy: a late window queued before
        the flush, a rank stuck in its own code) is skipped, what it wrote and reported is all
        there is of it; the others' reports still count. Otherwise one that does not answer
        within ``step_timeout_s + timeout_s`` is stuck, and left out of the run's end
        (``_stuck_at_end``). A rank whose snapshot of ``final``
        found the state unsaveable: the complete steps are committed, then its
        ``UnsaveableState`` raised, as in a step."""
        members = [m for m in self.group.members if m.rank not in self._unhealed]  # the lost ones: nothing to ask
        refs = [(m.rank, m.name, m.actor.flush_checkpoint.remote(final)) for m in members]
        keys = {r: self._actor_key(r) for r, _, _ in refs}
        unsaveable: UnsaveableState | None = None
        # Otherwise a snapshot of ``final`` (bounded as a step is) and the rank's own wait for its
        # writes (bounded by its writer's close timeout, which storage is given ``timeout_s`` to
        # beat here too): a rank past both is stuck, and without a bound it hung the run's end.
        fc = self.failure_config
        bound = f"heartbeat_timeout_s={fc.heartbeat_timeout_s:g}s" if lost_ok else \
            f"step_timeout_s + {timeout_s:g}s = {fc.step_timeout_s + timeout_s:g}s"
        deadline = time.monotonic() + fc.step_timeout_s + timeout_s
        for r, name, ref in refs:
            try:
                report = ray.get(ref, timeout=fc.heartbeat_timeout_s if lost_ok else max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                self.log("checkpoint_failed", f"rank {r} ({name}) did not finish its writes within {bound} ({what}); "
                         "its steps not yet reported stay uncommitted", rank=r)
                if not lost_ok:
                    self._stuck_at_end(r, name, f"the {what}'s flush within {bound}")
                continue
            except ray.exceptions.RayError as exc:
                if _unsaveable(exc) is not None:
                    unsaveable = unsaveable or exc.cause
                    continue
                if not actor_lost(exc):
                    raise
                # Lost after its last step (the run's end, a stop): every step trained, and what it
                # wrote and reported is all there is of it; the steps it still owed a part of stay
                # uncommitted (checkpoint_incomplete says where fit() again resumes). Failing the
                # run for it would throw away a finished run's weights.
                self._lost_after_end(r, name, f" ({what})", exc)
                continue
            if report and "snapshots_dropped" in report:
                self._snapshot_drops[keys[r]] = int(report["snapshots_dropped"])
            self._merge_ckpt(r, report)
        committed = self.committer.flush(timeout_s=timeout_s)
        self._drain_storage_events()
        if self.committer.halted:  # the lease was lost: nothing was committed, for that reason
            self._check_lease()
        if not committed:
            self.log("checkpoint_flush_timeout", f"{what} not committed within {timeout_s:g}s; storage may be down")
        if unsaveable is not None:
            raise unsaveable
        return committed

    def _newest_live_member(self) -> tuple[Member, int] | None:
        """A stop in a wait: the rank, of those not lost, holding the newest step, and that step
        (the ranks may be out of their group, and one may have finished a step another had
        not), or None if none answers, or none holds a step yet (stopped while starting). Its
        weights are the run's so far: without storage, all there is of it."""
        live = [m for m in self.group.members if m.rank not in self._unhealed and m.name not in self._stateless]
        best, (best_step, _) = max(self._ask_progress(live), key=lambda answer: answer[1][0], default=(None, (-1, 0)))
        # Weights nothing trained or restored, or older than the run's step: not the run's.
        return (best, best_step) if best_step > 0 and best_step >= self.step else None

    def _snapshots_dropped(self) -> int:
        """Every actor's dropped snapshots: its total at the end's drain where it answered one (the
        drop events are sent at most once a minute), else what its events said as they came."""
        told, drained = self._snapshot_drops_told, self._snapshot_drops
        return sum(max(told.get(k, 0), drained.get(k, 0)) for k in told.keys() | drained.keys())

    @property
    def _world_size(self) -> int:
        """Ranks in the group, the lost ones not yet replaced or shrunk away left out, and those
        lost after the last step (``_lost_at_end``: the result counted them)."""
        return len(self._counted_members()) if self.group else 0

    def _counted_members(self) -> list[Member]:
        """The members ``_world_size`` counts: not lost and not yet replaced or shrunk away, nor
        lost after the last step. One read of the list (another thread may replace it)."""
        return [m for m in list(self.group.members) if m.rank not in self._unhealed and m.name not in self._lost_at_end]

    def result(self, include_state: bool) -> dict:
        final = {}
        holder = None
        if include_state and self.group is not None and self.group.members:
            if self._stopped_while is None:
                # Checked at the run's end (run_for); here only for a run_for that did not get there.
                final["replica_checksums"] = self._replica_sums if self._replica_sums is not None \
                    else self.verify_replicas()
                holder = self._answered_at_end[0]
            elif self._stop_holder is not None:
                holder = self._stop_holder[0]
        if holder is not None:
            # Handed on as a reference the driver resolves: deserializing tensors here would
            # import torch into the controller (see elastic/_lazy.py). Waited for without
            # fetching, so it exists before the workers are shut down.
            ref = holder.actor.model_state.remote()
            ray.wait([ref], timeout=self.failure_config.step_timeout_s, fetch_local=False)
            final["model_state_ref"] = [ref]  # in a list: Ray must not resolve it on the way out
        totals = self.totals()
        out = {
            "steps": self.step,
            "history": [asdict(h) for h in self.history],
            "totals": asdict(totals),
            "events": [asdict(e) for e in self.events],
            "recoveries": list(self.recoveries),
            "failures": self.failures,
            "recomputed_steps": self.recomputed,
            "late_gradients": self.late_gradients,
            "agreed_steps": self.agreed_steps,
            "ledger": [asdict(e) for e in self.ledger.entries],
            "dropped_samples": totals.dropped,
            "checkpoint_snapshots_dropped": self._snapshots_dropped() if self.committer is not None else None,
            "restored_from": self.restored_from,
            "checkpoint": None,
            "state": self.state.value,
            "stop_reason": self._stop_reason,
            "stopped_while": self._stopped_while,
            "world_size": self._world_size,
        }
        if self.committer is not None:
            out["checkpoint"] = {"location": self.store.location, "latest_step": self.committer.latest_committed}
        out.update(final)
        return out

    # ---- status for the CLI and dashboard ---------------------------------------------------
    def rank_rows(self, spares: bool = True) -> list[dict]:
        """One row per active rank, then (``spares``) one per spare, ready or still building."""
        scores = self.straggler_policy.scores()
        now = time.time()
        rows = []
        # rank -> since when it has been on its oldest window still out, as the policy reads it
        # (_note_lateness). From when that window went late, a replica working off a backlog
        # showed the whole backlog's stretch as its step time, long after it sped up.
        late = {r: start for r, (start, _) in self._late_clocks().items()}
        if self.group is None:
            return rows
        # While the group is rebuilt nobody asks the survivors for heartbeats (a wait for
        # capacity can take minutes): their ages are not shown (None, "-"), as the gauge drops
        # them (RunMetrics.on_rebuild). Shown, each survivor's age grew red, "about to be counted
        # lost", like the lost rank's. The lost ranks, members until the decision is carried
        # out, say so, and their ages go on growing.
        rebuilding, unhealed = self.state is State.RECOVERING, set(self._unhealed)
        for m in self.group.members:
            done = min(self._rank_done.get(m.rank, self.step), self.step)
            lost = m.rank in unhealed
            rows.append({
                "rank": m.rank, "name": m.name, "node_ip": m.info.get("node_ip"), "node_id": m.info.get("node_id"),
                "node_rank": m.node_rank,
                "local_rank": m.local_rank, "pid": m.info.get("pid"), "role": "active",
                "state": "lost" if lost else "late" if m.rank in late else self.state.value,
                "step": done, "behind_steps": self.step - done,
                "step_time_s": self._shown_step_time(m.rank, late.get(m.rank), now),
                "heartbeat_age_s": None if rebuilding and not lost else now - self._last_beat.get(m.rank, now),
                # None with no score yet (the warm-up, a rank's cold first step): not "typical".
                "straggler_score": scores.get(m.rank),
            })
        if not spares:
            return rows
        pool = [(m, "ready") for m in self.group.spares] + [(m, "building") for m in self.group.building_spares]
        for m, state in pool:  # a spare still building has no node or pid yet: Ray has not placed it
            rows.append({"rank": None, "name": m.name, "node_ip": m.info.get("node_ip"),
                         "node_id": m.info.get("node_id"), "node_rank": None,
                         "local_rank": None, "pid": m.info.get("pid"), "role": "spare", "state": state,
                         "step": None, "behind_steps": None, "step_time_s": None, "heartbeat_age_s": None,
                         "straggler_score": None})
        return rows

    def _shown_step_time(self, rank: int, late_since: float | None, now: float) -> float | None:
        """A rank's step time for the gauge and `elastic status`: the newest it computed, or, while
        it is late, at least how long it has been late. Why: a replica fast so far and now stuck in
        one long step showed its last fast time (a fix before showed nothing then, which left a
        replica late every window with no step time at all)."""
        last = self._step_time_of.get(rank)
        if late_since is None:
            return last
        return max(last or 0.0, now - late_since)

    def status(self) -> dict:
        history = self.history  # read once: the step thread may put another list there (_truncate_history)
        last = history[-1] if history else None
        # The newest known loss, as result.metrics["loss"] (trainer.last_loss): a kept step whose
        # result no rank had is passed over (the progress bar showed its NaN), a model's NaN is not.
        known = next((h for h in reversed(history) if h.loss_known), None)
        return {
            "run": self.run_config.name, "state": self.state.value, "step": self.step,
            "total_steps": self.total_steps, "loss": known.loss if known else None,
            # Only while training: during a rebuild the last step's rate was shown as the run's.
            "samples_per_s": (last.samples / last.step_time_s)
            if last and last.step_time_s and self.state is State.RUNNING else None,
            "straggler_factor": self.failure_config.straggler_factor,
            "heartbeat_timeout_s": self.failure_config.heartbeat_timeout_s,
            "world_size": self._world_size,
            "spares": len(self.group.spares) if self.group else 0,
            "spares_building": self.group.pending_spares if self.group else 0,
            # Nodes refill spares stay off (a straggler was evicted there) -> seconds left, None
            # for the rest of the run (straggler_node_avoid_s=inf; JSON has no infinity).
            "avoided_nodes": self._avoided_for(time.monotonic()),
            "failures": self.failures, "recoveries": len(self.recoveries), "ranks": self.rank_rows(),
            "waiting_for": self._waiting_for,
            "checkpoint": {"latest": self.committer.latest_committed if self.committer else None,
                           "lag": self.committer.lag(self._progress_step())
                           if self.committer else None,
                           "storage_outage": (self._resume_outage is not None and self._resume_outage.active)
                           or (self.committer is not None and self.committer.in_outage)},
        }


def _split_wall(wall: float, worker_times: list[float]) -> list[float]:
    """A window's wall time split over its steps: each step's slowest rank time, plus an equal
    share of what the controller added; scaled down when those times add up to more than the wall.

    Why they can: each rank times its own steps back to back, and the slowest rank of one step
    is not the slowest of the next (in DDP a rank's step includes waiting for the others, in
    first-N five processes share the cores), so the sum of the per-step maxima overstates the
    window. Added up unscaled, on the benchmark workload (4 DDP ranks, 2 cores), they made
    training read ~13% slower than the wall clock (13.1k samples/s against 15.4k over the run),
    and first-N ~20%: so the run's samples_per_s and the ratios between modes were off.
    Scaled, the steps' times add up to the wall time between one window's results and the
    next, which is what the run spent."""
    busy = sum(worker_times)
    if busy > wall > 0:
        return [t * wall / busy for t in worker_times]
    share = max(0.0, wall - busy) / len(worker_times)
    return [t + share for t in worker_times]


EVICTION_HELD_BACK = "held back:"  # then why: "no live spare", "the run is stopping"


def evictions_carried_out(events: list[dict]) -> list[dict]:
    """The ``EvictStraggler`` decision events (``Result.events``) of the evictions carried out.
    Why not every such decision: ``_evict`` logs it before it looks at the spare pool a last
    time, and one held back then (its transition back to running says ``EVICTION_HELD_BACK``)
    left the straggler in place."""
    out, decision = [], None
    for e in events:
        if e["kind"] == "decision" and e["details"].get("decision") == "EvictStraggler":
            decision = e
        elif decision is not None and e["kind"] == "transition" and e["details"].get("new") == "running":
            if EVICTION_HELD_BACK not in e["message"]:
                out.append(decision)
            decision = None
    return out


def _blamed(refs: dict, info: dict, own_for_s: float | None = None, waiting_for_s: float | None = None) -> dict:
    """``Controller._culprits``' choice, from the pending ``refs`` (ref -> rank) and the
    heartbeats' ``info`` (rank -> answer; a rank missing did not answer): the silent ranks, else
    those in their own code (for more than ``own_for_s``, if given), else the one that entered
    its collective last (if in it for more than ``waiting_for_s``, if given). How long a rank has
    been in its phase is read on its own clock (its answer's ``time`` against its
    ``phase_since``): against the controller's, a node's clock skew counted too."""
    def longer(r: int, limit: float | None) -> bool:
        return limit is None or _phase_age(info[r]) > limit

    silent = {ref: r for ref, r in refs.items() if r not in info}
    if silent:
        return silent
    own = {ref: r for ref, r in refs.items() if not _waits_on_peers(info[r]["phase"])}
    if own:
        return {ref: r for ref, r in own.items() if longer(r, own_for_s)}
    # A late replica waits on the fast set's leader, who waits in the collective: blamed
    # only when no rank waits in one.
    collective = [r for r in info if "allreduce" in info[r]["phase"]] or list(info)
    # The shortest time in it, not the latest phase_since: clocks differ by node.
    last = min(collective, key=lambda r: _phase_age(info[r]))
    return {ref: r for ref, r in refs.items() if r == last and longer(r, waiting_for_s)}


def _phase_age(answer: dict) -> float:
    """How long a rank had been in its phase when it answered its heartbeat, on its own clock."""
    return answer.get("time", answer["phase_since"]) - answer["phase_since"]


def _waits_on_peers(phase: str) -> bool:
    """A rank in ``phase`` (``TrainWorker._enter``) waits on other ranks, not on its own code:
    in a collective, or (first-N) at the step's arrival count or for the fast set's update."""
    return "allreduce" in phase or phase in ("arrive", "late")


def _storage_unavailable(exc: BaseException) -> BaseException | None:
    """The ``StorageUnavailable`` behind ``exc`` (raised here, or by a rank reading a checkpoint),
    else None: storage that kept failing with transient errors, as opposed to a permanent error."""
    from elastic.checkpoint.storage import StorageUnavailable

    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else exc
    return cause if isinstance(cause, StorageUnavailable) else None


def _user_failure(rank: int, exc: "ray.exceptions.RayTaskError") -> Exception:
    """What a step ends the run with when ``rank``'s user code raised ``exc``: the
    ``UnsaveableState`` a snapshot found (the training state took on something no checkpoint can
    store after the set-up's check passed: the same state on every rank, with the fix in its
    message), as it is; any other error as the rank's ``WorkerError``, with its traceback."""
    return _unsaveable(exc) or WorkerError(rank, str(exc))


def _unsaveable(exc: BaseException) -> UnsaveableState | None:
    """The ``UnsaveableState`` a rank raised behind ``exc`` (a snapshot or the writer's set-up
    found a state no checkpoint can store), else None. Every path that reads a rank's error
    ends the run with it as it is (a step, a late window, the eviction's snapshot, the end's
    flush, the writers' set-up)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, UnsaveableState) else None


_NODE_DEATH_MARKERS = ("node has died", "node died", "node is dead", "socket closed")


def _steps_text(steps: list[int]) -> str:
    """``step 7``, or ``steps 7-9`` for consecutive steps, first to last."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _raylet_reachable(node_id: str | None) -> bool:
    """Whether the raylet of ``node_id`` accepts a TCP connection (the node is up)."""
    return not unreachable_nodes({node_id})


def _wait_dead(actor, timeout_s: float) -> bool:
    """Whether ``actor`` was seen dead within ``timeout_s`` (asked every 0.1 s)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(actor.heartbeat.remote(), timeout=max(0.1, deadline - time.time()))
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayError as exc:
            if actor_lost(exc):
                return True
            raise
        time.sleep(0.1)
    return False


LEAVE_MARGIN_S = 10.0  # beyond the group's timeout, for survivors asked to leave (_ask_to_leave)


def actor_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a call to an actor, says the actor is gone or cannot be
    reached. Ray reports most deaths as ``RayActorError`` (ActorDiedError, ActorUnavailableError),
    but an actor its memory monitor killed fails its pending calls with ``OutOfMemoryError``, and
    a node's death or a crashed process can come as ``NodeDiedError``, ``WorkerCrashedError`` or
    a result lost with its node (``ObjectLostError``): none of them a RayActorError, and each
    ended the run where a death is healed. Not lost: the actor's own code raised
    (``RayTaskError``), a wait ran out (``GetTimeoutError``), the call was cancelled."""
    if isinstance(exc, ray.exceptions.RayActorError):  # a RayTaskError too when a call inside the actor's died
        return True
    return isinstance(exc, ray.exceptions.RayError) and not isinstance(
        exc, (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError, ray.exceptions.TaskCancelledError))


def _looks_like_node_death(exc: BaseException) -> bool:
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return True
    text = str(exc).lower()
    return any(m in text for m in _NODE_DEATH_MARKERS)
