"""Dashboard metrics through ``ray.util.metrics``, tagged with run and rank.

Ray exports custom metrics with a ``ray_`` prefix, so ``elastic_step_time_s`` shows up as
``ray_elastic_step_time_s`` in Prometheus and in the dashboard's Metrics view. Only numbers and
run/rank/kind tags leave here: never a storage URL or a credential.
"""

from __future__ import annotations

import logging
import math
import threading
import time

logger = logging.getLogger(__name__)

STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

# Ray's default metrics_report_interval_ms: how often a process exports its metrics.
RAY_REPORT_INTERVAL_S = 10.0


def refresh_interval_s() -> float:
    """How often the gauges are set again: half Ray's export interval (see ``RunMetrics``)."""
    try:
        import ray

        # Ray's own setting, read where Ray reads it; private, hence the fallback to its default.
        interval = max(ray._config.metrics_report_interval_ms(), 1000) / 1000.0
    except Exception:
        interval = RAY_REPORT_INTERVAL_S
    return interval / 2


# The per-rank gauges, heartbeat age first (a lost rank's keeps growing through a rebuild).
PER_RANK = ("heartbeat_age", "straggler", "rank_behind", "rank_step_time")


class RunMetrics:
    """Created lazily inside the controller actor (metrics objects are per process).

    Why the gauges are set again every few seconds (``_refresh``): on Ray 2.60 (OpenTelemetry)
    a process exports a gauge's value once after it was set and then forgets it, and the node's
    dashboard agent keeps an exported value for two export intervals (~20 s). A gauge set only
    when something happens (the last recovery's seconds, the spare pool during a wait for
    capacity, every per-step gauge while a long step runs) dropped off Prometheus ~20 s later:
    a degraded run went blank on its dashboard exactly when it mattered. A thread sets each
    gauge's last value again every half export interval while the run lives; once the run has
    ended (``close``) they age out of the endpoint within ~20 s. Counters and the histogram are
    cumulative and need none of this.
    """

    def __init__(self, run: str):
        self.run = run
        self._m = None
        self._ranks: set[str] = set()  # ranks the per-rank gauges were last set for
        self._last: dict[tuple[str, tuple], float] = {}  # (gauge, tags) -> its last value
        self._since: dict[tuple[str, tuple], float] = {}  # heartbeat series -> monotonic time of that answer
        self._lock = threading.RLock()  # reentrant: _forget_ranks drops a series while holding it
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None

    def __getstate__(self):
        return {"run": self.run}

    def __setstate__(self, state):
        self.__init__(state["run"])

    @staticmethod
    def _series(name: str, tags: dict) -> tuple[str, tuple]:
        return name, tuple(sorted(tags.items()))

    def _set(self, m, name: str, value: float, tags: dict) -> None:
        """Set a gauge and keep its value for the refresher. A heartbeat age is kept as the time
        of the answer, and the refresher sets it as the age then: it grows on a rank that is
        lost or hung while nothing else updates it (a long wait for capacity, a recovery)."""
        series = self._series(name, tags)
        with self._lock:  # with the refresher's sets: it must not put back a value set over
            m[name].set(value, tags=tags)
            self._last[series] = value
            if name == "heartbeat_age" and math.isfinite(value):
                self._since[series] = time.monotonic() - value
            if self._refresher is None and not self._closed.is_set():
                self._refresher = threading.Thread(target=self._refresh, name="elastic-metrics-refresh", daemon=True)
                self._refresher.start()

    def _drop(self, name: str, tags: dict) -> None:
        """Stop refreshing a gauge series: it ages out of the endpoint."""
        with self._lock:
            self._last.pop(self._series(name, tags), None)
            self._since.pop(self._series(name, tags), None)

    def _refresh(self) -> None:
        every = refresh_interval_s()
        while not self._closed.wait(every):
            self.refresh()

    def refresh(self) -> None:
        """Set every gauge again with its last value (the refresher's tick); a heartbeat age as
        the seconds since that answer. Under the lock: a series blanked and dropped meanwhile
        (``_forget_ranks``) was set back to its stale value once."""
        if self._closed.is_set() or self._m is None:
            return
        with self._lock:
            now = time.monotonic()
            for series, value in self._last.items():
                name, tags = series
                since = self._since.get(series)
                try:
                    self._m[name].set(value if since is None else now - since, tags=dict(tags))
                except Exception:  # metrics must never stop training
                    logger.debug("metrics refresh failed", exc_info=True)

    def close(self) -> None:
        """The run has ended: its gauges are no longer set again, and leave the endpoint."""
        self._closed.set()

    def _metrics(self):
        if self._m is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            rank_tags = ("run", "rank")
            self._m = {
                "step_time": Histogram("elastic_step_time_s", "Wall time of a training step (s)",
                                       boundaries=STEP_BUCKETS, tag_keys=("run",)),
                "samples": Gauge("elastic_samples_per_s", "Training throughput (samples/s)", tag_keys=("run",)),
                "heartbeat_age": Gauge("elastic_heartbeat_age_s", "Seconds since a rank last answered",
                                       tag_keys=rank_tags),
                "straggler": Gauge("elastic_straggler_score", "Rank step time / median step time of the other ranks",
                                   tag_keys=rank_tags),
                "rank_step_time": Gauge("elastic_rank_step_time_s", "Last step time of a rank (s)", tag_keys=rank_tags),
                "rank_behind": Gauge("elastic_rank_behind_steps",
                                     "Steps a rank trails the run's newest step (first-N: a late replica)",
                                     tag_keys=rank_tags),
                "world_size": Gauge("elastic_world_size", "Active ranks", tag_keys=("run",)),
                "spares": Gauge("elastic_spares_available", "Hot spares ready to join", tag_keys=("run",)),
                "spares_building": Gauge("elastic_spares_building", "Hot spares asked for and still starting",
                                         tag_keys=("run",)),
                "step": Gauge("elastic_step", "Last completed step", tag_keys=("run",)),
                "failures": Counter("elastic_failures_total", "Worker failures by kind", tag_keys=("run", "kind")),
                "recoveries": Counter("elastic_recoveries_total", "Completed recoveries by kind",
                                      tag_keys=("run", "kind")),
                "recovery_s": Gauge("elastic_recovery_seconds", "Seconds the last recovery took",
                                    tag_keys=("run", "kind")),
                "persist_s": Gauge("elastic_checkpoint_persist_seconds",
                                   "Seconds from the last committed step's snapshot to its commit", tag_keys=("run",)),
                "ckpt_lag": Gauge("elastic_checkpoint_lag_steps", "Steps since the newest committed checkpoint",
                                  tag_keys=("run",)),
                "grad_norm": Gauge("elastic_grad_norm", "2-norm of the last step's averaged gradient, before "
                                   "clipping (with max_grad_norm)", tag_keys=("run",)),
                "dropped": Counter("elastic_dropped_samples_total",
                                   "Samples whose gradient was dropped (first-N); a step replayed after a "
                                   "rollback counts again, where Result.metrics counts it once", tag_keys=("run",)),
                "skipped": Counter("elastic_skipped_updates_total",
                                   "Steps whose update was skipped (mixed_precision='fp16': the gradient "
                                   "overflowed and the loss scale backed off); a step replayed after a rollback "
                                   "counts again, one kept in a rebuild without its results does not",
                                   tag_keys=("run",)),
            }
        return self._m

    def _safe(self, fn) -> None:
        """``fn(metrics)``, under the lock: every update's reads and sets are of one moment with
        the other threads' (the refresher, the run's end's heartbeat thread). A group formed on
        the step thread while the end's heartbeats published left a released rank's number
        ageing on the gauge (``on_heartbeats``)."""
        try:
            with self._lock:
                fn(self._metrics())
        except Exception:  # metrics must never stop training
            logger.debug("metrics update failed", exc_info=True)

    def on_step(self, record, controller, per_rank: bool = True) -> None:
        """Run-level figures for every step; the per-rank gauges only when ``per_rank`` (once per
        dispatch window: they are sampled every few seconds, and setting ~3 per rank per step
        costs the controller CPU the workers could use)."""
        def update(m):
            run = {"run": self.run}
            m["step_time"].observe(record.step_time_s, tags=run)
            if record.step_time_s > 0:
                self._set(m, "samples", record.samples / record.step_time_s, run)
            self._set_membership(m, record.world_size, len(controller.group.spares), controller.group.pending_spares)
            self._set_step_done(m, record)
            if record.grad_norm is not None:
                self._set(m, "grad_norm", record.grad_norm, run)
            if per_rank:
                rows = controller.rank_rows(spares=False)
                for row in rows:
                    tags = {"run": self.run, "rank": str(row["rank"])}
                    self._set(m, "heartbeat_age", row["heartbeat_age_s"], tags)
                    # No score yet (the warm-up, the rank's cold first step): NaN, "no value",
                    # not 1.0, which said "typical" of a spare three times slower.
                    score = row["straggler_score"]
                    self._set(m, "straggler", float("nan") if score is None else score, tags)
                    self._set(m, "rank_behind", row["behind_steps"], tags)
                    # No step time yet (none computed since the group formed): NaN, "no value".
                    # Left unset, the gauge kept a predecessor's or the last group's value.
                    step_time = row["step_time_s"]
                    self._set(m, "rank_step_time", float("nan") if step_time is None else step_time, tags)
                self._forget_ranks(m, {str(row["rank"]) for row in rows})
            if controller.committer is not None:
                # Against the newest step any rank finished, as the commits' and status()'s lag:
                # against this record's step, the gauge flipped between the two.
                self._set(m, "ckpt_lag", controller.committer.lag(controller._progress_step()), run)
        self._safe(update)

    def _forget_ranks(self, m, ranks: set[str]) -> None:
        """Ranks gone since the last update (the group shrank) get NaN, "no value", once, and are
        no longer refreshed, so their series leave the endpoint: a rank that no longer exists
        would otherwise go on showing its last straggler score or heartbeat age on dashboards
        and alerts."""
        for rank in self._ranks - ranks:
            self._blank(m, rank, PER_RANK)
        self._ranks = ranks

    def _blank(self, m, rank: str, names) -> None:
        """``rank``'s series of ``names`` set to NaN once and no longer refreshed, so they leave
        the endpoint."""
        tags = {"run": self.run, "rank": rank}
        for name in names:
            with self._lock:  # NaN and the drop in one hold: the refresher sets no stale value between
                m[name].set(float("nan"), tags=tags)
                self._drop(name, tags)

    def on_rebuild(self, lost: set[int]) -> None:
        """The group is being rebuilt (a recovery of the ``lost`` ranks, an eviction): nothing
        trains, so throughput is 0; the old ring's step times, scores and lags leave the
        endpoint, and so do the heartbeat ages of every rank but the lost ones, until a new group
        forms (``on_group``). Why: the last step's throughput stayed on the dashboard for the
        whole recovery, each survivor's heartbeat age grew as if it were hung (no one asks the
        survivors for heartbeats while the ring is rebuilt: a wait for capacity can take
        minutes), and an evicted straggler's score went on showing on the rank number its
        replacement took. A lost rank's age goes on growing: the alert on it should fire."""
        def update(m):
            self._set(m, "samples", 0.0, {"run": self.run})
            keep = {str(rank) for rank in lost} & self._ranks
            for rank in self._ranks:
                self._blank(m, rank, [name for name in PER_RANK if not (name == "heartbeat_age" and rank in keep)])
            self._ranks = keep
        self._safe(update)

    def on_group(self, ranks: list[int]) -> None:
        """A group formed: each rank answered just now (its join), and its step time, score and
        lag are not known until its first window (NaN, "no value")."""
        def update(m):
            for rank in ranks:
                tags = {"run": self.run, "rank": str(rank)}
                self._set(m, "heartbeat_age", 0.0, tags)
                for name in PER_RANK[1:]:
                    self._set(m, name, float("nan"), tags)
            self._forget_ranks(m, {str(rank) for rank in ranks})
        self._safe(update)

    def on_rewind(self, step: int, lag: int | None) -> None:
        """Training went back to ``step`` (a restart from a checkpoint): the step gauge and the
        checkpoint lag say so now, not once the first step after it completes."""
        def update(m):
            run = {"run": self.run}
            self._set(m, "step", step, run)
            if lag is not None:
                self._set(m, "ckpt_lag", lag, run)
        self._safe(update)

    def on_heartbeats(self, ages) -> None:
        """Heartbeat ages while the controller waits on a step, so the gauge grows on a rank
        that is hung or lost: in data parallel no step completes then, and ``on_step`` does
        not run. ``ages``: rank -> seconds, or a function returning them, called under the lock
        every update holds (``_safe``): for a caller on another thread than the one
        that forms groups (the run's end's heartbeat thread), whose rank numbers may change
        between reading them and publishing. Read first, a late replica released meanwhile
        kept its old number, published after the new group's ``on_group`` had forgotten it, and
        a rank that no longer existed aged on the gauge until the run ended."""
        def update(m):
            published = {str(rank): age for rank, age in (ages() if callable(ages) else ages).items()}
            for rank, age in published.items():
                self._set(m, "heartbeat_age", age, {"run": self.run, "rank": rank})
            # Known from now on, so a shrink before the next per-rank update still blanks them
            # (_forget_ranks): a rank hung in the first window, then renumbered away, kept
            # showing its heartbeat age for as long as the process lived.
            self._ranks = self._ranks | set(published)
        self._safe(update)

    def on_membership(self, world_size: int, spares: int, building: int) -> None:
        """Group size and spare pool at every state change (a failure, a rebuild, an eviction),
        not only after a step: during a recovery, a wait for capacity or a failed run no step
        completes, and the gauges showed the pool before the failure (a spare counted as
        available after it was promoted)."""
        self._safe(lambda m: self._set_membership(m, world_size, spares, building))

    def on_kept_step(self, record) -> None:
        """A step kept after a rebuild (finished, its result never came back): it is booked
        without ``on_step``, so its drops and the step gauge are counted here."""
        self._safe(lambda m: self._set_step_done(m, record))

    def _set_membership(self, m, world_size: int, spares: int, building: int) -> None:
        run = {"run": self.run}
        self._set(m, "world_size", world_size, run)
        self._set(m, "spares", spares, run)
        self._set(m, "spares_building", building, run)

    def _set_step_done(self, m, record) -> None:
        """The step gauge and the dropped-samples and skipped-updates counters, for a step booked
        as done."""
        run = {"run": self.run}
        self._set(m, "step", record.step, run)
        if record.dropped:
            m["dropped"].inc(record.dropped, tags=run)
        if record.update_skipped:
            m["skipped"].inc(1, tags=run)

    def on_failure(self, kind: str) -> None:
        self._safe(lambda m: m["failures"].inc(1, tags={"run": self.run, "kind": kind}))

    def on_recovery(self, kind: str, seconds: float) -> None:
        def update(m):
            tags = {"run": self.run, "kind": kind}
            m["recoveries"].inc(1, tags=tags)
            self._set(m, "recovery_s", seconds, tags)
        self._safe(update)

    def on_checkpoint(self, persist_s: float | None, lag: int | None = None) -> None:
        """A step committed: the seconds from its snapshot to its commit (None: not known), and
        the lag now (the per-step update left it as it was before the run's last commits)."""
        def update(m):
            run = {"run": self.run}
            if persist_s is not None:
                self._set(m, "persist_s", persist_s, run)
            if lag is not None:
                self._set(m, "ckpt_lag", lag, run)
        self._safe(update)
