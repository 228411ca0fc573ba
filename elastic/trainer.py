"""``Trainer``: the user's entry point. Validates everything, connects to Ray, runs the controller.

The user hands over the pieces of training (factories, loss, batch size), never a loop. ``fit``
validates config and storage before any actor starts, starts the named controller actor, shows
progress while it drives the workers, and returns a ``Result``.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.actors.cluster_fit import check_cluster_fits
from elastic.actors.controller_actor import ControllerActor
from elastic.actors.names import free_actor_name
from elastic.actors.protocol import PackedSpec, TrainingSpec
from elastic.address import host_port, shown, trainer_address_problem, unreachable
from elastic.checkpoint.compat import UnsaveableState
from elastic.config import (CheckpointConfig, ConfigError, FailureConfig, RunConfig, ScalingConfig, _finite_real,
                            _require_flag, _require_int, _require_positive, check_environment,
                            elastic_environment)
from elastic.controller import ReplicaDivergence, TrainingFailed, WorkerError
from elastic.policies import FailurePolicy
from elastic.redact import redact_urls_in

logger = logging.getLogger(__name__)

# The run names (their namespaces) a fit() of this process is training now.
_FITTING: set[str] = set()
_FITTING_LOCK = threading.Lock()
# The controllers this process created (Ray actor IDs, hex): the only ones a fit() may take for
# its own leftovers (_claim_run_name). Kept after their kill (an ID a fit): the GCS frees a killed
# actor's name after ray.kill returns, and the next fit() of the name finds it still there.
_OUR_CONTROLLERS: set[str] = set()
# The fits of this process training on the embedded Ray one of them started (connect): the last to
# finish shuts it down. Why counted: fits in two threads share the process's one Ray, and the
# first to finish shut it down under the other.
_EMBEDDED_LOCK = threading.Lock()
_embedded_fits = 0


@dataclass
class Result:
    """What a run produced."""

    metrics: dict
    history: list[dict]  # the newest steps' records, up to elastic.controller.HISTORY_KEPT; metrics count all
    events: list[dict]
    checkpoint: dict | None
    recoveries: list[dict]
    ledger: list[dict]  # the newest steps' rows, up to elastic.data.LEDGER_INDICES indices
    model_state: dict | None = None
    replica_checksums: list[int] = field(default_factory=list)

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


class TrainingStopped(KeyboardInterrupt):
    """``fit()`` was interrupted (Ctrl-C, SIGTERM as ``ray job stop`` sends, or ``elastic stop
    RUN`` from anywhere) and stopped cleanly: the steps already dispatched finished and their
    checkpoint committed. ``result`` holds what the run produced up to there. A
    KeyboardInterrupt, so a script still ends and ``except Exception`` does not swallow it."""

    def __init__(self, message: str, result: "Result"):
        super().__init__(message)
        self.result = result

    def __reduce__(self):  # pickled with its result (a fit() in a Ray task, Tune, multiprocessing)
        return type(self), (str(self), self.result)


@contextmanager
def _sigterm_stops_the_run():
    """While fit() waits, SIGTERM raises KeyboardInterrupt in the main thread, so ``ray job
    stop`` (SIGTERM, then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S``, 3 s by default) stops the
    run as Ctrl-C does. Yields a set that holds "SIGTERM" once one arrived: Ray's ``get`` and
    ``wait`` turn whatever a signal handler raises into a plain KeyboardInterrupt, so the
    exception's type cannot tell. Taken over only from the default or Ray's own handler
    (``ray.init`` installs one that exits); a handler of the user's stays in charge. The first
    SIGTERM puts the previous handler back, so a second one acts as it would have."""
    seen: set[str] = set()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGTERM)
    if not _default_or_rays(previous):
        yield seen
        return

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, previous)
        seen.add("SIGTERM")
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield seen
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)


class _CtrlCHeld:
    """Holds a Ctrl-C (SIGINT) from its creation until ``release``, which raises it then.

    Why: the controller must be in ``Trainer.controller`` before an interrupt can end fit(), or
    nothing kills it. A KeyboardInterrupt inside ``.remote()`` (after the actor was created) or
    at the assignment left it training on the user's cluster for as long as its handle lived:
    Ray's reference counting ends an actor whose handles are gone, but a notebook keeps the last
    traceback, whose frames hold the handle. Python runs signal handlers in the main thread between
    bytecodes, so only swapping the handler holds one; ``release`` is called inside the ``try``
    that kills the controller, so a held Ctrl-C ends there like one a moment later. Swapped only
    in the main thread (no other gets a KeyboardInterrupt) and only from Python's default
    handler: a handler of the user's stays in charge. Only the first is held: it puts the default
    handler back, so a second Ctrl-C interrupts at once (``.remote()`` of a named actor asks the
    GCS, which may not answer for a minute), at the cost of what the hold is for."""

    def __init__(self):
        self.held = False
        self._swapped = (threading.current_thread() is threading.main_thread()
                         and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self._swapped:
            signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self.held = True
        self._swapped = False
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def release(self) -> None:
        """Put the default handler back, and raise the Ctrl-C held meanwhile, if any."""
        if self._swapped:
            self._swapped = False
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.held:
            self.held = False
            raise KeyboardInterrupt


def _default_or_rays(handler) -> bool:
    """Whether a SIGTERM handler is the default or the one ``ray.init`` installs: no user's.
    Not None, Python's answer for a handler installed from C (an embedded interpreter, a host
    application): it cannot be put back (``signal.signal`` takes no None), so it stays in
    charge. Taken over, the first SIGTERM raised a TypeError where it should stop the run."""
    return handler is signal.SIG_DFL or getattr(handler, "__module__", "").startswith("ray.")


@contextmanager
def _users_sigterm_kept():
    """``ray.init`` (in the main thread) installs a SIGTERM handler of its own that exits the
    process, over whatever was there. A handler of the user's (or SIG_IGN) is put back, so it
    stays in charge during fit() (``_sigterm_stops_the_run`` leaves it alone) and after it;
    without this ``ray job stop`` got fit()'s stop instead, and after fit() SIGTERM exited."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if (threading.current_thread() is threading.main_thread() and not _default_or_rays(previous)
                and previous is not None and signal.getsignal(signal.SIGTERM) is not previous):
            signal.signal(signal.SIGTERM, previous)


def connect(address: str | None, min_cpus: float = 0, use_gpu: bool = False) -> bool:
    """Join or start Ray. Returns True when this call started an embedded local instance.

    ``None``: reuse an initialised Ray; else join the cluster named by ``RAY_ADDRESS`` (set by
    ``ray job submit``); else start an embedded local Ray sized to hold the run. ``"local"`` (Ray's
    name for a new local instance) is that embedded Ray whatever ``RAY_ADDRESS`` says, unless this
    process has joined Ray already (then it trains there, with a warning): passed to
    ``ray.init`` as it was, it started a Ray that fit() never shut down, without the import path
    or GPU count below.

    ``use_gpu`` on an embedded Ray names the GPUs torch sees here. Why: Ray counts GPUs through
    NVML, and a Ray node started on a lent H100 in a Firecracker VM counted none while torch (the
    CUDA runtime) saw the card, so the run would stop with "the cluster has no GPUs". The workers use the GPUs
    through torch, so torch's count is the one that matters; CUDA_VISIBLE_DEVICES limits both.
    When torch sees none (a CPU-only build, the cards hidden), a ConfigError, before Ray starts.
    """
    if ray.is_initialized():
        _check_same_cluster(address)
        return False
    env_address = _env_address(address)
    if env_address == "local":
        # Ray's own name for a new local instance: the embedded Ray, as address="local" is. Passed
        # on as "auto", Ray read it back from the environment and started a Ray that this
        # function did not count as started, so fit() never shut it down.
        address = "local"
    elif env_address:
        address = "auto"
    if address is None or address == "local":
        cpus = max(os.cpu_count() or 1, int(min_cpus + 0.999))
        # Workers of an embedded Ray run on this machine: give them the driver's import path, so
        # factories defined in the user's own modules unpickle there.
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        gpus = {}
        if use_gpu:
            import torch

            gpus = {"num_gpus": torch.cuda.device_count()}
            if not gpus["num_gpus"]:
                # Refused before Ray starts, naming this machine's torch: the cluster check that
                # came next told of a Ray that did not count its GPUs, and to `ray start
                # --num-gpus=N`, which is no fix for the Ray this function starts.
                hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
                raise ConfigError(
                    "ScalingConfig.use_gpu=True, but torch sees no CUDA device on this machine "
                    f"(torch.cuda.device_count() is 0; torch {torch.__version__}, built "
                    + (f"for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only")
                    + (f", CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None else "")
                    + "), and the embedded local Ray started here gives the workers the GPUs torch sees. Install a "
                    "CUDA build of torch or let CUDA_VISIBLE_DEVICES show the cards, set use_gpu=False, or join a "
                    "cluster with GPUs (Trainer.address, or RAY_ADDRESS).")
        try:
            with _users_sigterm_kept():
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True,
                         configure_logging=False, runtime_env={"env_vars": env}, **gpus)
        except BaseException:
            # A Ctrl-C (or a failure) part way through: a Ray half started here was never shut
            # down, and the next fit() found it initialised, took it for the user's, and kept it.
            if ray.is_initialized():
                ray.shutdown()
            raise
        return True
    with _users_sigterm_kept():
        ray.init(address=address, log_to_driver=True)
    return False


def _env_address(address: str | None) -> str | None:
    """The ``RAY_ADDRESS`` that ``address`` stands for: the variable's value when it is set and
    ``address`` is None or "auto" (``ray.init`` replaces "auto" with it), else None."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return env if env and address in (None, "auto") else None


@contextmanager
def _ray_for_fit(address: str | None, min_cpus: float, use_gpu: bool,
                 check_address: Callable[[], None] | None = None):
    """Ray for one fit(): ``connect``, and the embedded Ray it started shut down when the last fit
    of this process that trains on it is done (a fit in another thread may still be training
    there). ``check_address`` (``Trainer._check_cluster_address``) runs first when Ray is not
    initialised, as ``connect`` then joins or starts one."""
    global _embedded_fits
    # A Ctrl-C is held from before connect() to inside the try (``_CtrlCHeld``): one that came
    # after ray.init returned and before the count, left the embedded Ray up and uncounted, and
    # the next fit() took it for the user's and never shut it down. Only the first is held: a
    # second interrupts ray.init, which connect() handles.
    held = _CtrlCHeld()
    try:
        with _EMBEDDED_LOCK:
            # Checked here, under the lock the last fit holds while it shuts the embedded Ray down.
            # Checked before the lock, a fit that found Ray up skipped the check, a fit in another
            # thread then shut that Ray down, and connect() gave ray.init an address nobody had
            # checked (a dead RAY_ADDRESS retried for a minute, a user:password@ echoed by Ray).
            if check_address is not None and not ray.is_initialized():
                check_address()
            # connect() joins the Ray already up (checking it is the one asked for) and says False;
            # while fits of this process train on it, that Ray is the embedded one, and ours too.
            ours = connect(address, min_cpus, use_gpu) or _embedded_fits > 0
            _embedded_fits += ours
    except BaseException:
        with suppress(KeyboardInterrupt):  # the error connect() raised is what is told
            held.release()
        raise
    try:
        held.release()
        yield
    finally:
        if ours:
            with _EMBEDDED_LOCK:
                _embedded_fits -= 1
                if _embedded_fits == 0:
                    ray.shutdown()


_MAX_FAULT = 86400.0  # the largest slow factor or delay_s (seconds) a fault may ask for


def _valid_fault(f: Any, replicas: int) -> bool:
    """A ``Trainer.faults`` entry the workers and the controller can carry out: a dict whose
    rank, steps and factors have the types they are used with (a rank of "0" or a step of
    "soon" failed inside the controller or a worker, after the actors started)."""
    if not isinstance(f, dict):
        return False

    def count(key: str, low: int, default: Any = None) -> bool:
        v = f.get(key, default)
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    def number(key: str) -> float | None:
        v = f.get(key, 0)
        # No more than a day a step (a delay of 1e10 s overflowed time.sleep inside the worker).
        return v if _finite_real(v) and v <= _MAX_FAULT else None

    if not (count("rank", 0) and f["rank"] < replicas):
        return False
    kind = f.get("kind")
    if kind == "slow":
        factor, delay = number("factor"), number("delay_s")
        return count("from_step", 0) and factor is not None and delay is not None and (factor >= 1 or delay > 0)
    if kind == "kill":
        return count("at_step", 0) and isinstance(f.get("after_update", False), bool) \
            and isinstance(f.get("mark", ""), str)
    if kind == "hang":
        return count("at_step", 0) and "after_update" not in f
    return kind == "kill_spare" and count("recovery", 1, default=1)


def _check_failure_actions(failure: FailureConfig, run: RunConfig, num_workers: int, global_batch: int) -> None:
    """Refuse, before any actor starts, a failure action that could never heal a failure. Why
    here: each of these used to be found only at the run's first lost rank, after hours of
    training perhaps, where the run then stopped."""
    actions = {failure.on_failure, failure.when_no_spare}
    for name in ("on_failure", "when_no_spare"):
        if getattr(failure, name) == "restart" and (run.storage is None or run.checkpoint.every_n_steps < 1):
            raise ConfigError(
                f"FailureConfig.{name}='restart' restarts every rank from the last committed checkpoint, and this "
                "run writes none: set RunConfig.storage (with CheckpointConfig.every_n_steps >= 1), or choose "
                "another action (wait, shrink, fail).")
    if "shrink" in actions:
        low = failure.min_workers if failure.min_workers is not None else num_workers
        # The size the policy would shrink to on the first lost rank, by the same rule.
        if FailurePolicy(failure, num_workers, global_batch).shrink_size(num_workers - 1) is None:
            unset = failure.min_workers is None
            why = ((f"FailureConfig.min_workers is None (never fewer than num_workers={num_workers})" if unset else
                    f"FailureConfig.min_workers={low}") + " leaves no smaller size to shrink to"
                   if low >= num_workers else
                   f"Trainer.global_batch_size={global_batch} divides over none of the sizes "
                   f"{low}..{num_workers - 1} (a shrunk run keeps the global batch)")
            if num_workers == 1:  # min_workers is at least 1: there is no size below to name
                raise ConfigError("FailureConfig asks to shrink, but a run of ScalingConfig.num_workers=1 has no "
                                  "smaller size: raise num_workers, or choose another action (wait, restart, "
                                  "fail) for FailureConfig.on_failure/when_no_spare.")
            raise ConfigError(f"FailureConfig asks to shrink, but {why}: set FailureConfig.min_workers below "
                              f"ScalingConfig.num_workers={num_workers} to a size the global batch divides over.")


def _ignored_settings(scaling: ScalingConfig, run: RunConfig, failure: FailureConfig,
                      requeue_dropped: bool) -> list[str]:
    """Settings changed from their defaults that this run never reads, or that cannot act as
    asked (spares nothing takes, a strict strategy spares may break, a GPU a rank never uses),
    one sentence each. Why warn, not refuse: each is harmless, and a config shared between runs
    of both kinds may carry one; but a user who set it expects it to act."""
    def changed(config, name: str) -> bool:
        return getattr(config, name) != getattr(type(config)(), name)

    out = []
    if scaling.aggregation != "first_n" and changed(scaling, "late_backoff_steps"):
        out.append("ScalingConfig.late_backoff_steps applies to aggregation='first_n' only; this run ignores it.")
    if scaling.steps_per_dispatch != 0 and changed(scaling, "dispatch_target_s"):
        out.append(f"ScalingConfig.dispatch_target_s sizes automatic dispatch windows (steps_per_dispatch=0); with "
                   f"steps_per_dispatch={scaling.steps_per_dispatch} it is ignored.")
    elif scaling.aggregation == "first_n" and requeue_dropped and changed(scaling, "dispatch_target_s"):
        # The controller plans a step only once the previous step's drops are known (its
        # _look_ahead is off), so every call is one step and no window is ever sized.
        out.append("ScalingConfig.dispatch_target_s sizes automatic dispatch windows, and with "
                   "aggregation='first_n' and Trainer.requeue_dropped=True each step goes out alone, once the "
                   "previous step's dropped samples are known: it is ignored.")
    if "shrink" not in (failure.on_failure, failure.when_no_spare):
        for name in ("allow_shrink", "min_workers"):
            if changed(failure, name):
                out.append(f"FailureConfig.{name} applies only when a failure shrinks the run (on_failure or "
                           "when_no_spare 'shrink'); this run ignores it.")
    if failure.evict_stragglers and scaling.num_replicas < 2:
        out.append("FailureConfig.evict_stragglers compares each rank's step time with its peers'; with one rank "
                   "there is none to compare with, and this run never evicts.")
    spares = scaling.num_hot_spares
    if spares and not failure.evict_stragglers and (failure.on_failure in ("restart", "fail")
                                                    or failure.max_failures == 0):
        why = ("max_failures=0 ends the run at its first failure" if failure.max_failures == 0 else
               f"on_failure={failure.on_failure!r} does not take spares")
        out.append(f"ScalingConfig asks for {spares} hot spare(s), but FailureConfig.{why} and evict_stragglers is "
                   "off: the spares hold their resources for the whole run and never train.")
    if spares and scaling.placement_strategy in ("STRICT_PACK", "STRICT_SPREAD"):
        out.append(f"ScalingConfig.placement_strategy={scaling.placement_strategy!r} holds for the ranks' own "
                   "placement group; hot spares are placed apart from it (PACK), so once a spare takes a rank the "
                   "run may no longer keep that strategy.")
    if scaling.use_gpu and scaling.resources_per_worker.get("GPU", 1) > 1:
        out.append(f"ScalingConfig.resources_per_worker['GPU']={scaling.resources_per_worker['GPU']:g}: each rank "
                   "trains on one GPU (its first); the others are held and idle. Raise num_workers instead.")
    if run.storage is None:
        if run.checkpoint != CheckpointConfig():
            out.append("RunConfig.checkpoint is set but RunConfig.storage is None: this run writes no checkpoints.")
        if run.storage_options:
            out.append("RunConfig.storage_options is set but RunConfig.storage is None: this run writes no "
                       "checkpoints, and they are not used.")
    elif run.checkpoint.every_n_steps == 0 and changed(run.checkpoint, "keep_every"):
        out.append("CheckpointConfig.keep_every keeps every Nth committed step, and every_n_steps=0 commits none "
                   "but the last; it is ignored.")
    return out


def _check_same_cluster(address: str | None) -> None:
    """This process already joined Ray, and ``ray.init`` joins one cluster per process: refuse an
    ``address`` that names another one, instead of training on the wrong cluster in silence.
    A ``host:port`` GCS address is compared with the GCS joined, a ``ray://`` address with the
    Ray Client server joined (where Ray says which: ``_client_server``; ``auto`` and ``local``
    name no one cluster), and hosts are compared by resolved IP, so ``localhost`` and
    ``127.0.0.1`` are the same."""
    if address is not None and address.startswith("ray://") and not _client_connected():
        # Connected straight to a GCS, not through Ray Client: a ray:// address is another
        # connection, and training ran on the cluster this process had joined, logged at INFO.
        raise ConfigError(f"Trainer.address={shown(address)!r} is a Ray Client address, but this process is already "
                          f"connected to the Ray cluster at {ray.get_runtime_context().gcs_address} directly: call "
                          "ray.shutdown() first, or pass address=None to train on the cluster it is connected to.")
    if address is not None and address.startswith("ray://") and _client_connected():
        joined, asked = _client_server(), host_port(address)
        if joined is not None and asked is not None and _resolve(joined) != _resolve(f"{asked[0]}:{asked[1]}"):
            # Both through Ray Client: training ran on the cluster joined first, logged at INFO,
            # and its checkpoints went under this run's name there.
            raise ConfigError(f"Trainer.address={shown(address)!r}, but this process is already connected through "
                              f"Ray Client to ray://{shown(joined)}: call ray.shutdown() first, or pass address=None "
                              "to train on the cluster it is connected to.")
    if address is None or address in ("auto", "local") or "://" in address:
        if address == "local":
            # Asked for a new local Ray, which this process cannot start while it is connected.
            logger.warning("Trainer.address='local', but this process already joined the Ray cluster at %s: "
                           "training runs there (call ray.shutdown() first for an embedded Ray of its own)",
                           ray.get_runtime_context().gcs_address)
        elif address is not None:
            logger.info("Ray is already initialised in this process; Trainer.address=%r uses that connection",
                        address)
        return
    current = ray.get_runtime_context().gcs_address
    if _resolve(address) != _resolve(current):
        raise ConfigError(f"Trainer.address={address!r}, but this process is already connected to the Ray "
                          f"cluster at {current}: call ray.shutdown() first, or pass address=None to train "
                          "on the cluster it is connected to.")


def _client_connected() -> bool:
    """Whether this process joined Ray through Ray Client (ray://)."""
    from ray.util.client import ray as client

    return client.is_connected()


def _client_server() -> str | None:
    """HOST:PORT of the Ray Client server this process is connected to; None where Ray does not
    say (read from the client worker's connection string, a private attribute of Ray 2.60)."""
    try:
        from ray.util.client import ray as client

        joined = client.get_context().client_worker._conn_str
    except Exception:  # noqa: BLE001 - a private attribute: without it the address is not compared
        return None
    return joined if isinstance(joined, str) and joined else None


def _resolve(host_port: str) -> tuple[str, str]:
    """(IP, port) of a GCS address, as Ray records it: Ray stores a loopback host (``localhost``,
    ``127.0.0.1``) as this node's IP (``canonicalize_bootstrap_address``), so the user's address
    goes through the same function before the host is resolved."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        host_port = canonicalize_bootstrap_address(host_port) or host_port
    except Exception:  # a private helper: if it moves or refuses, compare the address as given
        logger.debug("could not canonicalise %s as Ray does", host_port, exc_info=True)
    host, _, port = host_port.rpartition(":")
    try:
        return socket.gethostbyname(host.strip("[]")), port
    except OSError:
        return host, port


def last_loss(history: list[dict]) -> float | None:
    """The newest known loss. A step kept after a failure (its survivors finished it) for which
    no rank still had its result is booked with a NaN loss for "unknown" (``loss_known`` False),
    and may be the run's last: passed over. A NaN or infinite loss the model computed is the
    answer: skipping every non-finite loss reported a diverged run with its last finite loss."""
    return next((h["loss"] for h in reversed(history) if h["loss"] is not None and h.get("loss_known", True)),
                None)


def _copied(value: Any) -> Any:
    """A setting's own copy for one fit() (``_prepare``): a config's fields, and a list's or
    dict's items, can be set in place too. A RunConfig is copied with its CheckpointConfig
    but not its storage options, which may hold a client or session that does not copy (the
    store is built from them once, in the checks)."""
    if isinstance(value, RunConfig):
        run = copy.copy(value)
        if isinstance(value.checkpoint, CheckpointConfig):
            run.checkpoint = copy.copy(value.checkpoint)
        return run
    if isinstance(value, (ScalingConfig, FailureConfig, list, tuple, dict)):
        return copy.deepcopy(value)
    return value  # None, or a wrong type the checks name


@dataclass(frozen=True)
class _Prepared:
    """A Trainer's settings as one ``fit()`` checked them (``Trainer._prepare``), and trains with."""

    run: RunConfig
    scaling: ScalingConfig
    failure: FailureConfig
    spec: TrainingSpec
    global_batch_size: int
    faults: list
    requeue_dropped: bool
    batch_schedule: dict
    address: str | None


class Trainer:
    """Synchronous data-parallel training on Ray that survives failures and stragglers."""

    def __init__(
        self,
        model_fn: Callable[[], Any],
        optimizer_fn: Callable[[Any], Any],
        dataset_fn: Callable[[], Any],
        loss_fn: Callable[[Any, Any], Any],
        global_batch_size: int,
        scaling: ScalingConfig | None = None,
        run: RunConfig | None = None,
        failure: FailureConfig | None = None,
        step_fn: Callable[[Any, Any], Any] | None = None,
        scheduler_fn: Callable[[Any], Any] | None = None,
        address: str | None = None,
        requeue_dropped: bool = False,
        faults: list[dict] | None = None,
        max_grad_norm: float | None = None,
        mixed_precision: str | None = None,
        batch_schedule: dict[int, int] | None = None,
    ):
        self.scaling, self.run, self.failure = scaling, run, failure
        self.model_fn, self.optimizer_fn, self.dataset_fn, self.loss_fn = model_fn, optimizer_fn, dataset_fn, loss_fn
        self.step_fn, self.scheduler_fn, self.max_grad_norm = step_fn, scheduler_fn, max_grad_norm
        self.mixed_precision, self.batch_schedule = mixed_precision, batch_schedule
        self.global_batch_size, self.address, self.requeue_dropped = global_batch_size, address, requeue_dropped
        self.faults = faults
        self._warned: set[str] = set()
        self._store_for = None  # (storage, name, options' hash) the store was built and checked for
        self._prepare()
        self.controller = None  # the actor handle while fit() runs
        self._fitting = False  # a fit() of this Trainer is running (in some thread)
        self._fit_settings: _Prepared | None = None  # that fit()'s settings, as checked when it started (_settings)

    def _prepare(self) -> _Prepared:
        """Every check of the Trainer's settings, and what is built from them (the workers' spec,
        the checkpoint store). Run when the Trainer is made and again by each ``fit()``: the
        configs are plain dataclasses, and a field set between the two (``trainer.scaling.use_gpu
        = True``) went to the actors unchecked, with a spec still built for the old value.

        Returns the settings checked, copied once before the checks: what a ``fit()`` trains with
        (``_settings``), whatever the Trainer's are set to meanwhile. Read again after the checks,
        a setting changed from another thread while Ray started (a notebook cell) reached the
        controller unchecked; the RunConfig was the only one copied."""
        run, scaling, failure = _copied(self.run), _copied(self.scaling), _copied(self.failure)
        batch_schedule, faults = _copied(self.batch_schedule), _copied(self.faults)
        check_environment()  # the ELASTIC_* overrides, which the actors read too
        for name, value, kind in (("scaling", scaling, ScalingConfig), ("run", run, RunConfig),
                                  ("failure", failure, FailureConfig)):
            if value is not None and not isinstance(value, kind):
                raise ConfigError(f"Trainer.{name} must be an elastic.{kind.__name__}(...) or None, "
                                  f"got {type(value).__name__}.")
            if value is not None:
                # Again: a config's fields can be set after it was made (num_workers = 0 then
                # divided by zero here, a negative CPU count failed at placement in the controller).
                value.__post_init__()
        if scaling is None:
            self.scaling = scaling = ScalingConfig()
        if run is None:
            self.run = RunConfig()
            run = _copied(self.run)
        if failure is None:
            self.failure = failure = FailureConfig()
        model_fn, optimizer_fn, dataset_fn, loss_fn = self.model_fn, self.optimizer_fn, self.dataset_fn, self.loss_fn
        step_fn, scheduler_fn, max_grad_norm = self.step_fn, self.scheduler_fn, self.max_grad_norm
        global_batch_size, address, requeue_dropped = self.global_batch_size, self.address, self.requeue_dropped
        mixed_precision = self.mixed_precision
        for name, fn in (("model_fn", model_fn), ("optimizer_fn", optimizer_fn), ("dataset_fn", dataset_fn),
                         ("loss_fn", loss_fn)):
            if not callable(fn):
                raise ConfigError(f"Trainer.{name} must be callable, got {type(fn).__name__}.")
        for name, fn in (("step_fn", step_fn), ("scheduler_fn", scheduler_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"Trainer.{name} must be callable or None.")
        if max_grad_norm is not None:
            _require_positive("Trainer.max_grad_norm", max_grad_norm, "a number",
                              "(the gradients' total 2-norm is clipped to it), or None")
        _check_mixed_precision(mixed_precision, step_fn)
        n = scaling.num_workers
        _require_int("Trainer.global_batch_size", global_batch_size, 1)
        _require_flag("Trainer.requeue_dropped", requeue_dropped)
        if global_batch_size % n:
            raise ConfigError(
                f"Trainer.global_batch_size={global_batch_size} is not divisible by ScalingConfig.num_workers={n}; "
                f"use a multiple of {n} (e.g. {global_batch_size - global_batch_size % n or n})."
            )
        _check_batch_schedule(batch_schedule, n, failure)
        mw = failure.min_workers
        if mw is not None and mw > n:
            raise ConfigError(f"FailureConfig.min_workers={mw} is larger than ScalingConfig.num_workers={n}; lower it.")
        if requeue_dropped and scaling.aggregation != "first_n":
            raise ConfigError("Trainer.requeue_dropped is for ScalingConfig.aggregation='first_n' (only first-N "
                              "drops samples); leave it False.")
        if requeue_dropped and scaling.steps_per_dispatch > 1:
            raise ConfigError("Trainer.requeue_dropped puts a step's dropped samples into the next step, so steps "
                              "go out one at a time: set ScalingConfig.steps_per_dispatch to 0 or 1.")
        if failure.evict_stragglers and scaling.num_hot_spares == 0:
            field = "num_spares" if scaling.aggregation == "first_n" else "num_backups"
            raise ConfigError("FailureConfig.evict_stragglers puts a hot spare in a straggler's place, and this run "
                              f"keeps none: set ScalingConfig.{field} >= 1, or evict_stragglers=False.")
        if scaling.aggregation == "first_n" and "shrink" in (failure.on_failure, failure.when_no_spare):
            # Named first: told only "set allow_shrink False", the user then met FailureConfig's
            # own "asks to shrink but allow_shrink=False; set allow_shrink=True", each error
            # pointing at the other.
            which = "on_failure" if failure.on_failure == "shrink" else "when_no_spare"
            raise ConfigError(f"FailureConfig.{which}='shrink' is not supported with aggregation='first_n' (a "
                              "first-N group keeps its size); use 'wait', 'restart' or 'fail' there (with "
                              "on_failure='replace', spares first), and allow_shrink=False.")
        if scaling.aggregation == "first_n" and failure.allow_shrink:
            raise ConfigError("FailureConfig.allow_shrink is not supported with aggregation='first_n'; set it False.")
        _check_failure_actions(failure, run, n, global_batch_size)
        for note in _ignored_settings(scaling, run, failure, requeue_dropped):
            if note not in self._warned:  # once per Trainer: fit() prepares again
                self._warned.add(note)
                logger.warning("%s", note)
        spec = self.spec = TrainingSpec(
            model_fn=model_fn, optimizer_fn=optimizer_fn, dataset_fn=dataset_fn, loss_fn=loss_fn, step_fn=step_fn,
            scheduler_fn=scheduler_fn, seed=run.seed, use_gpu=scaling.use_gpu,
            cpus_per_worker=scaling.resources_per_worker.get("CPU", 1.0),
            bucket_cap_mb=scaling.bucket_cap_mb, find_unused_parameters=scaling.find_unused_parameters,
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            mixed_precision=mixed_precision,
        )
        if address is not None:
            problem = trainer_address_problem(address) if isinstance(address, str) else "is not a Ray address"
            if problem is not None:
                raise ConfigError(f"Trainer.address={shown(address) if isinstance(address, str) else address!r} "
                                  f"{problem}: use HOST:PORT (the GCS, e.g. 10.0.0.1:6379), ray://HOST:10001, 'auto' "
                                  "or 'local', or None (RAY_ADDRESS, else an embedded local Ray).")
        if faults is not None and not isinstance(faults, (list, tuple)):
            raise ConfigError(f"Trainer.faults must be a list of fault dicts or None, got {type(faults).__name__}.")
        faults = list(faults or [])
        if not isinstance(self.faults, list):
            self.faults = list(faults)  # None or a tuple, read as a list from now on
        for f in faults:
            if not _valid_fault(f, scaling.num_replicas):
                raise ConfigError(
                    f"Trainer.faults entry {f!r} must be {{'kind': 'slow', 'rank': r, 'factor': x>=1 or 'delay_s': d>0, 'from_step': s}} "
                    "or {'kind': 'kill'|'hang', 'rank': r, 'at_step': s} (a kill may add 'after_update': True and "
                    "'mark': a file path for the time of the kill) "
                    "with 0 <= r < number of replicas, or {'kind': 'kill_spare', 'rank': r, 'recovery': n>=1} "
                    "(kills the spare that takes rank r in recovery n, while the ring is rebuilt).")
        # The storage is checked when it is named, not again by each fit(): a fit() while the
        # endpoint is down waits for it (a resume in an outage), where a fresh check would refuse.
        # The store and the key it was checked for change together, and only once the check
        # passed: a failed check left the old key with a cleared or unchecked store, so putting
        # the config back found the key unchanged, and the run trained with no checkpoints (its
        # resume skipped) or into the location of the config that had failed.
        where = (run.storage, run.name, hash(repr(run.storage_options)))  # no secrets kept
        if where != self._store_for:
            self._store = self._store_for = None
            store = None
            if run.storage is not None:
                from elastic.checkpoint import CheckpointStore

                store = CheckpointStore(run.storage, run.name, run.storage_options)
                store.validate()
            self._store, self._store_for = store, where
        return _Prepared(run=run, scaling=scaling, failure=failure, spec=spec, global_batch_size=global_batch_size,
                         faults=faults, requeue_dropped=requeue_dropped, batch_schedule=dict(batch_schedule or {}),
                         address=address)

    def _check_cluster_address(self) -> None:
        """The address ``connect`` will join, checked as ``Trainer.address`` is when it is set
        (``trainer_address_problem``, then ``unreachable``), naming where it came from: with
        ``Trainer.address=None`` it is the environment's ``RAY_ADDRESS``. Why: a stale
        RAY_ADDRESS (a cluster torn down since, a dashboard's http:// address left from ``ray
        job``) went to ``ray.init`` unchecked, which retried for a minute while Ray's core logged
        each try, and a ``user:password@`` in it was echoed by Ray's messages."""
        given = self._fit_settings.address if self._fit_settings is not None else self.address
        env = _env_address(given)
        if env is None and given is not None:
            address, source = given, "Trainer.address"
        elif env and env != "local":
            address, source = env, "the environment variable RAY_ADDRESS"
        else:
            return
        # Trainer.address passed trainer_address_problem in _prepare (each fit() runs it); RAY_ADDRESS is read now.
        problem = None if source == "Trainer.address" else trainer_address_problem(address)
        if problem is not None:
            raise ConfigError(f"{source}={shown(address)!r} {problem}: use HOST:PORT (the GCS, e.g. 10.0.0.1:6379), "
                              "ray://HOST:10001 or 'auto', or unset it for an embedded local Ray.")
        reason = unreachable(address)
        if reason is not None:  # else ray.init retries for a minute, Ray's core logging each try
            fix = "fix the address" if source == "Trainer.address" else "unset RAY_ADDRESS for an embedded local Ray"
            raise ConfigError(f"{source}={shown(address)!r}: nothing answers there ({reason}); start the "
                              f"cluster (`ray start --head`) or {fix}.")

    @property
    def _running(self) -> RunConfig:
        """The RunConfig of the fit() in progress, as it was when it started; else ``run``.
        Why: a fit() reads its run again as it goes (the namespace of the controller it kills
        and the placement groups it removes, the name its messages tell to fit() again with),
        and ``run`` set meanwhile (another thread, a notebook cell) made it act on another run:
        the killed run's groups left reserved, a live run of the new name's groups removed, and
        a resume advised under a name that starts a new run."""
        return self._fit_settings.run if self._fit_settings is not None else self.run

    @property
    def _settings(self) -> _Prepared:
        """The settings of the fit() in progress, as checked when it started (``_prepare``)."""
        assert self._fit_settings is not None, "read only while a fit() runs"
        return self._fit_settings

    @property
    def namespace(self) -> str:
        return f"elastic-{self._running.name}"

    def fit(self, steps: int | None = None, epochs: int | None = None) -> Result:
        if (steps is None) == (epochs is None):
            raise ConfigError("Trainer.fit needs exactly one of steps=... or epochs=...")
        for name, v in (("steps", steps), ("epochs", epochs)):
            if v is not None:
                _require_int(f"Trainer.fit's {name}", v, 1)
        # Claimed inside the try whose finally releases it: claimed before it, a KeyboardInterrupt
        # taken as the lock's __exit__ returned left it claimed for good, and every later fit()
        # of this Trainer was refused as "in fit() already".
        claimed = False
        try:
            with _FITTING_LOCK:
                # A fit() keeps its run's state on its Trainer (the run, the store, the controller's
                # handle) and reads it as it goes: a second fit() of the same Trainer in another
                # thread, under another run name, replaced them under the first, whose controller
                # then started in the second's namespace and was killed by it as a leftover.
                if self._fitting:
                    raise ConfigError("this Trainer is in fit() already (another thread): a fit() keeps its run's "
                                      "state on its Trainer, so runs at the same time need a Trainer each.")
                claimed = self._fitting = True
            return self._fit_once(steps, epochs)
        finally:
            if claimed:
                self._fitting = False

    def _fit_once(self, steps: int | None, epochs: int | None) -> Result:
        # Again: a setting may have changed since the Trainer was made. What it checked is what
        # this fit() reads from now on (_settings, _running): copies, as a field may be set in place too.
        self._fit_settings = self._prepare()
        try:
            return self._fit_as_prepared(steps, epochs)
        finally:
            self._fit_settings = None

    def _fit_as_prepared(self, steps: int | None, epochs: int | None) -> Result:
        settings = self._settings
        packed = _packed_spec(settings.spec, self._running)  # before Ray: a factory that cannot travel is a ConfigError
        scaling = settings.scaling
        total_cpu = scaling.resources_per_worker.get("CPU", 1.0) * (scaling.num_replicas + scaling.num_hot_spares + 2)
        namespace = self.namespace  # as taken: released as taken, whatever the run is renamed to meanwhile
        claimed = False  # inside the try that releases it, as fit() claims its Trainer
        try:
            with _FITTING_LOCK:
                if namespace in _FITTING:
                    # Another fit() of this run name is live in this process (a thread, a notebook
                    # cell): _claim_run_name would take its controller for a leftover of this
                    # driver's and kill it, and the two would write one checkpoint directory.
                    raise ConfigError(f"RunConfig.name={self._running.name!r} is in use: another fit() of that run "
                                      "is training in this process. Choose another RunConfig.name, or wait for that "
                                      "fit() to return.")
                # Flagged first: an interrupt is taken as a call returns (the add's), never before it starts.
                claimed = True
                _FITTING.add(namespace)
            # The address is checked there, under the lock, where it is known whether Ray is up.
            with _ray_for_fit(settings.address, total_cpu, scaling.use_gpu, self._check_cluster_address):
                return self._fit(steps, epochs, packed)
        finally:
            if claimed:
                with _FITTING_LOCK:
                    _FITTING.discard(namespace)

    def _fit(self, steps: int | None, epochs: int | None, packed: PackedSpec) -> Result:
        from elastic.metrics import RunMetrics

        # Packed: the controller hands the spec on without unpickling the user's modules (torch).
        settings = self._settings
        kwargs = dict(spec=packed, scaling=settings.scaling, run=self._running, failure=settings.failure,
                      global_batch_size=settings.global_batch_size, checkpoint_store=self._store,
                      metrics=RunMetrics(self._running.name), fault_plan=settings.faults,
                      requeue_dropped=settings.requeue_dropped, batch_schedule=settings.batch_schedule)
        actor_cls = ray.remote(concurrency_groups={"status": 1, "stop": 1, "checkpoint": 1, "wait": 4})(ControllerActor)
        # Here, before the controller starts, as well as in it (Controller._schedule): a run the
        # cluster can never place fails now, not inside the controller, as a TrainingFailed.
        check_cluster_fits(settings.scaling, settings.scaling.num_replicas)
        self._claim_run_name()
        mirror = self._shared_memory_storage()
        with mirror or nullcontext():
            return self._run_controller(actor_cls, kwargs, steps, epochs, mirror.name if mirror else None)

    def _shared_memory_storage(self):
        """memory:// storage: a mirror of the run's directory of the driver's memory, shared with
        the run's processes while it trains (elastic/checkpoint/memory.py); else None."""
        if self._store is None or self._store.storage.protocol != "memory":
            return None
        from elastic.checkpoint.memory import DriverMirror

        return DriverMirror(self._store.storage.full_path())

    def _controller_options(self, memory_host: str | None = None) -> dict:
        """The controller actor's options: beside the driver (a worker node that dies must not
        take the run along), and with the driver's ELASTIC_* overrides, which the ranks and
        agents it starts inherit (``elastic_environment``), as they do ``memory_host``, the name
        of the run's memory:// host (elastic/checkpoint/memory.py)."""
        from elastic.checkpoint.memory import HOST_ENV

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        options = dict(name="controller", namespace=self.namespace, num_cpus=0, scheduling_strategy=here,
                       max_restarts=0, lifetime=None)
        env = elastic_environment()
        if memory_host is not None:
            env[HOST_ENV] = memory_host
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    def _run_controller(self, actor_cls, kwargs: dict, steps: int | None, epochs: int | None,
                        memory_host: str | None = None) -> Result:
        # The controller lives beside the driver: a worker node that dies must not take the
        # controller (and with it the run) along.
        ctrl_c = _CtrlCHeld()  # until the controller is ours to kill
        try:
            self.controller = actor_cls.options(**self._controller_options(memory_host)).remote(kwargs)
        except BaseException as exc:
            ctrl_c.release()
            if isinstance(exc, ray.exceptions.ActorAlreadyExistsError):
                # Another driver claimed the name between _claim_run_name and here.
                raise ConfigError(f"RunConfig.name={self._running.name!r} is in use: another run of that name started "
                                  "on this cluster just now. Choose another RunConfig.name, or stop that run "
                                  "first.") from exc
            raise
        try:
            # In the try: a Ctrl-C here, before the run is awaited, still kills the controller.
            _OUR_CONTROLLERS.add(self.controller._actor_id.hex())
            ctrl_c.release()
            out, stopped_by = self._await_controller(steps, epochs)
            # The final weights are owned by the controller: fetch them before it goes.
            state_ref = out.pop("model_state_ref", None)
            if state_ref:
                try:
                    out["model_state"] = ray.get(state_ref[0])
                except ray.exceptions.RayError as exc:  # their holder died after the run ended
                    logger.warning("run %r: the final weights could not be fetched (%s); the result has no "
                                   "model_state (the latest committed checkpoint has them, if storage was set)",
                                   self._running.name, type(exc).__name__)
        except BaseException:
            # Any way out but the run's own end: an error of the progress display (a closed
            # stdout, a broken pipe), a Ctrl-C while the final weights come. The controller
            # trained on (or held the weights) on the user's cluster until this process exited.
            self._kill_controller()
            raise
        self._kill_controller(release=False)
        if "error" in out:
            _raise_run_error(out["error"])
        hist, totals = out["history"], out["totals"]
        metrics = {
            "steps": out["steps"],
            "loss": last_loss(hist),
            "samples_per_s": totals["timed_samples"] / totals["time_s"] if totals["time_s"] else 0.0,
            "mean_step_time_s": totals["time_s"] / totals["timed_steps"] if totals["timed_steps"] else 0.0,
            "dropped_samples": out["dropped_samples"],
            "skipped_updates": totals["skipped_updates"],
            "checkpoint_snapshots_dropped": out.get("checkpoint_snapshots_dropped"),
            "late_gradients": out["late_gradients"],
            "agreed_steps": out["agreed_steps"],
            "failures": out["failures"],
            "recomputed_steps": out["recomputed_steps"],
            "world_size": out["world_size"],
            "restored_from": out["restored_from"],
        }
        result = Result(metrics=metrics, history=hist, events=out["events"], checkpoint=out["checkpoint"],
                        recoveries=out["recoveries"], ledger=out["ledger"], model_state=out.get("model_state"),
                        replica_checksums=out.get("replica_checksums", []))
        if stopped_by is None and out.get("state") == "stopped":
            stopped_by = out.get("stop_reason") or "stop requested"  # from outside, e.g. `elastic stop RUN`
        if stopped_by is not None:
            raise TrainingStopped(self._stopped_message(stopped_by, out), result)
        return result

    def _await_controller(self, steps: int | None, epochs: int | None) -> tuple[dict, str | None]:
        """Run the controller to its end: its output, and what stopped it (None: nothing did)."""
        ref = self.controller.run.remote(steps, epochs)
        with _sigterm_stops_the_run() as signals:
            try:
                return self._wait_with_progress(ref), None
            except KeyboardInterrupt:
                stopped_by = "SIGTERM" if "SIGTERM" in signals else "KeyboardInterrupt"
                return self._stop(ref, stopped_by), stopped_by
            except ray.exceptions.RayError as exc:
                # The controller itself is gone (Ray's memory monitor, a crash, a kill from the
                # dashboard), or its run raised past its own handling: it never ran
                # WorkerGroup.shutdown, and its placement groups stay reserved while this driver
                # lives, so a next fit() would wait for resources nothing uses. The caller kills
                # what is left of it and frees them; this says how to go on.
                raise TrainingFailed(self._controller_failure(exc)) from exc

    def _controller_failure(self, exc: BaseException) -> str:
        """What to tell the user of a controller that failed or was lost."""
        from elastic.actors.worker_group import describe_worker_failure

        init_failed = isinstance(exc, ray.exceptions.RayActorError) and getattr(exc, "actor_init_failed", False)
        if init_failed or isinstance(exc, ray.exceptions.RayTaskError):
            # Ray's text puts the exception's own line last: described as a worker's failure is,
            # not cut at its first 500 characters (the header and traceback, the cause cut off).
            told = describe_worker_failure(exc, f"run {self._running.name!r}: its controller "
                                                f"{'could not start' if init_failed else 'failed'}")
        else:  # lost: Ray's account of the process's end, no traceback; its first line
            # Redacted before it is cut: a URL cut inside its user:password@ no longer reads as
            # one, and would show the secret's first characters.
            line = redact_urls_in((str(exc).strip().splitlines() or [""])[0])
            told = f"run {self._running.name!r}: its controller was lost ({type(exc).__name__}: {line[:400]})"
        return f"{redact_urls_in(told)}\n{self._after_a_kill()}"

    def _after_a_kill(self) -> str:
        """What a next ``fit()`` does after this run was lost or killed: said by whether it had storage."""
        if self._running.storage is not None:
            return (f"fit() again with RunConfig.name={self._running.name!r} and the same storage continues from the "
                    "latest committed checkpoint")
        return "This run had no RunConfig.storage, so a new fit() starts from the beginning"

    def _claim_run_name(self) -> None:
        """Make sure no other live run has this run's name on the cluster, before any actor starts.

        A controller of the same name that this process created is a leftover (a fit() that
        was killed mid-way): it goes. Any other is a live run: its owner (the process that
        created it) is alive, since Ray ends an actor with its owner. That includes a fit() in
        another process of this job (a Ray task or actor, a Tune trial), which a check of the
        job alone took for a leftover and killed. Two runs of one name would write into one
        checkpoint directory, so that is an error that names the field to change, never a kill
        of someone else's run."""
        try:
            old = ray.get_actor("controller", namespace=self.namespace)
        except ValueError:
            return
        # Known by its actor ID, which needs no answer from the actor. Why not ask it: a
        # controller that is still starting, or too busy to answer within a timeout, used to
        # count as a leftover and was killed, with another driver's live run under it.
        if old._actor_id.hex() not in _OUR_CONTROLLERS:
            # The job that created the actor is part of its ID (Ray's ActorID embeds the JobID).
            owner = old._actor_id.job_id.hex()
            where = ("another process of this job (a Ray task or actor)"
                     if owner == ray.get_runtime_context().get_job_id() else f"job {owner}")
            raise ConfigError(
                f"RunConfig.name={self._running.name!r} is in use: a run of that name is training on this cluster "
                f"({where}; its controller is the actor 'controller' in namespace {self.namespace!r}). "
                f"Choose another RunConfig.name, or stop that run first (Ctrl-C in its driver, or ray job stop).")
        # Its placement groups removed while it still holds the name, so none can be another
        # driver's (removed after the name was free, they could be one's that took it meanwhile);
        # one it places as it dies, the new controller removes once it holds the name
        # (_remove_leftover_placement). Then killed (that actor only), and the name free.
        self._release_placement()
        free_actor_name("controller", self.namespace, actor_id=old._actor_id.hex())

    def _kill_controller(self, release: bool = True) -> None:
        """Kill this run's controller (if any is left) and, with ``release``, remove the placement
        groups it may have left (``_release_placement``), which only a controller that did not
        end its run itself does."""
        owner = None
        if self.controller is not None:
            owner = self.controller._actor_id.hex()
            ray.kill(self.controller, no_restart=True)
            self.controller = None
        if release and owner is not None:  # a second call (a stop that killed it, then the fit's way out): nothing
            self._release_placement(owner)

    def _release_placement(self, owner: str | None = None) -> None:
        """After a kill of this run's controller: its placement groups (see
        ``remove_run_placement_groups``). ``owner``: that controller's actor ID, whose groups
        alone go. Why: a controller that died on its own (its node, the memory monitor) had
        freed the run's name before this sweep, and another driver's run of that name may have
        placed groups since. None: every group of the run's name, for a controller that still
        holds it (``_claim_run_name``), as only the holder makes groups."""
        from elastic.actors.worker_group import remove_run_placement_groups

        try:
            removed = remove_run_placement_groups(self.namespace, owner)
        except Exception:  # noqa: BLE001 - best effort on a path that is already failing
            logger.debug("could not remove the placement groups of %s", self.namespace, exc_info=True)
            return
        if removed:
            logger.warning("removed the placement groups the killed controller left: %s", ", ".join(removed))

    def _stop(self, ref, why: str) -> dict:
        """Ask the running controller to stop after the steps already dispatched and wait, up to
        ``RunConfig.stop_timeout_s``, for it to commit their checkpoint. Another interrupt, or
        the timeout, kills the run at once (steps not yet committed are then lost, as in a crash)."""
        logger.warning("%s: stopping run %r after the steps already dispatched and committing their checkpoint "
                       "(up to %gs; interrupt again to kill it now)", why, self._running.name, self._running.stop_timeout_s)
        try:
            self.controller.stop.remote(why)
            return ray.get(ref, timeout=self._running.stop_timeout_s)
        except BaseException as exc:
            self._kill_controller()
            # A KeyboardInterrupt, as a clean stop's TrainingStopped is: Ray's GetTimeoutError is
            # an Exception, so `except Exception` swallowed the user's interrupt and said nothing of it.
            # Named by what ended the wait: a controller that died while stopping (its node lost,
            # out of memory) is not a timeout, and its user should not go and raise one.
            if isinstance(exc, KeyboardInterrupt):
                what = "a second interrupt"
            elif isinstance(exc, ray.exceptions.GetTimeoutError):
                what = f"RunConfig.stop_timeout_s={self._running.stop_timeout_s:g}s ran out before the stop finished"
            else:
                # Its exception's own line (Ray's text of a failed call puts it last, after a
                # header and the traceback), redacted as _controller_failure's text is: a
                # storage error may name a URL.
                from elastic.actors.worker_group import describe_worker_failure

                failed = "the controller failed while stopping"
                line = describe_worker_failure(exc, failed).splitlines()[0] \
                    if isinstance(exc, ray.exceptions.RayTaskError) else f"{failed}: {type(exc).__name__}: {exc}"
                what = redact_urls_in(line)[:400]
            # Whether a next fit() continues: a run with no storage was told it would, from a
            # checkpoint that was never written.
            raise KeyboardInterrupt(f"run {self._running.name!r} killed ({what}): steps not yet committed are lost, "
                                    f"as in a crash. {self._after_a_kill()}") from exc

    def _stopped_message(self, why: str, out: dict) -> str:
        ckpt = out.get("checkpoint") or {}
        if ckpt.get("latest_step") is not None:
            resume = (f"latest committed checkpoint: step {ckpt['latest_step']} at {ckpt['location']}; fit() again "
                      f"with RunConfig.name={self._running.name!r} and the same storage continues from there")
        elif self._running.storage is not None and out.get("stopped_while") and out.get("restored_from") is None:
            resume = (f"the checkpoints on storage were not read; fit() again with RunConfig.name={self._running.name!r} "
                      "and the same storage continues from the newest committed one, if any")
        elif self._running.storage is not None:
            resume = "no checkpoint was committed"
        elif out.get("model_state") is None:
            resume = "no checkpoint storage was set (RunConfig.storage), and no rank handed its weights back"
        else:
            resume = "no checkpoint storage was set (RunConfig.storage); the weights are in .result.model_state"
        where = f" ({out['stopped_while']})" if out.get("stopped_while") else ""
        return f"{why}: run {self._running.name!r} stopped after step {out['steps']}{where}; {resume}"

    def _wait_with_progress(self, ref) -> dict:
        if not self._running.progress:
            return ray.get(ref)
        progress = _Progress(self._running.name, sys.stderr)
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=0.25)
                if ready:
                    break
                try:
                    st = ray.get(self.controller.status.remote(), timeout=2)
                except Exception:
                    continue
                progress.show(st)
            return ray.get(ref)
        finally:
            progress.close()


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


_PROGRESS_REDRAW_S = 0.5  # a terminal's progress bar is redrawn at most this often
_PROGRESS_LINE_S = 30.0  # elsewhere (a log file) a plain progress line is written at most this often


def _redraws_in_place(stream) -> bool:
    """Whether ``stream`` shows a '\\r' redraw in place: a terminal, or a Jupyter kernel's output,
    which draws a carriage return as a terminal does though its ``isatty()`` says False."""
    if type(stream).__module__.startswith("ipykernel."):
        return True
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001 - a closed or unusual stream: plain lines read right anywhere
        return False


class _Progress:
    """fit()'s progress display (``RunConfig.progress``) on ``stream``, from the controller's status.

    In a terminal, a tqdm bar redrawn in place, at most every ``_PROGRESS_REDRAW_S``. Anywhere else
    a plain line, at most every ``_PROGRESS_LINE_S`` and none while nothing changed, and the newest
    one at the end. Why: Ray Jobs writes the driver's stderr to a log file that ``ray job logs`` and
    the dashboard read back as text, where each '\\r' redraw is a line of its own; the bar,
    redrawn four times a second, wrote some 14,000 lines an hour there (as it did to ``python
    train.py > log 2>&1``), burying the warnings, with Ray's worker log lines glued onto its lines."""

    def __init__(self, name: str, stream):
        self._name, self._stream = name, stream
        self._bar = None
        if _redraws_in_place(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=None, unit="step", dynamic_ncols=True, file=stream)
        self._shown_at: float | None = None  # time.monotonic() of the last redraw or line
        self._shown = self._newest = None  # plain lines: the last one written, the newest one made

    def show(self, st: dict) -> None:
        now = time.monotonic()
        if self._bar is not None:
            bar = self._bar
            bar.total = st.get("total_steps") or bar.total
            bar.n = st["step"]
            bar.set_postfix(loss=_fmt(st.get("loss")), samples_s=_fmt(st.get("samples_per_s")),
                            world=st["world_size"], spares=st["spares"], state=st["state"], refresh=False)
            # refresh() draws whatever tqdm's mininterval says: the rate is kept here.
            if self._due(now, _PROGRESS_REDRAW_S):
                self._shown_at = now
                bar.refresh()
            return
        total = st.get("total_steps")
        self._newest = (f"run {self._name!r}: step {st['step']}{f'/{total}' if total else ''} "
                        f"loss={_fmt(st.get('loss'))} samples_s={_fmt(st.get('samples_per_s'))} "
                        f"world={st['world_size']} spares={st['spares']} state={st['state']}")
        if self._newest != self._shown and self._due(now, _PROGRESS_LINE_S):
            self._shown_at = now
            self._write_newest()

    def _due(self, now: float, every_s: float) -> bool:
        return self._shown_at is None or now - self._shown_at >= every_s

    def _write_newest(self) -> None:
        self._shown = self._newest
        if self._stream is None:
            return
        try:
            self._stream.write(self._newest + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            # Best-effort, as tqdm's own writes are (it stops drawing on a closed stream or EIO):
            # raised here, a display that could not be written (stderr closed, a log on a failing
            # mount) ended a training run, and in close() replaced the Ctrl-C that was stopping
            # it cleanly. Nothing more is written to it.
            self._stream = None

    def close(self) -> None:
        """The bar drawn one last time and closed, or the newest line written if it was held back."""
        if self._bar is not None:
            self._bar.close()
        elif self._newest is not None and self._newest != self._shown:
            self._write_newest()


def _check_batch_schedule(schedule: Any, num_workers: int, failure: FailureConfig) -> None:
    """``Trainer.batch_schedule``: ``{step: global batch size}``, each step an integer >= 2 (step 1
    takes ``Trainer.global_batch_size``), each size an integer >= 1 that ``num_workers`` divides.
    Not with a shrink, which keeps one global batch over fewer ranks."""
    if schedule is None:
        return
    if not isinstance(schedule, dict):
        raise ConfigError(f"Trainer.batch_schedule must be a dict {{step: global batch size}} or None, got "
                          f"{type(schedule).__name__}.")
    for step, size in schedule.items():
        if isinstance(step, bool) or not isinstance(step, int) or step < 2:
            raise ConfigError(f"Trainer.batch_schedule's step {step!r} must be an integer >= 2 (the step from which "
                              "its size holds; step 1 takes Trainer.global_batch_size).")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size % num_workers:
            raise ConfigError(f"Trainer.batch_schedule[{step}]={size!r} must be an integer >= 1 divisible by "
                              f"ScalingConfig.num_workers={num_workers} (each rank takes an equal share).")
    if schedule and "shrink" in (failure.on_failure, failure.when_no_spare):
        raise ConfigError("Trainer.batch_schedule changes the global batch, and a shrink keeps one global batch over "
                          "fewer ranks: choose another action for FailureConfig.on_failure/when_no_spare (replace, "
                          "wait, restart, fail), or leave batch_schedule None.")


MIXED_PRECISION = (None, "bf16", "fp16")


def _check_mixed_precision(kind: Any, step_fn: Any) -> None:
    """``Trainer.mixed_precision``: one of ``MIXED_PRECISION``, and not with a ``step_fn``, which
    runs the forward and backward itself (the autocast and the loss scaling belong there)."""
    if kind not in MIXED_PRECISION:
        raise ConfigError(f"Trainer.mixed_precision must be None, 'bf16' or 'fp16', got {kind!r}.")
    if kind is not None and step_fn is not None:
        raise ConfigError(f"Trainer.mixed_precision={kind!r} runs loss_fn's forward under autocast (and scales the "
                          "fp16 loss for its backward), and a step_fn runs the forward and backward itself: "
                          "use loss_fn, or autocast inside step_fn (bf16) and leave mixed_precision None.")


def _packed_spec(spec: TrainingSpec, run: RunConfig) -> PackedSpec:
    """The workers' spec, pickled (cloudpickle) as the actors get it, or a ConfigError naming the
    setting that cannot be: before Ray starts, where the bare TypeError ("cannot pickle
    '_thread.lock' object") came after an embedded Ray had started, naming no setting. The
    storage options travel to the actors too; their values are never shown (credentials)."""
    import ray.cloudpickle

    try:
        packed = PackedSpec.pack(spec)
    except Exception as exc:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, or the object's own
        names = ("model_fn", "optimizer_fn", "dataset_fn", "loss_fn", "step_fn", "scheduler_fn")
        for name in names:
            try:
                ray.cloudpickle.dumps(getattr(spec, name))
            except Exception as fn_exc:  # noqa: BLE001 - as above
                exc, where = fn_exc, f"Trainer.{name}"
                break
        else:
            where = "The training settings"
        raise ConfigError(f"{where} cannot be sent to the workers, which get it pickled (cloudpickle): "
                          f"{type(exc).__name__}: {exc}. A function that captures a lock, an open file, a "
                          "client or a live object in its closure cannot travel: create such things inside the "
                          "function.") from None
    try:
        ray.cloudpickle.dumps(run.storage_options)
    except Exception as exc:  # noqa: BLE001 - as above
        raise ConfigError(f"RunConfig.storage_options cannot be sent to the run's actors (cloudpickle: "
                          f"{type(exc).__name__}); give it plain values (strings, numbers, dicts).") from None
    return packed


def _raise_run_error(err: dict) -> None:
    """Raise the error the controller's run ended with (``ControllerActor.run``'s ``error``) as
    the user catches it: the rank's WorkerError, the ConfigError (an ``UnsaveableState`` as
    that class), a ReplicaDivergence, anything else a TrainingFailed with the controller's
    traceback."""
    if err["type"] == "WorkerError":
        raise WorkerError(-1, err["message"]) if "rank" not in err["message"] else _worker_error(err["message"])
    if err["type"] == "UnsaveableState":
        raise UnsaveableState(*err["args"])
    if err["type"] == "ConfigError":
        raise ConfigError(err["message"])
    if err["type"] == "LeaseHeld":  # a ConfigError too: another live run holds the run's storage
        from elastic.checkpoint.lease import LeaseHeld

        raise LeaseHeld(err["message"])
    # A ReplicaDivergence as that class (exported as elastic.ReplicaDivergence, a TrainingFailed too).
    failed = ReplicaDivergence if err["type"] == "ReplicaDivergence" else TrainingFailed
    raise failed(f"{err['message']}\n--- controller traceback ---\n{err['traceback']}")


def _worker_error(message: str) -> WorkerError:
    import re

    m = re.search(r"worker rank (\d+) raised", message)
    rank = int(m.group(1)) if m else -1
    body = message.split("raised:\n", 1)[-1]
    return WorkerError(rank, body)
