"""One training rank (or hot spare) as a Ray actor.

A worker builds its model, optimizer and dataset when it is created, so a spare is ready to join
the moment it is needed. It runs exactly one step per call from the controller and keeps no loop
of its own: the controller decides what every step is, which group it runs in, and who is in it.

Two ways to synchronise gradients:
- ``train_step`` (aggregation "all"): DDP over the whole group.
- ``compute_grad`` + ``reduce_apply``/``apply_update`` (aggregation "first_n"): each replica
  computes a local gradient, the controller picks the first N to finish, those N all-reduce in a
  subgroup created once for that exact set, and the others apply the same averaged gradient from
  the object store.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import random
import signal
import socket
import time
import traceback
import zlib
from datetime import timedelta
from typing import Any, Callable

import ray

from elastic._lazy import LazyModule
from elastic.actors.protocol import (  # noqa: F401  (re-exported: the worker's call protocol)
    CollectiveError,
    PackedSpec,
    StaleStep,
    StepResult,
    TrainingSpec,
    choose_device_and_backend,
    step_seed,
    unpack_spec,
)

# Imported on first use, in the worker process: the controller imports this module to name the
# actor class and must not pay for torch (see elastic/_lazy.py).
torch = LazyModule("torch")
dist = LazyModule("torch.distributed")
np = LazyModule("numpy")
torch_data = LazyModule("torch.utils.data")
torch_parallel = LazyModule("torch.nn.parallel")

logger = logging.getLogger(__name__)


def _seed_everything(value: int, device_type: str = "cpu") -> None:
    """Seed python, numpy and torch for this device.

    Not ``torch.manual_seed``: on a process where CUDA/XPU/MTIA are not initialised it queues a
    lazy seeding call for each of them, with a formatted stack trace apiece (~0.2 ms, 5-10% of a
    small step) and a queue that grows three entries every step for the life of the worker.
    """
    torch.default_generator.manual_seed(value)
    if device_type == "cuda":
        torch.cuda.manual_seed(value)  # the current device, initialised by now: no lazy queue
    np.random.seed(value % (2**32))
    random.seed(value)


class TrainWorker:
    """The actor class. ``elastic.actors.worker_group`` wraps it with ``ray.remote``."""

    def __init__(self, spec: TrainingSpec | PackedSpec, actor_name: str = ""):
        self.spec = spec = unpack_spec(spec)
        self.actor_name = actor_name

        self._gpu_ids = list(ray.get_gpu_ids()) if spec.use_gpu else []
        self.device_str, self.backend = choose_device_and_backend(
            spec.use_gpu, self._gpu_ids, torch.cuda.is_available()
        )
        self.device = torch.device(self.device_str)
        torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
        _seed_everything(spec.seed)
        self.model = spec.model_fn().to(self.device)
        self.optimizer = spec.optimizer_fn(self.model.parameters())
        self.scheduler = spec.scheduler_fn(self.optimizer) if spec.scheduler_fn else None
        self.dataset = spec.dataset_fn()
        self.ddp = None  # DistributedDataParallel while in a group (aggregation "all")
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.completed_step = 0
        self.started_step = 0  # newest step this rank began computing; started - completed = work at risk
        self.current_step: int | None = None
        self.last_beat = time.time()
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._pending_flat: torch.Tensor | None = None
        self._slow: tuple[float, int] | None = None  # (factor, from_step) fault injection
        self._hang_at: int | None = None
        self._kill_at: int | None = None
        self._compute_ema: float | None = None
        self.phase, self.phase_since = "idle", time.time()
        self._ckpt = None

    # ---- identity and liveness -------------------------------------------------------------
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": self._gpu_ids,
            "device": self.device_str,
            "backend": self.backend,
            "name": self.actor_name,
        }

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> dict:
        """Answered from its own thread, so a worker busy in a long step still answers."""
        return {"time": time.time(), "step": self.current_step, "completed_step": self.completed_step,
                "rank": self.rank, "phase": self.phase, "phase_since": self.phase_since}

    @ray.method(concurrency_group="control")
    def reap(self, pid: int) -> bool:
        """SIGKILL a hung peer's process on this node (the controller found it by its heartbeats)."""
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False

    def _enter(self, phase: str) -> None:
        """Phases let the controller tell a rank stuck in its own code from one waiting on peers."""
        self.phase, self.phase_since = phase, time.time()

    def free_port(self) -> int:
        """A port that is free on this node right now; rank 0 hosts the rendezvous store on it."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def dataset_size(self) -> int:
        return len(self.dataset)

    # ---- fault injection (tests, benchmarks, demo) ------------------------------------------
    def inject_slowdown(self, factor: float, from_step: int) -> None:
        """Make this worker ``factor`` times slower from ``from_step`` on. A test and demo aid."""
        self._slow = (float(factor), int(from_step))

    def inject_hang(self, at_step: int) -> None:
        """Stop answering inside step ``at_step`` (sleeps far past every timeout). A test aid."""
        self._hang_at = int(at_step)

    def inject_kill(self, at_step: int) -> None:
        """SIGKILL this worker's own process in the middle of step ``at_step``. A test and bench aid."""
        self._kill_at = int(at_step)

    def _injected_delay(self, step: int) -> float:
        """Sleep that makes this rank ``factor`` times slower than its own measured compute."""
        if self._kill_at is not None and step == self._kill_at:
            os.kill(os.getpid(), 9)
        if self._hang_at is not None and step >= self._hang_at:
            time.sleep(3600)
        if not self._slow or step < self._slow[1] or self._slow[0] <= 1 or self._compute_ema is None:
            return 0.0
        delay = self._compute_ema * (self._slow[0] - 1)
        time.sleep(delay)
        return delay

    def _note_compute(self, seconds: float) -> None:
        self._compute_ema = seconds if self._compute_ema is None else 0.8 * self._compute_ema + 0.2 * seconds

    # ---- process group ---------------------------------------------------------------------
    def join(self, rank: int, world_size: int, master_addr: str, master_port: int, generation: int,
             timeout_s: float, use_ddp: bool = True, subgroup_size: int = 0) -> dict:
        """Leave any old group and form the new one. Survivors keep their model and optimizer."""
        self.leave()
        t0 = time.time()
        self.rank, self.world_size, self.generation = rank, world_size, generation
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        dist.init_process_group(
            self.backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=self.device if self.backend == "nccl" else None,
        )
        if use_ddp:
            device_ids = [0] if self.backend == "nccl" else None
            self.ddp = torch_parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        if subgroup_size and subgroup_size < world_size:
            # Every rank must create every subgroup, in the same order: gloo's new_group is a
            # collective over the world (the use_local_synchronization variant hung in our probe).
            for members in itertools.combinations(range(world_size), subgroup_size):
                pg = dist.new_group(list(members))
                if rank in members:
                    self._subgroups[members] = pg
        return {"rank": rank, "join_s": time.time() - t0}

    def leave(self) -> None:
        """Tear down the group. Peers blocked on us see their sockets close and raise at once."""
        self._subgroups.clear()
        self.ddp = None  # drop the reducer so its autograd hooks and its group reference go
        if dist.is_initialized():
            try:
                if self.backend == "nccl":
                    # A blocked NCCL kernel never returns by itself: abort the communicators
                    # first, then release the group.
                    dist.distributed_c10d._abort_process_group()
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # an already-broken group may refuse a clean destroy
                logger.debug("destroy_process_group failed", exc_info=True)
        gc.collect()

    # ---- training --------------------------------------------------------------------------
    def _batch(self, indices: list[int]):
        batch = torch_data.default_collate([self.dataset[i] for i in indices])
        return _to_device(batch, self.device)

    def _forward_backward(self, model, batch, step: int, has_collective: bool) -> tuple[torch.Tensor, float]:
        """Forward and backward; returns (loss, local seconds).

        Local seconds is the part of the step no peer can stretch: with DDP the backward waits
        in all-reduce for the slowest rank, so only data + forward count there (and 3x forward
        is the compute estimate); without a collective the whole forward+backward counts.
        """
        t0 = time.perf_counter()
        self._enter("compute")
        first = self._compute_ema is None  # nothing measured yet: slow down after this compute
        delay = 0.0 if first else self._injected_delay(step)
        t1 = time.perf_counter()
        if self.spec.step_fn is not None:
            loss = self.spec.step_fn(model, batch)
            self._note_compute(time.perf_counter() - t1)
            if first:
                delay = self._injected_delay(step)
            return loss, time.perf_counter() - t0
        loss = self.spec.loss_fn(model, batch)
        fwd = time.perf_counter() - t1
        self._enter("backward+allreduce" if has_collective else "backward")
        loss.backward()
        both = time.perf_counter() - t1
        self._note_compute(3 * fwd if has_collective else both)
        if first:
            delay = self._injected_delay(step)
        return loss, (fwd if has_collective else both) + delay

    def _run_guarded(self, fn: Callable[[], Any]) -> Any:
        """Run a step; a collective failure tears the group down at once so peers unblock.

        Why this holds: gloo has no working abort for a blocked collective (``abort()`` returns but
        the waiting thread stays blocked until the timeout, as our probe showed). What does
        unblock it is its peer closing the socket. A rank whose collective raised therefore
        destroys its group before returning; that closes its sockets, the ranks waiting on it
        raise in turn, and the failure cascades round the ring in well under a second.
        """
        try:
            out = fn()
            self._enter("idle")
            return out
        except Exception as exc:
            self._enter("failed")
            self.current_step = None
            msg = f"rank {self.rank} failed: {exc}\n{traceback.format_exc()}"
            collective = isinstance(exc, (dist.DistBackendError, RuntimeError)) and _looks_collective(exc)
            exc = None  # drop frames that reference the DDP reducer before tearing down
            if collective:
                self.leave()
                raise CollectiveError(msg)
            raise

    def train_step(self, step: int, indices: list[int], generation: int) -> StepResult:
        """One synchronous DDP step on this rank's shard, in group ``generation``.

        A step queued for a group this rank has left (a failure happened while it waited in the
        actor's queue) refuses to run: training without the group would update this replica alone.
        """
        if generation != self.generation or (self.ddp is None and self.world_size > 1):
            raise StaleStep(f"rank {self.rank}: step {step} was queued for group generation {generation}, "
                            f"but this rank is in generation {self.generation} "
                            f"({'joined' if dist.is_initialized() else 'no group'})")
        return self._run_guarded(lambda: self._train_step(step, indices))

    def train_steps(self, first_step: int, shards: list[list[int]], generation: int) -> list[StepResult]:
        """Several consecutive DDP steps in one call (``ScalingConfig.steps_per_dispatch``).

        Each step is still the controller's: it chose every shard, and it gets one result per
        step. What one call saves is Ray's per-call cost (task submission, a thread hand-off,
        result serialisation: 1-3 ms of CPU per rank per call on a loaded 2-core machine) when
        steps are only tens of milliseconds long. If a step fails, the steps before it stand:
        this rank's ``progress()`` says how far it got, and the controller keeps them.
        """
        return [self.train_step(first_step + i, indices, generation) for i, indices in enumerate(shards)]

    def _train_step(self, step: int, indices: list[int]) -> StepResult:
        t0 = time.perf_counter()
        self.current_step = self.started_step = step
        _seed_everything(step_seed(self.spec.seed, self.rank, step), self.device.type)
        batch = self._batch(indices)
        model = self.ddp if self.ddp is not None else self.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, local = self._forward_backward(model, batch, step, has_collective=self.ddp is not None)
        compute = time.perf_counter() - t0
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.completed_step = step
        self.current_step = None
        extra = {**self._after_step(step), "local_time_s": local}
        return StepResult(self.rank, step, float(loss.detach()), time.perf_counter() - t0, compute,
                          len(indices), self.completed_step, extra)

    def compute_grad(self, step: int, indices: list[int]) -> StepResult:
        """First-N mode, phase 1: a local gradient only; no collective."""
        return self._run_guarded(lambda: self._compute_grad(step, indices))

    def _compute_grad(self, step: int, indices: list[int]) -> StepResult:
        t0 = time.perf_counter()
        self.current_step = self.started_step = step
        _seed_everything(step_seed(self.spec.seed, self.rank, step), self.device.type)
        batch = self._batch(indices)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss, local = self._forward_backward(self.model, batch, step, has_collective=False)
        compute = time.perf_counter() - t0
        self._pending_flat = _flatten_grads(self.model)
        return StepResult(self.rank, step, float(loss.detach()), time.perf_counter() - t0, compute,
                          len(indices), self.completed_step)

    def reduce_apply(self, step: int, fast: list[int], publish: bool) -> tuple[dict, torch.Tensor | None]:
        """First-N mode, phase 2 on the fast N: average in the cached subgroup and step.

        Why cached subgroups, and not a DDP comm hook or cutting stragglers short: a comm hook
        runs inside backward, before anyone knows which N finished first, and an all-reduce over
        the whole group waits for the straggler by definition. Cutting a straggler short at a
        micro-batch boundary still makes the step wait for its partial gradient. With one gloo
        group per possible fast set, made once at rendezvous by every rank in the same order,
        the fast three of four finished a 1M-float all-reduce in ~0.1 s while the fourth slept
        2 s (our probe; creating all four subgroups took 0.04 s). The late replica gets the same
        averaged gradient from the object store and applies it after its own step, so its queue
        never grows and its parameters stay bitwise equal.

        Returns the averaged flat gradient when ``publish`` so the controller can hand the
        identical update to the replicas that were late.
        """
        def run() -> dict:
            flat = self._pending_flat
            if flat is None:
                raise RuntimeError(f"rank {self.rank}: reduce_apply({step}) without compute_grad")
            group = self._subgroups.get(tuple(fast)) if len(fast) < self.world_size else None
            self._enter("allreduce")
            dist.all_reduce(flat, group=group)
            flat.div_(len(fast))
            self._apply_flat(step, flat)
            out = {"rank": self.rank, "step": step, **self._after_step(step)}
            return out, (flat.cpu() if publish else None)
        return self._run_guarded(run)

    def apply_update(self, step: int, flat: torch.Tensor) -> dict:
        """First-N mode, phase 2 on a late replica: drop our gradient, apply the agreed one."""
        self._pending_flat = None
        self._apply_flat(step, flat.to(self.device))
        return {"rank": self.rank, "step": step, **self._after_step(step)}

    def _apply_flat(self, step: int, flat: torch.Tensor) -> None:
        _unflatten_into_grads(self.model, flat)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._pending_flat = None
        self.completed_step = step
        self.current_step = None

    # ---- state -----------------------------------------------------------------------------
    def get_state(self) -> dict:
        """The full replicated training state, for a peer that has to catch up."""
        return {
            "model": self.model_state(),
            "optimizer": _to_device(self.optimizer.state_dict(), torch.device("cpu")),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "completed_step": self.completed_step,
        }

    def model_state(self) -> dict:
        """The model's state dict on the CPU (the final weights a ``Result`` carries)."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def set_state(self, state: dict) -> int:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(_to_device(state["optimizer"], self.device))
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.completed_step = self.started_step = int(state["completed_step"])
        self._pending_flat = None
        return self.completed_step

    def progress(self) -> tuple[int, int]:
        """(newest completed step, newest step begun). A step begun and not completed when the
        group broke is work thrown away: the controller counts it as recomputed."""
        return self.completed_step, self.started_step

    def param_checksum(self) -> int:
        """CRC32 over every parameter's bytes: equal only if replicas are bitwise identical."""
        crc = 0
        for p in self.model.parameters():
            crc = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), crc)
        return crc

    def evaluate(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        self.model.eval()
        with torch.no_grad():
            return fn(self.model)

    # ---- checkpoints (elastic.checkpoint does the storage work) ------------------------------
    def configure_checkpoint(self, url: str, storage_options: dict, run_name: str, every_n_steps: int,
                             blocking: bool) -> None:
        from elastic.checkpoint import WorkerCheckpointer

        if self._ckpt is not None:
            self._ckpt.close()
        self._ckpt = WorkerCheckpointer(url, storage_options, run_name, every_n_steps, blocking) \
            if every_n_steps > 0 else None

    def restore_checkpoint(self, url: str, storage_options: dict, run_name: str, step: int) -> dict:
        """Load a committed step (checksums verified while reading); returns its manifest meta."""
        from elastic.checkpoint import CheckpointStore

        state, meta = CheckpointStore(url, run_name, storage_options).read_state(step)
        self.set_state(state)
        return meta

    def flush_checkpoint(self) -> dict:
        """Wait for this rank's pending persist and report what finished."""
        if self._ckpt is None:
            return {}
        self._ckpt.flush()
        return {**self._ckpt.drain(), "world_size": self.world_size}

    def _after_step(self, step: int) -> dict:
        if self._ckpt is None:
            return {}
        return {**self._ckpt.after_step(self, step), "world_size": self.world_size}

    def shutdown(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
        self.leave()


_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                       "broken pipe", "process group", "socket", "peer", "aborted")


def _looks_collective(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistBackendError):
        return True
    text = str(exc).lower()
    return any(m in text for m in _COLLECTIVE_MARKERS)


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj


def _flatten_grads(model: torch.nn.Module) -> torch.Tensor:
    grads = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads.append(g.detach().reshape(-1))
    return torch.cat(grads)


def _unflatten_into_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n
