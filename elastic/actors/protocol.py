"""What the controller and the workers exchange, without torch.

The controller imports this (and the worker module, whose torch is lazy) but never torch: it only
passes the user's training pieces on, packed, to the workers that unpack and run them.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass, field
from typing import Any, Callable

import ray.cloudpickle


class CollectiveError(RuntimeError):
    """A collective failed because a peer vanished or the group was torn down."""


class StaleStep(CollectiveError):
    """A step queued for a group generation that no longer exists on this rank."""


class StopRequested(Exception):
    """A stop (Ctrl-C, SIGTERM, ``elastic stop``) came while the controller waited: for placement,
    for spares or capacity, or for storage to answer. The run ends there instead of when the
    wait runs out, which could be long after the driver's ``stop_timeout_s`` killed it."""


class WorkerError(RuntimeError):
    """User code raised on a worker (in a step, or while the worker built the model, optimizer
    and dataset); carries the rank and the original traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"worker rank {rank} raised:\n{message}")
        self.rank = rank
        self.message = message

    def __reduce__(self):  # pickled by its arguments (a fit() in a Ray task, Tune, multiprocessing)
        return type(self), (self.rank, self.message)


class ModelParameters(list):
    """What ``optimizer_fn`` gets: the model's parameters as a list, in ``model.parameters()``'s
    order, with ``named``: ``[(name, parameter), ...]`` as ``model.named_parameters()`` gives
    them (the bare model's names, before any DDP wrapper), for rules by name such as no weight
    decay on biases and norms. ``torch.optim`` optimizers also take ``params.named`` itself, and
    keep the names in their param groups. A list, so an ``optimizer_fn`` written for
    ``model.parameters()`` works unchanged and may read it twice."""

    def __init__(self, model: Any):
        self.named = list(model.named_parameters())
        super().__init__(p for _, p in self.named)


@dataclass
class TrainingSpec:
    """The user's pieces of training, shipped to every worker."""

    model_fn: Callable[[], torch.nn.Module]
    optimizer_fn: Callable[[ModelParameters], torch.optim.Optimizer]
    dataset_fn: Callable[[], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None
    seed: int = 0
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    bucket_cap_mb: float | None = None  # DDP gradient bucket size; None: chosen by backend (see worker)
    find_unused_parameters: bool = False  # DDP's option: some parameters may get no gradient in a step
    max_grad_norm: float | None = None  # clip the averaged gradient's total 2-norm to this, before the step
    mixed_precision: str | None = None  # "bf16" or "fp16": the forward under autocast (fp16 with a loss scaler)


@dataclass
class StepResult:
    rank: int
    step: int
    loss: float
    step_time_s: float
    compute_time_s: float
    samples: int
    completed_step: int
    extra: dict = field(default_factory=dict)


def choose_device_and_backend(use_gpu: bool, gpu_ids: list, cuda_available: bool,
                              device_count: int = 1, visible: str | None = None) -> tuple[str, str]:
    """NCCL on a GPU that Ray assigned to this actor, gloo on the CPU.

    Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs, so the first visible device (cuda:0) is
    ours. Where it does not (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``, which some
    serving set-ups use), every GPU of the node is visible (``device_count`` above the GPUs
    assigned) and Ray's id is the device's index: cuda:0 on every rank of a node made NCCL refuse
    the group ("Duplicate GPU detected"). ``visible``: the process's CUDA_VISIBLE_DEVICES. Where
    the node's own list narrows the GPUs ("4,5,6,7"), Ray's ids are that list's entries and torch
    numbers the devices it names from 0, so the device is the id's place in the list (ids 4-7
    all gave cuda:0 before).
    """
    if use_gpu:
        if not gpu_ids:
            raise RuntimeError("use_gpu=True but Ray assigned no GPU to this worker")
        if not cuda_available:
            raise RuntimeError(f"Ray assigned GPU(s) {gpu_ids} but torch.cuda is not available in this worker")
        first = str(gpu_ids[0])
        if device_count > len(gpu_ids):
            listed = [v.strip() for v in visible.split(",")] if visible and visible.strip() else []
            if first in listed:
                index = listed.index(first)
            else:  # no list, or an id not in it: Ray's id as the index
                index = int(first) if first.isascii() and first.isdigit() else None
            if index is not None and index < device_count:
                return f"cuda:{index}", "nccl"
        return "cuda:0", "nccl"
    return "cpu", "gloo"


def step_seed(seed: int, rank: int, step: int) -> int:
    """RNG for (rank, step) is a pure function of the run seed, so replays and spares are exact.

    A 64-bit hash of the three, not a linear mix: ``seed * 1_000_003 + rank * 10_007 + step``
    (in 31 bits) gave rank r at step s the seed of rank r + 1 at step s - 10,007, so past
    10,007 steps the ranks repeated each other's dropout and augmentation draws, and seed k at
    step s + 1,000,003 repeated seed k + 1 at step s."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class PackedSpec:
    """A ``TrainingSpec`` pickled in the driver and unpickled only in the workers.

    Unpickling the user's factories imports the user's modules, and torch with them; the
    controller only hands the spec on, so it keeps the bytes.
    """

    blob: bytes

    @classmethod
    def pack(cls, spec: TrainingSpec) -> "PackedSpec":
        return cls(ray.cloudpickle.dumps(spec))

    def unpack(self) -> TrainingSpec:
        return ray.cloudpickle.loads(self.blob)


def unpack_spec(spec: "TrainingSpec | PackedSpec") -> TrainingSpec:
    return spec.unpack() if isinstance(spec, PackedSpec) else spec
