"""Deterministic sharding of a map-style dataset, and the ledger of which rank used which samples.

The controller owns the plan: the order of an epoch comes from (seed, epoch) alone, each global
batch is cut into equal per-rank shards, and every shard handed out is recorded, used or dropped.
Dropped samples can be requeued so every sample still counts exactly once per epoch, apart from
the epoch's tail: the samples left when fewer remain than one step hands out (requeued ones still
waiting among them) are dropped with the epoch, as ``DataLoader(drop_last=True)`` drops a short
last batch.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch; the same on every machine and every run."""
    return epoch_order_array(num_samples, seed, epoch).tolist()


def epoch_order_array(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """``epoch_order`` as a numpy array, as the sampler keeps it.

    numpy's PCG64 rather than ``torch.randperm``: the controller owns the plan and does not
    import torch (see elastic/_lazy.py). An array, in 32 bits where the indices fit, rather than
    a list: a Python list of 20M indices took ~720 MB of the controller, the array 80 MB.
    """
    rng = np.random.Generator(np.random.PCG64(_order_key(seed, epoch)))
    order = rng.permutation(num_samples)
    return order.astype(np.int32) if num_samples < 2**31 else order


def _order_key(seed: int, epoch: int) -> int:
    """The PCG64 seed of an epoch's order: ``seed * 1_000_003 + epoch`` where that is in
    [0, 2**63) (every seed from 0 to ~9.2e12, so the orders of runs and checkpoints made before
    stay as they were; a negative seed's changed, and a checkpoint of one mid-epoch resumes at
    the next epoch, ``data_order_changed`` saying so), else one key per (seed, epoch) from 2**63
    up. The old key, masked to 63 bits, gave seeds 2**63 apart (0 and 2**63, -1 and 2**63 - 1: ``RunConfig.seed`` takes torch's
    [-2**63, 2**64)) the same order in every epoch. numpy's ``SeedSequence`` takes any
    non-negative integer, so the wide key needs no hash."""
    key = seed * 1_000_003 + epoch
    if 0 <= key < 2**63 and 0 <= epoch < 1_000_003:
        return key
    return 2**63 + ((seed + 2**63) << 64 | epoch)


def order_digest(order: np.ndarray) -> str:
    """A fingerprint of an epoch's sample order, kept with each checkpoint.

    Why: the order comes from numpy's ``Generator.permutation``, and numpy promises that stream
    only on the same numpy (NEP 19: ``Generator`` may change its streams between versions). A
    run resumed under another numpy, with the seed and dataset size unchanged, would continue the
    saved cursor into another order: some samples of the epoch used twice, others never, and
    nothing said. Comparing the order itself catches that, and anything else that changes it.
    CRC-32 of the little-endian indices, read in place (no copy of the order): ~0.03 s once an
    epoch for 20M samples, not a security check (the manifest's sha256 guards the bytes)."""
    import zlib

    return f"{zlib.crc32(np.ascontiguousarray(order.astype(order.dtype.newbyteorder('<'), copy=False))):08x}"


def epoch_order_digest(num_samples: int, seed: int, epoch: int) -> str:
    """``order_digest`` of epoch ``epoch``'s order."""
    return order_digest(epoch_order_array(num_samples, seed, epoch))


class BatchSchedule:
    """The global batch size of each step: ``Trainer.global_batch_size`` from step 1, and from
    each step ``s`` of ``Trainer.batch_schedule`` (``{s: size}``) on, that size. A progressive
    schedule grows the batch where the learning rate would otherwise decay (Smith et al. 2018,
    "Don't Decay the Learning Rate, Increase the Batch Size"): the same noise scale, fewer
    steps. A function of the step alone, so a replayed, recovered or resumed step gets the
    batch size it was first given."""

    def __init__(self, initial: int, changes: dict[int, int] | None = None):
        self._steps = sorted(changes or {})
        self._sizes = [initial] + [int((changes or {})[s]) for s in self._steps]

    def size_at(self, step: int) -> int:
        """The global batch of ``step`` (1-based)."""
        return self._sizes[bisect.bisect_right(self._steps, step)]

    @property
    def sizes(self) -> list[int]:
        """Every size the run trains with, in order."""
        return list(self._sizes)

    @property
    def largest(self) -> int:
        return max(self._sizes)

    def pairs(self) -> list[list[int]]:
        """[first step, size] for each size in turn, from step 1: the schedule as a checkpoint's
        meta keeps it (``from_pairs`` reads it back)."""
        return [[1, int(self._sizes[0])]] + [[int(s), int(size)] for s, size in zip(self._steps, self._sizes[1:])]

    @classmethod
    def from_pairs(cls, pairs: Any) -> "BatchSchedule | None":
        """The schedule ``pairs()`` wrote; None for anything else (a meta written before it was
        kept, or unreadable)."""
        if not (isinstance(pairs, list) and pairs and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(type(v) is int for v in p) for p in pairs)):
            return None
        return cls(pairs[0][1], {first: size for first, size in pairs[1:]})

    def first_difference(self, other: "BatchSchedule", from_step: int) -> tuple[int, int, int] | None:
        """The first step from ``from_step`` on whose size this schedule and ``other`` differ:
        (that step, this one's size, other's); None where they agree. Both are constant between
        their change points, so those (and ``from_step``) are all that need comparing."""
        for at in sorted({from_step, *self._steps, *other._steps}):
            if at >= from_step and self.size_at(at) != other.size_at(at):
                return at, self.size_at(at), other.size_at(at)
        return None

    def first_step_of(self, size: int) -> int:
        """The first step that trains at ``size`` (one of ``sizes``)."""
        i = self._sizes.index(size)
        return 1 if i == 0 else self._steps[i - 1]

    def steps_for_epochs(self, num_samples: int, epochs: int) -> int:
        """How many steps make ``epochs`` epochs of ``num_samples`` global batches: each epoch ends
        where fewer samples than the next step's batch remain (its tail dropped, as
        ``drop_last``). With one size: ``epochs * (num_samples // size)``. For data parallel this
        is how ``ShardPlan`` cuts them; first-N draws M/N times the batch a step, so its
        sampler's epoch runs ahead of these nominal ones (with requeueing, by what was dropped)."""
        step, last = 0, self._steps[-1] if self._steps else 1
        for epoch in range(epochs):
            left = num_samples
            while left >= self.size_at(step + 1):
                if step + 1 >= last:
                    # One size from here on (from the start, with no schedule): the rest is
                    # arithmetic. Why: stepping on one at a time ran in the controller after the
                    # actors started, and fit(epochs=10**6) with a schedule hung there.
                    final = self._sizes[-1]
                    return step + left // final + (epochs - epoch - 1) * (num_samples // final)
                step += 1
                left -= self.size_at(step)
        return step


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
        self._order = epoch_order_array(num_samples, seed, self.position.epoch)
        self._requeued = deque(self.position.requeued)
        self._digests: dict[int, str] = {}  # epoch -> order_digest, the newest two epochs

    def digest(self, epoch: int) -> str:
        """``order_digest`` of epoch ``epoch``'s order (a checkpoint's epoch may trail the plan's,
        which runs a dispatch window ahead, by one at an epoch's end)."""
        if epoch not in self._digests:
            self._digests = {e: d for e, d in self._digests.items() if e >= epoch - 1}
            self._digests[epoch] = (order_digest(self._order) if epoch == self.position.epoch else
                                    epoch_order_digest(self.num_samples, self.seed, epoch))
        return self._digests[epoch]

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
        flat.extend(self._order[start : start + take_new].tolist())
        self.position.cursor = start + take_new
        self.position.requeued = list(self._requeued)
        shards = [flat[i * shard_size : (i + 1) * shard_size] for i in range(num_shards)]
        return self.position.epoch, shards

    def requeue(self, indices: list[int], epoch: int) -> None:
        """Put dropped samples back so they are used later in this epoch. Samples dropped in an
        epoch the plan has already left are not carried over: the new epoch has them in its
        own order, and carrying them would use them twice there. (``epoch`` is required: left
        out, the check was skipped.)"""
        if epoch != self.position.epoch:
            return
        self._requeued.extend(indices)
        self.position.requeued = list(self._requeued)

    def _next_epoch(self) -> None:
        self.position = DataPosition(epoch=self.position.epoch + 1, cursor=0, requeued=[])
        self._order = epoch_order_array(self.num_samples, self.seed, self.position.epoch)
        self._requeued.clear()


@dataclass
class LedgerEntry:
    step: int
    epoch: int
    rank: int
    indices: list[int]
    used: bool | None  # None: a first-N step kept in a recovery whose fast set no replica knew


LEDGER_INDICES = 1_000_000  # sample indices whose rows SampleLedger keeps (Result.ledger): ~36 MB


class SampleLedger:
    """Which sample indices each rank used (or had dropped) in each step: rows for the newest
    steps, up to ``keep_indices`` sample indices in all.

    Why bounded: a row holds a rank's shard indices, ~2.5 KB for 64 samples, so the rows came
    to ~10 KB a step with 4 ranks of 64, and grew the controller without end (a million steps
    would be ~10 GB). The bound is in indices, not steps, because a step's rows grow with the
    batch. The newest step is always kept whole. The run's dropped-sample count does not come
    from here: every step's record in the controller's history carries its own.
    """

    def __init__(self, keep_indices: int = LEDGER_INDICES) -> None:
        if keep_indices < 1:
            raise ValueError(f"keep_indices must be >= 1, got {keep_indices!r}")
        self.keep_indices = keep_indices
        self.entries: list[LedgerEntry] = []  # in step order
        self._kept = 0  # indices in self.entries

    def record(self, step: int, epoch: int, rank: int, indices: list[int], used: bool | None) -> None:
        self.entries.append(LedgerEntry(step, epoch, rank, list(indices), used))
        self._kept += len(indices)
        self._trim(step)

    def _trim(self, newest: int) -> None:
        # Whole steps, oldest first, once the rows pass the bound by a tenth: the cost per row
        # stays constant. Never the newest step.
        if self._kept <= self.keep_indices + self.keep_indices // 10:
            return
        cut, kept = 0, self._kept
        while cut < len(self.entries) and kept > self.keep_indices and self.entries[cut].step < newest:
            step = self.entries[cut].step
            while cut < len(self.entries) and self.entries[cut].step == step:
                kept -= len(self.entries[cut].indices)
                cut += 1
        del self.entries[:cut]
        self._kept = kept

    def truncate(self, step: int) -> None:
        """Forget every step after ``step`` (training rolled back to it and will do them again)."""
        self.entries = [e for e in self.entries if e.step <= step]
        self._kept = sum(len(e.indices) for e in self.entries)

    def for_step(self, step: int) -> list[LedgerEntry]:
        return [e for e in self.entries if e.step == step]
