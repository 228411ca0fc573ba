"""What a policy may ask the controller to do. Plain data: policies decide, the controller acts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    reason: str


@dataclass(frozen=True)
class Continue(Decision):
    """``straggler``: a persistent straggler the policy would evict, were a spare ready."""

    reason: str = "healthy"
    straggler: int | None = None


@dataclass(frozen=True)
class ReplaceWithSpares(Decision):
    """Spares take over ``ranks`` (same rank numbers, same data shards) in one rebuild."""

    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shrink(Decision):
    """Drop ``ranks`` and go on with ``size`` ranks, which keep the global batch by taking bigger
    shards. Survivors beyond ``size`` (the global batch does not divide over all of them) stand by
    as hot spares. ``replace``: lost ranks that ready spares take first (fewer spares than lost
    ranks); the rest of ``ranks`` are dropped."""

    ranks: tuple[int, ...] = ()
    size: int = 0
    replace: tuple[int, ...] = ()


@dataclass(frozen=True)
class WaitForCapacity(Decision):
    """Ask for replacement actors and wait up to ``timeout_s`` for them, then decide again."""

    ranks: tuple[int, ...] = ()
    timeout_s: float = 30.0


@dataclass(frozen=True)
class RestartFromCheckpoint(Decision):
    """Start every rank again and load the newest committed checkpoint."""


@dataclass(frozen=True)
class Fail(Decision):
    """Stop the run with an error."""


@dataclass(frozen=True)
class EvictStraggler(Decision):
    """Replace a persistently slow ``rank`` with a hot spare; the evicted actor is released."""

    rank: int = -1
