"""Failure policy: given a lost set of ranks and what capacity is left, decide how to heal.

It never touches an actor. The controller asks, gets a decision with its reason, logs it, and
carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config import FailureConfig
from elastic.policies.decisions import (
    Decision,
    Fail,
    ReplaceWithSpares,
    RestartFromCheckpoint,
    Shrink,
    WaitForCapacity,
)


@dataclass(frozen=True)
class FailureView:
    """What the controller knows when it asks."""

    lost_ranks: tuple[int, ...]
    kind: str  # "actor_died", "node_lost", "hang", "collective"
    num_active: int
    spares_ready: int
    spares_pending: int
    failures_so_far: int  # including this one
    waited: bool = False  # a WaitForCapacity already ran its course (capacity_timeout_s) for this failure


class FailurePolicy:
    def __init__(self, config: FailureConfig, num_workers: int, global_batch: int | None = None):
        """``global_batch``: a shrunk run keeps it, so it must divide over the new size (None: any size)."""
        self.config = config
        self.min_workers = config.min_workers if config.min_workers is not None else num_workers
        self.global_batch = global_batch

    def shrink_size(self, survivors: int) -> int | None:
        """The largest size from ``min_workers`` up to ``survivors`` that the global batch divides
        over, or None. Why not always ``survivors``: 4 ranks with a global batch of 64 that lose
        one cannot go on as 3, and going on as 2 (the third survivor standing by) beats failing a
        run whose config promised it could shrink to 2."""
        for size in range(survivors, self.min_workers - 1, -1):
            if size >= 1 and (self.global_batch is None or self.global_batch % size == 0):
                return size
        return None

    def decide(self, view: FailureView) -> Decision:
        cfg = self.config
        lost = view.lost_ranks
        if view.failures_so_far > cfg.max_failures:
            return Fail(f"failure {view.failures_so_far} exceeds FailureConfig.max_failures={cfg.max_failures}")
        if not lost:
            # The group broke with every rank alive (a link dropped): on_failure is for a lost
            # rank, and none is; the same members form the group again. With "restart" every
            # rank was rebuilt from the checkpoint, with "fail" the run ended, for a network blip.
            return ReplaceWithSpares(f"no rank lost ({view.kind}): the same members form the group again", ())
        action = cfg.on_failure
        if action == "replace":
            if view.spares_ready >= len(lost):
                return ReplaceWithSpares(f"{view.spares_ready} hot spare(s) ready for rank(s) {list(lost)}", lost)
            action = cfg.when_no_spare
            why = f"only {view.spares_ready} spare(s) ready for {len(lost)} lost rank(s)"
            if action != "wait" and not view.waited and view.spares_ready + view.spares_pending >= len(lost):
                # Spares still building (a refill after an earlier failure) are waited for before
                # when_no_spare's fallback. Why: a shrink is for the rest of the run (nothing grows
                # it back) and a restart or a failure loses far more than the seconds a spare
                # needs to finish; the fallback still comes if they are not ready in time.
                return WaitForCapacity(f"{why}, {view.spares_pending} building; waiting up to "
                                       f"{cfg.capacity_timeout_s:g}s for them before when_no_spare={action!r}",
                                       lost, cfg.capacity_timeout_s)
        else:
            why = f"FailureConfig.on_failure={cfg.on_failure!r}"
        return self._fallback(action, view, why)

    def _fallback(self, action: str, view: FailureView, why: str) -> Decision:
        cfg = self.config
        lost = view.lost_ranks
        remaining = view.num_active - len(lost)
        if action == "wait":
            # Capacity is spares: those ready now (built while the run trained, or during the
            # wait) heal the failure whether "wait" is the first choice or the fallback.
            if view.spares_ready >= len(lost):
                return ReplaceWithSpares(f"{why}; {view.spares_ready} hot spare(s) ready for rank(s) {list(lost)}",
                                         lost)
            if view.waited:
                return Fail(f"{why}; no capacity came within capacity_timeout_s={cfg.capacity_timeout_s:g}s")
            return WaitForCapacity(f"{why}; waiting up to {cfg.capacity_timeout_s:g}s for capacity", lost,
                                   cfg.capacity_timeout_s)
        if action == "shrink":
            if not cfg.allow_shrink:
                return Fail(f"{why}; shrinking is not allowed (FailureConfig.allow_shrink=False)")
            if view.spares_ready >= len(lost):
                # Ready spares keep the size: with on_failure="shrink" these are survivors an
                # earlier shrink stood by (they hold a bundle each; shrinking again would leave
                # them idle for the rest of the run).
                return ReplaceWithSpares(f"{why}; {view.spares_ready} hot spare(s) ready for rank(s) {list(lost)} "
                                         "keep the run's size instead of a shrink", lost)
            # Fewer ready spares than lost ranks: they count toward the new size, taking lost
            # ranks first, so a spare is not left idle (and a run that lost more ranks than
            # min_workers leaves goes on on its spares). Only as many as the size needs.
            usable = min(view.spares_ready, len(lost))
            size = self.shrink_size(remaining + usable)
            if size is None:
                have = remaining + usable
                cannot = (f"shrinking would leave {have} < min_workers={self.min_workers}"
                          if have < self.min_workers else
                          f"the global batch {self.global_batch} divides over no size from "
                          f"min_workers={self.min_workers} to the {have} survivor(s) and spare(s)")
                return Fail(f"{why}; {cannot}")
            replace = lost[:max(0, min(usable, size - remaining))]
            taken = f"; {len(replace)} hot spare(s) take rank(s) {list(replace)}" if replace else ""
            left = remaining + len(replace)
            standby = (f"; {left - size} survivor(s) stand by as hot spares (the global batch "
                       f"{self.global_batch} does not divide over {left})" if size < left else "")
            return Shrink(f"{why}; shrinking to {size} worker(s) (min_workers={self.min_workers}){taken}{standby}",
                          lost, size=size, replace=replace)
        if action == "restart":
            return RestartFromCheckpoint(f"{why}; restarting every rank from the last committed checkpoint")
        return Fail(f"{why}; FailureConfig says fail")
