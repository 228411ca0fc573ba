"""WorkerGroup's bookkeeping without a cluster (its placement on real Ray: test_placement_e2e.py,
test_node_loss_e2e.py)."""

from __future__ import annotations

import time

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
    monkeypatch.setattr(group, "_move_to_placed_free_bundles", lambda: looked.append(time.monotonic()))
    monkeypatch.setattr(group, "_take_built_spares", lambda: None)  # the spare never builds
    monkeypatch.setattr(group, "_place_anywhere_if_stuck", lambda grace_s, wait: None)
    monkeypatch.setattr(worker_group_module, "wait_refs", lambda refs, timeout_s, interrupted=None: time.sleep(timeout_s) or [])
    monkeypatch.setattr(worker_group_module, "MOVE_CHECK_S", 0.05)
    t0 = time.monotonic()
    assert group.collect_spares(block=True, timeout_s=0.4) == 0
    assert len(looked) >= 5 and time.monotonic() - t0 >= 0.4
    looked.clear()
    group.collect_spares()  # not blocking: one look
    assert len(looked) == 1
