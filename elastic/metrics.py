"""Dashboard metrics through ``ray.util.metrics``, tagged with run and rank.

Ray exports custom metrics with a ``ray_`` prefix, so ``elastic_step_time_s`` shows up as
``ray_elastic_step_time_s`` in Prometheus and in the dashboard's Metrics view. Only numbers and
run/rank/kind tags leave here: never a storage URL or a credential.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class RunMetrics:
    """Created lazily inside the controller actor (metrics objects are per process)."""

    def __init__(self, run: str):
        self.run = run
        self._m = None
        self._ranks: set[str] = set()  # ranks the per-rank gauges were last set for

    def __getstate__(self):
        return {"run": self.run, "_m": None, "_ranks": set()}

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
                "persist_s": Gauge("elastic_checkpoint_persist_seconds", "Seconds the last checkpoint commit took",
                                   tag_keys=("run",)),
                "ckpt_lag": Gauge("elastic_checkpoint_lag_steps", "Steps since the newest committed checkpoint",
                                  tag_keys=("run",)),
                "grad_norm": Gauge("elastic_grad_norm", "2-norm of the last step's averaged gradient, before "
                                   "clipping (with max_grad_norm)", tag_keys=("run",)),
                "dropped": Counter("elastic_dropped_samples_total",
                                   "Samples whose gradient was dropped (first-N); a step replayed after a "
                                   "rollback counts again, where Result.metrics counts it once", tag_keys=("run",)),
            }
        return self._m

    def _safe(self, fn) -> None:
        try:
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
                m["samples"].set(record.samples / record.step_time_s, tags=run)
            self._set_membership(m, record.world_size, len(controller.group.spares), controller.group.pending_spares)
            self._set_step_done(m, record)
            if record.grad_norm is not None:
                m["grad_norm"].set(record.grad_norm, tags=run)
            if per_rank:
                rows = controller.rank_rows(spares=False)
                for row in rows:
                    tags = {"run": self.run, "rank": str(row["rank"])}
                    m["heartbeat_age"].set(row["heartbeat_age_s"], tags=tags)
                    m["straggler"].set(row["straggler_score"], tags=tags)
                    m["rank_behind"].set(row["behind_steps"], tags=tags)
                    # No result this window (a late first-N replica, one sitting out): NaN, "no
                    # value". Left unset, the gauge kept the rank's last fast step time, so a
                    # straggler looked healthy on the very panel meant to show it.
                    step_time = row["step_time_s"]
                    m["rank_step_time"].set(float("nan") if step_time is None else step_time, tags=tags)
                self._forget_ranks(m, {str(row["rank"]) for row in rows})
            if controller.committer is not None:
                m["ckpt_lag"].set(controller.committer.lag(record.step), tags=run)
        self._safe(update)

    def _forget_ranks(self, m, ranks: set[str]) -> None:
        """Ranks gone since the last update (the group shrank) get NaN, "no value": a gauge keeps
        its last value for as long as the process lives, and a rank that no longer exists would
        go on showing its last straggler score or heartbeat age on dashboards and alerts."""
        for rank in self._ranks - ranks:
            tags = {"run": self.run, "rank": rank}
            for name in ("heartbeat_age", "straggler", "rank_behind", "rank_step_time"):
                m[name].set(float("nan"), tags=tags)
        self._ranks = ranks

    def on_heartbeats(self, ages: dict[int, float]) -> None:
        """Heartbeat ages while the controller waits on a step, so the gauge grows on a rank
        that is hung or lost: in data parallel no step completes then, and ``on_step`` does
        not run."""
        def update(m):
            for rank, age in ages.items():
                m["heartbeat_age"].set(age, tags={"run": self.run, "rank": str(rank)})
            # Known from now on, so a shrink before the next per-rank update still blanks them
            # (_forget_ranks): a rank hung in the first window, then renumbered away, kept
            # showing its heartbeat age for as long as the process lived.
            self._ranks = self._ranks | {str(rank) for rank in ages}
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
        m["world_size"].set(world_size, tags=run)
        m["spares"].set(spares, tags=run)
        m["spares_building"].set(building, tags=run)

    def _set_step_done(self, m, record) -> None:
        """The step gauge and the dropped-samples counter, for a step booked as done."""
        run = {"run": self.run}
        m["step"].set(record.step, tags=run)
        if record.dropped:
            m["dropped"].inc(record.dropped, tags=run)

    def on_failure(self, kind: str) -> None:
        self._safe(lambda m: m["failures"].inc(1, tags={"run": self.run, "kind": kind}))

    def on_recovery(self, kind: str, seconds: float) -> None:
        def update(m):
            tags = {"run": self.run, "kind": kind}
            m["recoveries"].inc(1, tags=tags)
            m["recovery_s"].set(seconds, tags=tags)
        self._safe(update)

    def on_checkpoint(self, persist_s: float) -> None:
        self._safe(lambda m: m["persist_s"].set(persist_s, tags={"run": self.run}))
