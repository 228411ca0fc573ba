"""One training rank (or hot spare) as a Ray actor.

A worker builds its model, optimizer and dataset when it is created, so a spare is ready to join
the moment it is needed. It runs the steps the controller hands it (one window of consecutive
steps per call) and keeps no loop of its own: the controller decides what every step is, which
group it runs in, and who is in it.

Two ways to synchronise gradients:
- ``_train_step`` (aggregation "all"): DDP over the whole group.
- ``_first_n_step`` (aggregation "first_n"): each replica computes a local gradient, the replicas
  agree through the rendezvous store which N arrived first (or, when replicas that were late rest
  and exactly N compute, know it without asking), those N all-reduce in a subgroup created once
  for that exact set, and the late ones receive the same averaged gradient from the fastest rank
  and apply it.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dis
import gc
import inspect
import itertools
import logging
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
import weakref
import zlib
from collections import OrderedDict, deque
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Iterator

import ray

from elastic._lazy import LazyModule
from elastic.actors.priority import idle_priority, idle_threads
from elastic.actors.protocol import (  # noqa: F401  (re-exported: the worker's call protocol)
    CollectiveError,
    ModelParameters,
    PackedSpec,
    StaleStep,
    StepResult,
    TrainingSpec,
    choose_device_and_backend,
    step_seed,
    unpack_spec,
)
from elastic.actors.buffers import ReplicaBuffers, buffer_survey
from elastic.actors.grads import FlatGrads, sparse_embeddings
from elastic.actors.sends import UpdateSends, in_flight_limit, max_trail
from elastic.actors.sitout import SitOutSchedule

# Imported on first use, in the worker process: the controller imports this module to name the
# actor class and must not pay for torch (see elastic/_lazy.py).
torch = LazyModule("torch")
dist = LazyModule("torch.distributed")
np = LazyModule("numpy")
torch_data = LazyModule("torch.utils.data")
torch_parallel = LazyModule("torch.nn.parallel")
ddp_hooks = LazyModule("torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
torch_dist_utils = LazyModule("torch.distributed.utils")

# DDP's bucket size for the broadcast of rank 0's module state at construction (torch's
# DistributedDataParallel: ``int(250 * 1024 * 1024)``), used for first-N's broadcast at a join.
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024

logger = logging.getLogger(__name__)


def _seed_everything(value: int, device: Any = None) -> None:
    """Seed python, numpy and torch, and ``device``'s generator when it is a GPU.

    Not ``torch.manual_seed``: on a process where CUDA/XPU/MTIA are not initialised it queues a
    lazy seeding call for each of them, with a formatted stack trace apiece (~0.2 ms, 5-10% of a
    small step) and a queue that grows three entries every step for the life of the worker.
    """
    torch.default_generator.manual_seed(value)
    if device is not None and device.type == "cuda":
        # The calling thread's current device: every caller runs on a thread that bound this
        # rank's (TrainWorker._bind_device, in _build and train_steps).
        torch.cuda.manual_seed(value)
    np.random.seed([value & 0xFFFF_FFFF, value >> 32 & 0xFFFF_FFFF])  # all 64 bits: numpy's legacy seed takes 32 a word
    random.seed(value)


def wait_for_stream(stream: Any, timeout_s: float) -> bool:
    """Wait until ``stream``'s queued work is done (True), or ``timeout_s`` passed first (False).

    Polled, since a CUDA stream's ``synchronize()`` takes no timeout: the first 2 ms by yielding
    (a step's collectives usually end within them, and a GPU rank has its CPU to itself while
    it waits), then with sleeps doubling to 1 ms, so a wait costs at most ~1 ms past the work."""
    if stream.query():
        return True
    start = time.monotonic()
    deadline, spin_until, delay = start + timeout_s, start + 0.002, 0.0001
    while not stream.query():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            time.sleep(0)
        else:
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, 0.001)
    return True


class LocalClock:
    """The local seconds of a step (``TrainWorker._forward_backward``): from the step's start to
    the rank's first contact with its peers, or to the end of its own work.

    On CPU that is the host's clock. On a GPU the host only queues kernels: the host's time to
    the contact was the data fetch and the kernel launches, the same on a throttled or shared
    GPU as on a healthy one. Every rank then scored about 1.0, so a slow GPU was never found,
    and with DDP the ring ran at its pace for the whole run. So on a GPU the time from where the
    forward is queued (``begin``) to the contact is read from CUDA events on the device's
    stream, plus the host's time before it; the GPU is idle at ``begin`` (the step before ended
    on reading its loss), so the events' span is the forward's (and backward's) device time, or
    the host's launches where those are slower.

    ``seconds`` waits for the contact event (bounded by ``timeout_s``, as ``wait_for_stream``
    waits): after the step's backward is queued, so the device stays busy while the host waits.
    Waited for after the backward of a first-N replica, it also makes the replica's arrival
    (``TrainWorker._first_n_step``'s count) mean its gradient is computed, not only queued: a
    slow GPU arrived first by its host's speed, and the fast N waited for it in the reduce."""

    def __init__(self, device: Any, timeout_s: Callable[[], float] = lambda: 60.0,
                 event: Callable[[], Any] | None = None):
        if event is None and device.type == "cuda":
            event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731 - made on the GPU's thread
        self._event, self._timeout_s = event, timeout_s
        self._t_step = 0.0
        self._start: Any = None
        self._before = 0.0
        self._mark: Any = None

    def begin(self, t_step: float) -> None:
        """The step started at ``t_step`` (``perf_counter``); its forward is queued next."""
        self._t_step, self._mark = t_step, None
        if self._event is not None:
            self._before = time.perf_counter() - t_step
            self._start = self._event()
            self._start.record()

    @property
    def reached(self) -> bool:
        """Whether ``contact`` was called since ``begin``."""
        return self._mark is not None

    def contact(self) -> None:
        """The rank reaches its peers now (or its own work ends); the first call counts."""
        if self.reached:
            return
        if self._event is None:
            self._mark = time.perf_counter() - self._t_step
        else:
            self._mark = self._event()
            self._mark.record()

    def seconds(self) -> float:
        """The local seconds up to ``contact`` (called first). On a GPU whose contact event
        does not complete within the timeout (a kernel hung), the host's time so far: the
        step's own wait for the stream reports the hang."""
        if self._event is None:
            return self._mark
        if not wait_for_stream(self._mark, self._timeout_s()):
            return time.perf_counter() - self._t_step
        return self._before + self._start.elapsed_time(self._mark) / 1000.0


def ddp_bucket_kwargs(backend: str, bucket_cap_mb: float | None) -> dict:
    """DDP's bucket arguments: the user's size, else torch's defaults on NCCL and one 25 MiB cap
    (torch's own bucket size) for every bucket on gloo.

    torch's default puts the first 1 MiB of gradients in a bucket of its own so NCCL can start
    while the backward still runs. On CPU that overlap buys little (gloo's threads and the
    backward share the rank's cores) and every extra bucket is another gloo all-reduce, each
    2 * (world - 1) rounds over TCP. Passing ``bucket_cap_mb`` explicitly makes torch use it for
    the first bucket too. Measured on the default benchmark workload (MLP 256-512-512-10, 1.6 MB
    of gradients, 4 gloo ranks on 2 cores, 300 steps, 3 alternating runs): 13108/12054/13330
    samples/s with one bucket against 11658/10129/10423 with torch's two.
    """
    if bucket_cap_mb is not None:
        return {"bucket_cap_mb": bucket_cap_mb}
    return {"bucket_cap_mb": 25} if backend == "gloo" else {}


def bucket_bytes(backend: str, bucket_cap_mb: float | None) -> tuple[int, int]:
    """The first bucket's and every other bucket's size in bytes that DDP gets from
    ``ddp_bucket_kwargs``: first-N's buckets (elastic/actors/grads.py) are the same size."""
    cap = ddp_bucket_kwargs(backend, bucket_cap_mb).get("bucket_cap_mb")
    if cap is None:  # torch's defaults, as DDP applies them
        return dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20
    nbytes = int(cap * 2**20)
    return nbytes, nbytes


def ddp_no_forward_buffer_sync(ddp_init) -> dict:
    """DDP's argument that stops it broadcasting buffers at every forward (elastic broadcasts
    them at the end of each step, elastic/actors/buffers.py): ``forward_sync_buffers=False``
    where torch has it (2.13 on; it still syncs buffers once at construction), else the
    ``broadcast_buffers=False`` it replaces, which torch 2.13 deprecates with a warning."""
    if "forward_sync_buffers" in inspect.signature(ddp_init).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _freeze_startup_heap() -> None:
    """Put every object alive now (torch's ~200k import-time objects, the model, the optimizer,
    the dataset) out of the garbage collector's reach, after one full collection.

    Why: ``leave()`` runs a full collection at every group change, so that a dropped process
    group's sockets close at once and peers blocked on them raise; ``join()`` leaves first, so a
    survivor ran two per recovery. Each scanned all of these objects: ~0.09 s of CPU in an idle
    process, ~0.17 s per call measured in the ranks of a 4-rank run on the 2-vCPU VM, in every
    rank, in the middle of a rebuild. They live as long as the process, so there is nothing to
    find among them. What this gives up: a reference cycle among them that became garbage later
    would be kept (reference counting still frees everything else). Objects made after this
    (process groups, DDP, each step's tensors) are collected as before.
    """
    gc.collect()
    gc.freeze()


class TrainWorker:
    """The actor class. ``elastic.actors.worker_group`` wraps it with ``ray.remote``."""

    def __init__(self, spec: TrainingSpec | PackedSpec, actor_name: str = "", background_start: bool = False):
        """``background_start``: build on idle CPU only (a spare refilling the pool while ranks
        train; see ``elastic.actors.priority``). The threads go back to normal priority before
        the actor is ready."""
        from elastic.checkpoint import memory

        memory.join_run()  # memory:// here is the run's shared copy (elastic/checkpoint/memory.py)
        with idle_priority(background_start) as idle:
            self._build(unpack_spec(spec), actor_name)
            _freeze_startup_heap()
        self.started_in_background = idle

    def _build(self, spec: TrainingSpec, actor_name: str) -> None:
        from elastic.checkpoint.compat import canonical_param_names, param_names_of

        self.spec = spec
        self.actor_name = actor_name

        self._gpu_ids = list(ray.get_gpu_ids()) if spec.use_gpu else []
        cuda = spec.use_gpu and torch.cuda.is_available()
        self.device_str, self.backend = choose_device_and_backend(
            spec.use_gpu, self._gpu_ids, cuda, torch.cuda.device_count() if cuda else 0,
            os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.device = torch.device(self.device_str)
        self._bind_device()
        torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
        # The GPU's generator too: a model_fn that initialises on the GPU otherwise drew from
        # CUDA's fixed default seed whatever RunConfig.seed said.
        _seed_everything(spec.seed, self.device)
        self.model = spec.model_fn().to(self.device)
        if not any(m.training for m in self.model.modules()):
            # Built in eval mode as a whole (from_pretrained returns models so): trained in train
            # mode, as a training loop's model.train() would. A model_fn that put some modules in
            # eval mode beside others (a frozen backbone: BatchNorm statistics and dropout fixed)
            # is left as it is; the steps never call model.train(), which turned those back on.
            self.model.train()
        if not any(p.requires_grad for p in self.model.parameters()):
            # DDP would refuse it at the rendezvous, and first-N would train nothing.
            raise ValueError("model_fn returned a model with no trainable parameters (none has "
                             "requires_grad=True): there is nothing to train")
        # A list, not model.parameters()'s generator: an optimizer_fn that reads its argument twice
        # (weights in one param group, biases and norms in another) built an empty second group.
        # With the names beside it (ModelParameters.named), for a rule by name.
        self.optimizer = spec.optimizer_fn(ModelParameters(self.model))
        _check_optimizer_covers(self.model, self.optimizer)
        # Once, here: saved with every snapshot, and read by a resume's check (compat); a list of
        # names per step would cost the step the walk over the model's parameters.
        self.optimizer_param_names = param_names_of(self.model, self.optimizer)
        self.optimizer_canonical_names = canonical_param_names(self.model, self.optimizer)  # live_state
        _check_step_needs_no_closure(self.optimizer)
        sparse = sparse_embeddings(self.model)
        if sparse and spec.max_grad_norm is not None:
            # clip_grad_norm_ raises NotImplementedError on a sparse gradient, at the first step.
            raise ValueError(f"max_grad_norm clips the gradient's norm, which torch does not compute for sparse "
                             f"gradients ({', '.join(sparse[:5])} has sparse=True): use dense embeddings, or "
                             "leave Trainer.max_grad_norm unset")
        self._autocast_dtype, self.scaler = mixed_precision(spec.mixed_precision, self.device)
        self._update_skipped = False  # fp16: the last update was skipped, its gradient having overflowed
        self.scheduler = spec.scheduler_fn(self.optimizer) if spec.scheduler_fn else None
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # Its step() needs a metric, and the first optimizer step would fail on it far from here.
            raise TypeError("scheduler_fn returned a ReduceLROnPlateau, which steps on a metric; elastic steps "
                            "the scheduler after every optimizer step with none, on every replica alike. Use a "
                            "step-based scheduler (LambdaLR, StepLR, OneCycleLR, CosineAnnealingLR, ...).")
        self.dataset = spec.dataset_fn()
        if isinstance(self.dataset, torch_data.IterableDataset) or not hasattr(self.dataset, "__len__"):
            # The controller hands each rank sample indices, so the dataset must be read by index
            # (len() failed with a bare TypeError in the worker's first report).
            raise ValueError(f"dataset_fn returned a {type(self.dataset).__name__}, which cannot be read by index: "
                             "elastic hands each rank the indices of its samples, so it needs a map-style dataset "
                             "(with __len__ and __getitem__)")
        self.ddp = None  # DistributedDataParallel while in a group (aggregation "all")
        self._ddp_forwarded = False  # the step's forward went through self.ddp (_note_ddp_forward)
        self.teardown_leaks = 0  # leave() calls the DDP wrapper outlived (see leave)
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self._collective_timeout_s = 0.0  # the group's, from join()
        self.completed_step = 0
        self.started_step = 0  # newest step this rank began computing; started - completed = work at risk
        self.current_step: int | None = None
        self.last_beat = time.time()
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._fn_store = None  # first-N: the group's rendezvous store, which orders arrivals
        self._hosted_store = None  # rank 0: the store host_rendezvous bound, until join takes it
        self.part_pool = None  # where this group's ranks pool written checkpoint parts (world > 1)
        self._fn_n = 0  # first-N: how many gradients make a step
        self._fn_grads: FlatGrads | None = None  # first-N: every gradient, in one buffer (elastic/actors/grads.py)
        self._ddp_user_ignored: set[str] | None = None  # what the model asked DDP to ignore before the first join
        self._fn_schedule: SitOutSchedule | None = None  # first-N: who rests which step (elastic/actors/sitout.py)
        self._fn_agreed: deque = deque()  # first-N: steps agreed on the store whose keys are not yet forgotten
        self._fn_sends: UpdateSends | None = None  # first-N leader: the update's sends to late ranks
        self._fn_buffer_sends: UpdateSends | None = None  # ... and of the agreed buffers (models that have any)
        self._buffers: ReplicaBuffers | None = None  # agreed after every step (elastic/actors/buffers.py)
        self._fn_abandoned = False  # first-N: the controller gave this group's agreements up
        self._fast_log: dict[int, tuple[int, ...]] = {}
        # The results of a call's steps that completed before one of its steps failed (the call
        # raised, so they never reached the controller), with the call's group generation; see
        # ``unreported_results``.
        self._unreported: tuple[int, list[StepResult]] = (-1, [])
        self._checksum_every = 0
        # NCCL: the group generation whose communicators abort_collectives aborted (see there),
        # and the lock that keeps an abort from landing on a group being left or joined.
        self._aborted_generation: int | None = None
        self._group_lock = threading.Lock()
        self._world_pg = None  # the group's default process group, held for leave() (see there)
        self._slow: tuple[float, int, float] | None = None  # (factor, from_step, delay_s) fault injection
        self._hang_at: int | None = None
        self._kill_at: int | None = None
        self._kill_after_update = False
        self._kill_mark: str | None = None
        self._healthy_times: deque = deque(maxlen=32)  # step wall times before an injected slowdown
        self._slow_base: float | None = None
        # A step_fn under DDP: (step, its start) while it runs (_first_contact_hook)
        self._step_clock: tuple[int, float] | None = None
        # Each step's local seconds, to its first contact with its peers (_forward_backward)
        self._local_clock = LocalClock(self.device, lambda: self._collective_timeout_s or 60.0)
        self.phase, self.phase_since = "idle", time.time()
        self._ckpt = None

    # ---- identity and liveness -------------------------------------------------------------
    def _bind_device(self) -> None:
        """Make this rank's GPU the calling thread's current device (the CUDA runtime keeps one per
        thread, and Ray runs calls on its own threads): the user's functions that say "cuda"
        without an index, and torch calls that take the current device, then mean this rank's."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

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
            "started_in_background": self.started_in_background,
            "idle_threads": idle_threads(),
            "gc_frozen_objects": gc.get_freeze_count(),
            "dataset_size": len(self.dataset),
        }

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> dict:
        """Answered from its own thread, so a worker busy in a long step still answers."""
        return {"time": time.time(), "step": self.current_step, "completed_step": self.completed_step,
                "rank": self.rank, "phase": self.phase, "phase_since": self.phase_since}

    @ray.method(concurrency_group="control")
    def abort_collectives(self, generation: int) -> bool:
        """Abort this rank's NCCL communicators of group ``generation``; the controller calls it,
        from this actor's control thread, when a peer of the group died or failed. Returns
        whether there was one to abort.

        Why: on NCCL a rank whose peer died does not fail. Its collective kernel waits on the
        GPU for data that never comes, and no socket closes to wake it (gloo's way out, see
        ``_run_guarded``); it would wait out the collective timeout and be killed, survivors and
        the state they hold lost with it. Aborted, its kernels return, and before the optimizer
        steps on partly reduced gradients the step raises: a synchronous collective's ``wait()``
        with blocking waits (``NCCL_ERROR_ENV``), DDP's step in ``_check_not_aborted`` (DDP waits
        on a future that blocking waits do not reach). A CollectiveError, and the rank leaves the
        group as a gloo rank does.
        On gloo there is nothing to do (its abort does not unblock a waiting collective)."""
        if self.backend != "nccl":
            return False
        # Not waited for: this thread also answers heartbeats. Held by the training thread, the
        # group is being left (leave() aborts NCCL itself) or another generation is being set.
        # Without the lock, an abort that passed the check below could land after a leave and
        # join, on the next generation's group.
        if not self._group_lock.acquire(blocking=False):
            return False
        try:
            if generation != self.generation or not dist.is_initialized():
                return False
            # Set first: a step of this generation must not take what the aborted kernels leave
            # for its update (_check_not_aborted), nor read a failure after it as the user's.
            self._aborted_generation = generation
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # an already-broken group may refuse
                logger.debug("rank %s: aborting the NCCL group failed", self.rank, exc_info=True)
            return True
        finally:
            self._group_lock.release()

    def _check_not_aborted(self) -> None:
        """NCCL, before the optimizer steps: the step's collectives are done, and were not aborted.

        Why: DDP does not wait on its all-reduce's ``Work``; it waits on the work's future, which
        on NCCL completes once the kernel is queued (torch: ``CUDAFuture`` does not honour
        ``TORCH_NCCL_BLOCKING_WAIT``). So an abort that frees a kernel hung on a dead peer lets
        the step run on to the optimizer with partly reduced gradients, and report the step done:
        a survivor with corrupted weights, taken as current by the recovery. Waiting for the
        stream here (the update waits for the gradients anyway) and then reading the abort flag,
        set before the abort, turns that step into a failed collective, as on gloo.

        Waited for with the group's timeout, not ``synchronize()``: with TORCH_NCCL_BLOCKING_WAIT
        (NCCL_ERROR_ENV) torch's own watchdog does not end a hung collective, and DDP's future
        does not wait with it, so a kernel hung on a dead peer that no abort reaches (the
        controller's abort refused for a generation, or never sent) held this rank in the
        stream's synchronize until it was killed as hung, its state lost with it."""
        if self.backend != "nccl":
            return
        if not wait_for_stream(torch.cuda.current_stream(self.device), self._collective_timeout_s):
            raise CollectiveError(f"rank {self.rank}: the collectives of group generation {self.generation} did "
                                  f"not finish within the group's timeout ({self._collective_timeout_s:g} s): a "
                                  "peer is hung or gone; the step makes no update")
        if self._aborted_generation == self.generation:
            raise CollectiveError(f"rank {self.rank}: the NCCL collectives of group generation {self.generation} "
                                  "were aborted (a peer failed); the step's gradients are not whole, so it makes "
                                  "no update")

    @ray.method(concurrency_group="control")
    def reap(self, pid: int) -> bool:
        """SIGKILL a hung peer's process on this node (the controller found it by its heartbeats)."""
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False

    @ray.method(concurrency_group="control")
    def sees_file(self, path: str, within_s: float = 2.0) -> bool:
        """Whether ``path`` (on this node's filesystem) exists, looked for up to ``within_s``: the
        controller's check that a local checkpoint directory is the same directory on every node
        (``_check_storage_shared``). Looked for again for a while, as a network filesystem's cached
        listing (NFS attribute caches, a FUSE mount's) can lag a file made on another node."""
        deadline = time.monotonic() + within_s
        while not os.path.exists(path):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _enter(self, phase: str) -> None:
        """Phases let the controller tell a rank stuck in its own code from one waiting on peers."""
        self.phase, self.phase_since = phase, time.time()

    def host_rendezvous(self, timeout_s: float) -> int:
        """Rank 0's rendezvous store, listening from now on a port the kernel picks; its port.

        Why bound here, before the group is told the port: the port used to be one this rank
        found free and let go, and another socket on the node could take it before rank 0's
        store bound it (the group then failed to form with every rank alive). A store bound on
        port 0 holds its port from the start; ``join`` hands it to the process group."""
        self._hosted_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=timeout_s))
        return self._hosted_store.port

    # ---- fault injection (tests, benchmarks, demo) ------------------------------------------
    def inject_slowdown(self, factor: float, from_step: int, delay_s: float = 0.0) -> None:
        """Make this worker ``factor`` times slower from ``from_step`` on, or, with ``delay_s``,
        add a fixed sleep to each of its steps (a pace that does not depend on the machine's
        load, for tests that need a step to last a known time). A test and demo aid."""
        self._slow = (float(factor), int(from_step), float(delay_s))

    def inject_hang(self, at_step: int) -> None:
        """Stop answering inside step ``at_step`` (sleeps far past every timeout). A test aid."""
        self._hang_at = int(at_step)

    def inject_kill(self, at_step: int, after_update: bool = False, mark: str | None = None) -> None:
        """SIGKILL this worker's own process in the middle of step ``at_step``, or with
        ``after_update`` once that step's update is applied and before its result goes back (a
        node lost right after a step: its peers finished the step with it). ``mark``: a file the
        time of the kill (``time.time()``) is written to just before it, for a benchmark's
        time to detect. A test and bench aid."""
        self._kill_at = int(at_step)
        self._kill_after_update = bool(after_update)
        self._kill_mark = mark

    def _kill_now(self) -> None:
        if self._kill_mark:
            try:
                with open(self._kill_mark, "w") as f:
                    f.write(repr(time.time()))
            except OSError:  # a path on another node's disk, say: the kill still happens
                logger.warning("could not write the injected kill's time to %s", self._kill_mark, exc_info=True)
        os.kill(os.getpid(), 9)

    def _injected_delay(self, step: int, elapsed_s: float) -> float:
        """Sleep that makes this rank's step ``factor`` times as long as its healthy steps were.

        The baseline is the median wall time of this rank's steps before the slowdown began (a
        step includes waiting on peers, so in a synchronous ring it is the ring's pace): a slow
        node drags its whole step, not only its arithmetic. With no healthy step measured yet
        (slow from step 1), the time into this step so far is the baseline.
        """
        self._injected_kill(step)
        if self._hang_at is not None and step >= self._hang_at:
            time.sleep(3600)
        if not self._slow or step < self._slow[1]:
            return 0.0
        if self._slow[2] > 0:
            time.sleep(self._slow[2])
            return self._slow[2]
        if self._slow[0] <= 1:
            return 0.0
        if self._slow_base is None:
            self._slow_base = statistics.median(self._healthy_times) if self._healthy_times else elapsed_s
        delay = self._slow_base * (self._slow[0] - 1)
        time.sleep(delay)
        return delay

    def _injected_kill(self, step: int) -> None:
        """The mid-step kill of ``inject_kill``: where a computing rank first talks to its peers,
        or where a first-N replica that skips computing this step reads the fast set."""
        if self._kill_at is not None and step == self._kill_at and not self._kill_after_update:
            self._kill_now()

    def _note_step_time(self, step: int, seconds: float) -> None:
        """Healthy step times, kept only while an injected slowdown is still to come."""
        if self._slow is not None and step < self._slow[1]:
            self._healthy_times.append(seconds)

    # ---- process group ---------------------------------------------------------------------
    def join(self, rank: int, world_size: int, master_addr: str, master_port: int, generation: int,
             timeout_s: float, use_ddp: bool = True, subgroup_size: int = 0, checksum_every: int = 0,
             late_backoff_steps: int = 0) -> dict:
        """Leave any old group and form the new one. Survivors keep their model and optimizer."""
        # This call's thread on the rank's GPU: the join's object gather (buffer_survey)
        # stages its bytes on the current device, and Ray runs calls on threads of its own.
        self._bind_device()
        hosted, self._hosted_store = self._hosted_store, None  # this join's, or none: never kept past it
        self.leave()
        self._unreported = (-1, [])  # the recovery that could book them has read them, or never will
        t0 = time.time()
        with self._group_lock:  # an abort checked against the old generation cannot land on this one
            self.rank, self.world_size, self.generation = rank, world_size, generation
        self._collective_timeout_s = float(timeout_s)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        if self.backend == "nccl":
            for key, value in NCCL_ERROR_ENV.items():
                os.environ.setdefault(key, value)  # the user's own setting wins
        store = None
        try:
            store = self._rendezvous_store(hosted, rank, world_size, master_addr, master_port, timeout_s)
            self._join(store, rank, world_size, master_addr, master_port, generation, timeout_s, use_ddp,
                       subgroup_size, checksum_every, late_backoff_steps)
        except BaseException:
            # Torn down at once, as after a failed step (_run_guarded): a group formed before the
            # failure (a peer lost during DDP's first broadcast, a subgroup, the part pool) left up
            # keeps its sockets and rank 0's store open, and the peers blocked on them wait out
            # collective_timeout_s instead of failing now. This frame's own references to the
            # store go first: the exception's traceback holds this frame (running, so leave()
            # cannot clear it) until Ray frees the exception, and rank 0's store with it.
            store = hosted = None
            self.leave()
            raise
        return {"rank": rank, "join_s": time.time() - t0}

    @staticmethod
    def _rendezvous_store(hosted, rank: int, world_size: int, master_addr: str, master_port: int,
                          timeout_s: float):
        """The group's TCPStore: on rank 0 the one ``host_rendezvous`` bound for this port (or,
        called without it, one bound now on ``master_port``), a client of it on every other rank."""
        if rank == 0 and hosted is not None and hosted.port == master_port:
            return hosted
        with _group_failures_as_collective(f"rank {rank} could not reach the rendezvous store "
                                           f"{master_addr}:{master_port}"):
            return dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s))

    def _join(self, store, rank: int, world_size: int, master_addr: str, master_port: int, generation: int,
              timeout_s: float, use_ddp: bool, subgroup_size: int, checksum_every: int,
              late_backoff_steps: int) -> None:
        # A failure of the group itself (a peer gone, the store unreachable) is a CollectiveError, as
        # in a step, for the controller to recover from; anything else is the model's, the user's.
        with _group_failures_as_collective(f"rank {rank} could not join generation {generation}"):
            dist.init_process_group(
                self.backend,
                # Under the prefix torch's tcp:// rendezvous puts its group's keys: the part pool
                # shares this store (its own keys), and the group's keys stay apart from them.
                store=dist.PrefixStore("default_pg", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                device_id=self.device if self.backend == "nccl" else None,
            )
            self._world_pg = dist.group.WORLD
            uneven, wide = buffer_survey(self.model, self._world_pg) if world_size > 1 else ([], [])
            if subgroup_size and world_size > 1:
                # First-N replicas start from rank 0's parameters and buffers, as DDP's constructor
                # makes its replicas do (with the same torch function and bucket size). Why: nothing
                # else makes a fresh run's replicas agree (a recovery's state sync comes before the
                # join, so this changes nothing there), and a model_fn that is not deterministic
                # under the run's seed (a torch.empty parameter, an init by time or pid, a
                # nondeterministic init kernel) gave each replica other weights from step 0: the
                # replica checksum then ended the run, or with it off they trained apart.
                torch_dist_utils._sync_module_states(self.model, self._world_pg, DDP_BROADCAST_BUCKET_BYTES, 0,
                                                     set(uneven))
            if use_ddp:
                device_ids = [self.device.index] if self.backend == "nccl" else None
                # Gradients as views into DDP's communication buckets: no copy out of the buckets
                # after the all-reduce. (Each step's zero_grad(set_to_none=True), which keeps an
                # optimizer from stepping a parameter that got no gradient, drops the views, so
                # the backward still allocates each gradient and the reducer copies it in before
                # it points .grad at its view again.) Measured on the default benchmark
                # workload (4 ranks, 2 cores, 500 steps, alternating runs): 8641/8708/8715 samples/s
                # against 7717/6650/8411 without.
                # No buffer broadcast at every forward: rank 0's buffers go out at the end of each
                # step instead (_train_step), so every rank holds them between steps.
                ddp = torch_parallel.DistributedDataParallel
                # Its constructor broadcasts rank 0's buffers (torch 2.13 does even with
                # forward_sync_buffers=False): not the caches whose size differs between ranks
                # (buffer_survey). Added to what the user's model asks DDP to ignore, as the
                # model had it before the first join (each join sets the list again: last join's
                # uneven caches may be even now). (A private hook, which torch says it will
                # replace: where it is gone, nothing is told, as before.)
                ignore = getattr(ddp, "_set_params_and_buffers_to_ignore_for_model", None)
                if self._ddp_user_ignored is None:
                    self._ddp_user_ignored = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
                if ignore is not None:
                    ignore(self.model, sorted(self._ddp_user_ignored | set(uneven)))
                no_forward_sync = ddp_no_forward_buffer_sync(ddp.__init__)
                self.ddp = ddp(
                    self.model, device_ids=device_ids, gradient_as_bucket_view=True,
                    find_unused_parameters=self.spec.find_unused_parameters,
                    **no_forward_sync, **ddp_bucket_kwargs(self.backend, self.spec.bucket_cap_mb))
                if "broadcast_buffers" in no_forward_sync and world_size > 1:
                    # Before torch 2.13, broadcast_buffers=False also stops the constructor's
                    # broadcast of the buffers (its parameters still go): rank 0's buffers are
                    # sent here instead, after it, with the same function and bucket size. Why:
                    # each rank's first forward ran on its own buffers (step 1's gradients
                    # averaged over forwards that saw different statistics), and a non-persistent
                    # buffer of one layout everywhere (random features drawn at build) was never
                    # made rank 0's, nor checked (the replica checksum skips non-persistent
                    # buffers). After the constructor, not before: its check that every rank has
                    # the same parameters comes first (a broadcast of buckets of other sizes
                    # aborts a gloo process or waits out the timeout), and the parameters go once.
                    skip = self._ddp_user_ignored | set(uneven)
                    torch_dist_utils._sync_params_and_buffers(
                        self._world_pg, [b.detach() for name, b in self.model.named_buffers() if name not in skip],
                        DDP_BROADCAST_BUCKET_BYTES, 0)
                if self.spec.step_fn is not None:
                    self.ddp.register_comm_hook(None, self._first_contact_hook)
                self.ddp.forward = _noting_forward(self.ddp, self._note_ddp_forward)
            buffers = ReplicaBuffers(self.model, self.device, leave_out=wide)  # the same list on every rank
            self._buffers = buffers if buffers and world_size > 1 else None
            if subgroup_size and subgroup_size < world_size:
                # Every rank must create every subgroup, in the same order: gloo's new_group is a
                # collective over the world (the use_local_synchronization variant hung in our probe).
                # With the world's timeout: a subgroup takes torch's default otherwise (30 min on
                # gloo, 10 on NCCL), and the fast N's collectives run on subgroups.
                for members in itertools.combinations(range(world_size), subgroup_size):
                    pg = dist.new_group(list(members), timeout=timedelta(seconds=timeout_s))
                    if rank in members:
                        self._subgroups[members] = pg
            if subgroup_size:
                self._fn_store = dist.distributed_c10d._get_default_store()
                self._fn_n = subgroup_size
                if self._fn_grads is None:  # once per model: it hooks every parameter
                    self._fn_grads = FlatGrads(self.model)
                flat = self._fn_grads.bind(self.device)
                self._fn_grads.plan_buckets(*bucket_bytes(self.backend, self.spec.bucket_cap_mb))
                # A step's sends to a late replica are its averaged gradient and, in a model with
                # buffers, the agreed buffers (float64): one limit from both, so the copies in
                # flight stay within SEND_BUDGET_BYTES together (a large persistent buffer, a
                # causal mask say, made the buffer copies alone many times the budget).
                step_bytes = flat.numel() * flat.element_size()
                if self._buffers is not None:
                    step_bytes += self._buffers.flat.numel() * self._buffers.flat.element_size()
                self._fn_sends = UpdateSends(dist.isend, in_flight_limit(step_bytes))
                if self._buffers is not None:
                    self._fn_buffer_sends = UpdateSends(dist.isend, self._fn_sends.limit)
                self._fn_schedule = SitOutSchedule(world_size, late_backoff_steps)
                self._fn_agreed.clear()  # the old generation's keys died with its store
                self._fn_abandoned = False
            self._checksum_every = checksum_every
            if world_size > 1:
                from elastic.checkpoint.pool import PartPool

                self.part_pool = PartPool(master_addr, master_port, world_size)  # connects on first use

    def leave(self) -> None:
        """Tear down the group. Peers blocked on us see their sockets close and raise at once.

        The group's ``ProcessGroup`` objects are held here until the end, and dropped last. Why:
        the DDP reducer also owns the group, and a reducer is freed with the GIL held (pybind's
        default), while a ``ProcessGroup`` object lets go of the GIL in its destructor (torch's
        ``IntrusivePtrNoGilDestructor``). Gloo's destructor waits for its worker threads, and a
        worker thread that just finished a collective frees that work under the group's mutex,
        which needs the GIL (the work's saved thread-local state holds a Python object). So a
        reducer that drops the last reference deadlocks the process: its thread holds the GIL and
        waits for the mutex, the worker thread holds the mutex and waits for the GIL. Seen on the
        recovery benchmark's workload in 4 of 59 SIGKILL runs (and 0 of 70 since): a survivor
        answered no heartbeat until it was killed as hung (py-spy: ``~Reducer ->
        ~ProcessGroupGloo -> pthread_mutex_lock`` on one thread, ``~AsyncAllreduceWork ->
        gil_scoped_acquire`` on gloo's). That happened when Ray freed the failed step's
        exception, whose frames still held the DDP wrapper (the step's ``model``). So a leave()
        called while a failure is being handled clears that exception's frames first; the
        wrapper dies in here (``gc.collect`` for its cycles), and the last reference to the group
        is ours. ``teardown_leaks`` counts leaves where the wrapper was still alive at the end;
        dropping the group is not put off then, because a group kept alive keeps its sockets open
        and peers blocked on us would wait out the timeout.
        """
        held = list(self._subgroups.values())
        if dist.is_initialized():
            held.append(dist.group.WORLD)
        # Also once an NCCL abort (abort_collectives) has emptied torch's registry of groups, and
        # dist.is_initialized() says False: the reducer would otherwise hold the last reference
        # to the world group, and free it (joining its watchdog threads) with the GIL held.
        held.append(self._world_pg)
        self._world_pg = None
        wrapper = weakref.ref(self.ddp) if self.ddp is not None else None
        _clear_frames(sys.exception())  # the failure being handled, if any (see above)
        self._subgroups.clear()
        self._fn_store, self._fn_sends = None, None  # unfinished sends went to peers of the old group
        self._fn_buffer_sends = None
        if self._fn_grads is not None:
            self._fn_grads.release()  # its step's subgroup and works, or their sockets stay open
        if self.part_pool is not None:
            self.part_pool.retire()  # snapshots taken in the old group keep theirs, which now fails fast
        self.part_pool = None
        if self._ckpt is not None:
            try:
                self._ckpt.left_group()  # a part left waiting in the old pool goes on its own
            except Exception:  # noqa: BLE001 - the teardown below must run (peers wait on it)
                logger.debug("rank %s: could not report its pooled checkpoint part on leaving", self.rank,
                             exc_info=True)
        self.ddp = None  # drop the reducer so its autograd hooks and its group reference go
        with self._group_lock:  # no abort_collectives in the middle (see there)
            if dist.is_initialized() and self.backend == "nccl":
                try:
                    # A blocked NCCL kernel never returns by itself: abort the communicators
                    # first, then release the group.
                    dist.distributed_c10d._abort_process_group()
                except Exception:  # an already-broken group may refuse it
                    logger.debug("aborting the process group failed", exc_info=True)
            # Its own try: an abort that raised skipped the destroy, and with the default group
            # still set every later join of this rank failed ("initialize the default process
            # group twice"), read as a collective failure, until the run gave up on it.
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # an already-broken group may refuse a clean destroy
                    logger.debug("destroy_process_group failed", exc_info=True)
        gc.collect()
        if wrapper is not None and wrapper() is not None:
            self.teardown_leaks += 1
            logger.warning("rank %s: the DistributedDataParallel wrapper outlived leaving group generation %s "
                           "(something still references it); its reducer may free the group later",
                           self.rank, self.generation)
        del held  # the last references: the gloo group is destroyed here, without the GIL

    # ---- training --------------------------------------------------------------------------
    def _batch(self, indices: list[int]):
        try:
            collated = torch_data.default_collate(fetch_samples(self.dataset, indices))
        except Exception as exc:
            # The dataset's own error (a network-backed dataset's "read timed out"): no collective
            # runs while a batch is read, so it is never a broken group, whatever its words say
            # (``_looks_collective`` reads a RuntimeError's text, and this mark). Taken for one, it was replayed
            # after a rebuild, failure after failure, until max_failures ended the run.
            with contextlib.suppress(AttributeError, TypeError):  # an exception that takes no attribute
                exc.elastic_data_error = True
            raise
        return _to_device(collated, self.device)

    def _forward_backward(self, model, batch, step: int, has_collective: bool, t_step: float) -> torch.Tensor:
        """Forward and backward; returns the loss. Its local seconds are ``_local_clock``'s to
        read (``seconds``; on a GPU that read waits for the device to reach the contact, so a
        caller with nothing to decide on it reads it once the step has synchronised anyway).

        Local seconds is the part of the step no peer can stretch, counted from the step's start
        (``t_step``: the batch's fetch is this rank's own work; a rank slow at reading its data
        is a straggler too). With DDP the backward waits in all-reduce for the slowest rank, so
        only data + forward count there; under a ``step_fn``, which runs the backward itself,
        up to the rank's first bucket going out (``_first_contact_hook``); without a collective
        the whole forward+backward counts. An injected slowdown sleeps just before the rank's
        first contact with its peers, and counts as local. The caller entered the phase
        "compute" before the batch's fetch.
        """
        clock = self._local_clock
        clock.begin(t_step)
        if self.spec.step_fn is not None:
            self._step_clock = (step, t_step)
            try:
                loss = self.spec.step_fn(model, batch)
            finally:
                self._step_clock = None
            if not clock.reached:  # no bucket went out: no collective, or no backward in it
                self._injected_delay(step, time.perf_counter() - t_step)
                clock.contact()
            return loss
        with self._autocast():
            loss = self.spec.loss_fn(model, batch)
        if has_collective:
            self._injected_delay(step, time.perf_counter() - t_step)
            clock.contact()
        self._enter("backward+allreduce" if has_collective else "backward")
        # fp16: the loss scaled, so small gradients do not flush to zero; _apply_update unscales.
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if not has_collective:
            self._injected_delay(step, time.perf_counter() - t_step)
            clock.contact()
        return loss

    def _autocast(self):
        """``Trainer.mixed_precision``'s autocast for the forward (the backward runs outside it, as
        torch's AMP recipe says), or a context that does nothing."""
        if self._autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _note_ddp_forward(self) -> None:
        """The DDP wrapper's forward ran: the step's loss went through it (``_train_step``).

        Under a ``step_fn``, a forward after a backward (the next micro-batch of an accumulation
        without ``no_sync``) is this rank's own code again: the phase goes back to "compute"
        (on NCCL, where the backward's end leaves it at the collective: see
        ``_first_contact_hook``). Entered only from another phase, so the step's first forward
        keeps the time of the step's start, its batch's fetch included."""
        self._ddp_forwarded = True
        if self._step_clock is not None and self.phase != "compute":
            self._enter("compute")

    def _first_contact_hook(self, state, bucket):
        """DDP's all-reduce of a bucket (its default hook, the same sum and division), first
        noting, under a ``step_fn``, when this rank's first bucket of the step goes out: where it
        first reaches its peers. Why a hook: the ``step_fn`` runs the backward, which waits
        inside DDP for the slowest rank, so the time around the call is the ring's pace on every
        rank, and a straggler scored like the others and was never found. An injected slowdown
        (or mid-step kill) lands here too, before the peers are reached, as without a step_fn.
        Buckets of a backward under ``no_sync`` never come here; the last backward's do.

        The first bucket of each backward also enters the collective's phase, and (not on NCCL)
        has the phase go back to "compute" once the backward's all-reduces are done
        (``_queue_backward_end``). Why: the step_fn runs on after its backward (a logging call,
        the next micro-batch's forward), and a rank hung there read as waiting on its peers
        until ``_apply_update``, so the controller (``_blamed``) killed a healthy rank first. On
        NCCL the host cannot tell when the all-reduces end (DDP's wait on them only queues the
        stream's wait), and a rank whose kernels hang on a dead peer would read as in its own
        code: its phase stays the collective's until the step's update (``_check_not_aborted``
        waits for the stream) or the step_fn's next forward (``_note_ddp_forward``)."""
        if self._step_clock is not None:
            if not self._local_clock.reached:
                step, t_step = self._step_clock
                self._injected_delay(step, time.perf_counter() - t_step)
                self._local_clock.contact()
            if self.phase != "backward+allreduce":  # this backward's first bucket
                self._enter("backward+allreduce")
                if self.backend != "nccl":
                    self._queue_backward_end()
        return ddp_hooks.allreduce_hook(state, bucket)

    def _queue_backward_end(self) -> None:
        """Have the phase go back to "compute" at the end of the running backward, once DDP has
        waited for its all-reduces. Called from a bucket's comm hook, inside the backward.

        How: an autograd engine callback runs when the backward's graph is done, on the
        backward's own thread, before ``backward()`` returns (so in order with the step's other
        phases; a callback on the all-reduce's future ran on gloo's thread, and could land after
        the step had entered "update"). DDP queues its own callback, which waits for every
        bucket's all-reduce and writes the gradients, when the last bucket is ready, so after
        this one; callbacks queued while the engine runs them run after those already queued,
        so ours queues a second one, which runs after DDP's. A backward that raises runs none:
        the step fails, and ``_run_guarded`` enters "failed"."""
        engine = torch.autograd.Variable._execution_engine

        def graph_done() -> None:
            engine.queue_callback(lambda: self._enter("compute"))  # after DDP's (see above)

        engine.queue_callback(graph_done)

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
            # After an abort of this generation's NCCL group (abort_collectives), whatever fails
            # is the abort's doing: torch's group registry is gone, so the next dist call raises
            # a ValueError ("Default process group has not been initialized"), which read as the
            # user's error and ended the run instead of rebuilding the group.
            collective = (isinstance(exc, (dist.DistBackendError, RuntimeError)) and _looks_collective(exc)) \
                or self._aborted_generation == self.generation
            advice = _ddp_advice(str(exc), self.spec.find_unused_parameters) if self.ddp is not None else None
            if collective or self.world_size > 1:
                # A user error too: not the group's fault, but the peers wait on this rank in the
                # step's collective and would sit there until collective_timeout_s, when the
                # controller kills one as hung and replays the step into the same error, failure
                # after failure. Left now, they raise at once, no rank is lost, and the
                # controller reports this error.
                self.leave()
            if collective:
                raise CollectiveError(msg)
            if advice is not None:
                raise RuntimeError(f"{msg}\n{advice}") from None
            raise

    def train_steps(self, first_step: int, shards: list[list[int]], generation: int) -> list[StepResult]:
        """Consecutive steps in one call (``ScalingConfig.steps_per_dispatch``): DDP steps, or
        first-N steps when this rank joined its group for first-N aggregation.

        Each step is still the controller's: it chose every shard, and it gets one result per
        step. What one call saves is Ray's per-call cost (task submission, a thread hand-off,
        result serialisation: 1-3 ms of CPU per rank per call on a loaded 2-core machine) when
        steps are only tens of milliseconds long. If a step fails, the steps before it stand:
        this rank's ``progress()`` says how far it got, the controller keeps them, and books them
        with their results from ``unreported_results``.
        """
        run = self._first_n_step if self._fn_store is not None else self._train_step
        self._bind_device()
        results: list[StepResult] = []
        try:
            for i, indices in enumerate(shards):
                results.append(self._guarded_step(run, first_step + i, indices, generation))
        except BaseException:
            # Kept for the controller's recovery, which books those steps with them (their loss,
            # timings, fast sets) instead of as steps with no result. A call that failed at its
            # first step (a queued one of a broken generation) leaves the last failure's be.
            if results:
                self._unreported = (generation, results)
            raise
        return results

    def unreported_results(self, first: int, last: int, generation: int) -> list[StepResult]:
        """The results of steps ``first``..``last`` that this rank completed in a call of group
        ``generation`` that then failed at a later step, and forgets them. The controller asks
        when it keeps the steps a survivor finished before that group broke
        (``Controller._keep_steps_held_by``). Why the generation: a rank that left the group
        before the recovery read them (a survivor a shrink stood by as a spare) joins no group
        and may take no state until it is promoted, maybe after a rollback that replays those
        step numbers; its results then belong to a history given up."""
        stashed, results = self._unreported
        self._unreported = (-1, [])
        return [r for r in results if first <= r.step <= last] if stashed == generation else []

    def _guarded_step(self, run: Callable[[int, list[int]], StepResult], step: int, indices: list[int],
                      generation: int) -> StepResult:
        """One step in group ``generation``. A step queued for a group this rank has left (a
        failure happened while it waited in the actor's queue) refuses to run: training without
        the group would update this replica alone."""
        joined = self.ddp is not None or self._fn_store is not None
        if generation != self.generation or (not joined and self.world_size > 1):
            raise StaleStep(f"rank {self.rank}: step {step} was queued for group generation {generation}, "
                            f"but this rank is in generation {self.generation} "
                            f"({'joined' if dist.is_initialized() else 'no group'})")
        if self._buffers is not None:
            self._buffers.save()
        try:
            return self._run_guarded(lambda: run(step, indices))
        except Exception:
            if self._buffers is not None and self.completed_step < step:
                try:
                    self._buffers.restore()  # the failed step's forward leaves no trace in the replica
                except Exception:  # noqa: BLE001 - as the scaler's below: a sticky CUDA error fails
                    # the copy back too, and raised here it replaced the step's CollectiveError, so
                    # a group to heal read as the user's error
                    logger.debug("rank %s: could not restore the buffers", self.rank, exc_info=True)
            if self.scaler is not None and self.completed_step < step:
                try:
                    self._renew_scaler(self.scaler.state_dict())
                except Exception:  # noqa: BLE001 - the step's own error is the one to report
                    # (its state_dict reads the scale from the GPU, which a sticky CUDA error
                    # fails too: raised here, it replaced the CollectiveError the step raised)
                    logger.debug("rank %s: could not renew the loss scaler", self.rank, exc_info=True)
            raise

    def _train_step(self, step: int, indices: list[int]) -> StepResult:
        t0 = time.perf_counter()
        self.current_step = self.started_step = step
        # Before the fetch, which is this rank's own work: the phase was the last call's "idle",
        # a survivor's "failed", or a promoted spare's "idle" since it was built, hours old, and
        # a rank reading a cold dataset at a peer's death read as in its own code since then,
        # past ``step_timeout_s``, and was killed at the collective timeout (``_blamed``).
        self._enter("compute")
        _seed_everything(step_seed(self.spec.seed, self.rank, step), self.device)
        batch = self._batch(indices)
        model = self.ddp if self.ddp is not None else self.model
        self.optimizer.zero_grad(set_to_none=True)
        self._ddp_forwarded = False
        loss = self._forward_backward(model, batch, step, self.ddp is not None, t0)
        local = self._local_clock.seconds()
        if self.ddp is not None and not self._ddp_forwarded:
            fn = "step_fn" if self.spec.step_fn is not None else "loss_fn"
            raise ValueError(
                f"{fn} never called the model it was given: with data parallel that is the "
                "DistributedDataParallel wrapper, whose forward sets up the gradient all-reduce. A forward "
                "through model.module (or another reference to the model) leaves each rank on its own "
                "gradients, and the replicas drift apart. Call model(...) for the forward; model.module "
                "is the bare model for anything else.")
        if self.ddp is not None:
            # DDP all-reduces its buckets in order, each once every parameter in it has its
            # gradient: a parameter this step's backward never reached (a branch used only on
            # some steps) holds its bucket, and every bucket after it, back. The optimizer below
            # then stepped each rank on its own gradients, unaveraged, with no error until the
            # next forward (where torch checks the prior reduction): a checkpoint of that step
            # held replicas that differ, and on the run's last step the end's checksum failed
            # the run as a ReplicaDivergence that named no cause. Checked here, the step
            # fails before any update with DDP's own error, which _run_guarded turns into the
            # find_unused_parameters hint. After a no_sync accumulation the last, synced
            # backward finalizes the reducer, so correct code passes.
            self.ddp._check_reducer_finalized()
        compute = time.perf_counter() - t0
        if self._buffers is not None:  # DDP's rule: rank 0's buffers (elastic/actors/buffers.py)
            if self.phase == "compute":
                # A step_fn's backward left the phase at "compute" (_first_contact_hook), or it
                # ran none: the broadcast below waits on the peers.
                self._enter("allreduce")
            if self.rank == 0:
                self._buffers.pack()
            dist.broadcast(self._buffers.flat, src=0)
            if self.rank != 0:
                self._buffers.unpack()
        grad_norm = self._apply_update(step)
        extra = {**self._after_step(step, grad_norm), "local_time_s": local}
        self._note_step_time(step, time.perf_counter() - t0)
        return StepResult(self.rank, step, float(loss.detach()), time.perf_counter() - t0, compute,
                          len(indices), self.completed_step, extra)

    def _first_n_step(self, step: int, indices: list[int]) -> StepResult:
        """One first-N-of-M step, agreed among the replicas themselves.

        Why the ranks agree through the rendezvous store and not through the controller: asking
        the controller who came first costs two Ray round trips a step (gradient ready, then
        reduce/apply), 10-15 ms on a loaded 2-core machine, against a 25 ms step. The store's
        atomic ``add`` orders arrivals in one round trip, so the whole step stays inside the
        worker and steps go out in windows like DDP steps.

        The protocol, for step t in one group generation (the store is fresh per generation),
        costs each rank at most two store round trips:
        0. Every rank keeps the same sit-out schedule (elastic/actors/sitout.py): a replica
           whose gradients came late rests a few steps, and every rank knows who rests in step
           t before it starts. If exactly N may compute, they are the fast set: they compute and
           go to 3 with no store round trip (a resting replica goes to 4 the same way).
        1. A rank that was late last step first reads the arrival counter (``add(count, 0)``).
           If N ranks have already arrived its gradient could only be dropped: it skips the
           compute and goes to 4. This is what lets a straggler catch up instead of falling
           further behind, and stops it spending CPU on gradients nobody will use.
        2. Otherwise it computes its gradient and arrives with ``add(count, 1 + 2**(8 + rank))``:
           one atomic add returns both its arrival order (low 8 bits) and the set of ranks
           arrived so far, itself included (the bits above). The N-th arrival therefore knows
           the fast set at once and publishes it under one key; the others read that key
           (``get`` blocks until it is set).
        3. The fast N average [gradient, loss] in the subgroup cached for exactly that set
           (made at rendezvous by every rank in the same order: ``new_group`` is collective over
           the world): each divides by N, then all-reduce (``FlatGrads.reduce``), and step. In a step whose fast set was known before it
           began (0), with no ``step_fn``, they reduce bucket by bucket during the backward, as
           DDP does (``FlatGrads.begin_early_reduce``, elastic/actors/grads.py); otherwise in
           one all-reduce after it. The lowest fast rank sends the averaged vector to each late
           rank with a non-blocking ``isend`` and does not wait for it: a late rank receives
           when it gets there, so it never holds up the fast N while it is within a bound of
           sends behind (``UpdateSends``, elastic/actors/sends.py: beyond it the leader waits
           for it, which bounds the copies it holds).
        4. A late rank reads the fast set (or knows it, 0), receives the vector from the lowest
           fast rank and applies it. Every replica runs the same optimizer step on the same
           averaged gradient, so parameters stay bitwise identical (checked by checksum every K
           steps). A model's buffers go the same way in a vector of their own: the fast N's
           mean, sent to the late (elastic/actors/buffers.py).
        Alternatives measured or reasoned out: a DDP comm hook runs inside backward, before
        anyone knows which N finished first (and where the set is known, DDP's reducer still
        belongs to the world group: see elastic/actors/grads.py); an all-reduce over the world
        waits for the straggler by definition; cutting stragglers short at a micro-batch
        boundary still makes the step wait for their partial gradient.
        """
        t0 = time.perf_counter()
        # current_step before the flag is checked (abandon_first_n reads it after setting the
        # flag); started_step after: a step abandoned before it began was no work thrown away,
        # and counted as begun, each recovery counted one step recomputed too many.
        self.current_step = step
        self._check_abandoned(step)
        self.started_step = step
        self._enter("compute")  # before the arrival probe and the fetch, as in _train_step
        store, n, schedule = self._fn_store, self._fn_n, self._fn_schedule
        eligible = schedule.eligible(step)
        # Exactly N may compute: they are the fast set, known to every rank without asking (and
        # the step's store keys are never formatted).
        known = len(eligible) == n
        # ...and then the N reduce during the backward, unless a step_fn runs it: it may call
        # backward more than once, or change a gradient after it, once its bucket is gone.
        early = known and self.spec.step_fn is None
        order = n + 1
        flat = self._fn_grads.flat  # every gradient (views into it, bar other dtypes) and the loss
        local = 0.0
        computed = False
        self._fn_grads.check_model(self.model)
        if self.rank not in eligible:
            pass  # resting (elastic/actors/sitout.py): no gradient, the update all the same
        elif known or schedule.streak[self.rank] == 0 or (store.add(_count_key(step), 0) & 0xFF) < n:
            _seed_everything(step_seed(self.spec.seed, self.rank, step), self.device)
            batch = self._batch(indices)
            self.optimizer.zero_grad(set_to_none=False)
            self._fn_grads.before_backward()
            if early:
                self._fn_grads.begin_early_reduce(self._fn_group(eligible), n)
            loss = self._forward_backward(self.model, batch, step, False, t0)
            if not known:
                # Read at once only where the arrival is counted: on a GPU the read waits for the
                # backward, so the arrival means a gradient computed, not only queued. With the
                # fast set known, nothing waits on it: the reduce and update are queued first,
                # and the time is read with the step's result.
                self._local_clock.seconds()
            self._fn_grads.after_backward(loss)
            if self._buffers is not None:
                self._buffers.pack()
            computed = True
            if known:
                order = eligible.index(self.rank) + 1
            else:
                self._enter("arrive")
                arrived = store.add(_count_key(step), 1 + (1 << (8 + self.rank)))
                order = arrived & 0xFF
        if not computed:
            self._injected_kill(step)  # a replica skipping this step's gradient dies in it all the same
        self._enter("allreduce" if order <= n else "late")
        if known:
            fast = eligible
        else:
            if order == n:
                # compare_set, not set: the key is written once, so every rank reads the same value,
                # the fast set or the controller's ABANDONED (see abandon_first_n), never both.
                agreed = store.compare_set(_fast_key(step), "", str(arrived >> 8))
            else:
                self._check_abandoned(step)
                agreed = store.get(_fast_key(step))
            if agreed == ABANDONED:
                raise FirstNAbandoned(f"rank {self.rank}: step {step} abandoned: a peer was lost before "
                                      f"{n} gradients arrived")
            mask = int(agreed)
            fast = tuple(r for r in range(self.world_size) if mask >> r & 1)
            self._fn_agreed.append(step)
        leader = fast[0]
        late = [r for r in range(self.world_size) if r not in fast]
        tag = step if self.backend == "gloo" else 0  # NCCL has no tags; its pairs match in issue order
        buffers = self._buffers.flat if self._buffers is not None else None
        # The agreed buffers (the fast N's mean) travel under a tag of their own.
        buffer_tag = _BUFFER_TAG | (step & (_BUFFER_TAG - 1)) if self.backend == "gloo" else 0
        if order <= n:
            group = self._fn_group(fast)
            if early:
                self._fn_grads.finish_reduce()
            else:
                self._fn_grads.reduce(group, n)
            if buffers is not None:
                dist.all_reduce(buffers, group=group)
                buffers.div_(n)
            if self.rank == leader and late:
                # A copy: the next step's backward writes into ``flat`` before a late rank may
                # have received this one (elastic/actors/sends.py bounds and reuses the copies).
                # fast: its ranks applied every earlier update, so the sends to them are done
                # and their buffers free (UpdateSends.confirm).
                self._fn_sends.send(flat, late, tag, received=fast)
                if buffers is not None:
                    self._fn_buffer_sends.send(buffers, late, buffer_tag, received=fast)
        else:
            dist.recv(flat, src=leader, tag=tag)
            if buffers is not None:
                dist.recv(buffers, src=leader, tag=buffer_tag)
        schedule.record(step, fast)
        # An agreed step's keys are forgotten ``agreement_horizon`` steps later (every rank keeps
        # the same list of agreed steps), by one rank: the first late replica, off the fast N's
        # path (it has slack), or the leader when a group down to N ranks has no late one.
        horizon = step - agreement_horizon(self.world_size)
        while self._fn_agreed and self._fn_agreed[0] <= horizon:
            old = self._fn_agreed.popleft()
            if self.rank == (late[0] if late else leader):
                forget_agreement(store, old)
        if buffers is not None:
            self._buffers.unpack()
        # The averaged gradient is in ``flat``, which the .grad views share (other dtypes' grads
        # are copied from it); a parameter no fast replica's backward reached has none for this
        # update, as in one process.
        with self._fn_grads.for_update():
            grad_norm = self._apply_update(step)
        self._fast_log[step] = fast
        if len(self._fast_log) > 4096:
            self._fast_log.pop(next(iter(self._fast_log)))
        extra = {**self._after_step(step, grad_norm), "fast": list(fast), "computed": computed, "agreed": not known}
        if computed:
            local = extra["local_time_s"] = self._local_clock.seconds()
        self._note_step_time(step, time.perf_counter() - t0)
        return StepResult(self.rank, step, self._fn_grads.loss, time.perf_counter() - t0, local, len(indices),
                          self.completed_step, extra)

    def _fn_group(self, fast: tuple[int, ...]):
        """The process group of a fast set: its cached subgroup, or the world's (None) in a group
        down to N ranks."""
        return self._subgroups.get(fast) if self._fn_n < self.world_size else None

    def _check_abandoned(self, step: int) -> None:
        """Fail a first-N step of a group the controller has given up (see ``abandon_first_n``)."""
        if self._fn_abandoned:
            raise FirstNAbandoned(f"rank {self.rank}: step {step} abandoned: the controller lost a peer "
                                  f"of group generation {self.generation}")

    @ray.method(concurrency_group="control")
    def abandon_first_n(self, generation: int) -> bool:
        """Release this rank from waiting on a first-N agreement that may never come.

        The controller calls this, from this actor's control thread, when a peer of the group has
        died. If fewer than N replicas are left, the N-th arrival of the current step never
        happens, and a rank that arrived would wait on the store until the collective timeout
        and then be killed as hung. Nothing in the store is tied to the dead peer's socket, so
        the peer's death does not wake it.

        Two parts. A flag that every first-N step of this group checks before it computes and
        before it blocks on an agreement: a rank may have windows of steps queued behind the
        current one (the controller dispatches ahead, and a late rank lags), and each of them
        fails at once. And the agreement key of this rank's current step, marked ABANDONED, for
        a step already blocked in its ``get``: a waiting rank reads ABANDONED and fails the step
        like a broken collective. The marking uses ``compare_set``, so a step whose fast set was
        already published keeps it. Only the current step needs its key: the flag is set before
        the current step is read, and a step sets ``current_step`` before it checks the flag, so
        a step that missed the flag is the current step. Keys of the old generation die with its
        store at the rebuild.

        The marking runs in a thread of its own and this returns at once: reaching the store
        can take up to its timeout when the store's host (rank 0's node) is the one that died,
        and the control thread must keep answering heartbeats meanwhile. It uses a clone of the
        store (same keys, its own connection; torch's ``Store.clone`` is meant for other
        threads): the main thread may be blocked in a ``get`` on the original. Returns whether
        there was a first-N group to release.

        ``generation``: the group the controller gave up; a call that arrives after this rank
        joined a newer group (the control thread runs beside the main one) is ignored."""
        # Checked and set under the group lock, not waited for (as abort_collectives): between
        # a check and a set without it, the main thread could leave and join the next generation,
        # whose _join clears the flag, and the flag then set made every step of the new group
        # fail as abandoned. Held by the main thread, the group is being left or joined anyway.
        if not self._group_lock.acquire(blocking=False):
            return False
        try:
            store = self._fn_store
            if store is None or generation != self.generation:
                return False
            self._fn_abandoned = True
        finally:
            self._group_lock.release()
        current = self.current_step if self.current_step is not None else self.completed_step + 1
        threading.Thread(target=_mark_abandoned, args=(store, current, self.rank),
                         name="elastic-abandon-first-n", daemon=True).start()
        return True

    def fast_sets(self, first: int, last: int) -> dict[int, list[int]]:
        """Which ranks were the fast N in steps first..last (kept for the last 4096 steps): the
        controller asks when it keeps steps that finished before a failure without their results."""
        return {s: list(self._fast_log[s]) for s in range(first, last + 1) if s in self._fast_log}

    def _apply_update(self, step: int) -> float | None:
        """Optimizer and scheduler step on the gradients in .grad; the step is then complete.
        Returns the gradient's norm before clipping when ``max_grad_norm`` clips, else None.

        ``max_grad_norm`` clips here, on the averaged gradient (after DDP's all-reduce, or the
        first-N mean a replica computed or received), as one process clips its full batch's
        gradient. Clipping inside ``step_fn`` would clip each rank's own gradient before the
        first-N mean. Every replica clips the same vector the same way, so they stay identical.

        The phase is "update" from here (NCCL: once the stream's collectives are done) to the
        step's end, ``_after_step``'s snapshot and checksum included: this rank's own code. Left
        at the collective's phase, a rank stuck in its optimizer or a blocking checkpoint write
        read as waiting on peers beside ranks that had gone on to the next step's collective,
        and the last of those to enter it, a healthy rank, was killed as the hang."""
        self._check_not_aborted()
        self._enter("update")
        norm = None
        scaler = self.scaler
        if scaler is not None and self.spec.max_grad_norm is not None:
            scaler.unscale_(self.optimizer)  # clip the gradient itself, not the scaled one
        if self.spec.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm))
        self._update_skipped = False
        if scaler is None:
            self.optimizer.step()
        else:
            # fp16: GradScaler skips the step when a gradient overflowed (inf or NaN), and update()
            # backs the scale off exactly then, so a lower scale is a skipped step. Read from the
            # scale for every optimizer: a fused one (fused=True) is always called, with the
            # overflow flag, and skips inside its kernel, so its step hooks cannot tell. On a GPU
            # the two reads are host syncs, beside the one the step's loss costs anyway. Every
            # replica sees the same averaged gradient (DDP's all-reduce, the first-N mean), so
            # all skip alike and their scalers stay equal. The LR scheduler steps with the
            # optimizer only, as the usual AMP loops do.
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            self._update_skipped = scaler.get_scale() < scale
        if self.scheduler is not None and not self._update_skipped:
            self.scheduler.step()
        self.completed_step = step
        self.current_step = None
        if self._kill_after_update and step == self._kill_at:
            self._kill_now()
        return norm

    def _renew_scaler(self, state: dict | None) -> None:
        """A new GradScaler with ``state`` (a scale and growth count; None: a fresh one's). Why
        new: a GradScaler remembers, per optimizer, that it unscaled (and found an overflow in)
        the step under way, until its ``update()``; ``load_state_dict`` keeps that. A step that
        failed between the two (a collective failure in the clipping or the optimizer's step),
        trained again, raised "unscale_() has already been called", or, without clipping, stepped
        on the still-scaled gradient, this replica alone."""
        _, self.scaler = mixed_precision("fp16", self.device)
        if state is not None:
            self.scaler.load_state_dict(state)

    # ---- state -----------------------------------------------------------------------------
    def get_state(self) -> dict:
        """The full replicated training state, for a peer that has to catch up."""
        from elastic.checkpoint.worker_hook import param_names, scaler_state

        return {
            "model": self.model_state(),
            "optimizer": _to_device(self.optimizer.state_dict(), torch.device("cpu")),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "completed_step": self.completed_step,
            **scaler_state(self),
            **param_names(self),  # the receiver gives the optimizer's state by name (set_state)
        }

    def model_state(self) -> dict:
        """The model's state dict on the CPU (the final weights a ``Result`` carries)."""
        # A module's extra state (``get_extra_state``: TransformerEngine's, some quantised layers')
        # need not be a tensor: it goes as it is.
        live = self.model.state_dict()
        state = OrderedDict((k, v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in live.items())
        # With the modules' versions (``_metadata``), as torch's own state dict has them: a peer
        # catching up from it loaded the model with none, which ``_load_from_state_dict`` reads
        # as a state dict of an old version, and a module that upgrades old ones changed its
        # current weights (the checkpoint keeps them too: codec._METADATA).
        metadata = getattr(live, "_metadata", None)
        if metadata is not None:
            state._metadata = copy.deepcopy(metadata)
        return state

    def set_state(self, state: dict) -> int:
        self.model.load_state_dict(state["model"])
        # As it came (on the CPU): torch's load_state_dict moves each state tensor to its
        # parameter's device itself, except plain Adam's ``step`` counters, which it keeps on the
        # CPU on purpose; moved to a GPU, each optimizer step would read them back with two
        # device syncs per parameter.
        from elastic.checkpoint.compat import PARAM_NAMES_KEY, state_by_name

        names = getattr(self, "optimizer_param_names", None)  # None: a stand-in worker (tests)
        optimizer_state = state_by_name(state["optimizer"], state.get(PARAM_NAMES_KEY), names,
                                        [len(g["params"]) for g in self.optimizer.param_groups])
        self.optimizer.load_state_dict(optimizer_state)
        if names is not None:
            _keep_state_dtypes(self.optimizer, optimizer_state, state["model"], names)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:  # a state of a run without fp16 has none: a fresh scaler, as a new run's
            self._renew_scaler(state.get("scaler"))
        self.completed_step = self.started_step = int(state["completed_step"])
        # The fast sets of steps past the state taken (a restore or a rollback to an older step)
        # belong to a history that was given up. Kept, they answered the controller's fast_sets
        # for those steps of the new history when this rank had not done them again yet (a
        # double failure in a recovery whose holder computed none of them), and booked the
        # steps' samples to the wrong ranks.
        self._fast_log = {s: f for s, f in self._fast_log.items() if s <= self.completed_step}
        self._unreported = (self._unreported[0], [r for r in self._unreported[1] if r.step <= self.completed_step])
        return self.completed_step

    def progress(self, discard_begun: bool = False) -> tuple[int, int]:
        """(newest completed step, newest step begun). A step begun and not completed when the
        group broke is work thrown away: the controller counts it as recomputed, and with
        ``discard_begun`` this rank forgets it at once, so a second look (another failure while
        the ring heals) cannot count the same lost work again."""
        out = (self.completed_step, self.started_step)
        if discard_begun:
            self.started_step = self.completed_step
        return out

    def param_checksum(self) -> int:
        """CRC32 over every parameter's and persistent buffer's bytes: equal only if replicas are
        bitwise identical (buffers too: BatchNorm's running statistics are state a replica could
        lose agreement on without any parameter showing it; non-persistent ones are caches,
        elastic/actors/buffers.py)."""
        crc = 0
        for t in self.model.state_dict(keep_vars=True).values():
            if not isinstance(t, torch.Tensor):
                continue  # a module's non-tensor extra state: not a parameter or buffer
            # The array itself, not .tobytes(): zlib reads any contiguous buffer, and the copy
            # was a fresh allocation of the whole model every check, on every replica.
            crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
        return crc

    # ---- checkpoints (elastic.checkpoint does the storage work) ------------------------------
    def configure_checkpoint(self, url: str, storage_options: dict, run_name: str, every_n_steps: int,
                             blocking: bool, controller: Any = None, min_shard_bytes: int = 0,
                             agent_address: str | None = None, agents_in_run: bool = False,
                             keep_every: int = 0, check_storage: bool = False) -> None:
        """``controller``: the controller actor, told of each written part the moment it is written.
        ``min_shard_bytes``: see ``CheckpointConfig``. ``agent_address``: the socket of this
        node's checkpoint agent, which then writes this rank's snapshots (``AgentCheckpointer``).
        ``agents_in_run``: the run has node agents (some other node's, if not this one's; it has
        when this one's is given), so a rank that writes in its own process reports its own
        parts: ranks on agents never add theirs to the group's pool (``WorkerCheckpointer``'s
        ``pool_parts``). ``keep_every``: ``CheckpointConfig.keep_every``, whose steps' snapshots
        are never replaced on their way to storage (``store.is_milestone``). ``check_storage``: at
        the run's start, a rank that writes in its own process raises ConfigError when the storage
        refuses it (``CheckpointStore.warm_up``); the node's agent checks for the ranks it writes for."""
        from elastic.checkpoint import UnsaveableState, WorkerCheckpointer
        from elastic.checkpoint.codec import UnsaveableValue, flatten_state
        from elastic.checkpoint.store import with_ages
        from elastic.checkpoint.worker_hook import AgentCheckpointer, live_state

        try:  # once, before any step: a state no snapshot can take fails every one of them alike
            flatten_state(live_state(self))  # checks every dtype too (check_storable_dtype)
        except UnsaveableValue as exc:
            raise UnsaveableState(str(exc)) from None
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
        notify = None
        if controller is not None:
            def notify(step, world_size, parts):  # writer thread; fire and forget
                controller.checkpoint_written.remote(step, world_size, with_ages(parts))

        pool_parts = not (agents_in_run or agent_address is not None)

        def in_process() -> WorkerCheckpointer:
            return WorkerCheckpointer(url, storage_options, run_name, every_n_steps, blocking, notify=notify,
                                      progress=lambda: self.completed_step, min_shard_bytes=min_shard_bytes,
                                      pool_parts=pool_parts, keep_every=keep_every)

        # every_n_steps=0: no step is due (``is_due``), and the writer is here for the run's last
        # step, which the controller has snapshotted at the end (flush_checkpoint); without it
        # that step was never written, though a stop or a finish promises it.
        if agent_address is not None and not blocking and every_n_steps > 0:
            try:
                self._ckpt = AgentCheckpointer(agent_address, every_n_steps, in_process, min_shard_bytes,
                                               keep_every=keep_every)
                return
            except OSError as exc:
                logger.warning("rank %s: cannot reach the node's checkpoint agent (%s); writing checkpoints "
                               "in this process", self.rank, exc)
        ckpt = in_process()
        try:
            ckpt.warm_up(check_storage)
        except BaseException:
            ckpt.close()  # its writer thread: the run ends here
            raise
        self._ckpt = ckpt

    def restore_checkpoint(self, url: str, storage_options: dict, run_name: str, step: int) -> dict:
        """Load a committed step (checksums verified while reading); returns its manifest meta.
        Raises ``CheckpointMismatch``, with this rank's state untouched, when the step does not
        fit the model or optimizer this run built (``elastic.checkpoint.compat``)."""
        from elastic.checkpoint import CheckpointMismatch, CheckpointStore, state_mismatches
        from elastic.checkpoint.compat import PARAM_NAMES_KEY, PARAM_ORDER_KEY, param_shapes_of, state_by_name
        from elastic.checkpoint.worker_hook import live_state

        store = CheckpointStore(url, run_name, storage_options)
        # data_position: the controller resumes from it; a step whose meta lacks it is corrupt
        # (skipped for an older one), not a KeyError that ended the resume.
        state, meta = store.read_state(step, meta_keys=("data_position",))
        # The saved state by name into this process's order first, as set_state does a peer's:
        # checked by position, a group built from a set (another order in each process) was
        # refused at every resume and every restore mid-run, and the run ended with a ConfigError.
        # Only a state written in the canonical order (PARAM_ORDER_KEY): in an older one each
        # writer used its own order, and by name another writer's moments went to same-shaped
        # parameters; that one is checked by position, as before.
        names = getattr(self, "optimizer_param_names", None)
        if names is not None and PARAM_NAMES_KEY in state and state.get(PARAM_ORDER_KEY) == "model":
            mine = state_by_name(state["optimizer"], state[PARAM_NAMES_KEY], names,
                                 [len(g["params"]) for g in self.optimizer.param_groups])
            if mine is not state["optimizer"]:
                state = {**state, "optimizer": mine, PARAM_NAMES_KEY: list(names)}
        problems = state_mismatches(live_state(self, canonical=False), state, param_shapes=param_shapes_of(self.optimizer))
        if problems:
            raise CheckpointMismatch(step, store.location, problems)
        self.set_state(state)
        return meta

    def flush_checkpoint(self, final_step: int | None = None) -> dict:
        """Wait for this rank's pending persist and report what finished. ``final_step``: the
        run's last step, when ``every_n_steps`` did not make it a checkpoint step; it is
        snapshotted now (if this rank completed it), so the run ends on a committed step."""
        if self._ckpt is None:
            return {}
        events = self._ckpt.snapshot(self, final_step) if final_step == self.completed_step else []
        if not self._ckpt.flush(worker=self):
            # Said here: the controller only sees a step whose part never came
            # (checkpoint_incomplete), which points at the rank, not at slow storage.
            timeout = self._ckpt.close_timeout_s
            events = events + [{"event": "checkpoint_rank_flush_timeout", "step": self.completed_step,
                                "time": time.time(),
                                "message": f"this rank's checkpoint writes did not finish within {timeout:g}s of the "
                                           "flush (slow or unavailable storage); the run ends on an older "
                                           "committed step"}]
        return self._ckpt_report(self._ckpt.drain(events))

    def snapshot_checkpoint(self, step: int) -> dict:
        """Snapshot ``step`` now, off the ``every_n_steps`` schedule, if this rank completed it:
        persisted in the background as any step's, its part reported with a later step's
        results (``_after_step``). The controller asks after an eviction (``_snapshot_after_evict``)."""
        if self._ckpt is None or step != self.completed_step:
            return {}
        # Not through the new group's pool: its other ranks wrote this step in the old group, or
        # snapshot it here too, and none of them adds it to the new pool alongside this part.
        return self._ckpt_report(self._ckpt.drain(self._ckpt.snapshot(self, step, pooled=False)))

    def _ckpt_report(self, report: dict) -> dict:
        """The checkpointer's report as it goes to the controller: the finished parts with their
        ages (``with_age``: the controller may be on another host, with another clock), and this
        rank's world size."""
        from elastic.checkpoint.store import with_age

        now = time.time()
        return {**report, "ckpt_done": [(step, with_age(part, now)) for step, part in report.get("ckpt_done", [])],
                "world_size": self.world_size}

    def _after_step(self, step: int, grad_norm: float | None = None) -> dict:
        """What a step reports besides its loss: finished checkpoint shards, the gradient norm
        when clipping, and, every K steps, a parameter checksum the controller compares across
        replicas."""
        extra = {} if self._ckpt is None else self._ckpt_report(self._ckpt.after_step(self, step))
        if grad_norm is not None:
            extra["grad_norm"] = grad_norm
        if self._update_skipped:
            extra["update_skipped"] = True
        if self._checksum_every and step % self._checksum_every == 0:
            extra["checksum"] = self.param_checksum()
        return extra

    def shutdown(self) -> None:
        try:
            if self._ckpt is not None:
                self._ckpt.close()
        finally:
            self.leave()  # also when the writers' close fails: the group must not stay up


# Set for NCCL ranks before the group forms, unless the user set them. Blocking waits: the wait()
# of a collective's Work blocks until the collective is done and raises if it failed or was
# aborted, instead of queueing the next kernels behind it. That covers our synchronous
# collectives: first-N's all_reduce and recv of the agreed update, finish_reduce's work.wait(),
# the buffer broadcast after a DDP step. Without it a rank whose communicators were aborted
# (abort_collectives) would go on to step the optimizer on partly reduced gradients, and hand that
# state to peers in the recovery. Not DDP's all-reduce: DDP waits on the work's future, which on
# NCCL completes once the kernel is queued whatever this says; that step is stopped by
# _check_not_aborted (it waits for the stream, then reads the abort flag). The cost: the CPU waits
# for each synchronous collective before it launches the next kernels.
NCCL_ERROR_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1"}

_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                       "broken pipe", "process group", "socket", "peer", "aborted")


ABANDONED = b"abandoned"  # a first-N agreement key's value when the controller gave the step up
# Gloo tags of the agreed buffers' sends: the update's tag is the step; these set bit 30 and keep the
# step's low 30 bits (gloo takes tags below 2**31), so they can only meet an update's tag 2**30
# steps apart, far beyond the sends a leader keeps in flight.
_BUFFER_TAG = 1 << 30


def _fast_key(step: int) -> str:
    """The store key under which a first-N step's fast set (or ABANDONED) is agreed."""
    return f"fn/{step}/fast"


def _count_key(step: int) -> str:
    """The store key a first-N step's arrivals add to (their count and who arrived)."""
    return f"fn/{step}/n"


def agreement_horizon(world_size: int) -> int:
    """How many steps a first-N step's store keys outlive it (see ``forget_agreement``)."""
    return max(4096, 2 * max_trail(world_size))


def forget_agreement(store, step: int) -> None:
    """Delete first-N step ``step``'s keys from the group's rendezvous store.

    Why: the store is a TCPStore served from rank 0's process, and it kept the two keys of every
    step for the life of the group: rank 0 grew ~0.35 KB a step in native memory (19 MB over
    55,000 steps, linearly; the other ranks stayed flat), which a week of short steps makes
    gigabytes. Why deleting a step ``agreement_horizon`` behind is safe: a replica reads a step's
    keys only while it is at that step, and no replica is that far behind the one deleting.
    A replica trails the group by at most ``max_trail(world_size)`` steps (elastic/actors/sends.py);
    the horizon is twice that, and at least 4096. A key
    already gone (a step before the group formed, or before the run) is no error."""
    if step < 0:
        return
    for key in (_count_key(step), _fast_key(step)):
        store.delete_key(key)


def mixed_precision(kind: str | None, device: torch.device) -> tuple[torch.dtype | None, Any]:
    """``Trainer.mixed_precision`` on ``device``: (the forward's autocast dtype or None, the
    fp16 ``GradScaler`` or None).

    The scaler's scale is set up here, by one ``scale()`` call, instead of at the first
    backward: a replica may apply an update before it ever ran a backward (first-N: one sitting
    out its first steps, a spare just promoted into the group), and ``GradScaler.step`` refuses
    a scaler whose ``scale()`` never ran."""
    if kind is None:
        return None, None
    if kind == "bf16":
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
            # No bfloat16 units before Ampere (compute capability 8): torch emulates it there
            # (is_bf16_supported() says True by its default, including emulation), so the run
            # would go on far slower than fp16, with nothing in the run's output saying why.
            raise ValueError(f"Trainer.mixed_precision='bf16': {torch.cuda.get_device_name(device)} has no "
                             "native bfloat16 (it came with Ampere, compute capability 8); use "
                             "mixed_precision='fp16'")
        return torch.bfloat16, None
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))
    return torch.float16, scaler


def _noting_forward(ddp: Any, note: Callable[[], None]) -> Callable[..., Any]:
    """The DDP wrapper's own forward, calling ``note`` first; set as the instance's ``forward``.

    Why not a forward pre-hook: hooks run only through ``__call__``, and ``model.forward(x)``
    does DDP's all-reduce set-up too (its forward calls ``_pre_forward``), so a correct step was
    refused. The wrapper is reached through a weak reference: a strong one from its own
    ``__dict__`` is a reference cycle, which leaves freeing the reducer, and its process group,
    to the cyclic collector at any moment, not to ``leave()`` (see there for why that matters)."""
    forward, wrapper = type(ddp).forward, weakref.ref(ddp)

    def noted(*args: Any, **kwargs: Any) -> Any:
        note()
        return forward(wrapper(), *args, **kwargs)

    return noted


def _check_optimizer_covers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every trainable parameter is in one of the optimizer's param groups. Why: one left out is
    never stepped, and since zero_grad clears only the optimizer's parameters its gradient piles
    up step after step (and into max_grad_norm's norm). Almost always an optimizer_fn that
    dropped it by mistake; a parameter meant to stay as it is should not require a gradient."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    left = [name for name, p in trainable if id(p) not in held]
    if left and len(left) < len(trainable):  # none held: a wrapper stepping master copies of its own
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(f"optimizer_fn left {len(left)} trainable parameter(s) out of its param groups ({shown}): "
                         "put them in a group, or set requires_grad=False on parameters that are not trained")


def _check_step_needs_no_closure(optimizer: torch.optim.Optimizer) -> None:
    """elastic calls ``optimizer.step()`` once a step, with no closure: an optimizer whose step
    needs one (LBFGS, which evaluates the loss several times a step) failed at the first step,
    after the all-reduce, with a TypeError about a missing argument."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step with no signature to read: left to the first step
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"optimizer_fn returned a {type(optimizer).__name__}, whose step() needs a closure (it "
                         "evaluates the loss itself); elastic steps the optimizer once a step with the gradient "
                         "it reduced, and no closure. Use an optimizer that steps on a given gradient (SGD, "
                         "Adam, ...).")


class FirstNAbandoned(RuntimeError):
    """A first-N step whose agreement the controller abandoned after losing a peer."""


def _mark_abandoned(store, step: int, rank: int) -> None:
    """Set the step's first-N agreement key to ABANDONED unless it is already set."""
    try:
        client = store.clone()
        client.set_timeout(timedelta(seconds=5))
        client.compare_set(_fast_key(step), "", ABANDONED)
    except Exception as exc:  # noqa: BLE001 - the store died with rank 0: its clients raise already
        logger.debug("rank %s: cannot mark first-N steps abandoned: %s", rank, exc)


def _clear_frames(exc: BaseException | None) -> None:
    """Drop the local variables of the finished frames in ``exc``'s traceback, and in those of
    the exceptions it chains (``__cause__``, ``__context__``). Frames still running are left."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def fetch_samples(dataset, indices: list[int]) -> list:
    """The samples at ``indices``, as torch's DataLoader fetches a batch from a map-style dataset:
    in one ``__getitems__(indices)`` call when the dataset has one (Hugging Face datasets, torch's
    ``Subset`` and ``StackDataset`` over such datasets), else one ``dataset[i]`` per index. Why not
    torch's own fetcher: it lives in the private ``torch.utils.data._utils.fetch``, which may change
    within the torch range this package supports; the rule itself is these few lines."""
    getitems = getattr(dataset, "__getitems__", None)
    if callable(getitems):
        samples = getitems(list(indices))
        if len(samples) != len(indices):
            raise ValueError(f"{type(dataset).__name__}.__getitems__ returned {len(samples)} samples "
                             f"for {len(indices)} indices")
        return samples
    return [dataset[i] for i in indices]


@contextmanager
def _group_failures_as_collective(what: str) -> Iterator[None]:
    """torch.distributed's own errors (store, network, backend) and errors that read like a broken
    collective, raised inside, become a CollectiveError; other errors pass unchanged."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as exc:
        if isinstance(exc, dist.DistError) or _looks_collective(exc):
            raise CollectiveError(f"{what}: {exc}\n{traceback.format_exc()}") from None
        raise


# The fixed words of the DDP reducer's errors about the user's model, as torch's reducer.cpp
# writes them: a parameter with no gradient, and one marked ready twice. With
# TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL they go on to name the parameters, and a name is the
# user's to choose: ``peer_proj.weight`` holds a collective's word.
_DDP_NOT_FINISHED = "Expected to have finished reduction in the prior iteration"
_DDP_READY_TWICE = "Expected to mark a variable ready only once"
_DDP_REDUCER_USER_ERRORS = (_DDP_NOT_FINISHED, _DDP_READY_TWICE)


def _ddp_advice(text: str, find_unused_parameters: bool) -> str | None:
    """What to add to the DDP reducer's error ``text`` about the user's model, whose fixes name
    the constructor's arguments and methods (``find_unused_parameters``, ``_set_static_graph()``),
    which a user of elastic never calls (elastic builds the wrapper): the ``ScalingConfig``
    setting to change, or what else to change, for the error and for the setting as it is
    (``find_unused_parameters``). None for any other error.

    Why by the error, not by the word: DDP's error for a parameter without a gradient names
    the setting ("Since `find_unused_parameters=True` is enabled, this likely means that not
    all `forward` outputs participate in computing loss"), and told to set what they had set,
    users went round in circles. Its error for a gradient marked ready twice names it too, with
    the option on, as the thing to turn off (its reason 3): read by the word, it was told that
    every output of the forward must take part in the loss, the opposite of its causes
    (reentrant activation checkpointing, LoRA with gradient checkpointing most often)."""
    if _DDP_READY_TWICE in text:
        if find_unused_parameters:
            return ("ScalingConfig(find_unused_parameters=True) is set: a parameter DDP took for unused in the "
                    "forward got a gradient after all, or one got two. Most often reentrant activation "
                    "checkpointing (torch.utils.checkpoint(..., use_reentrant=True), as in LoRA with gradient "
                    "checkpointing) runs the forward again in the backward. Checkpoint with use_reentrant=False, "
                    "or, if every parameter gets a gradient in every backward, set "
                    "ScalingConfig(find_unused_parameters=False). Otherwise a parameter is used outside the "
                    "model's forward: use it only inside it.")
        # torch's fix, _set_static_graph(), is the wrapper's, which elastic builds.
        return ("elastic builds the DistributedDataParallel: a parameter got two gradients in one backward. Most "
                "often reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) wraps "
                "the same layers more than once: checkpoint with use_reentrant=False. Otherwise a parameter is "
                "used outside the model's forward: use it only inside it.")
    if "find_unused_parameters" not in text:
        return None
    if not find_unused_parameters:
        return "elastic builds the DistributedDataParallel: set ScalingConfig(find_unused_parameters=True)."
    if _DDP_NOT_FINISHED not in text:
        return None
    return ("ScalingConfig(find_unused_parameters=True) is already set: some parameters were reached from the "
            "forward's outputs but got no gradient. Every output of the model's forward must take part in the "
            "loss: return only what the loss uses (e.g. not an auxiliary output it leaves out), or add the "
            "unused output to the loss times 0.")


def _looks_collective(exc: BaseException) -> bool:
    if getattr(exc, "elastic_data_error", False):  # raised reading a batch (``_batch``): never a collective
        return False
    # Every torch.distributed error (backend, network, store) by its class, as a join's are
    # (``_group_failures_as_collective``). Why not the words: a first-N rank blocked in the
    # rendezvous store's get when rank 0 left the group (its store closed with it) raised
    # DistNetworkError("failed to recv, got 0 bytes"), which named no marker; read as the user's
    # error, it ended the run where the group was to be rebuilt.
    if isinstance(exc, (dist.DistError, FirstNAbandoned)):
        return True
    # The words only where torch (or this package) raised it: the user's code raising
    # RuntimeError("feature service request timed out") or "training aborted" read as a broken
    # group, which formed again with every rank alive and replayed the error until max_failures
    # ended the run, where one WorkerError said it at once. A collective's error comes up from
    # torch's frames (the DDP reducer in backward, a c10d call), whoever called them.
    if _raised_outside_libraries(exc):
        return False
    text = str(exc)
    # DDP's reducer error about the user's model, whatever the parameters it names: read by
    # their words, a model with a ``peer_proj`` layer was a broken group, rebuilt and replayed
    # into the same error until max_failures ended the run, which never said why. After an NCCL
    # abort of the step's group such an error is the abort's doing all the same (``_run_guarded``
    # reads every failure of an aborted generation as a collective's, before this).
    if any(words in text for words in _DDP_REDUCER_USER_ERRORS):
        return False
    text = text.lower()
    return any(m in text for m in _COLLECTIVE_MARKERS)


def _raised_outside_libraries(exc: BaseException) -> bool:
    """Whether a ``raise`` statement outside torch and this package raised ``exc`` (the user's
    code, or a Python library it called). Not one that came out of a call into C++ from such a
    frame: a step_fn's own ``work.wait()`` raises gloo's error in the user's frame, at its call.
    False for an exception never raised (no traceback)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if os.path.abspath(code.co_filename).startswith(_library_dirs()):
        return False
    op = code.co_code[tb.tb_lasti] if 0 <= tb.tb_lasti < len(code.co_code) else None
    return op is not None and dis.opname[op] in ("RAISE_VARARGS", "RERAISE")


def _library_dirs() -> tuple[str, ...]:
    import elastic

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, elastic))


def _keep_state_dtypes(optimizer: Any, loaded: dict, saved_model: dict, names: list[str]) -> None:
    """Put back the dtype of floating state ``loaded`` held in another dtype than its own
    parameter had where it was saved (``saved_model``, by the parameters' ``names`` in the
    optimizer's order), where torch's ``load_state_dict`` cast it to the parameter's (all but
    ``step``). Why: an optimizer keeping fp32 moments for bf16 or fp16 parameters (a
    Kahan-summation one, torchdistx's AnyPrecisionAdamW) got them back rounded to the
    parameter's dtype, on a spare or survivor that took a peer's state (the survivors kept
    theirs: ReplicaDivergence at the next checksum) and on a resume. State saved in its
    parameter's dtype is left to torch's cast: a run resumed with its model in another
    precision (fp32 saved, bf16 now) gets its moments in the new one, as stock optimizers want."""
    ids = [pid for group in loaded.get("param_groups", []) for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = loaded.get("state", {})
    for pid, p, name in zip(ids, params, names):
        live, was = optimizer.state.get(p), saved_model.get(name)
        if live is None or not isinstance(was, torch.Tensor):
            continue
        for key, value in (saved.get(pid) or {}).items():
            now = live.get(key)
            if key != "step" and isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) \
                    and value.is_floating_point() and value.dtype != was.dtype and now.dtype != value.dtype:
                live[key] = value.to(device=now.device, copy=True)


def _to_device(obj, device: torch.device):
    """A collated batch on ``device``, its containers of the types ``default_collate`` kept:
    namedtuples stay namedtuples (``batch.x``), and mappings that are not dicts (transformers'
    ``BatchEncoding``, a ``UserDict``) are rebuilt as their own type with their tensors moved
    (left as they were, their tensors stayed on the CPU beside a GPU model).

    Why not ``torch.utils._pytree.tree_map``: it is private, and it takes a mapping type it has
    no registration for (``UserDict``, ``BatchEncoding``) as a leaf, so that mapping's tensors
    would stay where they were (checked with torch 2.13: it returns the same ``UserDict``)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, collections.abc.Mapping):
        moved = {k: _to_device(v, device) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)
        except TypeError:  # a mapping type that cannot be built from a dict (as default_collate does)
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj
