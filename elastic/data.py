"""Deterministic sharding of a map-style dataset, and the ledger of which rank used which samples.

The controller owns the plan: the order of an epoch comes from (seed, epoch) alone, each global
batch is cut into equal per-rank shards, and every shard handed out is recorded, used or dropped.
Dropped samples can be requeued so every sample still counts exactly once per epoch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch; the same on every machine and every run.

    numpy's PCG64 rather than ``torch.randperm``: the controller owns the plan and does not
    import torch (see elastic/_lazy.py).
    """
    rng = np.random.Generator(np.random.PCG64((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF))
    return rng.permutation(num_samples).tolist()


@dataclass
class DataPosition:
    """Where the sampler stands; goes into checkpoints so a resumed run continues exactly."""

    epoch: int = 0
    cursor: int = 0
    requeued: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "requeued": list(self.requeued)}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), cursor=int(d["cursor"]), requeued=[int(i) for i in d.get("requeued", [])])


class ShardPlan:
    """Hands out per-rank index shards for each step.

    ``take(num_shards, shard_size)`` returns ``num_shards`` lists of ``shard_size`` indices. Requeued
    samples are served first. An epoch ends when fewer than a full global batch remain (the tail is
    dropped, as ``DataLoader(drop_last=True)`` does); the next epoch starts with a new order.
    """

    def __init__(self, num_samples: int, seed: int, position: DataPosition | None = None):
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples = num_samples
        self.seed = seed
        self.position = position or DataPosition()
        self._order = epoch_order(num_samples, seed, self.position.epoch)
        self._requeued = deque(self.position.requeued)

    def steps_per_epoch(self, global_batch: int) -> int:
        return self.num_samples // global_batch

    def take(self, num_shards: int, shard_size: int) -> tuple[int, list[list[int]]]:
        """Return (epoch, shards) for the next step."""
        need = num_shards * shard_size
        if need > self.num_samples:
            raise ValueError(f"a global batch of {need} is larger than the dataset ({self.num_samples})")
        available = len(self._requeued) + (self.num_samples - self.position.cursor)
        if available < need:
            self._next_epoch()
        flat: list[int] = []
        while self._requeued and len(flat) < need:
            flat.append(self._requeued.popleft())
        take_new = need - len(flat)
        start = self.position.cursor
        flat.extend(self._order[start : start + take_new])
        self.position.cursor = start + take_new
        self.position.requeued = list(self._requeued)
        shards = [flat[i * shard_size : (i + 1) * shard_size] for i in range(num_shards)]
        return self.position.epoch, shards

    def requeue(self, indices: list[int], epoch: int | None = None) -> None:
        """Put dropped samples back so they are used later in this epoch. Samples dropped in an
        epoch the plan has already left are not carried over: the new epoch has them in its
        own order, and carrying them would use them twice there."""
        if epoch is not None and epoch != self.position.epoch:
            return
        self._requeued.extend(indices)
        self.position.requeued = list(self._requeued)

    def _next_epoch(self) -> None:
        self.position = DataPosition(epoch=self.position.epoch + 1, cursor=0, requeued=[])
        self._order = epoch_order(self.num_samples, self.seed, self.position.epoch)
        self._requeued.clear()


@dataclass
class LedgerEntry:
    step: int
    epoch: int
    rank: int
    indices: list[int]
    used: bool


class SampleLedger:
    """Which sample indices each rank used (or had dropped) in each committed step."""

    def __init__(self) -> None:
        self.entries: list[LedgerEntry] = []

    def record(self, step: int, epoch: int, rank: int, indices: list[int], used: bool) -> None:
        self.entries.append(LedgerEntry(step, epoch, rank, list(indices), used))

    def used_counts(self, epoch: int | None = None) -> dict[int, int]:
        counts: dict[int, int] = {}
        for e in self.entries:
            if e.used and (epoch is None or e.epoch == epoch):
                for i in e.indices:
                    counts[i] = counts.get(i, 0) + 1
        return counts

    def dropped(self) -> int:
        return sum(len(e.indices) for e in self.entries if not e.used)

    def for_step(self, step: int) -> list[LedgerEntry]:
        return [e for e in self.entries if e.step == step]
