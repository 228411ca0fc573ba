"""WorkerGroup's bookkeeping without a cluster (its placement on real Ray: test_placement_e2e.py,
test_node_loss_e2e.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest

import elastic
from elastic.actors import worker_group as worker_group_module
from elastic.actors.worker import TrainingSpec
from elastic.actors.worker_group import Member, WorkerGroup


def test_a_blocking_wait_for_spares_looks_for_freed_bundles_again_as_it_waits(monkeypatch):
    # A node joining during a recovery's wait for capacity is when a lost rank's bundle is placed
    # again: the wait must look for it while it waits, not only once before.
    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=1, num_backups=1), spec, "elastic-unit")
    group._pending_spares = [Member(None, "spare-0", spare=True, info={"_ref": "built?", "_pg_ready": "placed?"})]
    looked = []
    monkeypatch.setattr(group, "_move_to_placed_free_bundles", lambda urgent: looked.append(time.monotonic()))
    monkeypatch.setattr(group, "_take_built_spares", lambda: None)  # the spare never builds
    monkeypatch.setattr(group, "_place_anywhere_if_stuck", lambda grace_s, wait: None)
    monkeypatch.setattr(worker_group_module, "wait_refs", lambda refs, timeout_s, interrupted=None: time.sleep(timeout_s) or [])
    monkeypatch.setattr(worker_group_module, "MOVE_CHECK_S", 0.05)
    t0 = time.monotonic()
    assert group.collect_spares(block=True, timeout_s=0.4) == 0
    assert len(looked) >= 2 and time.monotonic() - t0 >= 0.4  # more than the one look before the wait
    looked.clear()
    group.collect_spares()  # not blocking: one look
    assert len(looked) == 1


def _group_with_a_free_bundle(monkeypatch, placed: dict, reachable: set, slow: set = frozenset()):
    """A group whose ranks' placement group has bundle 0 held (on node A) and ``placed``'s other
    bundles free; Ray lists every node of ``placed`` alive, those in ``reachable`` answer, and
    those in ``slow`` time out (not down for certain); the others refuse."""
    import ray
    from types import SimpleNamespace

    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=1, num_backups=1), spec, "elastic-unit")
    group._ranks_pg = SimpleNamespace(bundle_specs=[{"CPU": 1}] * len(placed))
    group._bundle_holder = {0: "rank-0"}
    probed = []

    def unreachable(nodes, timeout_s=1.0, certain=None):
        probed.extend(nodes)
        if certain is not None:
            certain |= set(nodes) - reachable - slow
        return set(nodes) - reachable

    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: {"bundles_to_node_id": placed})
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in set(placed.values())])
    monkeypatch.setattr(worker_group_module, "unreachable_nodes", unreachable)
    return group, probed


def test_a_freed_bundle_on_a_node_whose_raylet_is_gone_is_not_used_while_ray_still_lists_it_alive(monkeypatch):
    # The GCS marks a node dead only after its health checks fail (~15 s by default); a recovery
    # asks for its refill spare within seconds, and the lost rank's freed bundle is still
    # "placed" on the dead node then. The spare was put there, to wait with the bundle.
    group, probed = _group_with_a_free_bundle(monkeypatch, {0: "A", 1: "DEAD", 2: "B"}, reachable={"A", "B"})
    assert group._placed_free_bundle([]) == 2
    assert probed == ["DEAD", "B"] and group._down_nodes == {"DEAD"}
    probed.clear()
    assert group._placed_free_bundle([]) == 2 and probed == ["B"]  # a node found down is not probed again
    assert group._placed_free_bundle(["B"]) is None


def test_a_node_whose_raylet_only_timed_out_is_probed_again_at_the_next_look(monkeypatch):
    # One connect that timed out (a SYN lost to a healthy raylet) kept the node's freed bundles
    # unused for the rest of the run.
    group, probed = _group_with_a_free_bundle(monkeypatch, {0: "A", 1: "SLOW"}, reachable={"A"}, slow={"SLOW"})
    assert group._placed_free_bundle([]) is None and group._down_nodes == set()
    probed.clear()
    assert group._placed_free_bundle([]) is None and probed == ["SLOW"]  # probed again at the next look
    # Timed out twice in a row: not probed again for SILENT_NODE_S (a node that died outright is
    # silent, not refusing, until the GCS marks it dead: each look spent a second on it), then again.
    probed.clear()
    assert group._placed_free_bundle([]) is None and probed == []
    group._silent_nodes = {node: until - worker_group_module.SILENT_NODE_S for node, until in group._silent_nodes.items()}
    assert group._placed_free_bundle([]) is None and probed == ["SLOW"]


def test_unreachable_nodes_tells_a_refusal_from_a_timeout(monkeypatch):
    import socket

    import ray

    answers = {"refuses": ConnectionRefusedError(), "times-out": socket.timeout("timed out"), "answers": None}
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": True, "NodeManagerAddress": n,
                                                "NodeManagerPort": 1} for n in answers])

    def connect(address, timeout):
        if answers[address[0]] is not None:
            raise answers[address[0]]
        return contextlib.nullcontext()
    monkeypatch.setattr(socket, "create_connection", connect)
    certain: set = set()
    assert worker_group_module.unreachable_nodes({"refuses", "times-out", "answers", "unknown"}, certain=certain) \
        == {"refuses", "times-out", "unknown"}
    assert certain == {"refuses", "unknown"}


def test_a_waiting_spare_moved_into_a_freed_bundle_keeps_off_nodes_avoided_since_it_was_asked_for(monkeypatch):
    # A straggler evicted from node X frees its bundle there; a spare asked for before that (its
    # own avoid list empty) was moved into that bundle at once, onto the slow node.
    group, _ = _group_with_a_free_bundle(monkeypatch, {0: "A", 1: "X"}, reachable={"A", "X"})
    waiting = Member(None, "spare-0", pg=object(), spare=True, info={"_avoid": [], "_background": True})
    asked = []
    monkeypatch.setattr(group, "_placed", lambda m: False)
    monkeypatch.setattr(group, "_release", lambda m: None)
    monkeypatch.setattr(group, "request_spare", lambda background, avoid_nodes: asked.append(avoid_nodes))
    group._pending_spares = [waiting]
    group.nodes_to_avoid = lambda: {"X"}
    group._move_to_placed_free_bundles()
    assert asked == [] and group._pending_spares == [waiting]
    group.nodes_to_avoid = lambda: set()  # X's time is up
    group._move_to_placed_free_bundles()
    assert asked == [[]] and group._pending_spares == []


def test_a_background_spare_asked_for_again_while_a_recovery_waits_starts_at_normal_priority(monkeypatch):
    # A refill spare (idle CPU) moved into a freed bundle, or re-asked anywhere after its grace,
    # while a recovery waits for it (collect_spares(block=True)) kept its idle priority: on a
    # node with other work it starved, and the wait for capacity ran out.
    group, _ = _group_with_a_free_bundle(monkeypatch, {0: "A", 1: "B"}, reachable={"A", "B"})
    asked = []
    monkeypatch.setattr(group, "_placed", lambda m: False)
    monkeypatch.setattr(group, "_release", lambda m: None)
    monkeypatch.setattr(group, "request_spare", lambda background, avoid_nodes=(): asked.append(background))
    monkeypatch.setattr(worker_group_module, "wait_refs", lambda refs, timeout_s, interrupted=None: [])
    group.nodes_to_avoid = lambda: set()

    def waiting(avoid):
        return Member(None, "spare-0", pg=object(), spare=True,
                      info={"_avoid": avoid, "_background": True, "_since": 0.0, "_pg_ready": None})

    for urgent in (False, True):
        group._pending_spares = [waiting([])]
        group._move_to_placed_free_bundles(urgent=urgent)
        group._pending_spares = [waiting(["X"])]
        group._place_anywhere_if_stuck(grace_s=1.0, wait=urgent)
    assert asked == [True, True, False, False]


def test_a_cluster_too_small_for_the_replicas_names_the_settings_that_count_them(monkeypatch):
    # "lower num_workers/num_backups/num_spares" sent a plain run's user to num_backups (its hot
    # spares, never counted here) and a first-N run's to num_spares.
    import pytest
    import ray

    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    _cluster(monkeypatch, [(2, 0)])
    plain = elastic.ScalingConfig(num_workers=3, num_backups=1)
    with pytest.raises(ConfigError) as err:
        check_cluster_fits(plain, plain.num_replicas)
    assert "needs 3 CPU (3 actors x 1) but the cluster has 2; lower ScalingConfig.num_workers or " \
           "resources_per_worker" in str(err.value) and "Hot spares (num_backups) are not counted" in str(err.value)
    first_n = elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n", num_spares=1)
    with pytest.raises(ConfigError) as err:
        check_cluster_fits(first_n, first_n.num_replicas)
    assert "lower ScalingConfig.num_workers or num_backups (first-N replicas)" in str(err.value)
    assert "Hot spares (num_spares) are not counted" in str(err.value)


def _nodes(*cpus):
    return [{"Alive": True, "Resources": {"CPU": float(c), "memory": 1e9}} for c in cpus] + \
        [{"Alive": False, "Resources": {"CPU": 64.0}}]  # a dead node holds nothing


@pytest.mark.parametrize("scaling, nodes, why", [
    # Totals suffice (8 CPUs for 2 x 4), but a worker's 4 CPUs are placed on one node of 2.
    (dict(num_workers=2, resources_per_worker={"CPU": 4}), (2, 2, 2, 2), "No node of the cluster has room for one "
     r"worker \(CPU=4\)"),
    (dict(num_workers=3, placement_strategy="STRICT_SPREAD"), (4, 4), "STRICT_SPREAD' puts each of the 3 actors on a "
     r"node of its own, and 2 node\(s\) have room"),
    (dict(num_workers=3, placement_strategy="STRICT_PACK"), (2, 2), "STRICT_PACK' puts all 3 actors on one node, and "
     "the largest holds 2"),
    # 2 + 1 whole bundles of 2 CPUs in 4 + 3 CPUs: 7 in all, room for 3 bundles of the 4 asked.
    (dict(num_workers=4, resources_per_worker={"CPU": 2}), (5, 3), r"The cluster's nodes hold 3 workers of CPU=2"),
])
def test_a_cluster_whose_nodes_cannot_place_the_run_is_refused_before_it_starts(monkeypatch, scaling, nodes, why):
    # Ray waited for such a placement group until placement_timeout_s, and the run failed with
    # a traceback naming no setting.
    import ray

    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    config = elastic.ScalingConfig(**scaling)
    _cluster(monkeypatch, [])  # no autoscaling config reported
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(sum(nodes))})
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(*nodes))
    with pytest.raises(ConfigError, match=why):
        check_cluster_fits(config, config.num_replicas)
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(*[sum(nodes) * 4] * (len(nodes) + 3)))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(sum(nodes) * 4 * (len(nodes) + 3))})
    check_cluster_fits(config, config.num_replicas)  # larger nodes, and more of them: it fits


def _reported(*groups, max_resources=None):
    """A cluster config as an autoscaler reports it to the GCS: ``groups`` of (resources,
    min_count, max_count)."""
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    for resources, lo, hi in groups:
        group = config.node_group_configs.add(min_count=lo, max_count=hi)
        group.resources.update(resources)
    config.max_resources.update(max_resources or {})
    return config


def _cluster(monkeypatch, live_nodes, config=None, draining=()):
    """Ray's view for check_cluster_fits: ``live_nodes`` (CPU, GPU) pairs up now (node IDs n0,
    n1, ...; ``draining`` those being drained), and the autoscaler's reported config (None:
    nothing reported)."""
    import ray
    from ray._private import state as ray_state

    nodes = [{"Alive": True, "NodeID": f"n{i}", "Resources": {"CPU": float(c), "GPU": float(g)}}
             for i, (c, g) in enumerate(live_nodes)]
    totals = {"CPU": float(sum(c for c, _ in live_nodes)), "GPU": float(sum(g for _, g in live_nodes))}
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "cluster_resources", lambda: totals)
    monkeypatch.setattr(ray_state.state, "get_cluster_config", lambda: config)
    monkeypatch.setattr(ray_state.state, "get_draining_nodes", lambda: {n: 0 for n in draining})


def test_a_draining_node_is_no_room_for_the_run(monkeypatch):
    # Ray lists a node being drained (a spot node told it goes) alive, with its resources, and
    # places nothing new there: a run that fit only with it waited out placement_timeout_s.
    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    config = elastic.ScalingConfig(num_workers=2, use_gpu=True)
    _cluster(monkeypatch, [(4, 1), (4, 1)], draining=["n1"])
    with pytest.raises(ConfigError, match=r"needs 2 GPU .* has 1"):
        check_cluster_fits(config, config.num_replicas)
    _cluster(monkeypatch, [(4, 1), (4, 1)])
    check_cluster_fits(config, config.num_replicas)


def test_strict_pack_is_refused_on_a_group_its_max_resources_never_lets_start(monkeypatch):
    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    reported = _reported(({"CPU": 2}, 1, 1), ({"CPU": 64, "GPU": 8}, 0, 2), ({"CPU": 8, "GPU": 1}, 0, -1),
                         max_resources={"GPU": 4})
    _cluster(monkeypatch, [(2, 0)], reported)
    config = elastic.ScalingConfig(num_workers=2, use_gpu=True, placement_strategy="STRICT_PACK")
    with pytest.raises(ConfigError, match="STRICT_PACK"):
        check_cluster_fits(config, config.num_replicas)


def test_a_ray_client_driver_leaves_the_check_to_the_controller(monkeypatch):
    # From a client the autoscaler's groups cannot be read, and the live nodes alone refused a
    # run the groups can grow to hold; the controller checks again inside the cluster.
    from ray.util.client import ray as client

    from elastic.actors.cluster_fit import check_cluster_fits

    _cluster(monkeypatch, [(4, 0)])  # no GPU up now
    monkeypatch.setattr(client, "is_connected", lambda: True)
    config = elastic.ScalingConfig(num_workers=4, use_gpu=True)
    check_cluster_fits(config, config.num_replicas)


def test_a_run_the_live_nodes_cannot_hold_is_refused_naming_wait_for_nodes_and_waits_with_it(monkeypatch):
    # An autoscaling cluster that reports nothing to Ray (the VM autoscaler, KubeRay) with its
    # GPU group at zero nodes: the run was refused for want of GPUs the autoscaler would add.
    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    _cluster(monkeypatch, [(4, 0)])
    config = elastic.ScalingConfig(num_workers=2, use_gpu=True)
    with pytest.raises(ConfigError, match="the cluster has no GPUs.*set ScalingConfig.wait_for_nodes=True"):
        check_cluster_fits(config, config.num_replicas)
    config = elastic.ScalingConfig(num_workers=8)
    with pytest.raises(ConfigError, match="needs 8 CPU .* but the cluster has 4.*wait_for_nodes=True"):
        check_cluster_fits(config, config.num_replicas)
    waits = elastic.ScalingConfig(num_workers=2, use_gpu=True, wait_for_nodes=True)
    check_cluster_fits(waits, waits.num_replicas)  # not refused: the placement waits for the nodes
    with pytest.raises(ConfigError, match="ScalingConfig.wait_for_nodes must be"):
        elastic.ScalingConfig(wait_for_nodes="yes")


@pytest.mark.parametrize("scaling, groups, why", [
    # One GPU group of up to 4 nodes of 1 GPU, none of them up.
    (dict(num_workers=5, use_gpu=True), [({"CPU": 8, "GPU": 1}, 0, 4)],
     r"needs 5 GPU \(5 actors x 1\) but the cluster's node groups can grow to 4; lower ScalingConfig.num_workers "
     r"or resources_per_worker, or raise the autoscaler's node group max counts"),
    (dict(num_workers=2, use_gpu=True), [({"CPU": 8}, 0, 10)],
     "the node groups of the cluster's autoscaler add no GPUs; set use_gpu=False, or give the autoscaler a GPU node group"),
    (dict(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2}), [({"CPU": 8, "GPU": 1}, 0, 8)],
     r"No node group of the cluster's autoscaler has room for one worker \(GPU=2, CPU=1\).*give the autoscaler a "
     "node group with larger nodes"),
    # The head's group (one node, fixed) counts with the others: 1 + 2 nodes.
    (dict(num_workers=4, placement_strategy="STRICT_SPREAD"), [({"CPU": 8}, 1, 2)],
     r"each of the 4 actors on a node of its own, and 3 node\(s\) at most have room for one"),
    (dict(num_workers=3, resources_per_worker={"CPU": 3}), [({"CPU": 4}, 0, 2)],
     r"The cluster's node groups at their max count hold 2 workers of CPU=3"),
    # An unlimited group of nodes too small for a worker, and one node that holds one: 0 x inf
    # made the count NaN, and a NaN is never below the run's size.
    (dict(num_workers=2, resources_per_worker={"CPU": 16}), [({"CPU": 8}, 0, -1), ({"CPU": 16}, 0, 1)],
     r"node groups at their max count hold 1 workers of CPU=16"),
    # The cluster-wide cap of the autoscaler's config, under what its groups add up to.
    (dict(num_workers=6), [({"CPU": 4}, 0, -1)], r"needs 6 CPU .* can grow to 5"),
])
def test_a_reported_autoscaling_config_is_what_the_run_is_checked_against(monkeypatch, scaling, groups, why):
    # Where the autoscaler reports its node groups (min, max count) to Ray, the run is checked
    # against the most they can grow to, as Ray Train checks it: not refused for want of nodes
    # not up yet, and refused, with no wait, when it can never fit. No wait_for_nodes hint then.
    from elastic.actors.cluster_fit import check_cluster_fits
    from elastic.config import ConfigError

    cap = {"CPU": 5} if groups == [({"CPU": 4}, 0, -1)] else None
    _cluster(monkeypatch, [(2, 0)], _reported(({"CPU": 2}, 1, 1), *groups, max_resources=cap))
    config = elastic.ScalingConfig(**scaling)
    with pytest.raises(ConfigError, match=why) as err:
        check_cluster_fits(config, config.num_replicas)
    assert "wait_for_nodes" not in str(err.value)
    fewer = elastic.ScalingConfig(**{**scaling, "num_workers": 1})
    if "GPUs" not in why and "room for one" not in why:
        check_cluster_fits(fewer, fewer.num_replicas)  # within the groups' maximum: not refused


def test_the_autoscalers_resource_cap_limits_how_many_nodes_of_each_group_count(monkeypatch):
    # 3 workers of 3 CPUs under a 10-CPU cap on an unlimited group of 4-CPU nodes passed both
    # checks (9 <= 10 in the totals; unlimited nodes) and waited out placement_timeout_s: the cap
    # starts two such nodes, which hold two workers. The head's group (min 1) counts whatever the cap.
    from elastic.actors.cluster_fit import autoscaler_capacity, check_cluster_fits
    from elastic.config import ConfigError

    _cluster(monkeypatch, [(2, 0)], _reported(({"CPU": 2}, 1, 1), ({"CPU": 4}, 0, -1), max_resources={"CPU": 10}))
    config = elastic.ScalingConfig(num_workers=3, resources_per_worker={"CPU": 3})
    with pytest.raises(ConfigError, match="node groups at their max count hold 2 workers of CPU=3"):
        check_cluster_fits(config, config.num_replicas)
    two = elastic.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 3})
    check_cluster_fits(two, two.num_replicas)
    _cluster(monkeypatch, [(4, 0)], _reported(({"CPU": 4}, 1, 1), max_resources={"CPU": 2}))
    assert [n for _, n in autoscaler_capacity().nodes] == [1.0]


def test_a_run_within_the_autoscalers_maximum_or_the_live_nodes_is_not_refused(monkeypatch):
    from elastic.actors.cluster_fit import autoscaler_capacity, check_cluster_fits
    from elastic.config import ConfigError

    # 4 GPU nodes at most, none up: a 4-GPU run waits for them; so does an unlimited group.
    config = elastic.ScalingConfig(num_workers=4, use_gpu=True, placement_strategy="STRICT_SPREAD")
    for groups in ([({"CPU": 8, "GPU": 1}, 0, 4)], [({"CPU": 8, "GPU": 1}, 0, -1)]):
        _cluster(monkeypatch, [(2, 0)], _reported(({"CPU": 2}, 1, 1), *groups))
        check_cluster_fits(config, config.num_replicas)
    # Groups that do not grow: what they hold is what the cluster will have (nodes still starting
    # counted), so a run beyond it is refused, wait_for_nodes or not.
    _cluster(monkeypatch, [(2, 0)], _reported(({"CPU": 2}, 1, 1), ({"CPU": 8, "GPU": 1}, 2, 2)))
    for scaling in (config, dataclasses.replace(config, wait_for_nodes=True)):
        with pytest.raises(ConfigError, match="needs 4 GPU .* the cluster's node groups can grow to 2"):
            check_cluster_fits(scaling, scaling.num_replicas)
    # A node outside the groups (started by hand) holds the run: not refused for what the
    # groups lack. Beyond it too, the error is the groups'.
    _cluster(monkeypatch, [(2, 0), (8, 0)], _reported(({"CPU": 2}, 1, 1)))
    fits_live = elastic.ScalingConfig(num_workers=6)
    check_cluster_fits(fits_live, fits_live.num_replicas)
    beyond = elastic.ScalingConfig(num_workers=12)
    with pytest.raises(ConfigError, match="needs 12 CPU .* the cluster's node groups can grow to 2") as err:
        check_cluster_fits(beyond, beyond.num_replicas)
    assert "wait_for_nodes" not in str(err.value)
    # A Ray whose private state API fails (moved, renamed): the live nodes are checked.
    from ray._private import state as ray_state

    monkeypatch.setattr(ray_state.state, "get_cluster_config", lambda: 1 / 0)
    assert autoscaler_capacity() is None


def test_freeing_a_name_kills_only_the_actor_that_held_it_first(monkeypatch):
    """A name freed and taken again between two looks (another driver's run of the same name)
    belonged to another actor: the loop killed whoever held the name at each look."""
    from types import SimpleNamespace

    import ray

    from elastic.actors.names import free_actor_name

    def Handle(hex_id):  # what free_actor_name reads of an actor handle
        return SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: hex_id))

    holders = [Handle("aa"), Handle("aa"), Handle("bb"), Handle("bb")]
    killed = []

    def get_actor(name, namespace=None):
        if not holders:
            raise ValueError(f"no actor {name}")
        return holders.pop(0)

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: killed.append(handle._actor_id.hex()))
    free_actor_name("controller", "ns", timeout_s=5)
    assert killed == ["aa", "aa"] and len(holders) == 1  # "bb" seen, and left alone
    # Told which actor was checked: one that holds the name at the first look already is not it.
    holders[:] = [Handle("cc")]
    killed.clear()
    free_actor_name("controller", "ns", timeout_s=5, actor_id="aa")
    assert killed == []


def _name_taken(*args, **kwargs):
    """A spawn Ray refuses: the actor's name is still taken."""
    raise ValueError("The name spare-0 (namespace=elastic-unit) is already taken")


def test_a_spare_whose_spawn_fails_leaves_its_freed_bundle_free(monkeypatch):
    # The bundle was recorded as the new spare's before the spawn: a spawn that raised (a name
    # still taken) left it held by an actor that does not exist, and no later spare used it.
    group, _ = _group_with_a_free_bundle(monkeypatch, {0: "A", 1: "B"}, reachable={"A", "B"})

    monkeypatch.setattr(group, "_spawn", _name_taken)
    with pytest.raises(ValueError, match="already taken"):
        group.request_spare()
    assert group._free_bundles == [1] and group._bundle_holder == {0: "rank-0"}


def test_a_ranks_group_ray_refuses_is_no_rank_lost(monkeypatch):
    # Ray's RaySystemError read as a rank lost: the start ran again max_failures times on a
    # refusal that came back each time (a group of that name left by a killed controller).
    import ray

    from elastic.actors.worker_group import PlacementRefused
    from elastic.controller import actor_lost

    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=2), spec, "elastic-unit")

    def refused(bundles, strategy, name):
        raise ray.exceptions.RaySystemError(f"Failed to create placement group because name '{name}' already exists.")

    monkeypatch.setattr(worker_group_module, "placement_group", refused)
    said = "the ranks' placement group 'elastic-unit/[0-9a-f]+[.][0-9]+/ranks': .*already exists"
    with pytest.raises(PlacementRefused, match=said) as info:
        group.start(2)
    assert not actor_lost(info.value) and group._pgs == []


def test_placement_group_names_are_the_controllers_own_and_never_repeat(monkeypatch):
    # Named "<namespace>/ranks" and "<namespace>/spare-<i>", every WorkerGroup of a run (a
    # restart's, a next controller's) asked for the names of the one before: a name Ray still
    # held (a removal not yet done, or one that failed) refused a spare's group, read as a rank
    # lost; and a driver could only sweep every group of the run's name after its controller died.
    from elastic.actors.worker_group import placement_owner_tag, remove_run_placement_groups

    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    first, second = (WorkerGroup(elastic.ScalingConfig(num_workers=2), spec, "elastic-unit") for _ in range(2))
    assert first.placement_prefix != second.placement_prefix
    assert all(g.placement_prefix.startswith("elastic-unit/") for g in (first, second))
    mine = f"elastic-unit/{placement_owner_tag('ab' * 16)}.3"
    table = {f"{i:02x}" * 18: {"name": name, "state": state} for i, (name, state) in enumerate([
        (f"{mine}/ranks", "CREATED"), (f"{mine}/spare-0", "PENDING"), (f"{mine}/spare-1", "REMOVED"),
        (f"elastic-unit/{placement_owner_tag('cd' * 16)}.0/ranks", "CREATED"),  # another controller's
        ("elastic-unit-b/x.0/ranks", "CREATED")])}  # another run's
    removed = []
    monkeypatch.setattr(worker_group_module, "placement_group_table", lambda: table)
    monkeypatch.setattr(worker_group_module, "remove_placement_group", removed.append)
    assert remove_run_placement_groups("elastic-unit", owner="ab" * 16) == [f"{mine}/ranks", f"{mine}/spare-0"]
    assert len(removed) == 2
    assert remove_run_placement_groups("elastic-unit") == [f"{mine}/ranks", f"{mine}/spare-0",
                                                            f"elastic-unit/{placement_owner_tag('cd' * 16)}.0/ranks"]


def test_ranks_spawned_before_one_whose_spawn_fails_are_killed(monkeypatch):
    # The ranks were spawned in one expression outside the start's try: one that raised left
    # those before it to the removal of their group, with their names still taken.
    import ray
    from types import SimpleNamespace

    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=3), spec, "elastic-unit")
    monkeypatch.setattr(worker_group_module, "placement_group",
                        lambda bundles, strategy, name: SimpleNamespace(bundle_specs=bundles))
    monkeypatch.setattr(worker_group_module, "_wait_ready", lambda *args: None)
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: "A", 1: "A", 2: "A"}})
    spawned, killed = [], []

    def spawn(pg, index, name, background=False):
        if len(spawned) == 2:
            raise ValueError(f"The name {name} (namespace=elastic-unit) is already taken")
        spawned.append(name)
        return name

    monkeypatch.setattr(group, "_spawn", spawn)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    with pytest.raises(ValueError, match="rank-2 .* already taken"):
        group.start(3)
    assert killed == spawned == ["rank-0", "rank-1"]


@pytest.mark.parametrize("room_off_both", [True, False])
def test_the_spares_of_a_new_group_keep_off_a_stragglers_node_too(monkeypatch, room_off_both):
    # A restart from the checkpoint after an eviction asked for its spares off the ranks' nodes
    # only: the pool could land on the straggler's node, which status() still listed as avoided.
    import ray
    from types import SimpleNamespace

    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=2, num_backups=1), spec, "elastic-unit")
    group.nodes_to_avoid = lambda: {"S"}
    monkeypatch.setattr(worker_group_module, "placement_group",
                        lambda bundles, strategy, name: SimpleNamespace(bundle_specs=bundles))
    monkeypatch.setattr(worker_group_module, "_wait_ready", lambda *args: None)
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: "A", 1: "A"}})
    nodes = ["A", "S"] + (["B"] if room_off_both else [])
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": n, "Resources": {"CPU": 4.0}} for n in nodes])
    monkeypatch.setattr(group, "_spawn", lambda pg, index, name, background=False: name)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    asked = []

    class Enough(Exception):
        pass

    def request_spare(background=False, avoid_nodes=()):
        asked.append(sorted(avoid_nodes))
        raise Enough

    monkeypatch.setattr(group, "request_spare", request_spare)
    with pytest.raises(Enough):
        group.start(2)
    assert asked == [["A", "S"] if room_off_both else ["S"]]


def test_a_spare_whose_spawn_fails_in_a_group_of_its_own_removes_that_group(monkeypatch):
    # No freed bundle: the spare gets a placement group of its own, which a spawn that raised
    # left reserved (its CPUs or GPUs) until the run ended.
    from types import SimpleNamespace

    group, _ = _group_with_a_free_bundle(monkeypatch, {0: "A"}, reachable={"A"})
    made, removed = [], []

    def placement_group(bundles, strategy, name, bundle_label_selector=None):
        made.append(SimpleNamespace(name=name))
        return made[-1]

    monkeypatch.setattr(worker_group_module, "placement_group", placement_group)
    monkeypatch.setattr(worker_group_module, "remove_placement_group", removed.append)

    monkeypatch.setattr(group, "_spawn", _name_taken)
    with pytest.raises(ValueError, match="already taken"):
        group.request_spare()
    assert [pg.name for pg in made] == [f"{group.placement_prefix}/spare-0"] and removed == made
    assert made[0] not in group._pgs


def test_a_draining_or_down_node_is_no_room_for_a_spare_kept_off_the_others(monkeypatch):
    # Counted as room, a spare kept off the ranks' node waited out its grace (placement_timeout_s
    # in the background) for a draining node Ray places nothing on: the pool a spare short.
    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    nodes = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 4.0}} for n in ("a", "b")]
    monkeypatch.setattr(worker_group_module.ray, "nodes", lambda: nodes)
    draining: set[str] = set()
    monkeypatch.setattr(worker_group_module, "_draining_nodes", lambda: draining)
    group = WorkerGroup(elastic.ScalingConfig(num_workers=1, num_backups=1), spec, "elastic-unit")
    assert group._avoidable({"a"}) == ["a"]  # b has room
    draining.add("b")
    assert group._avoidable({"a"}) == []  # asked for anywhere at once
    draining.clear()
    group._down_nodes.add("b")
    assert group._avoidable({"a"}) == []
