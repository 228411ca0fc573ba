"""The NCCL path on a real GPU: placement, training, checkpoint and exact resume, and the example
on an embedded Ray that has to find the GPU itself.

Runs only where torch sees a CUDA device (CI has none; the device choice itself is tested on the
CPU in test_config.py). One GPU is enough: NCCL refuses two ranks on one device, so these
tests use one rank, which still builds the NCCL process group, DDP with device_ids, the snapshot
from device memory to host and the restore back onto the device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
import torch

import elastic
from conftest import ROOT, release_shared_cluster, start_cluster, stop_cluster
from elastic.actors.protocol import CollectiveError
from elastic.checkpoint import CheckpointStore
from elastic.actors.worker import TrainingSpec
from elastic.actors.worker_group import WorkerGroup
from helpers import assert_weights_close, loss_fn, make_adam, make_dataset, make_model, make_sgd, reference_weights

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu_cluster():
    # The GPU count is named: Ray's own detection found none on a Firecracker VM whose GPU torch saw.
    release_shared_cluster()
    cluster = start_cluster(num_gpus=torch.cuda.device_count())
    yield cluster
    stop_cluster(cluster)


def gpu_trainer(name: str, storage: str, mixed_precision: str | None = None, optimizer_fn=make_adam) -> elastic.Trainer:
    return elastic.Trainer(
        make_model, optimizer_fn, make_dataset, loss_fn, 32,
        scaling=elastic.ScalingConfig(num_workers=1, use_gpu=True),
        run=elastic.RunConfig(name=name, storage=storage, seed=0), mixed_precision=mixed_precision)


def test_worker_on_gpu_uses_nccl(gpu_cluster):
    assert ray.cluster_resources().get("GPU", 0) >= 1
    group = WorkerGroup(elastic.ScalingConfig(num_workers=1, use_gpu=True),
                        TrainingSpec(make_model, make_adam, make_dataset, loss_fn, use_gpu=True), "elastic-gpu")
    try:
        group.start(1)
        info = group.members[0].info
        assert info["backend"] == "nccl"
        assert info["device"] == "cuda:0"
        assert len(info["gpu_ids"]) == 1
    finally:
        group.shutdown()


def test_an_aborted_nccl_group_fails_its_step_without_an_update_and_a_new_group_trains_on(gpu_cluster):
    """The survivor's path in a recovery, on a real NCCL communicator: the controller aborts the
    group (abort_collectives), the step of that generation fails as a collective and leaves the
    weights as they were, and the same process forms a fresh NCCL group and trains on."""
    group = WorkerGroup(elastic.ScalingConfig(num_workers=1, use_gpu=True),
                        TrainingSpec(make_model, make_adam, make_dataset, loss_fn, use_gpu=True), "elastic-gpu-abort")
    try:
        group.start(1)
        member = group.members[0]
        actor, shard = member.actor, [list(range(32))]

        def form(generation: int) -> None:
            port = ray.get(actor.host_rendezvous.remote(30.0))
            ray.get(actor.join.remote(0, 1, member.info["node_ip"], port, generation, 30.0))

        form(1)
        (done,) = ray.get(actor.train_steps.remote(1, shard, 1))
        assert done.completed_step == 1
        before = ray.get(actor.model_state.remote())
        assert ray.get(actor.abort_collectives.remote(1)) is True
        with pytest.raises(CollectiveError, match="abort|not been initialized"):
            ray.get(actor.train_steps.remote(2, shard, 1))
        assert ray.get(actor.progress.remote())[0] == 1
        assert_weights_close(ray.get(actor.model_state.remote()), before, atol=0.0)

        form(2)
        assert ray.get(actor.abort_collectives.remote(1)) is False  # an older generation's abort
        (again,) = ray.get(actor.train_steps.remote(2, shard, 2))
        assert again.completed_step == 2
        after = ray.get(actor.model_state.remote())
        assert any(not torch.equal(after[k], before[k]) for k in before)
        assert ray.get(actor.info.remote())["backend"] == "nccl"
    finally:
        group.shutdown()


def test_nccl_training_checkpoints_and_resumes_exactly(gpu_cluster, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    first = gpu_trainer("gpu", url).fit(steps=5)
    assert first.events_of("rendezvous")[0]["details"]["backend"] == "nccl"
    assert first.checkpoint["latest_step"] == 5
    # The result comes back on the host, loadable where there is no GPU.
    assert all(v.device.type == "cpu" for v in first.model_state.values())
    # Same batches as a one-process CPU reference; GPU kernels round differently, hence the atol.
    assert_weights_close(first.model_state, reference_weights(5, 32, seed=0, optimizer_fn=make_adam), atol=1e-4)

    resumed = gpu_trainer("gpu", url).fit(steps=12)
    assert resumed.metrics["restored_from"] == 5
    straight = gpu_trainer("gpu-straight", f"file://{tmp_path}/straight").fit(steps=12)
    # Same device, same kernels: the resumed run equals the uninterrupted one.
    assert_weights_close(resumed.model_state, straight.model_state, atol=1e-6)


def test_fp16_on_the_gpu_scales_on_the_ranks_device_and_resumes_its_scale(gpu_cluster, tmp_path):
    # The CPU tests run torch's AMP recipe on the CPU: here the autocast and the GradScaler are
    # CUDA's, chosen by the rank's device.
    url = f"file://{tmp_path}/ckpt"
    first = gpu_trainer("gpu-fp16", url, "fp16", make_sgd).fit(steps=5)
    saved = CheckpointStore(url, "gpu-fp16").read_state(5)[0]
    assert saved["scaler"]["_growth_tracker"] == 5 and saved["scaler"]["scale"] == 65536.0
    # torch's AMP recipe on this GPU in one process: SGD moves by the gradient itself, so a
    # missing or doubled unscale would show (Adam's normalised step would hide it)
    reference = reference_weights(5, 32, seed=0, optimizer_fn=make_sgd, fp16=True, device="cuda")
    assert_weights_close(first.model_state, reference, atol=1e-5)
    resumed = gpu_trainer("gpu-fp16", url, "fp16", make_sgd).fit(steps=8)
    assert resumed.metrics["restored_from"] == 5
    assert CheckpointStore(url, "gpu-fp16").read_state(8)[0]["scaler"]["_growth_tracker"] == 8


def test_digits_example_on_gpu_with_an_embedded_ray(gpu_cluster):
    # Its own process, so fit() starts an embedded local Ray and has to find the GPU itself.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "digits.py"), "--gpu", "--workers", "1",
                          "--spares", "0", "--epochs", "8", "--no-progress", "--name", "digits-gpu"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    acc = float(out.stdout.split("test_accuracy=")[1].split()[0])
    assert acc >= 0.95


def make_model_on_gpu() -> torch.nn.Module:
    """A model_fn that initialises its weights on the GPU, from CUDA's generator."""
    return torch.nn.Linear(16, 4, device="cuda")


def test_a_model_initialised_on_the_gpu_follows_the_run_seed(gpu_cluster):
    # Only the CPU's generators were seeded when the model was built: a model_fn initialising on
    # the GPU drew from CUDA's fixed default seed, the same weights whatever RunConfig.seed said.
    def first_weights(seed: int) -> dict:
        spec = TrainingSpec(make_model_on_gpu, make_adam, make_dataset, loss_fn, seed=seed, use_gpu=True)
        group = WorkerGroup(elastic.ScalingConfig(num_workers=1, use_gpu=True), spec, f"elastic-gpu-seed-{seed}")
        try:
            group.start(1)
            return ray.get(group.members[0].actor.model_state.remote())
        finally:
            group.shutdown()

    zero, again, one = first_weights(0), first_weights(0), first_weights(1)
    assert_weights_close(zero, again, atol=0.0)
    assert not torch.equal(zero["weight"], one["weight"])
