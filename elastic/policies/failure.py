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
    waited: bool = False  # a WaitForCapacity already ran out for this failure


class FailurePolicy:
    def __init__(self, config: FailureConfig, num_workers: int):
        self.config = config
        self.min_workers = config.min_workers if config.min_workers is not None else num_workers

    def decide(self, view: FailureView) -> Decision:
        cfg = self.config
        lost = view.lost_ranks
        if view.failures_so_far > cfg.max_failures:
            return Fail(f"failure {view.failures_so_far} exceeds FailureConfig.max_failures={cfg.max_failures}")
        action = cfg.on_failure
        if action == "replace":
            if view.spares_ready >= len(lost):
                return ReplaceWithSpares(f"{view.spares_ready} hot spare(s) ready for rank(s) {list(lost)}", lost)
            action = cfg.when_no_spare
            why = f"only {view.spares_ready} spare(s) ready for {len(lost)} lost rank(s)"
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
            if remaining < self.min_workers:
                return Fail(f"{why}; shrinking would leave {remaining} < min_workers={self.min_workers}")
            return Shrink(f"{why}; shrinking to {remaining} worker(s) (min_workers={self.min_workers})", lost)
        if action == "restart":
            return RestartFromCheckpoint(f"{why}; restarting every rank from the last committed checkpoint")
        return Fail(f"{why}; FailureConfig says fail")
