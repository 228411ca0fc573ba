"""Node loss on a real multi-node Ray cluster: a raylet removed while two ranks live on it.

Both ranks are replaced in one rebuild from the hot spares on the surviving node, no survivor
restarts, and the final weights equal a failure-free run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

import elastic
from conftest import release_shared_cluster
from elastic.checkpoint import CheckpointStore
from elastic.checkpoint.testing import TEST_SECRET
from helpers import (DRIVER_CREDENTIALS, assert_weights_close, loss_fn, make_dataset, make_model, make_sgd,
                     reference_weights, s3_with_credentials_in_this_process_only)

pytestmark = pytest.mark.slow

STEPS = 16


@pytest.fixture(scope="module")
def cluster():
    # Head: no CPUs (driver and controller only). Nodes A and B: room for two ranks each, so the
    # four ranks land two and two. The spares' node C joins once the ranks are placed.
    # The GCS declares a removed node dead after health_check_failure_threshold missed checks,
    # health_check_period_ms apart: 5 x 3 s by default, ~13 s of every test here spent waiting
    # for it. 3 x 0.5 s finds a killed raylet in ~1.5 s (its checks fail at once: connection
    # refused); a live one under load still has health_check_timeout_ms (10 s) to answer each.
    # The head's processes (the controller) have S3 credentials in their environment, the nodes'
    # none (test_storage_a_nodes_writers_cannot_write_ends_the_run_before_any_step).
    release_shared_cluster()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "env_vars": DRIVER_CREDENTIALS,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    try:  # as conftest's start_cluster/stop_cluster: no cluster is left running for later modules
        node_a = c.add_node(num_cpus=2)
        c.add_node(num_cpus=2)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c, node_a
    finally:
        try:
            ray.shutdown()
        finally:
            c.shutdown()


def trainer(name, backups):
    return elastic.Trainer(
        make_model, make_sgd, make_dataset, loss_fn, 32,
        scaling=elastic.ScalingConfig(num_workers=4, num_backups=backups),
        run=elastic.RunConfig(name=name, seed=0),
        # Paced so the node goes mid-run: at 0.05 s a step, steps 6-15 went in one dispatch
        # window and the run could end about 0.6 s after step 3 showed.
        faults=[{"kind": "slow", "rank": 0, "delay_s": 0.2, "from_step": 1}])


def test_remove_node_with_two_ranks(cluster):
    c, node_a = cluster
    clean = reference_weights(STEPS, 32, seed=0)  # one process, the same global batches, no failure

    t = trainer("nodeloss", backups=2)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", t.fit(steps=STEPS)))
    th.start()
    removed_ranks = None
    deadline = time.time() + 120
    while time.time() < deadline:
        pgs = ray.util.placement_group_table().values()
        if any(p["name"].startswith("elastic-nodeloss/") and p["name"].endswith("/ranks") and p["state"] == "CREATED"
               for p in pgs):
            break
        time.sleep(0.1)
    c.add_node(num_cpus=2)
    while time.time() < deadline and th.is_alive():
        try:
            st = ray.get(ray.get_actor("controller", namespace="elastic-nodeloss").status.remote())
        except Exception:
            time.sleep(0.05)
            continue
        if st["step"] >= 3 and st["state"] == "running":
            on_a = [r for r in st["ranks"] if r["node_id"] == node_a.node_id]
            removed_ranks = [r["rank"] for r in on_a if r["role"] == "active"]
            c.remove_node(node_a, allow_graceful=False)
            # A machine that loses power takes its processes with it. remove_node kills the raylet
            # only; its workers notice within about a second (the core worker's check on its
            # raylet), and this short run could finish its steps in that second with no recovery.
            for r in on_a:
                if not r.get("pid"):
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r["pid"], signal.SIGKILL)
            break
        time.sleep(0.02)
    th.join(timeout=180)
    result = box["r"]
    assert removed_ranks is not None and len(removed_ranks) == 2
    assert result.metrics["steps"] == STEPS
    # one rebuild for the whole node
    assert len(result.recoveries) == 1
    assert sorted(result.recoveries[0]["ranks"]) == sorted(removed_ranks)
    replaced = [e["details"]["rank"] for e in result.events if e["kind"] == "replace"]
    assert sorted(replaced) == sorted(removed_ranks)
    assert result.metrics["recomputed_steps"] <= 1
    assert_weights_close(result.model_state, clean, atol=1e-5)


def test_a_refill_spare_waiting_for_room_takes_the_lost_ranks_bundle_once_ray_places_it_again(cluster):
    # A cluster sized for 2 ranks and a spare (a "slot" resource on three nodes, none elsewhere).
    # Rank 0's node goes; its bundle waits for Ray to place it again, so the refill spare asks
    # for a group of its own. A node joins: Ray gives it to the rescheduled bundle first, and
    # the spare's own group never places. The spare is asked for again in that bundle.
    from elastic.actors.worker import TrainingSpec
    from elastic.actors.worker_group import WorkerGroup

    c, _ = cluster
    nodes = [c.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(3)]
    c.wait_for_nodes()
    scaling = elastic.ScalingConfig(num_workers=2, num_backups=1, resources_per_worker={"CPU": 1, "slot": 1})
    group = WorkerGroup(scaling, TrainingSpec(make_model, make_sgd, make_dataset, loss_fn), "elastic-refill")
    lost_node = None  # a failure before the removal must not hide behind an UnboundLocalError below
    try:
        group.start(2)
        assert len(group.spares) == 1
        lost_node, lost_bundle = group.members[0].info["node_id"], group.members[0].bundle_index
        c.remove_node(next(n for n in nodes if n.node_id == lost_node), allow_graceful=False)
        # At once, as a recovery does: the GCS may list the node alive for its health checks'
        # time yet (1.5 s here, ~15 s with Ray's defaults), and the spare must not go into the
        # bundle there (WorkerGroup._placed_free_bundle probes the raylet).
        group.promote_spare(0)  # rank 0's bundle is free, on a dead node
        group.request_spare(background=True)
        assert group.pending_spares == 1 and group.building_spares[0].pg is not group._ranks_pg
        # Then the GCS finds the node dead and reschedules the bundle; a node that joined before
        # that could go to the spare's own group instead, which this test is not about.
        deadline = time.time() + 60
        while time.time() < deadline and any(n["NodeID"] == lost_node and n["Alive"] for n in ray.nodes()):
            time.sleep(0.2)
        # The node joins and a recovery waits for the spare (a wait for capacity): Ray places the
        # bundle again during that wait or just before it, and the spare moves there either way
        # (the wait looks again every MOVE_CHECK_S; tests/test_worker_group.py).
        nodes.append(c.add_node(num_cpus=1, resources={"slot": 1}))
        group.collect_spares(block=True, timeout_s=90)
        assert len(group.spares) == 1 and group.pending_spares == 0
        assert group.spares[0].pg is group._ranks_pg and group.spares[0].bundle_index == lost_bundle
        notes = [message for _, message in group.take_spare_notes()]
        assert any("asking for the spare there" in m for m in notes)
    finally:
        group.shutdown()
        for node in nodes:
            if node.node_id != lost_node:
                c.remove_node(node)


@pytest.mark.parametrize("writers", ["agents", "ranks"])
def test_storage_a_nodes_writers_cannot_write_ends_the_run_before_any_step(cluster, monkeypatch, writers):
    """S3 credentials in the driver's environment and the head's (where the controller runs),
    none on the nodes that host the ranks. The driver's and the controller's checks pass;
    before, the nodes' writers (the node's checkpoint agent, or with blocking=True the ranks in
    their own processes) failed every write in the background for the whole run. Now the run
    ends at the start with a ConfigError that names the node and says what to do."""
    with s3_with_credentials_in_this_process_only(monkeypatch) as (s3, bucket, options):
        t = elastic.Trainer(
            make_model, make_sgd, make_dataset, loss_fn, 32, scaling=elastic.ScalingConfig(num_workers=2),
            run=elastic.RunConfig(name=f"nodecreds-{writers}", seed=0, storage=f"s3://{bucket}/runs",
                                  storage_options=options,
                                  checkpoint=elastic.CheckpointConfig(blocking=writers == "ranks")))
        with pytest.raises(elastic.ConfigError) as err:
            t.fit(steps=3)
        text = str(err.value)
        assert "no AWS credentials found" in text and "on node" in text and "storage_options" in text
        assert "controller" not in text
        assert ("checkpoint agent" in text) == (writers == "agents")
        assert TEST_SECRET not in text
        assert CheckpointStore(f"s3://{bucket}/runs", f"nodecreds-{writers}", s3.storage_options()).step_dirs() == []
