"""The controller's side of a rollback, without Ray: the ranks' checkpoint reports that arrive
after training went back (the controller's methods on a real ``Controller`` whose Ray runtime
context is a stand-in; nothing here starts or joins a cluster)."""

from __future__ import annotations

import time

import pytest

import elastic
from elastic import controller as controller_module
from elastic.actors.worker import TrainingSpec
from elastic.checkpoint import CheckpointCommitter, CheckpointStore
from elastic.config import CheckpointConfig
from elastic.data import DataPosition


@pytest.fixture
def controller(monkeypatch, tmp_path):
    """A controller with a committer of every step, as after ``_setup_data_and_checkpoints``."""
    def no_runtime():  # ray.get_runtime_context() outside an actor joins (or starts) a cluster
        raise RuntimeError("not in a Ray actor")

    monkeypatch.setattr(controller_module.ray, "get_runtime_context", no_runtime)
    spec = TrainingSpec(model_fn=lambda: None, optimizer_fn=lambda p: None, dataset_fn=lambda: None,
                        loss_fn=lambda m, b: None)
    c = controller_module.Controller(spec, elastic.ScalingConfig(num_workers=2), elastic.RunConfig(name="rollback"),
                                     elastic.FailureConfig(), global_batch_size=8)
    assert not controller_module.ray.is_initialized()
    store = CheckpointStore(f"file://{tmp_path}", "rollback")
    c.committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1))
    yield c
    c.committer.close()


def part(progress: int, **extra) -> dict:
    """A rank's part with no file (no share of the state): its RNG goes to the manifest."""
    return {"entries": [], "taken_at": time.time(), "progress": progress, "rng": {"python": progress}, **extra}


def test_a_rollback_takes_the_ranks_progress_back_to_the_step_it_went_back_to(controller, monkeypatch):
    """Every rank loads committed step 3 (no survivor held the state) after a rank reported
    step 10: the commit lag counts from step 3 again, and a rank's step 4 is its progress."""
    c = controller
    c.store, c.dataset_size = c.committer.store, 64
    c.step = 9
    c.checkpoint_written(10, 2, {0: part(10)})
    assert c._progress_step() == 10

    def restore_latest():  # the ranks' restore_checkpoint calls, stood in for
        c.step = 3
        return DataPosition(cursor=24)

    monkeypatch.setattr(c, "_restore_latest", restore_latest)
    c._restore_members_from_checkpoint()
    assert c._progress_step() == 3 and c.committer.lag(c._progress_step()) == 3
    c.checkpoint_written(4, 2, {0: part(4)})  # a rank writes step 4 again
    assert c._progress_step() == 4
