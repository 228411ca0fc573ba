"""Whether the cluster can ever place a run: checked before any actor starts.

A run the cluster can never place would otherwise wait ``placement_timeout_s`` for its placement
group, then fail with Ray's traceback, which names no setting. The check answers for one of
three clusters:

- one whose autoscaler reports its node groups to Ray (the cluster config in the GCS, which
  autoscaler v2 platforms report and which Ray Train reads for the same check): refused only if
  neither the most those groups can grow to nor the live nodes can hold the run (a node started
  by hand, outside the groups, counts);
- one that adds nodes on demand but reports nothing (Ray's autoscaler on VMs, KubeRay), which the
  user says with ``ScalingConfig.wait_for_nodes``: not checked, and the placement waits for the
  autoscaler up to ``placement_timeout_s``;
- any other: against the live nodes. The error then names ``wait_for_nodes``, for the user
  whose autoscaler has not started the nodes yet.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import ray

from elastic.config import ConfigError, ScalingConfig

logger = logging.getLogger(__name__)

_WAIT_HINT = (" If the cluster adds nodes on demand (an autoscaler whose nodes are not up yet), set "
              "ScalingConfig.wait_for_nodes=True to wait for them instead (up to placement_timeout_s).")


@dataclass(frozen=True)
class Wording:
    """The words of an error that differ between the live nodes and the autoscaler's groups."""

    has: str
    nodes_are: str
    hold: str
    more: str
    larger: str


LIVE = Wording(has="the cluster has", nodes_are="node of the cluster", hold="The cluster's nodes hold",
               more="add nodes", larger="add larger nodes")
GROUPS = Wording(has="the cluster's node groups can grow to", nodes_are="node group of the cluster's autoscaler",
                 hold="The cluster's node groups at their max count hold",
                 more="raise the autoscaler's node group max counts (or its max_resources)",
                 larger="give the autoscaler a node group with larger nodes")


@dataclass
class Capacity:
    """What the check counts: ``totals`` of each resource, and ``nodes``, each a node's resources
    with how many such nodes there may be (``math.inf``: no limit). ``live``: these are the
    nodes up now, not what the autoscaler's node groups can grow to."""

    totals: dict[str, float]
    nodes: list[tuple[dict, float]]
    live: bool

    @property
    def words(self) -> Wording:
        return LIVE if self.live else GROUPS


def bundles_on(node_resources: dict, bundle: dict) -> int:
    """How many of ``bundle`` one node holds: a bundle never spans nodes."""
    return int(min(math.floor(node_resources.get(key, 0.0) / per + 1e-9) for key, per in bundle.items() if per > 0))


def autoscaler_capacity() -> Capacity | None:
    """The most the cluster can grow to, from the node groups its autoscaler reported to Ray;
    None when none did (no autoscaler, or one that does not report).

    Read through ``ray._private.state`` as Ray Train and Ray Data read it (no public API has it);
    an error reading it (an older or newer Ray without it) counts as no report."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: without it, the live nodes are checked
        logger.debug("could not read the cluster's autoscaling config", exc_info=True)
        return None
    if config is None or not config.node_group_configs:
        return None
    caps = {k: float(v) for k, v in config.max_resources.items()}
    nodes = [({k: float(v) for k, v in g.resources.items()},
              _capped_count(math.inf if g.max_count == -1 else float(g.max_count), g.min_count, g.resources, caps))
             for g in config.node_group_configs if g.resources and g.max_count]
    # Summed here, not by Ray's get_max_resources_from_cluster_config (Ray Train's): that one
    # returns sys.maxsize for a resource an unlimited group has before it applies the config's
    # max_resources cap, so a cap on an unlimited group was never checked against.
    totals: dict[str, float] = {}
    for resources, count in nodes:
        for key, amount in resources.items():
            totals[key] = totals.get(key, 0.0) + (amount * count if amount else 0.0)
    for key, cap in config.max_resources.items():  # the cluster-wide cap, where one is set
        if key in totals:
            totals[key] = min(totals[key], float(cap))
    return Capacity(totals, nodes, live=False)


def _capped_count(count: float, min_count: int, resources, caps: dict[str, float]) -> float:
    """How many nodes of a group the cluster-wide ``max_resources`` cap lets the autoscaler start,
    at most: no more than the cap holds of each capped resource the node has, whatever the
    other groups take (so it never refuses what can be placed). Why per group and not only in
    the totals: 3 workers of 3 CPUs under a 10-CPU cap on an unlimited group of 4-CPU nodes
    passed the totals (9 <= 10) and the node check (unlimited nodes), and then waited out
    ``placement_timeout_s``: the cap starts two such nodes, which hold two workers. Never
    fewer than the group's ``min_count``, which are there whatever the cap (the head's group)."""
    capped = count
    for key, cap in caps.items():
        amount = float(resources.get(key, 0.0))
        if amount > 0:
            capped = min(capped, float(math.floor(cap / amount + 1e-9)))
    return min(count, max(capped, float(min_count)))


def live_capacity() -> Capacity:
    """The live nodes, but those being drained (a spot node told it goes, an autoscaler's scale
    down): Ray lists them alive and counts their resources, yet places no new bundle there, so
    a run that fit only with them was accepted and then waited out placement_timeout_s."""
    draining = _draining_nodes()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    totals = dict(ray.cluster_resources())
    for n in alive:
        if n.get("NodeID") in draining:
            for key, amount in n.get("Resources", {}).items():
                totals[key] = max(0.0, totals.get(key, 0.0) - float(amount))
    nodes = [(n.get("Resources", {}), 1.0) for n in alive if n.get("NodeID") not in draining]
    return Capacity(totals, nodes, live=True)


def _draining_nodes() -> set[str]:
    """The IDs of nodes being drained, as Ray Train reads them (``ray._private.state``: no public
    API has it); none when it cannot be read."""
    try:
        from ray._private.state import state

        return set(state.get_draining_nodes())
    except Exception:  # noqa: BLE001 - a private API: without it, every live node counts
        logger.debug("could not read the draining nodes", exc_info=True)
        return set()


def check_cluster_fits(scaling: ScalingConfig, total_bundles: int) -> None:
    """Fail fast, before any actor starts, when the cluster can never host the run (see the
    module's docstring for which cluster is checked against what)."""
    if _through_ray_client():
        # The autoscaler's groups cannot be read from a Ray Client driver (Ray's state API needs
        # the GCS, which a client has no options for), so the live nodes alone refused runs the
        # groups can grow to hold. The controller checks again inside the cluster (_schedule).
        return
    reported = autoscaler_capacity()
    if reported is None:
        if not scaling.wait_for_nodes:
            _check(scaling, total_bundles, live_capacity())
        return
    try:
        _check(scaling, total_bundles, reported)
    except ConfigError as beyond_groups:
        # The groups need not describe every node (one started by hand): a run the nodes up
        # now hold is not refused. Refused, the error is the groups' (what the cluster can grow to).
        try:
            _check(scaling, total_bundles, live_capacity())
        except ConfigError:
            raise beyond_groups from None


def _through_ray_client() -> bool:
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())
    except Exception:  # noqa: BLE001 - no client module: not connected through one
        return False


def _check(scaling: ScalingConfig, total_bundles: int, capacity: Capacity) -> None:
    _check_totals(scaling, total_bundles, capacity)
    _check_nodes_fit(scaling, total_bundles, capacity)


def _refuse(capacity: Capacity, message: str) -> ConfigError:
    return ConfigError(message + (_WAIT_HINT if capacity.live else ""))


def _replica_settings(scaling: ScalingConfig) -> tuple[str, str]:
    """The settings that make up the bundles counted (the replicas), and the spares' setting
    (spares wait for room, uncounted)."""
    if scaling.aggregation == "first_n":
        return "ScalingConfig.num_workers or num_backups (first-N replicas)", "num_spares"
    return "ScalingConfig.num_workers", "num_backups"


def _check_totals(scaling: ScalingConfig, total_bundles: int, capacity: Capacity) -> None:
    resources = capacity.totals
    bundle = scaling.bundle()
    if scaling.use_gpu and resources.get("GPU", 0) <= 0 and capacity.live:
        raise _refuse(capacity,
            "ScalingConfig.use_gpu=True but the cluster has no GPUs; set use_gpu=False or add GPU nodes. "
            "If its nodes do have GPUs, Ray did not count them (its count goes through NVML): start them "
            "with `ray start --num-gpus=N`."
        )
    if scaling.use_gpu and resources.get("GPU", 0) <= 0:
        raise _refuse(capacity,
            "ScalingConfig.use_gpu=True but the node groups of the cluster's autoscaler add no GPUs; set "
            "use_gpu=False, or give the autoscaler a GPU node group (or raise its max count or max_resources)."
        )
    count, spares = _replica_settings(scaling)
    for key, per in bundle.items():
        have = resources.get(key, 0.0)
        need = per * total_bundles
        if need > have + 1e-9:
            raise _refuse(capacity,
                f"The run needs {need:g} {key} ({total_bundles} actors x {per:g}) but {capacity.words.has} {have:g}; "
                f"lower {count} or resources_per_worker, or {capacity.words.more}. Hot spares ({spares}) are not "
                "counted here: they wait for room."
            )


def _check_nodes_fit(scaling: ScalingConfig, total_bundles: int, capacity: Capacity) -> None:
    """Node by node: a bundle is placed on one node, so totals that suffice can still leave a
    run that Ray never places (4 CPUs a worker on nodes of 2 each; more ranks than nodes with
    STRICT_SPREAD; more than one node holds with STRICT_PACK). Ray waits for such a placement
    group until ``placement_timeout_s``, and the run then failed with a traceback naming no
    setting."""
    bundle = scaling.bundle()
    count, _ = _replica_settings(scaling)
    # Groups whose max_resources cap lets no node start (_capped_count: 0) hold nothing: counted,
    # an 8-GPU group the cap keeps at 0 nodes let STRICT_PACK through, to wait out placement.
    fits = [(bundles_on(resources, bundle), n) for resources, n in capacity.nodes if n > 0]
    shown = ", ".join(f"{k}={v:g}" for k, v in bundle.items())
    if not any(f for f, _ in fits):
        raise _refuse(capacity, f"No {capacity.words.nodes_are} has room for one worker ({shown}): a worker's resources "
                                f"are placed on one node. Lower ScalingConfig.resources_per_worker, or {capacity.words.larger}.")
    strategy = scaling.placement_strategy
    roomy = sum(n for f, n in fits if f > 0)  # nodes with room for one worker
    held = sum(f * n for f, n in fits if f)  # not 0 x inf (nan): an unlimited group of nodes too small
    largest = max((f for f, _ in fits), default=0)
    nodes = "node(s) have" if capacity.live else "node(s) at most have"
    if strategy == "STRICT_SPREAD" and roomy < total_bundles:
        raise _refuse(capacity, f"ScalingConfig.placement_strategy='STRICT_SPREAD' puts each of the {total_bundles} "
                                f"actors on a node of its own, and {roomy:g} {nodes} room for one; use "
                                f"'SPREAD', lower {count}, or {capacity.words.more}.")
    if strategy == "STRICT_PACK" and largest < total_bundles:
        raise _refuse(capacity, f"ScalingConfig.placement_strategy='STRICT_PACK' puts all {total_bundles} actors on "
                                f"one node, and the largest holds {largest}; use 'PACK', lower {count}, or "
                                f"{capacity.words.larger}.")
    if held < total_bundles:
        raise _refuse(capacity, f"{capacity.words.hold} {held:g} workers of {shown} (a worker's resources are placed on one "
                                f"node), and the run needs {total_bundles}; lower {count} or resources_per_worker, "
                                f"or {capacity.words.more}.")
