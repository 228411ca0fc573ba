"""User-facing configuration: stdlib dataclasses validated in ``__post_init__``.

Every check here runs before any actor starts, and every message names the field to change.
Checks that need the cluster (GPUs present, enough resources) are
``elastic.actors.cluster_fit.check_cluster_fits``, which ``fit()`` and the controller run before
any worker actor starts.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from elastic.redact import redact_url

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
AGGREGATIONS = ("all", "first_n")
FAILURE_ACTIONS = ("replace", "shrink", "wait", "restart", "fail")


class ConfigError(ValueError):
    """A configuration value cannot work. The message names the field and what to change."""


# Longest duration a *_timeout_s / *_s field may hold. Python's thread waits refuse more than
# threading.TIMEOUT_MAX (about 292 years on Linux) and Ray's timeouts are int64 milliseconds, so
# a larger value fails inside an actor; 1e9 s (about 31 years) stays well inside both.
_MAX_SECONDS = 1e9
_MAX_WINDOW = 1_000_000  # steps a straggler window may span
# Steps one call to the workers may carry (ScalingConfig.steps_per_dispatch): each call's steps are
# planned, shards and all, when it is sent, and a stop waits for the call (stop_timeout_s, 60 s,
# then the run is killed); 10**9 planned every step of a run up front. Automatic mode stays <= 16.
MAX_STEPS_PER_DISPATCH = 1024
MAX_HOT_SPARES = 256  # num_backups and num_spares (first-N's replicas are bounded at 48 besides)
_MAX_RESOURCE = 1e14  # ray._private.ray_constants.MAX_RESOURCE_QUANTITY (Ray 2.60), not imported: no Ray here


def _got(value: Any) -> str:
    """``got <repr>``, with the type where the repr alone hides it (``True``, ``'5'``, ``None``).
    An integer too long for Python to print (over 4,300 digits: its repr raised ValueError, and
    the message naming the field was lost) is told by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 14_000:
        return f"got an integer of about {int(value.bit_length() * 0.30103)} digits"
    kind = "" if type(value) in (int, float) else f" ({type(value).__name__})"
    return f"got {value!r}{kind}"


def _hint(hint: str) -> str:
    return f" {hint}" if hint else ""


def _finite_real(value: Any) -> bool:
    """A real number, not a bool, that is neither NaN nor infinite (nor an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _require_int(where: str, value: Any, minimum: int, hint: str = "") -> None:
    """``value`` is an ``int`` >= ``minimum``; bools are refused (``True`` is an int to Python)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where} must be an integer >= {minimum}{_hint(hint)}, {_got(value)}.")


def _require_flag(where: str, value: Any) -> None:
    """``value`` is a real bool: the string ``"False"`` is truthy and would turn the option on."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be True or False, {_got(value)}.")


def _require_positive(where: str, value: Any, what: str, hint: str = "", at_most: float = math.inf) -> None:
    """``value`` is a finite real number (not a bool) > 0 and <= ``at_most``."""
    if not _finite_real(value) or not 0 < value <= at_most:
        limit = f" and <= {at_most:g}" if at_most < math.inf else ""
        raise ConfigError(f"{where} must be {what} > 0{limit}{_hint(hint)}, {_got(value)}.")


def _require_seconds(where: str, value: Any, hint: str = "") -> None:
    """A duration: a finite number of seconds > 0 (NaN, inf and strings fail later, inside actors)."""
    _require_positive(where, value, "a finite number of seconds", hint, at_most=_MAX_SECONDS)


def _seconds_as_float(config: Any) -> None:
    """Every ``*_s`` field of ``config`` that holds a number, as a float. Why: a checked numpy
    float32 or a Fraction passed the checks (a real number), then failed in a rank, in
    ``timedelta(seconds=...)`` at the group's rendezvous, after every model was built."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name.endswith("_s") and isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
            setattr(config, f.name, float(value))


# Environment overrides of defaults (tests make timeouts tiny with them; operators tune them):
# name -> (what a value must be, integer, smallest allowed, whether the smallest is excluded).
ENV_NUMBERS = {
    **{name: ("seconds > 0", False, 0.0, True) for name in (
        "ELASTIC_PLACEMENT_TIMEOUT_S", "ELASTIC_CAPACITY_TIMEOUT_S", "ELASTIC_HEARTBEAT_INTERVAL_S",
        "ELASTIC_HEARTBEAT_TIMEOUT_S", "ELASTIC_NODE_SETTLE_S")},
    # FailureConfig's own floor (a process group's timeout is whole milliseconds): below it the
    # default FailureConfig() the warnings compare with failed, blamed on the field, not the variable.
    **{name: ("seconds >= 0.001", False, 0.001, False) for name in (
        "ELASTIC_COLLECTIVE_TIMEOUT_S", "ELASTIC_STEP_TIMEOUT_S")},
    **{name: ("seconds >= 0", False, 0.0, False) for name in (
        "ELASTIC_STORAGE_BACKOFF_S", "ELASTIC_STORAGE_BACKOFF_MAX_S", "ELASTIC_CKPT_RETRY_MIN_S",
        "ELASTIC_CKPT_RETRY_MAX_S")},
    "ELASTIC_STORAGE_ATTEMPTS": ("an integer >= 1", True, 1, False),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env_number(name: str, default: float) -> float:
    """Environment variable ``name`` (one of ``ENV_NUMBERS``) as a number, else ``default``. A
    value that is not one is a ConfigError naming the variable: it was a bare "could not convert
    string to float", or a -1 backoff failed in a sleep inside a rank's storage retry."""
    value = os.environ.get(name)
    if not value:
        return default
    what, integer, low, exclusive = ENV_NUMBERS[name]
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = None
    if number is None or not _finite_real(number) or number < low or (exclusive and number == low) \
            or number > _MAX_SECONDS:
        raise ConfigError(f"the environment variable {name}={value!r} must be {what} and <= {_MAX_SECONDS:g}; "
                          "fix or unset it.")
    return number


def env_log_level() -> str:
    """``ELASTIC_LOG_LEVEL`` (any case; default WARNING) as a logging level name."""
    value = os.environ.get("ELASTIC_LOG_LEVEL") or "WARNING"
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"the environment variable ELASTIC_LOG_LEVEL={value!r} is not a logging level: use one of "
                          f"{', '.join(LOG_LEVELS)}.")
    return level


def elastic_environment() -> dict[str, str]:
    """The ELASTIC_* overrides set here (``ENV_NUMBERS`` and ``ELASTIC_LOG_LEVEL``), for the run's
    actors: the controller gets them in its runtime_env, and the ranks and checkpoint agents it
    starts inherit it (Ray merges a child's env_vars into its parent's). Why: on a joined cluster
    the actors run under the raylets' environment, not the driver's, and one set only in the
    driver (``ray job submit -- env ELASTIC_STORAGE_ATTEMPTS=8 python train.py``) was checked
    there and then silently not used. Only these names: another ELASTIC_* variable (an
    Elasticsearch password, say) is none of ours, and a runtime_env shows in the dashboard."""
    names = (*ENV_NUMBERS, "ELASTIC_LOG_LEVEL")
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def check_environment() -> None:
    """Every ELASTIC_* override that is set, checked in the driver before any actor starts (the
    actors read them too: a bad one failed there, late)."""
    for name in ENV_NUMBERS:
        env_number(name, 0)
    env_log_level()


@dataclass
class ScalingConfig:
    """How many workers, on what, and where.

    ``num_workers`` ranks train; ``num_backups`` extra actors are kept. With ``aggregation="all"``
    the backups are hot spares that take over a failed or evicted rank. With
    ``aggregation="first_n"`` the backups train too (M = N + b replicas) and each step keeps the
    first N gradients to arrive (Chen et al. 2016); hot spares for that mode are ``num_spares``.

    ``steps_per_dispatch`` is how many consecutive steps go to the workers
    in one call, like Keras' ``steps_per_execution``. Every step's shards are still chosen by the
    controller and every step still reports back; one call per several steps saves Ray's per-call
    cost when a step is only tens of milliseconds. 0 (the default) picks it from the measured
    step time, so one call spans about ``dispatch_target_s`` (at most 16 steps); 1 turns it off;
    at most ``MAX_STEPS_PER_DISPATCH`` (1024).

    ``bucket_cap_mb`` is DDP's gradient bucket size. ``None`` (the default) chooses by device:
    on GPU (NCCL) torch's own default, a small first bucket so communication starts early and
    overlaps the backward; on CPU (gloo) every bucket, the first included, up to 25 MiB, so a
    model of that size is one all-reduce a step. CPU ranks share cores with gloo's own threads,
    so there is little backward to overlap, and each all-reduce pays gloo's rounds over TCP.

    ``find_unused_parameters`` is DDP's option of that name (data parallel only): set it when some
    parameters get no gradient in a step (a branch the forward skips, a frozen head outside the
    loss); DDP then finds them after each forward, at some cost. Without it such a model fails
    its second step with DDP's error. First-N needs no such option: a parameter no fast replica's
    backward reached has no gradient for that step (elastic/actors/grads.py).

    ``background_spare_start``: a spare that refills the pool while training runs (after an
    eviction or a recovery) builds its model on idle CPU only (Linux ``SCHED_IDLE``, where the
    process may restore its priority afterwards), so its start-up does not slow ranks sharing
    its node. Spares that training waits for always start at normal priority.

    ``wait_for_nodes``: the cluster adds nodes on demand (Ray's autoscaler, KubeRay with
    autoscaling) and its nodes for this run may not be up yet. Before any actor starts, a run is
    checked against the cluster: where its autoscaler reports its node groups to Ray, against the
    most they can grow to (and the live nodes); otherwise against the live nodes, and a run they
    cannot hold is refused. With ``wait_for_nodes=True`` that last check is skipped (Ray's
    autoscaler on VMs and KubeRay report nothing it could be made against), and the placement
    group waits for the autoscaler up to ``placement_timeout_s``: raise that to cover a node's
    start (minutes for a cloud GPU node), and ``FailureConfig.capacity_timeout_s`` for a lost
    node's replacement when no spare is left.

    ``late_backoff_steps`` (first-N only): a replica whose gradient came late (or was skipped)
    ``k`` times in a row sits out the next ``min(4 * 2**(k-1), late_backoff_steps)`` steps. It
    still receives and applies every update, so it stays identical, but it computes no gradient
    that would only be dropped, and then tries again. A persistent straggler thus computes about
    one step in ``late_backoff_steps + 1``, and where replicas share a node's cores the CPU it
    would have wasted goes to the fast ones. The price: a replica that sits out is no backup for
    those steps, so a rank that turns slow meanwhile holds up at most ``late_backoff_steps`` steps
    before the rested replica is back. A step in which only N replicas may compute needs no
    agreement on who came first (every rank knows the schedule), and its N reduce the gradient
    bucket by bucket during the backward, as DDP does, so it costs what a data-parallel step
    does. 0 turns it off: a late replica then computes every step unless N gradients arrived
    before it started (Chen et al.'s backups always compute).
    """

    num_workers: int = 1
    num_backups: int = 0
    use_gpu: bool = False
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)
    placement_strategy: str = "PACK"
    aggregation: str = "all"
    num_spares: int = 0
    placement_timeout_s: float = field(default_factory=lambda: env_number("ELASTIC_PLACEMENT_TIMEOUT_S", 60.0))
    steps_per_dispatch: int = 0
    dispatch_target_s: float = 0.5
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    background_spare_start: bool = True
    late_backoff_steps: int = 8
    wait_for_nodes: bool = False

    def __post_init__(self) -> None:
        # Types first: the checks below do arithmetic with these (math.comb, sums, comparisons).
        _require_int("ScalingConfig.num_workers", self.num_workers, 1)
        _require_int("ScalingConfig.num_backups", self.num_backups, 0)
        _require_int("ScalingConfig.num_spares", self.num_spares, 0)
        for name in ("num_backups", "num_spares"):
            if getattr(self, name) > MAX_HOT_SPARES:
                # Each spare is an actor in a placement group of its own, held for the whole run:
                # 10**30 reached Ray as a resource count it refuses (naming no setting), 10**400
                # an OverflowError, and on a joined cluster one group and actor each was asked for.
                raise ConfigError(f"ScalingConfig.{name} must be at most {MAX_HOT_SPARES}, {_got(getattr(self, name))}: "
                                  "each hot spare (or backup replica) is an actor in a placement group of its own, "
                                  "held for the whole run.")
        _require_int("ScalingConfig.steps_per_dispatch", self.steps_per_dispatch, 0, "(0 = automatic)")
        if self.steps_per_dispatch > MAX_STEPS_PER_DISPATCH:
            raise ConfigError(
                f"ScalingConfig.steps_per_dispatch must be <= {MAX_STEPS_PER_DISPATCH}, {_got(self.steps_per_dispatch)}: "
                "the controller plans a whole call's steps when it sends it, and a stop, a failure or an "
                "eviction waits for the call; 0 picks it from the step time.")
        _require_int("ScalingConfig.late_backoff_steps", self.late_backoff_steps, 0,
                     "(0 = a late first-N replica never sits out)")
        for name in ("use_gpu", "background_spare_start", "find_unused_parameters", "wait_for_nodes"):
            _require_flag(f"ScalingConfig.{name}", getattr(self, name))
        _require_seconds("ScalingConfig.placement_timeout_s", self.placement_timeout_s)
        _require_seconds("ScalingConfig.dispatch_target_s", self.dispatch_target_s)
        if self.bucket_cap_mb is not None:
            # At most 1 TiB: DDP's reducer takes the cap in bytes as a C++ int64 (1e300 failed in its constructor).
            _require_positive("ScalingConfig.bucket_cap_mb", self.bucket_cap_mb, "a finite number of MiB",
                              "(or None to choose by device)", at_most=2.0 ** 20)
        strategy = str(self.placement_strategy).upper()
        if strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"ScalingConfig.placement_strategy={self.placement_strategy!r} is unknown; "
                f"use one of {', '.join(PLACEMENT_STRATEGIES)}."
            )
        self.placement_strategy = strategy
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"ScalingConfig.aggregation={self.aggregation!r} is unknown; use 'all' or 'first_n'."
            )
        if self.aggregation == "first_n" and self.num_backups < 1:
            raise ConfigError(
                "ScalingConfig.aggregation='first_n' needs backups: with M = N there is nothing to drop. "
                "Set num_backups >= 1 (M = num_workers + num_backups replicas compute each step)."
            )
        if self.aggregation == "first_n" and self.num_workers + self.num_backups > 48:
            raise ConfigError(
                f"ScalingConfig: first_n supports at most 48 replicas (num_workers + num_backups = "
                f"{self.num_workers + self.num_backups}); the ranks agree on the fast set through one 64-bit "
                "counter with a bit per replica. Lower num_workers or num_backups."
            )
        if self.aggregation == "first_n" and math.comb(self.num_workers + self.num_backups, self.num_workers) > 256:
            raise ConfigError(
                f"ScalingConfig: first_n with {self.num_workers} of {self.num_workers + self.num_backups} replicas "
                "needs one process subgroup per possible fast set (more than 256); lower num_backups."
            )
        if self.find_unused_parameters and self.aggregation == "first_n":
            raise ConfigError("ScalingConfig.find_unused_parameters is DDP's (aggregation='all'); first-N "
                              "handles unused parameters without it: leave it False.")
        if self.aggregation == "all" and self.num_spares:
            raise ConfigError(
                "ScalingConfig.num_spares is for aggregation='first_n'; with aggregation='all' "
                "the hot spares are num_backups. Move the value to num_backups."
            )
        if not isinstance(self.resources_per_worker, Mapping):
            raise ConfigError(f"ScalingConfig.resources_per_worker must be a mapping of Ray resource name to amount "
                              f"per worker, e.g. {{'CPU': 2}}; {_got(self.resources_per_worker)}.")
        resources = dict(self.resources_per_worker)
        for key, value in resources.items():
            if not isinstance(key, str):
                raise ConfigError(f"ScalingConfig.resources_per_worker keys must be Ray resource names (str), got "
                                  f"{key!r} ({type(key).__name__}).")
            if key.strip().upper() in ("NUM_CPUS", "NUM_GPUS", "CPUS", "GPUS"):
                # ray.remote's argument names: no node has such a resource, and the run waited
                # placement_timeout_s to be told it could not be placed.
                name = "GPU" if "GPU" in key.upper() else "CPU"
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}] is no Ray resource name; write "
                                  f"{name!r}" + (" (and set use_gpu=True)" if name == "GPU" else "") + ".")
            if key != key.strip():  # ' GPU' escaped the use_gpu check too
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}] has spaces around it, which no "
                                  f"resource's name has; write {key.strip()!r}.")
            if key.upper() in ("CPU", "GPU") and key != key.upper():
                # A custom resource to Ray: no node has it, and the run waited placement_timeout_s
                # to be told it could not be placed (a 'gpu' also got past the use_gpu check).
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}]: Ray's resource names are "
                                  f"case-sensitive; write {key.upper()!r}.")
            if not _finite_real(value) or value < 0:
                raise ConfigError(
                    f"ScalingConfig.resources_per_worker[{key!r}] must be a finite number >= 0, {_got(value)}."
                )
            if value > _MAX_RESOURCE:  # Ray's MAX_RESOURCE_QUANTITY: ray.init or placement refuses it, late
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}]={value:g} is more than Ray can "
                                  f"count (at most {_MAX_RESOURCE:g}).")
            if 0 < value < 1e-4:  # Ray refuses it when the actor is created, inside the controller
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}]={value:g} is finer than Ray's "
                                  "resource precision (0.0001): use 0 or at least 0.0001.")
            problem = _accelerator_problem(key, value) if key != "GPU" and value > 0 else None
            if problem is not None:
                raise ConfigError(f"ScalingConfig.resources_per_worker[{key!r}]={value:g}: {problem}")
        if resources.get("object_store_memory", 0) > 0:
            # Measured with Ray 2.60: an actor asking for object_store_memory in a placement
            # group bundle crashed its raylet (local_resource_manager.cc check failure), taking
            # every actor on the node with it.
            raise ConfigError("ScalingConfig.resources_per_worker['object_store_memory'] is not supported: Ray "
                              "sizes the object store per node (ray start --object-store-memory), and asking for "
                              "it per actor in a placement group crashed the raylet. Remove the key.")
        if "GPU" in resources and resources["GPU"] > 0 and not self.use_gpu:
            raise ConfigError("ScalingConfig.resources_per_worker asks for GPU but use_gpu=False; set use_gpu=True.")
        resources.setdefault("CPU", 1.0)
        if self.use_gpu:
            # The default GPU goes into bundle(), not into this field: written here, a config
            # turned to use_gpu=False later (dataclasses.replace, or the field set before fit())
            # read as one asking for a GPU, and was refused with "set use_gpu=True".
            gpu = resources.get("GPU", 1.0)
            if gpu <= 0:
                raise ConfigError("ScalingConfig.use_gpu=True needs resources_per_worker['GPU'] > 0.")
            if gpu < 1 and self.num_replicas > 1:
                # Ray would pack two ranks onto one card, and NCCL refuses two ranks of one group
                # on the same device ("Duplicate GPU detected") when the group forms.
                one = ("use aggregation='all' with num_workers=1 and no backups" if self.aggregation == "first_n"
                       else "train with one rank")
                raise ConfigError(
                    f"ScalingConfig.resources_per_worker['GPU']={gpu} lets Ray put two of the "
                    f"{self.num_replicas} ranks on one GPU, and NCCL refuses two ranks on one device. Give each "
                    f"worker a whole GPU (resources_per_worker['GPU'] >= 1), or {one}.")
            if gpu > 1 and gpu != int(gpu):
                # Ray counts GPUs in whole units: it refuses 1.5 when the actor is created, inside
                # the controller, with a message that names no setting.
                raise ConfigError(f"ScalingConfig.resources_per_worker['GPU']={gpu:g}: Ray takes a GPU amount "
                                  f"above 1 only as a whole number; use {int(gpu)} or {int(gpu) + 1}.")
        self.resources_per_worker = resources
        if not self.bundle():
            raise ConfigError(f"ScalingConfig.resources_per_worker={resources!r} asks for no resource, and Ray "
                              "cannot place an empty bundle: give each worker CPU > 0 (or another resource).")
        _seconds_as_float(self)

    @property
    def num_replicas(self) -> int:
        """Actors that compute a gradient every step (M)."""
        return self.num_workers + (self.num_backups if self.aggregation == "first_n" else 0)

    @property
    def num_hot_spares(self) -> int:
        return self.num_spares if self.aggregation == "first_n" else self.num_backups

    def bundle(self) -> dict[str, float]:
        """One rank's placement bundle: ``resources_per_worker``, with one GPU if ``use_gpu`` names none."""
        resources = dict(self.resources_per_worker)
        if self.use_gpu:
            resources.setdefault("GPU", 1.0)
        return {k: float(v) for k, v in resources.items() if v > 0}


@dataclass
class FailureConfig:
    """What to do when a worker dies, hangs or straggles.

    ``on_failure`` is the first choice when a rank is lost; spares are always used first when
    ``on_failure="replace"``. When spares run out, ``when_no_spare`` decides; it is read only
    with ``on_failure="replace"``, so another value with another ``on_failure`` is refused.
    """

    max_failures: int = 3
    on_failure: str = "replace"
    when_no_spare: str = "wait"
    allow_shrink: bool = False
    min_workers: int | None = None
    capacity_timeout_s: float = field(default_factory=lambda: env_number("ELASTIC_CAPACITY_TIMEOUT_S", 30.0))
    heartbeat_interval_s: float = field(default_factory=lambda: env_number("ELASTIC_HEARTBEAT_INTERVAL_S", 1.0))
    heartbeat_timeout_s: float = field(default_factory=lambda: env_number("ELASTIC_HEARTBEAT_TIMEOUT_S", 10.0))
    collective_timeout_s: float = field(default_factory=lambda: env_number("ELASTIC_COLLECTIVE_TIMEOUT_S", 60.0))
    step_timeout_s: float = field(default_factory=lambda: env_number("ELASTIC_STEP_TIMEOUT_S", 120.0))
    node_settle_s: float = field(default_factory=lambda: env_number("ELASTIC_NODE_SETTLE_S", 3.0))
    straggler_factor: float = 2.0
    straggler_window: int = 5
    straggler_warmup_steps: int = 5
    evict_stragglers: bool = False
    # After a straggler is evicted, spares refilling the pool stay off its node this long (while
    # another node can host them). Spark excludes a failing executor's node for an hour the same
    # way (spark.excludeOnFailure.timeout); a node slow only for a while gets spares again after it.
    straggler_node_avoid_s: float = 3600.0
    checksum_every_n_steps: int = 10

    def __post_init__(self) -> None:
        _require_int("FailureConfig.max_failures", self.max_failures, 0)
        if self.min_workers is not None:
            _require_int("FailureConfig.min_workers", self.min_workers, 1,
                         "or None (None: never fewer than num_workers)")
        _require_int("FailureConfig.straggler_window", self.straggler_window, 1)
        if self.straggler_window > _MAX_WINDOW:  # a deque's maxlen takes no more
            raise ConfigError(f"FailureConfig.straggler_window must be <= {_MAX_WINDOW}, {_got(self.straggler_window)}.")
        _require_int("FailureConfig.straggler_warmup_steps", self.straggler_warmup_steps, 0)
        _require_int("FailureConfig.checksum_every_n_steps", self.checksum_every_n_steps, 0, "(0 turns the check off)")
        for name in ("allow_shrink", "evict_stragglers"):
            _require_flag(f"FailureConfig.{name}", getattr(self, name))
        for name in ("capacity_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s",
                     "step_timeout_s", "node_settle_s"):
            _require_seconds(f"FailureConfig.{name}", getattr(self, name))
        for name in ("collective_timeout_s", "step_timeout_s"):
            if getattr(self, name) < 0.001:
                # The process group's timeout is a timedelta that torch counts in whole
                # milliseconds: under one it is 0, which c10d reads as no timeout at all.
                raise ConfigError(f"FailureConfig.{name} must be at least 0.001 s (torch counts a process "
                                  f"group's timeout in whole milliseconds), {_got(getattr(self, name))}.")
        for name in ("on_failure", "when_no_spare"):
            if getattr(self, name) not in FAILURE_ACTIONS:
                raise ConfigError(
                    f"FailureConfig.{name}={getattr(self, name)!r} is unknown; use one of {', '.join(FAILURE_ACTIONS)}."
                )
        if self.when_no_spare == "replace":
            raise ConfigError("FailureConfig.when_no_spare cannot be 'replace' (there is no spare); use wait, shrink, restart or fail.")
        if self.on_failure != "replace" and self.when_no_spare != "wait":
            # It decides when the spares of on_failure="replace" run out, and nothing reads it
            # otherwise: on_failure="wait" with when_no_spare="shrink" failed the run once the
            # wait ran out, where the config read as "wait, then shrink".
            raise ConfigError(
                f"FailureConfig.when_no_spare={self.when_no_spare!r} is read only with on_failure='replace' (it "
                f"decides when the spares run out); with on_failure={self.on_failure!r} it would be ignored. Use "
                f"on_failure='replace', when_no_spare={self.when_no_spare!r} (spares first, then "
                f"{self.when_no_spare}), or leave when_no_spare at its default ('wait').")
        if "shrink" in (self.on_failure, self.when_no_spare) and not self.allow_shrink:
            raise ConfigError("FailureConfig asks to shrink but allow_shrink=False; set allow_shrink=True.")
        factor = self.straggler_factor
        if isinstance(factor, numbers.Real) and not isinstance(factor, bool) and factor > 1.0 \
                and not _finite_real(factor):  # +inf, or an int too large for a float
            raise ConfigError(f"FailureConfig.straggler_factor must be finite, {_got(factor)}: so large a factor "
                              "means no rank is ever a straggler. To leave slow ranks in place, keep "
                              "straggler_factor finite and set evict_stragglers=False instead.")
        if not _finite_real(factor) or not factor > 1.0:  # "not >" refuses NaN too, which compares False to all
            raise ConfigError(
                f"FailureConfig.straggler_factor must be > 1 (a rank is a straggler above factor x median), "
                f"{_got(factor)}."
            )
        avoid = self.straggler_node_avoid_s
        # An int too large for a float (10**400) made the first eviction's deadline an OverflowError.
        too_large = not isinstance(avoid, (bool, float)) and isinstance(avoid, numbers.Real) and not _finite_real(avoid)
        if isinstance(avoid, bool) or not isinstance(avoid, numbers.Real) or too_large or not avoid >= 0:
            raise ConfigError(f"FailureConfig.straggler_node_avoid_s must be seconds >= 0 (0: spares may go back on a "
                              f"straggler's node at once; math.inf: never for this run), {_got(avoid)}.")
        _seconds_as_float(self)


def _accelerator_problem(name: str, amount: float) -> str | None:
    """Why Ray refuses ``amount`` of accelerator resource ``name`` (whole neuron_cores or HPUs,
    TPU chips 1, 2, 4 or 8), or None: Ray's own rule, which it applies only when the actor is
    created, inside the controller, with a message that names no setting. None for resources
    that are no accelerator, and where Ray's accelerator registry (a private module) is not
    there to ask. GPU amounts have rules of their own (``ScalingConfig``)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource(name)
        if manager is None:
            return None
        ok, why = manager.validate_resource_request_quantity(float(amount))
    except Exception:  # noqa: BLE001 - a private API: when it moves, Ray still checks at creation
        return None
    return None if ok else (why or "Ray refuses this amount")


# fullmatch, not match with "$": "$" also matches before a final newline ("run\n" passed).
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# The names of a run's step directories (``parse_step_dir`` in elastic/checkpoint/store.py reads
# the step from the group). Here, where RunConfig refuses a run of such a name: it sits beside
# the others under the storage root, and a listing of that root (``elastic checkpoints URL``)
# took the root for a run directory with a step in it.
STEP_DIR_NAME = re.compile(r"step-([0-9]{9,18})", re.ASCII)


@dataclass
class CheckpointConfig:
    """Per-step checkpoints. ``every_n_steps=0`` turns them off. The run's last step (finished or
    stopped) is always checkpointed too, whatever ``every_n_steps``.

    ``blocking``: each rank writes its share inside the step, and every step's commit follows in
    order (none is replaced by a newer one). Non-blocking (the default): the step only copies
    its share to host memory; a write or commit still waiting when a newer one comes is replaced.

    ``min_shard_bytes``: the least a writing rank writes a step. Data-parallel replicas hold the
    same state, so each tensor is written once, by one rank; a state of B bytes is spread over
    ``min(world_size, ceil(B / min_shard_bytes))`` ranks, a duty that rotates with the step
    (``elastic.checkpoint.codec.writer_slot``), and the other ranks write no file that step:
    their RNG state goes into the step's manifest. 0: every rank writes a shard.
    Why a floor: every file costs a fixed price whatever its size (an S3 PUT, a create, fsync
    and delete), and splitting a small state only multiplies it. Measured on this project's
    2-core machine against moto, client and server CPU together: about 6.4 ms a PUT plus 5 ms
    a MB (0.8 MB: 13 ms, 3.2 MB: 28 ms), so a 2 MiB part still spends about 40% on the fixed
    price. Why not more: fewer writers means longer writes. With a checkpoint every step of
    the benchmark's 3.2 MB state to S3 (alternating runs, one Ray session; mean step ms, lag
    p95 in steps): four writers 95.7 and 83.8 ms, lag 2 and 2; two writers (this default)
    74.6 and 82.9 ms, lag 2 and 2; one writer 76.5 and 77.6 ms, lag 3 and 3.
    """

    every_n_steps: int = 1
    blocking: bool = False
    keep_last: int = 3
    keep_every: int = 0
    min_shard_bytes: int = 2 * 2**20
    # How long a resume (when fit() starts, or a restart from a checkpoint) waits for storage
    # that does not answer before the run fails; the wait is logged and shows in status().
    resume_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require_int("CheckpointConfig.every_n_steps", self.every_n_steps, 0, "(0 turns checkpoints off)")
        _require_int("CheckpointConfig.keep_last", self.keep_last, 1, "(the newest committed step is always kept)")
        _require_int("CheckpointConfig.keep_every", self.keep_every, 0, "(0 keeps no extra steps)")
        _require_int("CheckpointConfig.min_shard_bytes", self.min_shard_bytes, 0, "(0: every rank writes a shard)")
        _require_flag("CheckpointConfig.blocking", self.blocking)
        _require_seconds("CheckpointConfig.resume_timeout_s", self.resume_timeout_s,
                         "(how long a resume waits for storage that does not answer)")
        every, keep = self.every_n_steps, self.keep_every
        if every > 0 and keep > 0 and keep % every:
            # Retention keeps committed steps divisible by keep_every, and only multiples of
            # every_n_steps are committed: the two together keep every lcm-th step only.
            below, above = keep // every * every, (keep // every + 1) * every
            nearest = f"{below} or {above}" if below else f"{above}"
            raise ConfigError(
                f"CheckpointConfig.keep_every={keep} is not a multiple of every_n_steps={every}: periodic checkpoints come "
                f"only at multiples of {every}, so only multiples of {math.lcm(keep, every)} would be kept. Set "
                f"keep_every to a multiple of every_n_steps (e.g. {nearest}).")
        _seconds_as_float(self)


@dataclass
class RunConfig:
    """Run identity and storage. ``storage`` is an fsspec URL or a plain path; None means no checkpoints."""

    name: str = "elastic-run"
    storage: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    seed: int = 0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    progress: bool = False
    # Ctrl-C or SIGTERM (``ray job stop``) during fit(): how long the run may take to finish the
    # steps already dispatched and commit their checkpoint before it is killed instead.
    stop_timeout_s: float = 60.0

    def __repr__(self) -> str:
        """The dataclass's repr with the storage URL's credentials (``user:secret@``, a signed
        query) taken out; ``storage_options`` is left out whole (``repr=False``)."""
        shown = []
        for f in fields(self):
            if f.repr:
                value = getattr(self, f.name)
                if f.name == "storage" and isinstance(value, str):
                    value = redact_url(value)
                shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _RUN_NAME.fullmatch(self.name):
            raise ConfigError(
                f"RunConfig.name={self.name!r} must be 1-100 characters of letters, digits, '_', '.', '-', starting with a letter or digit."
            )
        if STEP_DIR_NAME.fullmatch(self.name):
            raise ConfigError(f"RunConfig.name={self.name!r} is the name of a checkpoint step directory, which a run "
                              "beside it under the storage root would be taken for; choose another name.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64:
            raise ConfigError(f"RunConfig.seed must be an integer in [-2**63, 2**64) (torch's seed range), "
                              f"{_got(self.seed)}.")
        _require_seconds("RunConfig.stop_timeout_s", self.stop_timeout_s)
        _seconds_as_float(self)
        _require_flag("RunConfig.progress", self.progress)
        if isinstance(self.storage, os.PathLike):
            self.storage = os.fspath(self.storage)  # a pathlib.Path of a local directory: its path
        if self.storage is not None and not isinstance(self.storage, str):
            raise ConfigError(f"RunConfig.storage must be a URL (file://, memory://, s3://) or a path, as a str, "
                              f"got a {type(self.storage).__name__}.")
        # storage_options hold credentials: the messages name types only, never a value.
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"RunConfig.storage_options must be a mapping of fsspec option name to value (a "
                              f"dict), got a {type(self.storage_options).__name__}.")
        bad_keys = [type(k).__name__ for k in self.storage_options or {} if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(f"RunConfig.storage_options keys must be option names (str), got a key of type "
                              f"{bad_keys[0]}.")
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigError(f"RunConfig.checkpoint must be a CheckpointConfig: pass "
                              f"checkpoint=elastic.CheckpointConfig(...), got a {type(self.checkpoint).__name__}.")
        self.checkpoint.__post_init__()  # again: its fields may have been set since it was made
