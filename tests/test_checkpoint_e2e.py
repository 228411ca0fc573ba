"""Per-step checkpoints through real training on Ray: exact resume, corrupt steps skipped,
restart-from-checkpoint recovery, and an S3 outage in the middle of a run (moto on loopback).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import ray
import torch

import elastic
from elastic.checkpoint import CheckpointStore, UnsaveableState, memory
from elastic.checkpoint.store import MANIFEST, VERSION, parse_step_dir
from elastic.checkpoint.testing import TEST_SECRET, MotoS3, clear_memory
from helpers import (assert_weights_close, loss_fn, make_adam, make_dataset, make_dropout_model, make_model, make_sgd,
                     reference_weights, s3_with_credentials_in_this_process_only)

pytestmark = pytest.mark.slow

STEPS_OUTAGE = 100  # 0.2 s a step: ~5 before the outage, ~50 in its 10 s, ~45 (9 s) after it
OUTAGE_S = 10  # how long the S3 endpoint is down, as the issue asks ("about 10 s")
OUTAGE_STEPS = 3  # steps training must go on past the stop before the endpoint returns


def trainer(name, storage, workers=2, backups=0, failure=None, faults=None, storage_options=None,
            steps_per_dispatch=0, optimizer_fn=make_adam, loss=loss_fn, global_batch_size=32, mixed_precision=None,
            batch_schedule=None, **ckpt):
    return elastic.Trainer(
        make_model, optimizer_fn, make_dataset, loss, global_batch_size,
        scaling=elastic.ScalingConfig(num_workers=workers, num_backups=backups,
                                      steps_per_dispatch=steps_per_dispatch),
        run=elastic.RunConfig(name=name, storage=storage, storage_options=storage_options or {}, seed=0,
                              checkpoint=elastic.CheckpointConfig(**ckpt)),
        failure=failure, faults=faults, mixed_precision=mixed_precision, batch_schedule=batch_schedule)


@pytest.fixture(scope="module")
def uninterrupted():
    """Twelve failure-free steps in one process on the same global batches (no Ray needed)."""
    return reference_weights(12, 32, seed=0, optimizer_fn=make_adam)


def _torn_step_writer(url: str, run: str, step: int) -> None:
    """Child process: write every rank's shards of ``step`` (a state unlike the run's: the last
    committed one, every float tensor moved by 1) and die by SIGKILL before any manifest."""
    from elastic.checkpoint.codec import capture_rng, flatten_state

    store = CheckpointStore(url, run)
    state, _ = store.read_state()
    for value in flatten_state({"model": state["model"], "optimizer": state["optimizer"]})[0].values():
        if value.is_floating_point():
            value.add_(1.0)
    for rank in range(2):
        store.write_rank_files(step, rank, 2, state, capture_rng())
    os.kill(os.getpid(), signal.SIGKILL)


def test_every_step_committed_and_exact_resume(ray_cluster, tmp_path, uninterrupted):
    url = f"file://{tmp_path}/ckpt"
    # The first run has both ranks write a shard; the second (the default min_shard_bytes, far
    # above this model's size) has rank 0 write the whole state and rank 1 only report its RNG.
    first = trainer("resume", url, blocking=True, min_shard_bytes=0).fit(steps=5)
    assert first.checkpoint["latest_step"] == 5
    commits = [e["details"]["step"] for e in first.events if e["kind"] == "checkpoint_commit"]
    assert commits == [1, 2, 3, 4, 5]  # blocking mode: every step, in order
    assert first.metrics["checkpoint_snapshots_dropped"] == 0  # in-process writers never drop
    assert not first.events_of("checkpoint_incomplete")
    store = CheckpointStore(url, "resume")
    assert store.committed_steps() == [3, 4, 5]  # keep_last=3
    assert len(store.load_manifest(5)["files"]) == 2
    # what the sample order depends on, so a resume can tell it is the same order
    assert {k: store.load_manifest(5)["meta"][k] for k in ("dataset_size", "seed")} == {"dataset_size": 256, "seed": 0}
    # A torn write: a writer killed (SIGKILL) between step 6's shards and its manifest. The resume
    # never sees that step: it continues from 5, and ends on the weights of an uninterrupted run.
    import multiprocessing

    torn = multiprocessing.get_context("spawn").Process(target=_torn_step_writer, args=(url, "resume", 6))
    torn.start()
    torn.join(120)
    assert torn.exitcode == -signal.SIGKILL
    assert store.step_dirs()[-1] == 6 and len(store.storage.list_dir("step-000000006")) >= 2
    assert store.latest_valid() == 5
    second = trainer("resume", url).fit(steps=12)
    assert second.metrics["restored_from"] == 5
    resume = second.events_of("resume")[0]
    # One read from storage; the other rank got the state through the object store.
    assert resume["details"]["read_by"] == 0 and "sent to 1 more through the object store" in resume["message"]
    assert second.checkpoint["latest_step"] == 12
    # Through the agents, which may drop a snapshot for want of a free slot (the flush takes the
    # last step's again): at most one a rank for each of steps 6-12.
    assert second.metrics["checkpoint_snapshots_dropped"] in range(0, 2 * 7 + 1)
    assert_weights_close(second.model_state, uninterrupted, atol=1e-5)
    assert second.events_of("data_order_changed") == []
    manifest = store.load_manifest(12)
    assert [f["path"] for f in manifest["files"]] == ["step-000000012/shard-r0-of-2.safetensors"]
    assert set(manifest["rng"]) == {"1"} and store.read_rng(12, 1)["torch"]


def test_commits_do_not_wait_for_the_dispatch_window(ray_cluster, tmp_path, uninterrupted):
    # One call carries all twelve steps (rank 0 sleeps 0.2 s a step, so the call lasts >2.4 s); ranks report each
    # written part straight to the controller, so steps commit while the window is still running. (At
    # 0.1 s a step, a commit 0.4 s behind on a loaded machine failed the 0.2 s margin below.)
    result = trainer("windowed", f"file://{tmp_path}/ckpt", blocking=True, steps_per_dispatch=12,
                     faults=[{"kind": "slow", "rank": 0, "delay_s": 0.2, "from_step": 1}]).fit(steps=12)
    commits = result.events_of("checkpoint_commit")
    assert [e["details"]["step"] for e in commits] == list(range(1, 13))
    finished = [e["time"] for e in result.events_of("transition") if e["details"]["new"] == "finished"][0]
    by_step = {e["details"]["step"]: e for e in commits}
    # committed mid-window (details carry the commit's own time), long before its results arrived
    assert by_step[6]["details"]["time"] < finished - 0.2
    # Commits that waited for the window would lag up to 11 steps. Not <= 2: the lag is read after the
    # commit, and a commit thread behind on a loaded machine is a few steps.
    assert max(e["details"]["lag"] for e in commits) <= 6
    assert all(e["details"]["persist_s"] >= 0 for e in commits)
    assert_weights_close(result.model_state, uninterrupted, atol=1e-5)


def test_checkpoints_go_through_the_node_agent_and_survive_its_death(ray_cluster, tmp_path, uninterrupted):
    """In the background (the default) each node's checkpoint agent writes its ranks' snapshots.
    Its process is killed mid-run: the ranks write their own from then on and the run ends on
    its last step committed, with the weights of one process."""
    url = f"file://{tmp_path}/ckpt"
    # keep_last=12: every step committed stays, to be read back whole (those the agent wrote
    # before its kill among them).
    t = trainer("agent", url, faults=[{"kind": "slow", "rank": 0, "delay_s": 0.1, "from_step": 1}], keep_last=12)
    killed = {}

    def kill():
        # Once an agent has written step 3 (the ranks, a dispatch window ahead of the
        # controller, are not far past it: rank 0 takes 0.1 s a step).
        deadline, agents = time.time() + 120, []
        while time.time() < deadline and not agents:
            agents = [ray.get_actor(a["name"], namespace="elastic-agent")
                      for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == "elastic-agent" and a["name"].startswith("checkpoint-agent-")]
            time.sleep(0.02)
        while time.time() < deadline:
            stats = [ray.get(a.stats.remote()) for a in agents]
            if any(step >= 3 for s in stats for step in s["written"].values()):
                break
            time.sleep(0.02)
        for s in stats:
            os.kill(s["pid"], signal.SIGKILL)
        killed.update(at=max(step for s in stats for step in s["written"].values()), agents=len(agents))

    th = threading.Thread(target=kill)
    th.start()
    result = t.fit(steps=12)
    th.join()
    (started,) = result.events_of("checkpoint_agents")
    assert started["details"]["nodes"] and all(started["details"]["nodes"].values())
    assert killed["agents"] >= 1 and killed["at"] < 12
    lost = result.events_of("checkpoint_agent_lost")
    assert {e["details"]["rank"] for e in lost} == {0, 1}
    commits = [e["details"]["step"] for e in result.events_of("checkpoint_commit")]
    assert min(commits) <= killed["at"] and commits[-1] == 12  # before the kill by the agent, after it by the ranks
    assert result.checkpoint["latest_step"] == 12
    assert_weights_close(result.model_state, uninterrupted, atol=1e-5)
    store = CheckpointStore(url, "agent")
    state, _ = store.read_state(12)
    assert_weights_close(state["model"], uninterrupted, atol=1e-5)
    # Every step committed, the agent's among them: whole and loadable, none torn by the kill.
    assert store.committed_steps() == sorted(set(commits))
    for step in store.committed_steps():
        assert store.read_state(step)[0]["completed_step"] == step


def test_the_last_step_commits_whatever_every_n_steps_says(ray_cluster, tmp_path, uninterrupted):
    url = f"file://{tmp_path}/ckpt"
    first = trainer("last", url, blocking=True, every_n_steps=5).fit(steps=12)
    assert [e["details"]["step"] for e in first.events_of("checkpoint_commit")] == [5, 10, 12]
    assert first.checkpoint["latest_step"] == 12
    # fit() again continues from step 12 itself: nothing is replayed, the weights are the run's
    again = trainer("last", url, every_n_steps=5).fit(steps=12)
    assert again.metrics["restored_from"] == 12 and not again.events_of("checkpoint_commit")
    assert_weights_close(again.model_state, uninterrupted, atol=1e-5)


def test_every_n_steps_0_commits_the_last_step_alone(ray_cluster, tmp_path, uninterrupted):
    # The docs promise the last step whatever every_n_steps; with 0 the ranks had no writer, so
    # nothing committed and the run logged a rank's part as missing (checkpoint_incomplete).
    url = f"file://{tmp_path}/ckpt"
    first = trainer("last-only", url, every_n_steps=0).fit(steps=12)
    assert [e["details"]["step"] for e in first.events_of("checkpoint_commit")] == [12]
    assert first.checkpoint["latest_step"] == 12 and not first.events_of("checkpoint_incomplete")
    again = trainer("last-only", url, every_n_steps=0).fit(steps=12)
    assert again.metrics["restored_from"] == 12
    assert_weights_close(again.model_state, uninterrupted, atol=1e-5)


def _live_lease_elsewhere(url: str, run: str):
    """Another driver's run of ``run`` in ``url``, on another Ray cluster: its lease written and
    renewed every 0.5 s, as a live controller there renews it."""
    from elastic.checkpoint.lease import RunLease

    other = RunLease(CheckpointStore(url, run).storage, {"run": run, "cluster": "session_elsewhere",
                                                          "gcs": "10.9.8.7:6379", "host": "other-host", "pid": 7},
                     renew_s=0.5)
    other._write()
    other.start_renewing(lambda why: None)
    return other


def test_a_live_run_of_the_name_elsewhere_refuses_the_fit_before_any_rank_starts(ray_cluster, tmp_path):
    from elastic.checkpoint.lease import LEASE_FILE, LeaseHeld

    url = f"file://{tmp_path}/ckpt"
    other = _live_lease_elsewhere(url, "leased")
    try:
        with pytest.raises(LeaseHeld) as err:
            trainer("leased", url).fit(steps=3)
        assert "RunConfig.name" in str(err.value) and "other-host" in str(err.value)
        assert isinstance(err.value, elastic.ConfigError)
        store = CheckpointStore(url, "leased")
        assert store.step_dirs() == []  # not a shard written
        assert b"other-host" in store.storage.read_bytes(LEASE_FILE)  # its lease stands
    finally:
        other.stop()


def test_a_run_whose_lease_another_driver_takes_stops_and_commits_nothing_more(ray_cluster, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url, "taken")
    others = []

    def take_over_after_the_first_commit():
        deadline = time.monotonic() + 120
        while not store.committed_steps() and time.monotonic() < deadline:
            time.sleep(0.1)
        others.append(_live_lease_elsewhere(url, "taken"))
        # Written again until the run has failed: a renewal of the run's between its read and
        # its write puts its own back once (the race lease.py's docstring accepts), and the
        # taker's renewal would then find it lost and stop.
        while not done.wait(0.2):
            others[0]._write()

    done = threading.Event()
    thief = threading.Thread(target=take_over_after_the_first_commit, daemon=True)
    thief.start()
    try:
        with pytest.raises(elastic.TrainingFailed, match="another driver took over this run's storage") as err:
            trainer("taken", url, faults=[{"kind": "slow", "rank": 0, "delay_s": 0.2, "from_step": 1}]).fit(steps=150)
        assert "other-host" in str(err.value)
        done.set()
        thief.join(5)
        committed = store.committed_steps()
        assert committed and max(committed) < 150  # it stopped within the lease's renewal, not at the end
        time.sleep(1.0)
        assert store.committed_steps() == committed  # and nothing of it lands later
        assert others and others[0].renew()  # the taker's lease was left as it is (no release deleted it)
    finally:
        done.set()
        for other in others:
            other.stop()


def test_a_lease_left_by_a_run_on_this_cluster_is_taken_over_at_once(ray_cluster, tmp_path):
    from elastic.checkpoint.lease import LEASE_FILE, RunLease

    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url, "left")
    # As a controller of this cluster killed mid-run leaves it (its driver was killed).
    RunLease(store.storage, {"run": "left", "cluster": ray.get_runtime_context().get_session_name(),
                             "host": "gone-host", "pid": 1})._write()
    result = trainer("left", url).fit(steps=3)
    # No watch of a lease no live run can hold: taken over as this cluster's at once.
    assert [e["message"] for e in result.events_of("lease")] == [
        next(e["message"] for e in result.events_of("lease") if "ended on this Ray cluster" in e["message"])]
    assert result.checkpoint["latest_step"] == 3
    assert not store.storage.exists(LEASE_FILE)  # released at the run's end


KILLED_DRIVER = """
import sys
import ray
import elastic
from helpers import loss_fn, make_adam, make_dataset, make_model
ray.init(address=sys.argv[1], log_to_driver=False)
elastic.Trainer(make_model, make_adam, make_dataset, loss_fn, 32, scaling=elastic.ScalingConfig(num_workers=2),
                run=elastic.RunConfig(name=sys.argv[3], storage=sys.argv[2], seed=0),
                faults=[{"kind": "slow", "rank": 0, "delay_s": 0.5, "from_step": 1}]).fit(steps=12)
"""


def _torn_steps(run_dir: str, low: int) -> list[int]:
    """The steps from ``low`` on whose directory holds a file and no manifest (os.scandir: a few
    microseconds a look, to catch the moment between a step's shards and its manifest)."""
    torn = []
    with os.scandir(run_dir) as entries:
        for e in entries:
            step = parse_step_dir(e.name)
            if step is not None and step >= low:
                files = os.listdir(e.path)
                if files and MANIFEST not in files:
                    torn.append(step)
    return torn


def test_a_controller_and_driver_killed_between_shards_and_manifest_resume_from_the_last_whole_step(
        ray_cluster, tmp_path, uninterrupted):
    """The controller's process is SIGKILLed while a step's shards are on storage and its
    manifest is not, and the driver with it (an OOM kill, a lost laptop): the ranks die with
    them (Ray ends the actors a dead owner started) wherever they were, and the lease stays
    behind. fit() again from another driver of this cluster takes the lease over at once, never
    reads the torn step, resumes from the newest whole one and ends on the weights of an
    uninterrupted run."""
    url, run_dir = f"file://{tmp_path}/ckpt", str(tmp_path / "ckpt" / "killed")
    store = CheckpointStore(url, "killed")
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, ray_cluster.address, url, "killed"])
    torn = []
    try:
        deadline = time.monotonic() + 180
        controller_pid = None
        while controller_pid is None and time.monotonic() < deadline and driver.poll() is None:
            try:
                controller = ray.get_actor("controller", namespace="elastic-killed")
                # In the status group: the default one is busy with the run until its end.
                controller_pid = ray.get(controller.__ray_call__.options(concurrency_group="status").remote(
                    lambda self: os.getpid()), timeout=30)
            except ValueError:  # not started yet
                time.sleep(0.1)
        while time.monotonic() < deadline and driver.poll() is None:
            torn = os.path.isdir(run_dir) and _torn_steps(run_dir, 3)
            if torn:
                break
        assert torn and driver.poll() is None, "no step was caught between its shards and its manifest"
        os.kill(controller_pid, signal.SIGKILL)
        driver.kill()
        assert driver.wait(timeout=30) == -signal.SIGKILL
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 60  # Ray ends the dead driver's actors, the ranks with the controller
    while time.monotonic() < deadline:
        try:
            ray.get_actor("controller", namespace="elastic-killed")
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the killed controller's name is still taken after 60 s")
    newest = store.latest_valid()
    # What the kill left: the torn step, and no manifest for it or anything after it.
    assert newest is not None and newest < torn[0] < 12
    assert max(store.step_dirs()) > newest
    resumed = trainer("killed", url).fit(steps=12)
    assert resumed.metrics["restored_from"] == newest
    assert [e for e in resumed.events_of("lease") if "ended on this Ray cluster" in e["message"]]
    assert resumed.checkpoint["latest_step"] == 12
    assert_weights_close(resumed.model_state, uninterrupted, atol=1e-5)
    for step in store.committed_steps():  # the torn step and those after it, written again whole
        assert store.read_state(step)[0]["completed_step"] == step


def test_memory_storage_is_shared_by_the_run_and_stays_with_the_driver(ray_cluster, uninterrupted):
    """memory:// is this process's memory: the ranks and the controller (other processes) work
    on a shared copy while the run trains, and it comes back here when fit() returns."""
    from elastic.checkpoint.lease import LEASE_FILE, RunLease

    url = f"memory://elastic-e2e-{uuid.uuid4().hex}"
    try:
        # A lease a killed run of another Ray session left in this driver's memory: no other
        # driver reaches memory://, so the run takes none and waits for none.
        RunLease(CheckpointStore(url, "mem").storage, {"cluster": "session_before", "host": "here"})._write()
        first = trainer("mem", url, blocking=True).fit(steps=12)
        assert not first.events_of("lease")
        assert [e["details"]["step"] for e in first.events_of("checkpoint_commit")] == list(range(1, 13))
        store = CheckpointStore(url, "mem")  # this process's memory: retention applied, files verified
        assert store.committed_steps() == [10, 11, 12]
        state, _ = store.read_state(12)
        assert_weights_close(state["model"], first.model_state, atol=0)
        hosts = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == memory.NAMESPACE]
        assert hosts == []  # the run's shared copy ended with the run
        again = trainer("mem", url).fit(steps=12)
        assert again.metrics["restored_from"] == 12
        assert_weights_close(again.model_state, uninterrupted, atol=1e-5)
    finally:
        clear_memory(url)


@ray.remote(num_cpus=0)
class _TrainerInAnActor:
    """A Trainer run from inside a Ray actor, as a Tune trial runs one."""

    def fit_twice(self, url: str) -> tuple[list[int], int | None]:
        trainer("mem-in-actor", url, blocking=True).fit(steps=6)
        steps = CheckpointStore(url, "mem-in-actor").committed_steps()  # this process's memory
        again = trainer("mem-in-actor", url).fit(steps=6)
        return steps, again.metrics["restored_from"]


def test_memory_storage_of_a_trainer_inside_an_actor_is_that_actors_memory(ray_cluster):
    url = f"memory://elastic-e2e-{uuid.uuid4().hex}"
    actor = _TrainerInAnActor.remote()
    try:
        steps, restored = ray.get(actor.fit_twice.remote(url), timeout=300)
    finally:
        ray.kill(actor)
    assert steps == [4, 5, 6] and restored == 6


def test_corrupt_newest_step_is_skipped(ray_cluster, tmp_path, uninterrupted):
    url = f"file://{tmp_path}/ckpt"
    trainer("corrupt", url, blocking=True).fit(steps=6)
    shard = sorted(glob.glob(f"{tmp_path}/ckpt/corrupt/step-000000006/shard-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\x00garbage\x00")
    # Step 5 as a newer elastic writes it: this one cannot read it, and the resume must not go
    # below it once step 6 turns out corrupt (it went to step 4 and trained over step 5).
    from test_manifest_checks import rewrite_manifest, setting

    store = CheckpointStore(url, "corrupt")
    rewrite_manifest(store, 5, setting("version", VERSION + 1))
    with pytest.raises(elastic.TrainingFailed, match="step 5 .* was written by a newer elastic .*; the readable "
                                                     "committed steps newer than it did not check out"):
        trainer("corrupt", url, workers=1).fit(steps=12)
    assert store.step_dirs()[-3:] == [4, 5, 6]
    rewrite_manifest(store, 5, setting("version", VERSION))
    # Resumed by one worker: two ranks wrote the checkpoint, and the state does not depend on that.
    resumed = trainer("corrupt", url, workers=1).fit(steps=12)
    assert resumed.metrics["restored_from"] == 5 and resumed.metrics["world_size"] == 1
    skipped = [e for e in resumed.events_of("checkpoint") if e["details"].get("corrupt")]
    assert [e["details"]["step"] for e in skipped] == [6]
    assert os.path.basename(shard) in skipped[0]["message"]
    assert_weights_close(resumed.model_state, uninterrupted, atol=1e-5)


def test_a_checkpoint_of_another_model_stops_the_run_with_a_config_error_and_is_kept(ray_cluster, tmp_path):
    """Same run name, a wider model: one ConfigError naming the differences and the field to
    change, before any rank loads anything; the committed step stays on storage."""
    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url, "changed")
    model = make_model()
    state = {"model": model.state_dict(), "optimizer": make_adam(model.parameters()).state_dict(),
             "scheduler": None, "completed_step": 3}
    store.commit(3, store.write_rank_files(3, 0, 1, state), 1, {"data_position": {"epoch": 0, "cursor": 96}})
    before = sorted(glob.glob(f"{tmp_path}/ckpt/changed/**", recursive=True))

    def wider():
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

    run = elastic.Trainer(wider, make_adam, make_dataset, loss_fn, 32,
                          scaling=elastic.ScalingConfig(num_workers=1, num_backups=0),
                          run=elastic.RunConfig(name="changed", storage=url, seed=0))
    with pytest.raises(elastic.ConfigError) as info:
        run.fit(steps=5)
    message = str(info.value)
    assert f"checkpoint at step 3 in {url}/changed does not fit" in message
    assert "model: 0.weight is [32, 16] in the checkpoint and [64, 16] in the model" in message
    assert "change RunConfig.name" in message and "Traceback" not in message
    assert sorted(glob.glob(f"{tmp_path}/ckpt/changed/**", recursive=True)) == before
    assert store.latest_valid() == 3
    # The model it was trained with picks it up; at 3 steps asked for there is nothing to train.
    same = elastic.Trainer(make_model, make_adam, make_dataset, loss_fn, 32,
                           scaling=elastic.ScalingConfig(num_workers=1, num_backups=0),
                           run=elastic.RunConfig(name="changed", storage=url, seed=0)).fit(steps=3)
    assert same.metrics["restored_from"] == 3 and same.history == []
    assert "already at step 3, at or past the 3 asked for" in same.events_of("resume")[-1]["message"]
    assert_weights_close(same.model_state, state["model"], atol=0)


def test_a_state_that_turns_unsaveable_mid_run_ends_the_run_at_that_step(ray_cluster, tmp_path):
    """An optimizer that puts a set in its param group at its third step: no checkpoint can store
    step 3. The run ends there with UnsaveableState (a ConfigError) naming the value and the
    step, after committing step 2, which the background writers may still have held. It trained
    on with a checkpoint_failed event every step, no step committed after 2, and fit() succeeded."""

    class TaggingAdam(torch.optim.Adam):
        def step(self, closure=None):
            loss = super().step(closure)
            if int(next(iter(self.state.values()))["step"]) >= 3:
                self.param_groups[0]["tags"] = {"warm"}
            return loss

    url = f"file://{tmp_path}/ckpt"
    with pytest.raises(UnsaveableState) as info:
        trainer("tags", url, optimizer_fn=lambda params: TaggingAdam(params, lr=1e-2)).fit(steps=8)
    assert isinstance(info.value, elastic.ConfigError) and info.value.step == 3
    assert str(info.value).startswith("the training state cannot be checkpointed: checkpoint state at "
                                      "optimizer/param_groups/0/tags has a set; only tensors")
    assert "found in step 3's snapshot" in str(info.value)
    assert CheckpointStore(url, "tags").latest_valid() == 2


def test_an_error_in_the_users_step_commits_the_steps_before_it(ray_cluster, tmp_path):
    # A loss_fn that raises in its third step, on every rank: the run ends with that WorkerError,
    # and step 2, which the background writers may still have held, is committed first (the
    # newest committed step depended on how far they had got).
    calls = []

    def failing_loss(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("a batch this loss cannot take")
        return loss_fn(model, batch)

    url = f"file://{tmp_path}/ckpt"
    with pytest.raises(elastic.WorkerError, match="a batch this loss cannot take"):
        trainer("user-error", url, loss=failing_loss).fit(steps=8)
    assert CheckpointStore(url, "user-error").latest_valid() == 2


def test_fp16_trains_as_torchs_amp_recipe_and_its_loss_scale_resumes_with_it(ray_cluster, tmp_path):
    """Trainer(mixed_precision="fp16") on two DDP ranks: the forward under autocast, the loss
    scaled, the averaged gradient unscaled before the step. The scaler's state is in every
    checkpoint, and a resumed run goes on with it: its growth count reaches 8, not 8 - 4."""
    url = f"file://{tmp_path}/ckpt"

    fp16 = lambda: trainer("fp16", url, optimizer_fn=make_sgd, mixed_precision="fp16", blocking=True)

    fp16().fit(steps=4)
    store = CheckpointStore(url, "fp16")
    saved = store.read_state(4)[0]
    assert saved["scaler"] == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 2000, "_growth_tracker": 4}
    # With every checkpoint: the names of the optimizer's parameters, for the resume's check
    assert saved["optimizer_param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    again = fp16().fit(steps=8)
    assert again.metrics["restored_from"] == 4
    assert store.read_state(8)[0]["scaler"]["_growth_tracker"] == 8
    # Each rank's fp16 forward rounds on its own half of the batch: the reference averages the
    # two halves' gradients as DDP does (over the whole batch at once it differs by ~2e-5).
    assert_weights_close(again.model_state, reference_weights(8, 32, fp16=True, shards=2), atol=1e-6)


def test_a_growing_batch_schedule_trains_each_step_at_its_size_and_resumes_across_a_change(ray_cluster, tmp_path):
    """Trainer.batch_schedule={3: 32, 5: 64} over global_batch_size=16: the run stops after step
    3 and a second fit() goes on from the checkpoint, each step at its scheduled size; the
    weights equal one process trained on the same global batches."""
    url = f"file://{tmp_path}/ckpt"

    growing = lambda: trainer("growing", url, global_batch_size=16, batch_schedule={3: 32, 5: 64})

    first = growing().fit(steps=3)
    again = growing().fit(steps=6)
    assert again.metrics["restored_from"] == 3
    batches = [[i for e in sorted((e for e in result.ledger if e["step"] == step), key=lambda e: e["rank"])
                for i in e["indices"]] for result, steps in ((first, (1, 2, 3)), (again, (4, 5, 6))) for step in steps]
    assert [len(b) for b in batches] == [16, 16, 32, 32, 64, 64]
    assert len({i for b in batches for i in b}) == sum(map(len, batches))  # one epoch: no sample twice
    assert_weights_close(again.model_state, reference_weights(6, 16, optimizer_fn=make_adam, batches=batches),
                         atol=1e-5)


def test_elastic_stop_stops_cleanly_and_fit_again_continues_exactly(ray_cluster, tmp_path):
    """`elastic stop RUN` from another process mid-run: the run finishes the steps already
    dispatched, commits the last one's checkpoint and fit() raises TrainingStopped; a second
    fit() continues right after that step and ends with the weights of an uninterrupted run.
    (SIGTERM, what `ray job stop` sends, is the same stop: tests/test_jobs_e2e.py.)"""
    url = f"file://{tmp_path}/ckpt"
    slow = [{"kind": "slow", "rank": 0, "delay_s": 0.05, "from_step": 1}]  # the run outlasts the request
    cli: dict = {}

    def elastic_stop_after_step_4():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                controller = ray.get_actor("controller", namespace="elastic-stopme")
                if ray.get(controller.status.remote(), timeout=5)["step"] >= 4:
                    break
            except Exception:  # noqa: BLE001 - not started yet
                pass
            time.sleep(0.1)
        cli["out"] = subprocess.run([sys.executable, "-m", "elastic.cli", "stop", "stopme", "--address",
                                     ray_cluster.address], capture_output=True, text=True, timeout=120)

    helper = threading.Thread(target=elastic_stop_after_step_4, daemon=True)
    helper.start()
    # 2000 steps (100 s or more): the stop ends the run long before. With 200 (about 10 s), a CLI
    # that starts Python, imports ray and connects on a loaded machine could come after the end.
    with pytest.raises(elastic.TrainingStopped) as info:
        trainer("stopme", url, faults=slow).fit(steps=2000)
    helper.join(60)
    stopped = info.value.result
    last = stopped.metrics["steps"]
    assert isinstance(info.value, KeyboardInterrupt) and 4 <= last < 2000
    assert f"elastic stop: run 'stopme' stopped after step {last}; latest committed checkpoint: step {last}" \
        in str(info.value)
    assert cli["out"].returncode == 0, cli["out"].stderr
    assert f"run stopme stopped after step {last}; latest committed checkpoint: step {last}" in cli["out"].stdout
    assert stopped.events_of("stop") and stopped.events_of("transition")[-1]["details"]["new"] == "stopped"
    assert CheckpointStore(url, "stopme").latest_valid() == last  # the stop point itself is committed
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor("controller", namespace="elastic-stopme")

    resumed = trainer("stopme", url, workers=1).fit(steps=last + 3)
    assert resumed.metrics["restored_from"] == last
    assert_weights_close(resumed.model_state, reference_weights(last + 3, 32, seed=0, optimizer_fn=make_adam),
                         atol=1e-5)


def test_restart_from_checkpoint_when_no_spare(ray_cluster, uninterrupted):
    # memory://, the backend where this is hardest: the restarted ranks are new processes, and
    # they read the step from the run's shared copy. (The restart reads through the same
    # CheckpointStore as any resume; file:// and s3:// resumes are tested above and below.)
    url = f"memory://elastic-e2e-{uuid.uuid4().hex}"
    failure = elastic.FailureConfig(when_no_spare="restart")
    try:
        result = trainer("restart", url, failure=failure, blocking=True,
                         faults=[{"kind": "kill", "rank": 1, "at_step": 7}]).fit(steps=12)
    finally:
        clear_memory(url)
    assert "RestartFromCheckpoint" in [e["details"]["decision"] for e in result.events if e["kind"] == "decision"]
    assert result.events_of("restart") and result.events_of("resume")
    steps = [h["step"] for h in result.history]
    assert steps == list(range(1, 13))
    assert_weights_close(result.model_state, uninterrupted, atol=1e-5)


def test_a_resumed_a_healed_and_a_restarted_run_draw_the_random_numbers_of_an_uninterrupted_one(ray_cluster, tmp_path):
    # Every e2e model drew nothing at random, so nothing showed that a step is seeded from (seed,
    # rank, step): a resume in new processes, a spare taking over a rank and replaying its step,
    # and a restart from a checkpoint would all have passed with any RNG. With dropout, each of
    # them must end on the weights of the same run uninterrupted, to float precision.
    def dropout_trainer(name, storage=None, backups=0, failure=None, faults=None, **ckpt):
        return elastic.Trainer(
            make_dropout_model, make_adam, make_dataset, loss_fn, 32,
            scaling=elastic.ScalingConfig(num_workers=2, num_backups=backups),
            run=elastic.RunConfig(name=name, storage=storage, seed=0, checkpoint=elastic.CheckpointConfig(**ckpt)),
            failure=failure, faults=faults)

    uninterrupted = dropout_trainer("rng-clean").fit(steps=12).model_state
    # The masks matter: the run's weights are not those of the same layers (the same initial
    # weights) trained on the same batches without dropout.
    without_dropout = reference_weights(12, 32, seed=0, optimizer_fn=make_adam)
    assert not torch.allclose(uninterrupted["0.weight"], without_dropout["0.weight"], atol=1e-3)
    url = f"file://{tmp_path}/ckpt"
    assert dropout_trainer("rng-resume", url, blocking=True).fit(steps=5).checkpoint["latest_step"] == 5
    resumed = dropout_trainer("rng-resume", url).fit(steps=12)
    assert resumed.metrics["restored_from"] == 5
    healed = dropout_trainer("rng-heal", backups=1, faults=[{"kind": "kill", "rank": 1, "at_step": 4}]).fit(steps=12)
    assert [e["details"]["rank"] for e in healed.events_of("replace")] == [1]
    assert healed.metrics["recomputed_steps"] >= 1  # the spare computed rank 1's step 4 again
    restarted = dropout_trainer("rng-restart", f"file://{tmp_path}/restart", blocking=True,
                                failure=elastic.FailureConfig(when_no_spare="restart"),
                                faults=[{"kind": "kill", "rank": 1, "at_step": 7}]).fit(steps=12)
    assert restarted.events_of("restart")
    for result in (resumed, healed, restarted):
        assert_weights_close(result.model_state, uninterrupted, atol=1e-6)


def test_s3_outage_mid_run(ray_cluster):
    s3 = MotoS3().start()
    try:
        bucket = s3.create_bucket()
        url = f"s3://{bucket}/runs"
        t = trainer("outage", url, storage_options=s3.storage_options(), workers=2,
                    faults=[{"kind": "slow", "rank": 0, "delay_s": 0.2, "from_step": 1}])
        seen = {}

        # Stop the endpoint once training is under way and a step is committed, for OUTAGE_S and at
        # least until training has gone OUTAGE_STEPS steps past the stop, then bring it back. Rank 0
        # is slowed so a step takes ~0.2 s: the run goes on ~9 s after the endpoint returns, long
        # enough for the writers' next try (at most ELASTIC_CKPT_RETRY_MAX_S, 5 s, apart) to find it.
        # Why the steps as well as the time: on a loaded machine (the full suite on 2 cores) a step
        # can take longer than 1.5 s, and an outage that training does not outpace by two steps
        # supersedes no snapshot: the writers retry the one step they hold and commit it after the
        # outage. Why a commit first: the skipped steps show as a gap between a commit before the
        # outage and one after it. Under load the idle-class writers had committed nothing by step
        # 5 (CI, reproduced here beside another e2e module: the first commit was step 22, after the
        # outage, then every step), and the gap had no commit before it to show against.
        def status():
            return ray.get(ray.get_actor("controller", namespace="elastic-outage").status.remote())

        def outage():
            deadline = time.time() + 300  # placing and starting the ranks is slow on a loaded machine
            st = {"step": 0, "checkpoint": {"latest": None}}  # no answer yet: the asserts below say so
            while time.time() < deadline:
                try:
                    st = status()
                    if st["step"] >= 5 and st["checkpoint"]["latest"] is not None:
                        break
                except Exception:
                    pass
                time.sleep(0.1)
            s3.stop()
            seen["stopped_at"], seen["committed_before"] = st["step"], st["checkpoint"]["latest"]
            time.sleep(OUTAGE_S)
            deadline = time.time() + 60
            while (st := status())["step"] < seen["stopped_at"] + OUTAGE_STEPS and time.time() < deadline:
                time.sleep(0.1)
            seen["lag_in_outage"] = st["checkpoint"]["lag"]
            s3.start()
            seen["restarted_at"] = status()["step"]
        th = threading.Thread(target=outage)
        th.start()
        result = t.fit(steps=STEPS_OUTAGE)
        th.join(timeout=120)
        assert not th.is_alive()
        assert result.metrics["steps"] == STEPS_OUTAGE
        assert seen["stopped_at"] >= 5 and seen["committed_before"] is not None, \
            "the outage must begin once training is under way and a step is committed"
        assert seen["restarted_at"] < STEPS_OUTAGE, "training must go on through the outage"
        assert result.events_of("storage_outage"), "the outage must be visible in the event log"
        commits = [e for e in result.events if e["kind"] == "checkpoint_commit"]
        assert commits[-1]["details"]["step"] == STEPS_OUTAGE
        # Checkpoints caught up while the run went on, not only in the end's flush (which
        # commits the last step alone): steps after the endpoint's return committed before it.
        caught_up = [e["details"]["step"] for e in commits
                     if seen["restarted_at"] < e["details"]["step"] < STEPS_OUTAGE]
        assert caught_up, f"nothing committed between the endpoint's return at step {seen['restarted_at']} and the end"
        # Commits fell behind during the outage (the status lag grew), and resumed with the newest
        # snapshot, skipping the steps the outage superseded.
        assert seen["lag_in_outage"] >= 2
        steps = [e["details"]["step"] for e in commits]
        storage_events = [e for e in result.events if e["kind"].startswith("storage")]
        assert max(b - a for a, b in zip(steps, steps[1:])) >= 2, (
            f"no step superseded: {seen=}, commits {steps}, storage events "
            f"{[{k: e['details'].get(k) for k in ('event', 'what', 'step', 'time')} for e in storage_events]}, "
            f"commits' details {[{k: e['details'].get(k) for k in ('step', 'lag', 'persist_s', 'time')} for e in commits]}")
        store = CheckpointStore(url, "outage", s3.storage_options())
        assert store.latest_valid() == STEPS_OUTAGE
        # The outage changed nothing in training: the same weights as one process on the same batches.
        assert_weights_close(result.model_state, reference_weights(STEPS_OUTAGE, 32, seed=0, optimizer_fn=make_adam),
                             atol=1e-5)
        for e in result.events:
            assert TEST_SECRET not in str(e)
    finally:
        s3.stop()


def test_a_resume_waits_for_storage_that_does_not_answer(ray_cluster, uninterrupted):
    """fit() again while the S3 endpoint is down: the resume waits (logged, and in status())
    instead of failing or starting fresh, and continues from the committed step once it is back."""
    s3 = MotoS3().start()
    try:
        bucket = s3.create_bucket()
        url, options = f"s3://{bucket}/runs", s3.storage_options()
        trainer("wait", url, storage_options=options, blocking=True).fit(steps=6)
        again = trainer("wait", url, storage_options=options)  # validated while the endpoint answers
        s3.stop()
        seen, over = {}, threading.Event()

        def bring_storage_back_once_the_resume_waits():
            deadline = time.time() + 120
            while time.time() < deadline and "state" not in seen and not over.is_set():
                try:
                    st = ray.get(ray.get_actor("controller", namespace="elastic-wait").status.remote(), timeout=5)
                    if st["checkpoint"]["storage_outage"]:
                        seen["state"] = st["state"]
                except Exception:  # noqa: BLE001 - the controller is not up yet
                    pass
                time.sleep(0.1)
            # Not once the test is over: a fit() that failed at once left this thread to start
            # the server again after the test's stop, in whatever test ran next.
            if not over.wait(1):
                s3.start()

        th = threading.Thread(target=bring_storage_back_once_the_resume_waits)
        th.start()
        try:
            result = again.fit(steps=12)
        finally:
            over.set()
            th.join()
        # Before any rank starts: the run's storage lease is taken first, and waits as the resume would.
        assert seen["state"] == "scheduling"
        assert result.metrics["restored_from"] == 6
        waits = [e for e in result.events if e["kind"] in ("storage_outage", "storage_recovered")]
        assert [e["kind"] for e in waits] == ["storage_outage", "storage_recovered"]
        assert all(e["details"]["what"] == "lease" for e in waits)  # the resume's own: test_lease.py
        assert_weights_close(result.model_state, uninterrupted, atol=1e-5)
        for e in result.events:
            assert TEST_SECRET not in str(e)
    finally:
        s3.stop()


@pytest.mark.parametrize("writers", ["agents", "ranks"])
def test_storage_the_nodes_cannot_write_ends_the_run_before_any_step(ray_cluster, monkeypatch, writers):
    """The S3 credentials are in the driver's environment only (AWS_* variables set after the
    cluster started, whose processes never see them). The driver's check passed with them; the
    node's writers (its checkpoint agent, or ranks writing in their own processes with
    blocking=True) had none, and before, the run trained on with every write failing in the
    background. Now it ends at the start with a ConfigError that says where and what to do."""
    with s3_with_credentials_in_this_process_only(monkeypatch) as (s3, bucket, options):
        t = trainer(f"nocreds-{writers}", f"s3://{bucket}/runs", storage_options=options,
                    blocking=writers == "ranks")
        with pytest.raises(elastic.ConfigError) as err:
            t.fit(steps=3)
        text = str(err.value)
        # The controller is a Ray actor too, and the first to miss them (it reads storage to resume).
        assert "no AWS credentials found" in text and "controller (on node" in text and "storage_options" in text
        assert TEST_SECRET not in text
        assert CheckpointStore(f"s3://{bucket}/runs", f"nocreds-{writers}", s3.storage_options()).step_dirs() == []


def test_every_rank_lost_spares_load_the_checkpoint(ray_cluster, tmp_path, uninterrupted):
    faults = [{"kind": "kill", "rank": 0, "at_step": 6}, {"kind": "kill", "rank": 1, "at_step": 6}]
    result = trainer("allgone", f"file://{tmp_path}/ckpt", backups=2, blocking=True, faults=faults).fit(steps=12)
    assert any("no peer held the state" in e["message"] for e in result.events_of("state_sync"))
    assert [h["step"] for h in result.history] == list(range(1, 13))
    assert_weights_close(result.model_state, uninterrupted, atol=1e-5)
