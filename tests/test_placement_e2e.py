"""Placement on real Ray: rank order by node on a 2-node cluster, and cluster-level rejections."""

from __future__ import annotations

import pytest
import ray

import elastic
from conftest import release_shared_cluster, start_cluster, stop_cluster
from elastic.actors.priority import can_restore_priority
from elastic.actors.worker import TrainingSpec
from elastic.actors.worker_group import PlacementTimeout, WorkerGroup
from helpers import loss_fn, make_dataset, make_model, make_sgd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    release_shared_cluster()
    cluster = start_cluster(num_nodes=2, cpus_per_node=3)
    yield cluster
    stop_cluster(cluster)


def spec():
    return TrainingSpec(make_model, make_sgd, make_dataset, loss_fn)


def test_ranks_grouped_by_node(two_nodes):
    scaling = elastic.ScalingConfig(num_workers=4, placement_strategy="SPREAD")
    group = WorkerGroup(scaling, spec(), "elastic-placement")
    try:
        group.start(4)
        members = group.members
        nodes = [m.info["node_id"] for m in members]
        assert len(set(nodes)) == 2
        # ranks on the same node are contiguous, node ranks count up, local ranks restart per node
        assert nodes == sorted(nodes, key=nodes.index)
        assert [m.node_rank for m in members] == [0, 0, 1, 1]
        assert [m.local_rank for m in members] == [0, 1, 0, 1]
        assert [m.rank for m in members] == [0, 1, 2, 3]
        # actor names match ranks in the run's namespace
        for m in members:
            assert ray.get_actor(f"rank-{m.rank}", namespace="elastic-placement") is not None
    finally:
        group.shutdown()


def test_refill_spare_builds_on_idle_cpu_then_runs_at_normal_priority(two_nodes):
    # A real TrainWorker: torch, the model, the optimizer and the dataset built under SCHED_IDLE
    # where this user may come back from it, then every thread back to normal before it is ready.
    scaling = elastic.ScalingConfig(num_workers=1, num_backups=1)
    group = WorkerGroup(scaling, spec(), "elastic-background-spare")
    try:
        group.start(1)
        group.request_spare(background=True)
        assert group.collect_spares(block=True, timeout_s=120) == 2
        first, refill = [m.info for m in group.spares]
        assert first["started_in_background"] is False
        assert refill["started_in_background"] is can_restore_priority()
        assert first["idle_threads"] == refill["idle_threads"] == 0
    finally:
        group.shutdown()


def test_gpu_on_cluster_without_gpus(two_nodes):
    t = elastic.Trainer(make_model, make_sgd, make_dataset, loss_fn, 8,
                        scaling=elastic.ScalingConfig(num_workers=1, use_gpu=True))
    with pytest.raises(elastic.ConfigError, match=r"no GPUs.*ray start --num-gpus=N"):
        t.fit(steps=1)


def test_more_than_cluster_has(two_nodes):
    t = elastic.Trainer(make_model, make_sgd, make_dataset, loss_fn, 8,
                        scaling=elastic.ScalingConfig(num_workers=8))
    with pytest.raises(elastic.ConfigError, match="cluster has 6"):
        t.fit(steps=1)


def test_placement_that_never_fits_times_out(two_nodes):
    # 4 CPUs fit in the cluster's 6 in total, but not on one node: STRICT_PACK can never be placed.
    scaling = elastic.ScalingConfig(num_workers=4, placement_strategy="STRICT_PACK", placement_timeout_s=3)
    group = WorkerGroup(scaling, spec(), "elastic-nofit")
    with pytest.raises(PlacementTimeout, match="placement_timeout_s"):
        group.start(4)
    group.shutdown()
