"""Config validation: every rejection happens before any actor starts and names the field."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

import elastic
from elastic.actors.worker import choose_device_and_backend
from elastic.config import CheckpointConfig, ConfigError, FailureConfig, RunConfig, ScalingConfig
from helpers import loss_fn, make_dataset, make_model, make_sgd


@pytest.mark.parametrize("kwargs, field", [
    ({"num_workers": 0}, "num_workers"),
    ({"num_workers": 2, "num_backups": -1}, "num_backups"),
    ({"placement_strategy": "DIAGONAL"}, "placement_strategy"),
    ({"aggregation": "first_n", "num_backups": 0}, "needs backups"),
    ({"aggregation": "best_of"}, "aggregation"),
    ({"num_workers": 16, "num_backups": 8, "aggregation": "first_n"}, "lower num_backups"),
    ({"num_workers": 60, "num_backups": 1, "aggregation": "first_n"}, "at most 48 replicas"),
    ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker"),
    ({"use_gpu": True, "resources_per_worker": {"GPU": 0}}, "GPU"),
    ({"use_gpu": True, "num_workers": 2, "resources_per_worker": {"GPU": 0.5}}, r"resources_per_worker\['GPU'\]=0.5"),
    ({"use_gpu": True, "num_workers": 1, "num_backups": 1, "aggregation": "first_n",
      "resources_per_worker": {"GPU": 0.5}}, "two ranks on one device"),
    ({"steps_per_dispatch": -1}, "steps_per_dispatch"),
    ({"steps_per_dispatch": 10**9}, r"steps_per_dispatch must be <= 1024"),  # planned every step up front
    ({"dispatch_target_s": 0}, "dispatch_target_s"),
    # bools are ints to Python, so each count refuses True by name
    ({"num_workers": True}, r"ScalingConfig\.num_workers must be an integer >= 1, got True \(bool\)"),
    ({"num_backups": True}, r"ScalingConfig\.num_backups must be an integer"),
    ({"num_workers": 2, "num_backups": 1, "aggregation": "first_n", "num_spares": True}, r"ScalingConfig\.num_spares"),
    ({"steps_per_dispatch": True}, r"ScalingConfig\.steps_per_dispatch must be an integer >= 0"),
    ({"bucket_cap_mb": True}, r"ScalingConfig\.bucket_cap_mb"),
    ({"bucket_cap_mb": float("inf")}, r"ScalingConfig\.bucket_cap_mb"),
    # types come before arithmetic: a float count never reaches math.comb's TypeError
    ({"num_workers": 2.0, "num_backups": 1, "aggregation": "first_n"}, r"ScalingConfig\.num_workers"),
    ({"use_gpu": "False"}, r"ScalingConfig\.use_gpu must be True or False, got 'False' \(str\)"),
    ({"placement_timeout_s": float("nan")},
     r"ScalingConfig\.placement_timeout_s must be a finite number of seconds > 0"),
    ({"placement_timeout_s": float("inf")}, r"ScalingConfig\.placement_timeout_s"),
    ({"placement_timeout_s": "60"}, r"ScalingConfig\.placement_timeout_s"),
    ({"dispatch_target_s": float("nan")}, r"ScalingConfig\.dispatch_target_s must be a finite number of seconds"),
    ({"dispatch_target_s": True}, r"ScalingConfig\.dispatch_target_s"),
    ({"resources_per_worker": None}, r"ScalingConfig\.resources_per_worker must be a mapping"),
    ({"resources_per_worker": [("CPU", 1)]}, r"ScalingConfig\.resources_per_worker must be a mapping"),
    ({"resources_per_worker": {1: 1}}, r"ScalingConfig\.resources_per_worker keys must be Ray resource names"),
    ({"resources_per_worker": {"CPU": float("nan")}}, r"resources_per_worker\['CPU'\] must be a finite number >= 0"),
    ({"resources_per_worker": {"CPU": float("inf")}}, r"resources_per_worker\['CPU'\] must be a finite number"),
    ({"resources_per_worker": {"CPU": 1e300}}, r"resources_per_worker\['CPU'\]=1e\+300 is more than Ray can count"),
    ({"resources_per_worker": {"CPU": True}}, r"resources_per_worker\['CPU'\]"),
    ({"resources_per_worker": {"CPU": 1, "object_store_memory": 2**20}}, r"resources_per_worker\[.object_store_memory.\] is not supported"),
    ({"resources_per_worker": {"CPU": "1"}}, r"resources_per_worker\['CPU'\]"),
    ({"resources_per_worker": {"CPU": 0.00001}}, r"resources_per_worker\['CPU'\]=1e-05 is finer than Ray's resource precision"),
    ({"resources_per_worker": {"gpu": 1}}, r"resources_per_worker\['gpu'\]: Ray's resource names are case-sensitive; "
                                           r"write 'GPU'"),
    ({"resources_per_worker": {"Cpu": 2}}, r"write 'CPU'"),
    ({"use_gpu": True, "num_workers": 1, "num_backups": 1, "aggregation": "first_n", "resources_per_worker": {"GPU": 0.5}},
     r"or use aggregation='all' with num_workers=1 and no backups"),
    # data parallel's hot spares are num_backups: num_spares there would be read by nothing
    ({"num_workers": 2, "num_spares": 1},
     r"ScalingConfig\.num_spares is for aggregation='first_n'; with aggregation='all' the hot spares are num_backups"),
    ({"resources_per_worker": {"GPU": 1}}, r"resources_per_worker asks for GPU but use_gpu=False; set use_gpu=True"),
])
def test_scaling_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ScalingConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"straggler_factor": 1.0}, "straggler_factor"),
    ({"straggler_factor": 0.5}, "straggler_factor"),
    ({"straggler_factor": float("nan")}, "straggler_factor"),
    ({"straggler_factor": "3"}, "straggler_factor"),
    ({"straggler_factor": None}, "straggler_factor"),
    ({"max_failures": -1}, "max_failures"),
    ({"on_failure": "pray"}, "on_failure"),
    ({"on_failure": "shrink"}, "allow_shrink"),
    # when_no_spare is read only when on_failure="replace" runs out of spares: "wait, then shrink"
    # failed the run once the wait ran out
    ({"on_failure": "wait", "when_no_spare": "shrink", "allow_shrink": True, "min_workers": 2},
     r"when_no_spare='shrink' is read only with on_failure='replace'.*on_failure='wait' it would be ignored"),
    ({"on_failure": "shrink", "when_no_spare": "restart", "allow_shrink": True}, r"when_no_spare='restart'"),
    ({"when_no_spare": "replace"}, r"FailureConfig\.when_no_spare cannot be 'replace' \(there is no spare\)"),
    ({"min_workers": 0}, "min_workers"),
    ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s"),
    ({"straggler_node_avoid_s": -1}, "straggler_node_avoid_s"),
    ({"straggler_node_avoid_s": float("nan")}, "straggler_node_avoid_s"),
    ({"straggler_node_avoid_s": "1h"}, "straggler_node_avoid_s"),
    ({"straggler_node_avoid_s": 10**400}, r"straggler_node_avoid_s must be seconds >= 0 .*math.inf"),
    ({"collective_timeout_s": 0.0005}, r"collective_timeout_s must be at least 0.001 s \(torch counts"),
    ({"step_timeout_s": 1e-6}, r"step_timeout_s must be at least 0.001 s"),
    ({"straggler_factor": float("inf")}, r"straggler_factor must be finite.*set evict_stragglers=False instead"),
    ({"max_failures": True}, r"FailureConfig\.max_failures must be an integer >= 0, got True"),
    ({"min_workers": True}, r"FailureConfig\.min_workers must be an integer >= 1 or None"),
    ({"straggler_window": True}, r"FailureConfig\.straggler_window must be an integer >= 1"),
    ({"straggler_warmup_steps": False}, r"FailureConfig\.straggler_warmup_steps must be an integer >= 0"),
    ({"checksum_every_n_steps": True}, r"FailureConfig\.checksum_every_n_steps must be an integer >= 0"),
    ({"allow_shrink": "yes"}, r"FailureConfig\.allow_shrink must be True or False"),
    ({"evict_stragglers": "False"}, r"FailureConfig\.evict_stragglers must be True or False, got 'False'"),
    ({"evict_stragglers": 0}, r"FailureConfig\.evict_stragglers must be True or False"),
    ({"capacity_timeout_s": float("nan")}, r"FailureConfig\.capacity_timeout_s must be a finite number of seconds > 0"),
    ({"heartbeat_interval_s": float("inf")}, r"FailureConfig\.heartbeat_interval_s must be a finite number"),
    ({"heartbeat_timeout_s": "10"}, r"FailureConfig\.heartbeat_timeout_s must be a finite number"),
    ({"collective_timeout_s": 1e300}, r"FailureConfig\.collective_timeout_s .*<= 1e\+09"),
    ({"step_timeout_s": True}, r"FailureConfig\.step_timeout_s must be a finite number"),
    ({"node_settle_s": None}, r"FailureConfig\.node_settle_s must be a finite number"),
])
def test_failure_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        FailureConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"every_n_steps": -1}, "every_n_steps"),
    ({"keep_last": 0}, "keep_last"),
    ({"keep_every": -2}, "keep_every"),
    ({"min_shard_bytes": -1}, "min_shard_bytes"),
    ({"min_shard_bytes": 1.5}, "min_shard_bytes"),
    ({"min_shard_bytes": True}, "min_shard_bytes"),
    ({"resume_timeout_s": 0}, "resume_timeout_s"),
    ({"resume_timeout_s": "5"}, "resume_timeout_s"),
    ({"resume_timeout_s": float("nan")}, r"CheckpointConfig\.resume_timeout_s must be a finite number of seconds"),
    ({"resume_timeout_s": float("inf")}, r"CheckpointConfig\.resume_timeout_s"),
    ({"every_n_steps": True}, r"CheckpointConfig\.every_n_steps must be an integer >= 0 \(0 turns checkpoints off\)"),
    ({"keep_last": True}, r"CheckpointConfig\.keep_last must be an integer >= 1"),
    ({"keep_every": True}, r"CheckpointConfig\.keep_every must be an integer >= 0"),
    ({"blocking": "True"}, r"CheckpointConfig\.blocking must be True or False"),
    ({"every_n_steps": 10, "keep_every": 15},
     r"CheckpointConfig\.keep_every=15 is not a multiple of every_n_steps=10.*multiples of 30.*e\.g\. 10 or 20"),
    ({"every_n_steps": 4, "keep_every": 3}, r"CheckpointConfig\.keep_every=3 .*\(e\.g\. 4\)"),
])
def test_checkpoint_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        elastic.CheckpointConfig(**kwargs)


def test_placement_strategy_is_normalised():
    assert ScalingConfig(placement_strategy="spread").placement_strategy == "SPREAD"


def _trainer(**kw):
    args = dict(model_fn=make_model, optimizer_fn=make_sgd, dataset_fn=make_dataset, loss_fn=loss_fn,
                global_batch_size=32, scaling=ScalingConfig(num_workers=4))
    args.update(kw)
    return elastic.Trainer(**args)


def test_batch_not_divisible():
    with pytest.raises(ConfigError, match="global_batch_size=30 is not divisible by ScalingConfig.num_workers=4"):
        _trainer(global_batch_size=30)


def test_min_workers_above_num_workers():
    with pytest.raises(ConfigError, match="min_workers=5"):
        _trainer(failure=FailureConfig(min_workers=5))


def test_bad_fault_plan():
    with pytest.raises(ConfigError, match="faults"):
        _trainer(faults=[{"kind": "slow", "rank": 9, "factor": 3, "from_step": 1}])
    with pytest.raises(ConfigError, match="delay_s"):
        _trainer(faults=[{"kind": "slow", "rank": 0, "delay_s": 0, "from_step": 1}])
    with pytest.raises(ConfigError, match="after_update"):
        _trainer(faults=[{"kind": "kill", "rank": 0, "at_step": 3, "after_update": "yes"}])
    with pytest.raises(ConfigError, match="after_update"):
        _trainer(faults=[{"kind": "hang", "rank": 0, "at_step": 3, "after_update": True}])
    _trainer(faults=[{"kind": "kill", "rank": 0, "at_step": 3, "after_update": True}])  # accepted
    with pytest.raises(ConfigError, match="'mark': a file path"):
        _trainer(faults=[{"kind": "kill", "rank": 0, "at_step": 3, "mark": 5}])
    _trainer(faults=[{"kind": "kill", "rank": 0, "at_step": 3, "mark": "/tmp/killed_at"}])  # accepted


@pytest.mark.parametrize("faults", [
    [{"kind": "kill", "rank": "0", "at_step": 1}],  # was a TypeError from the comparison
    ["kill"],  # was an AttributeError ('str' object has no attribute 'get')
    [{"kind": "kill", "rank": 0, "at_step": "soon"}],  # accepted, then failed inside a worker
    [{"kind": "kill", "rank": True, "at_step": 1}],
    [{"kind": "slow", "rank": 0, "factor": "3", "from_step": 1}],
    [{"kind": "slow", "rank": 0, "factor": float("nan"), "from_step": 1}],
    [{"kind": "slow", "rank": 0, "factor": 3, "from_step": 1.5}],
    [{"kind": "kill_spare", "rank": 0, "recovery": 0}],
    [{"kind": "explode", "rank": 0, "at_step": 1}],
])
def test_fault_entries_of_the_wrong_shape_or_type_are_refused_before_start(faults):
    with pytest.raises(ConfigError, match="Trainer.faults entry") as err:
        _trainer(faults=faults)
    for kind in ("'slow'", "'kill'", "'hang'", "'kill_spare'"):  # the message names every kind it takes
        assert kind in str(err.value)


@pytest.mark.parametrize("faults", [
    {"kind": "kill", "rank": 0, "at_step": 1},  # one dict, not a list of them: its keys were the entries
    5,  # was a TypeError from list()
])
def test_faults_that_are_no_list_are_refused_before_start(faults):
    with pytest.raises(ConfigError, match="Trainer.faults must be a list of fault dicts"):
        _trainer(faults=faults)


@pytest.mark.parametrize("pace", [{"delay_s": 1e10}, {"factor": 1e300}])
def test_a_slowdown_no_sleep_can_take_is_refused_before_start(pace):
    # Accepted, then time.sleep raised OverflowError inside the worker.
    with pytest.raises(ConfigError, match="Trainer.faults entry"):
        _trainer(faults=[{"kind": "slow", "rank": 0, "from_step": 1, **pace}])


def test_a_config_changed_after_it_was_made_is_checked_again_by_the_trainer():
    # Fields are plain attributes: num_workers = 0 set afterwards was a ZeroDivisionError in Trainer(),
    # a negative CPU count or a bad run name failed later, inside the controller.
    scaling = ScalingConfig(num_workers=2)
    scaling.num_workers = 0
    with pytest.raises(ConfigError, match="ScalingConfig.num_workers"):
        _trainer(scaling=scaling)
    scaling = ScalingConfig(num_workers=2)
    scaling.resources_per_worker = {"CPU": -1}
    with pytest.raises(ConfigError, match="resources_per_worker"):
        _trainer(scaling=scaling)
    run = elastic.RunConfig()
    run.name = "a/b"
    with pytest.raises(ConfigError, match="RunConfig.name"):
        _trainer(run=run)
    run = elastic.RunConfig()
    run.checkpoint.keep_last = 0
    with pytest.raises(ConfigError, match="CheckpointConfig.keep_last"):
        _trainer(run=run)
    failure = FailureConfig()
    failure.straggler_factor = 1.0
    with pytest.raises(ConfigError, match="FailureConfig.straggler_factor"):
        _trainer(failure=failure)


def test_fault_entries_of_every_kind_are_accepted():
    faults = [{"kind": "slow", "rank": 0, "factor": 3, "from_step": 10},
              {"kind": "slow", "rank": 0, "delay_s": 0.5, "from_step": 0},
              {"kind": "kill", "rank": 0, "at_step": 3}, {"kind": "hang", "rank": 0, "at_step": 2},
              {"kind": "kill_spare", "rank": 0, "recovery": 1}, {"kind": "kill_spare", "rank": 0}]
    assert _trainer(faults=[dict(f) for f in faults]).faults == faults  # taken as given, none dropped


def test_fit_needs_steps_or_epochs():
    with pytest.raises(ConfigError, match="exactly one"):
        _trainer().fit()


@pytest.mark.parametrize("name", ["bad/name", "run\n", "", "-lead"])
def test_bad_run_name(name):
    # "run\n" passed a pattern ending in "$", which also matches before a final newline.
    with pytest.raises(ConfigError, match="RunConfig.name"):
        elastic.RunConfig(name=name)


def test_no_run_shares_its_namespace_with_the_memory_hosts():
    # A run's actors live in "elastic-" + its name; the memory:// hosts' namespace was
    # "elastic-memory", a run named "memory"'s too.
    from elastic.checkpoint import memory

    assert elastic.RunConfig(name="memory").name == "memory"
    assert not memory.NAMESPACE.startswith("elastic-")


@pytest.mark.parametrize("value", [0, -1, "30", None, float("nan"), float("inf"), True, 1e300])
def test_bad_stop_timeout(value):
    with pytest.raises(ConfigError, match="RunConfig.stop_timeout_s"):
        elastic.RunConfig(stop_timeout_s=value)


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": True}, r"RunConfig\.seed must be an integer in \[-2\*\*63, 2\*\*64\).*got True \(bool\)"),
    ({"seed": 2**64}, r"RunConfig\.seed must be an integer in"),
    ({"seed": -2**63 - 1}, r"RunConfig\.seed must be an integer in"),
    ({"seed": 1.0}, r"RunConfig\.seed"),
    ({"progress": "no"}, r"RunConfig\.progress must be True or False"),
    ({"checkpoint": None},
     r"RunConfig\.checkpoint must be a CheckpointConfig: pass checkpoint=elastic\.CheckpointConfig"),
    ({"checkpoint": {"every_n_steps": -5}}, r"RunConfig\.checkpoint must be a CheckpointConfig.*got a dict"),
    ({"storage_options": "key=abc"}, r"RunConfig\.storage_options must be a mapping"),
    ({"storage_options": {("key",): "abc"}}, r"RunConfig\.storage_options keys must be option names \(str\).*tuple"),
])
def test_run_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        elastic.RunConfig(**kwargs)


@pytest.mark.parametrize("options", [
    "s3://AKIAEXAMPLESECRET:hunter2hunter2@bucket",
    [("secret", "hunter2hunter2"), ("key", "AKIAEXAMPLESECRET")],
    {"key": "AKIAEXAMPLESECRET", 7: "hunter2hunter2"},
    {"client_kwargs": {"aws_secret_access_key": "hunter2hunter2"}, b"secret": "AKIAEXAMPLESECRET"},
])
def test_bad_storage_options_never_show_the_credentials(options):
    with pytest.raises(ConfigError, match="RunConfig.storage_options") as info:
        elastic.RunConfig(storage="s3://bucket/run", storage_options=options)
    message = str(info.value)
    assert "hunter2hunter2" not in message and "AKIAEXAMPLESECRET" not in message


def test_valid_edge_values_still_pass():
    assert elastic.RunConfig(seed=2**64 - 1).seed == 2**64 - 1
    assert elastic.RunConfig(seed=-2**63).seed == -2**63
    assert elastic.RunConfig(storage_options=None).storage_options is None  # "no options", as before
    ckpt = elastic.CheckpointConfig(every_n_steps=10, keep_every=30)
    assert (ckpt.every_n_steps, ckpt.keep_every) == (10, 30)
    assert elastic.RunConfig(checkpoint=ckpt, progress=True, stop_timeout_s=0.5).checkpoint is ckpt
    # keep_every is not tied to every_n_steps while checkpoints are off
    assert elastic.CheckpointConfig(every_n_steps=0, keep_every=7).keep_every == 7
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5, "custom": 2}, placement_timeout_s=1e9,
                            dispatch_target_s=0.01, bucket_cap_mb=0.5)
    assert scaling.bundle() == {"CPU": 0.5, "custom": 2.0}
    assert ScalingConfig(resources_per_worker={"CPU": 1, "memory": 0}).bundle() == {"CPU": 1.0}  # 0: not asked for
    failure = FailureConfig(min_workers=1, max_failures=0, straggler_window=1, straggler_warmup_steps=0,
                            checksum_every_n_steps=0, allow_shrink=True, evict_stragglers=True, node_settle_s=0.001,
                            straggler_factor=1.5, straggler_node_avoid_s=float("inf"))
    assert failure.straggler_node_avoid_s == float("inf") and failure.evict_stragglers is True
    import numpy as np

    assert FailureConfig(straggler_node_avoid_s=np.float32(3600)).straggler_node_avoid_s == 3600  # as other seconds


def test_a_storage_retry_far_past_any_default_waits_its_cap_and_raises_nothing():
    # ELASTIC_STORAGE_ATTEMPTS may be large: base_s * 2**attempt stopped fitting a float past
    # attempt ~1,020, an OverflowError inside an outage's retries.
    from elastic.checkpoint.storage import RetryPolicy

    policy = RetryPolicy(attempts=5000, base_s=0.5, max_s=5.0)
    assert 2.5 <= policy.delay_s(4999) <= 5.0 and policy.delay_s(0) <= 0.5


def test_fractional_gpu_is_fine_for_one_rank():
    # One rank (its hot spare joins only in place of a lost rank) never shares a card with a peer.
    assert ScalingConfig(use_gpu=True, num_backups=1, resources_per_worker={"GPU": 0.5}).bundle()["GPU"] == 0.5


def test_a_gpu_amount_above_one_must_be_whole():
    # Ray refuses 1.5 GPUs when the actor is created, inside the controller, naming no setting.
    with pytest.raises(ConfigError, match=r"resources_per_worker\['GPU'\]=1.5: Ray takes a GPU amount above 1 only "
                                          r"as a whole number; use 1 or 2"):
        ScalingConfig(use_gpu=True, num_workers=2, resources_per_worker={"GPU": 1.5})
    assert ScalingConfig(use_gpu=True, num_workers=2, resources_per_worker={"GPU": 2}).bundle()["GPU"] == 2.0


def test_a_gpu_config_turned_to_cpu_is_taken():
    # use_gpu's default GPU was written into resources_per_worker, so turning use_gpu off later
    # was refused with "asks for GPU but use_gpu=False; set use_gpu=True".
    import dataclasses

    gpu = ScalingConfig(use_gpu=True, num_workers=2)
    assert gpu.bundle() == {"CPU": 1.0, "GPU": 1.0} and "GPU" not in gpu.resources_per_worker
    cpu = dataclasses.replace(gpu, use_gpu=False)
    assert cpu.bundle() == {"CPU": 1.0}
    gpu.use_gpu = False
    gpu.__post_init__()  # as Trainer._prepare re-validates a field set before fit()
    assert gpu.bundle() == {"CPU": 1.0}


def test_device_choice_without_gpu():
    assert choose_device_and_backend(False, [], False) == ("cpu", "gloo")
    assert choose_device_and_backend(True, [0], True) == ("cuda:0", "nccl")
    with pytest.raises(RuntimeError, match="assigned no GPU"):
        choose_device_and_backend(True, [], True)
    with pytest.raises(RuntimeError, match="not available"):
        choose_device_and_backend(True, [1], False)
    # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU: it is cuda:0 whatever Ray's id.
    assert choose_device_and_backend(True, [3], True, device_count=1) == ("cuda:0", "nccl")
    assert choose_device_and_backend(True, ["3"], True, device_count=1) == ("cuda:0", "nccl")


def test_device_choice_when_ray_leaves_every_gpu_visible():
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: each rank sees all of the node's GPUs, and
    # Ray's id is the index. cuda:0 on every rank of a node made NCCL refuse ("Duplicate GPU").
    assert choose_device_and_backend(True, ["3"], True, device_count=8) == ("cuda:3", "nccl")
    assert choose_device_and_backend(True, [2, 5], True, device_count=8) == ("cuda:2", "nccl")
    assert choose_device_and_backend(True, ["GPU-1a2b"], True, device_count=8) == ("cuda:0", "nccl")  # not an index
    assert choose_device_and_backend(True, [9], True, device_count=8) == ("cuda:0", "nccl")
    # The node's own CUDA_VISIBLE_DEVICES narrows what torch sees: Ray's id is an entry of that
    # list, and the device its place there (ids 4-7 all gave cuda:0, id 1 the wrong card).
    assert choose_device_and_backend(True, ["5"], True, device_count=4, visible="4,5,6,7") == ("cuda:1", "nccl")
    assert choose_device_and_backend(True, ["1"], True, device_count=4, visible="0,1,2,3") == ("cuda:1", "nccl")
    assert choose_device_and_backend(True, ["1"], True, device_count=4, visible="3,2,1,0") == ("cuda:2", "nccl")
    assert choose_device_and_backend(True, ["GPU-b"], True, device_count=2, visible="GPU-a,GPU-b") == \
        ("cuda:1", "nccl")
    assert choose_device_and_backend(True, ["9"], True, device_count=4, visible="4,5,6,7") == ("cuda:0", "nccl")
    assert choose_device_and_backend(True, ["2"], True, device_count=4, visible="GPU-a,GPU-b,GPU-c,GPU-d") == \
        ("cuda:2", "nccl")  # an id the list does not name: taken as the index


def test_requeue_dropped_needs_first_n_and_single_step_dispatch():
    with pytest.raises(ConfigError, match="requeue_dropped is for ScalingConfig.aggregation='first_n'"):
        _trainer(requeue_dropped=True)
    first_n = ScalingConfig(num_workers=4, num_backups=1, aggregation="first_n", steps_per_dispatch=4)
    with pytest.raises(ConfigError, match="steps_per_dispatch to 0 or 1"):
        _trainer(scaling=first_n, requeue_dropped=True)


def test_first_n_with_shrink_names_the_action_to_change_not_allow_shrink_alone():
    # "set allow_shrink False", then FailureConfig's own "asks to shrink ... set allow_shrink=True":
    # each error pointed at the other.
    first_n = ScalingConfig(num_workers=4, num_backups=1, num_spares=1, aggregation="first_n")
    shrink = elastic.FailureConfig(on_failure="replace", when_no_spare="shrink", allow_shrink=True)
    with pytest.raises(ConfigError, match=r"FailureConfig\.when_no_spare='shrink' is not supported with "
                                          r"aggregation='first_n'.*'wait', 'restart' or 'fail'"):
        _trainer(scaling=first_n, failure=shrink)
    with pytest.raises(ConfigError, match=r"allow_shrink is not supported"):
        _trainer(scaling=first_n, failure=elastic.FailureConfig(allow_shrink=True))
    _trainer(scaling=first_n, failure=elastic.FailureConfig(when_no_spare="fail"))  # what the message offers


def test_a_second_fit_of_a_run_live_in_this_process_is_refused_before_anything_starts(monkeypatch):
    from elastic import trainer as trainer_module

    t = _trainer()
    monkeypatch.setattr(trainer_module, "connect", lambda *a: pytest.fail("connected"))
    monkeypatch.setattr(trainer_module, "_FITTING", {t.namespace})
    with pytest.raises(ConfigError, match=r"RunConfig\.name='.*' is in use: another fit\(\) of that run"):
        t.fit(steps=1)
    assert trainer_module._FITTING == {t.namespace}  # the live one's claim stays


def test_a_second_fit_of_the_same_trainer_in_another_thread_is_refused_and_a_claim_is_released_as_taken(
        monkeypatch):
    # A fit() keeps its run's state on its Trainer: a second fit() of it in another thread under
    # another run name replaced them under the first (its controller started in the second's
    # namespace, which killed it as a leftover), and a name changed mid-fit kept the old claim.
    import threading

    from elastic import trainer as trainer_module

    t = _trainer()
    entered, release = threading.Event(), threading.Event()
    claims = []

    def fit_inside(steps, epochs, packed):
        claims.append(set(trainer_module._FITTING))
        entered.set()
        assert release.wait(30)
        return "done"
    monkeypatch.setattr(trainer_module, "_ray_for_fit", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(t, "_check_cluster_address", lambda: None)
    monkeypatch.setattr(t, "_fit", fit_inside)
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("out", t.fit(steps=1)))
    thread.start()
    try:
        assert entered.wait(30)
        first_name = t.namespace
        t.run = dataclasses.replace(t.run, name="another-run")  # renamed while the first trains
        with pytest.raises(ConfigError, match=r"this Trainer is in fit\(\) already"):
            t.fit(steps=1)
    finally:
        release.set()
        thread.join(30)
    assert first["out"] == "done" and claims == [{first_name}]
    assert first_name not in trainer_module._FITTING  # released as it was taken
    assert t.fit(steps=1) == "done"  # once the first returned


def test_a_run_renamed_during_its_fit_is_acted_on_and_told_by_the_name_it_started_with(monkeypatch):
    # The fit read trainer.run again as it went: renamed meanwhile (another thread, a notebook
    # cell), the placement groups of the other name were removed after a kill (a live run's), the
    # killed run's left reserved, and the message advised fit() again under a name that starts anew.
    from elastic import trainer as trainer_module
    from elastic.actors import worker_group

    t = _trainer()
    swept, told = [], []
    monkeypatch.setattr(worker_group, "remove_run_placement_groups", lambda ns, owner=None: swept.append(ns) or [])
    monkeypatch.setattr(trainer_module, "_ray_for_fit", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(t, "_check_cluster_address", lambda: None)

    def fit_inside(steps, epochs, packed):
        started = t.namespace
        t.run = dataclasses.replace(t.run, name="another-run")  # renamed while it trains
        t._release_placement()  # as after a kill of its controller
        told.append(t._controller_failure(RuntimeError("lost")))
        t.run.name = "set-in-place"
        return started
    monkeypatch.setattr(t, "_fit", fit_inside)
    started = t.fit(steps=1)
    assert swept == [started] and "another-run" not in started
    assert told[0].startswith(f"run '{started[len('elastic-'):]}': its controller was lost")
    assert "another-run" not in told[0]
    assert t.namespace == "elastic-set-in-place"  # the fit over: the run as set now


def test_a_run_set_while_the_fit_checks_it_is_not_the_one_trained_with_the_others_store(monkeypatch, tmp_path):
    # The fit's copy of its run was taken after the checks: a run set in between trained under the
    # new run's name with the store built for the old one.
    from elastic import trainer as trainer_module

    t = _trainer(run=elastic.RunConfig(name="checked", storage=str(tmp_path)))
    real_check = trainer_module.check_environment

    def check_environment():  # the checks begin: another thread sets the run
        t.run = dataclasses.replace(t.run, name="set-meanwhile")
        return real_check()

    monkeypatch.setattr(trainer_module, "check_environment", check_environment)
    monkeypatch.setattr(trainer_module, "_ray_for_fit", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(t, "_check_cluster_address", lambda: None)
    monkeypatch.setattr(t, "_fit", lambda steps, epochs, packed: (t._running.name, t._store_for[1]))
    assert t.fit(steps=1) == ("checked", "checked")


def test_settings_changed_while_ray_starts_do_not_reach_the_controller_unchecked(monkeypatch):
    # Only the RunConfig was copied for the fit: the scaling, failure and other settings were read
    # again after the checks, so one changed from another thread while Ray started (a notebook
    # cell) went to the controller unchecked (num_workers=0 here, a batch no rank count divides).
    from elastic import metrics as metrics_module
    from elastic import trainer as trainer_module

    t = _trainer(faults=[{"kind": "slow", "rank": 1, "factor": 2.0, "from_step": 3}], batch_schedule={10: 64})

    @contextlib.contextmanager
    def ray_starting(*args):  # the checks passed: another thread changes every setting
        t.scaling.num_workers, t.failure.max_failures, t.global_batch_size = 0, -1, 7
        t.faults[0]["rank"], t.batch_schedule[10] = 99, 3
        t.requeue_dropped, t.address = True, "nowhere"
        yield

    monkeypatch.setattr(trainer_module, "_ray_for_fit", ray_starting)
    monkeypatch.setattr(t, "_check_cluster_address", lambda: None)
    monkeypatch.setattr(trainer_module, "check_cluster_fits", lambda scaling, n: None)
    monkeypatch.setattr(t, "_claim_run_name", lambda: None)
    monkeypatch.setattr(metrics_module, "RunMetrics", lambda name: None)
    monkeypatch.setattr(t, "_run_controller", lambda actor_cls, kwargs, steps, epochs, host: kwargs)
    kwargs = t.fit(steps=1)
    assert kwargs["scaling"].num_workers == 4 and kwargs["failure"].max_failures == FailureConfig().max_failures
    assert kwargs["global_batch_size"] == 32 and kwargs["fault_plan"][0]["rank"] == 1
    assert kwargs["batch_schedule"] == {10: 64} and kwargs["requeue_dropped"] is False
    assert t.scaling.num_workers == 0  # the Trainer's own, as set: the next fit() checks it


def test_a_mixed_precision_changed_while_the_settings_are_checked_is_not_the_one_the_workers_get(monkeypatch):
    # Trainer.mixed_precision was read twice, checked at the first read and put in the workers'
    # spec at the second: "fp8" set from another thread in between reached the workers unchecked.
    from elastic import trainer as trainer_module

    t = _trainer(mixed_precision="bf16")
    check_failure_actions = trainer_module._check_failure_actions

    def changed_meanwhile(*args):  # runs after the check, before the spec is built
        t.mixed_precision = "fp8"
        check_failure_actions(*args)

    monkeypatch.setattr(trainer_module, "_check_failure_actions", changed_meanwhile)
    assert t._prepare().spec.mixed_precision == "bf16" and t.spec.mixed_precision == "bf16"
    with pytest.raises(ConfigError, match=r"mixed_precision must be None, 'bf16' or 'fp16', got 'fp8'"):
        t._prepare()  # the next fit() checks the value as set


def test_a_leftover_controllers_groups_are_removed_while_it_still_holds_the_runs_name(monkeypatch):
    # Removed after its name was free, they could be another driver's that took the name meanwhile;
    # left to the new controller alone, a fit that failed before its controller ran left them.
    from types import SimpleNamespace

    import ray

    from elastic import trainer as trainer_module
    from elastic.actors import worker_group

    t = _trainer()
    order = []
    old = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "ab" * 8))
    monkeypatch.setattr(trainer_module, "_OUR_CONTROLLERS", {"ab" * 8})  # this driver's leftover
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: old)
    monkeypatch.setattr(worker_group, "remove_run_placement_groups",
                        lambda ns, owner=None: order.append(("sweep", ns, owner)) or [])
    monkeypatch.setattr(trainer_module, "free_actor_name", lambda name, ns, actor_id=None: order.append(("free", ns)))
    t._claim_run_name()
    # Every group of the run's name: the old controller still holds it, and only the holder makes groups.
    assert order == [("sweep", t.namespace, None), ("free", t.namespace)]


def test_after_a_kill_only_the_killed_controllers_placement_groups_are_removed(monkeypatch):
    # The sweep after a controller was lost took every group of the run's name. A controller
    # that died on its own had freed the name first, so another driver's new run of that name
    # could have placed its groups meanwhile, and lost them to this sweep.
    from types import SimpleNamespace

    import ray

    from elastic.actors import worker_group

    t = _trainer()
    swept, killed = [], []
    monkeypatch.setattr(worker_group, "remove_run_placement_groups",
                        lambda ns, owner=None: swept.append((ns, owner)) or [])
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    t.controller = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "cd" * 16))
    t._kill_controller()
    # Again, as a failed stop's kill and then the fit's way out do: no sweep of every group of the name.
    t._kill_controller()
    assert swept == [(t.namespace, "cd" * 16)] and len(killed) == 1 and t.controller is None


def test_fits_in_two_threads_share_the_embedded_ray_and_the_last_shuts_it_down(monkeypatch):
    # The first fit to finish shut the embedded Ray down under the other, still training.
    from elastic import trainer as trainer_module

    up, calls = [False], []

    def connect(address, min_cpus, use_gpu):  # as the real one: True only when it started Ray
        if up[0]:
            return False
        calls.append("connect")
        up[0] = True
        return True

    def shutdown():
        calls.append("shutdown")
        up[0] = False

    monkeypatch.setattr(trainer_module, "connect", connect)
    monkeypatch.setattr(trainer_module.ray, "shutdown", shutdown)
    with trainer_module._ray_for_fit(None, 1, False):
        with trainer_module._ray_for_fit(None, 1, False):  # a second fit while the first trains
            assert calls == ["connect"]
        assert calls == ["connect"] and up[0]  # the first still trains on it
    assert calls == ["connect", "shutdown"] and trainer_module._embedded_fits == 0
    with trainer_module._ray_for_fit(None, 1, False):  # a later fit starts its own again
        pass
    assert calls == ["connect", "shutdown", "connect", "shutdown"]


def test_the_address_is_checked_when_another_fits_ray_went_down_before_this_one_connects(monkeypatch):
    # The check ran before the lock, only if Ray was down then: a fit that found another fit's
    # embedded Ray up skipped it, that fit then shut its Ray down, and connect() gave ray.init a
    # RAY_ADDRESS nobody had checked (a dead one retried for a minute, Ray's core logging each try).
    from elastic import trainer as trainer_module

    up, inits = [True], []

    class OtherFitShutsDownFirst:  # the other fit's shutdown held the lock this fit waited for
        def __enter__(self):
            up[0] = False

        def __exit__(self, *exc):
            return False

    def init(**kw):
        inits.append(kw.get("address"))
        raise RuntimeError("ray.init: a test starts no Ray")

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens there
    monkeypatch.setattr(trainer_module, "_EMBEDDED_LOCK", OtherFitShutsDownFirst())
    monkeypatch.setattr(trainer_module.ray, "is_initialized", lambda: up[0])
    monkeypatch.setattr(trainer_module.ray, "init", init)
    with pytest.raises(ConfigError, match=r"the environment variable RAY_ADDRESS='127.0.0.1:1': nothing answers"):
        _trainer(scaling=ScalingConfig(num_workers=2)).fit(steps=1)
    assert inits == []


@pytest.mark.parametrize("env", ["local", " local "])
@pytest.mark.parametrize("address", [None, "auto"])
def test_ray_address_local_is_the_embedded_ray_fit_shuts_down(monkeypatch, env, address):
    # Passed on as "auto", Ray read "local" back from the environment and started a Ray that
    # connect() did not count as started: fit() never shut it down. Trainer.address="auto"
    # is read the same way (ray.init replaces "auto" with RAY_ADDRESS).
    from elastic import trainer as trainer_module

    seen = []
    monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(trainer_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_module.ray, "init", lambda **kw: seen.append(kw["address"]))
    assert trainer_module.connect(address) is True and seen == ["local"]


def test_an_embedded_ray_interrupted_while_it_starts_is_shut_down(monkeypatch):
    # A half-started Ray was left initialised; the next fit() took it for the user's and kept it.
    from elastic import trainer as trainer_module

    state, calls = {"up": False}, []

    def interrupted(**kw):
        state["up"] = True
        raise KeyboardInterrupt

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer_module.ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(trainer_module.ray, "init", interrupted)
    monkeypatch.setattr(trainer_module.ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(KeyboardInterrupt):
        trainer_module.connect(None)
    assert calls == ["shutdown"]


def test_the_errors_fit_raises_pickle_with_what_they_carry():
    # A fit() in a Ray task, a Tune trial or a multiprocessing pool sends its error back pickled:
    # these failed to unpickle (TypeError: missing 'result' / 'message') in place of the error.
    import pickle

    from elastic.actors.protocol import WorkerError
    from elastic.trainer import Result, TrainingStopped

    result = Result(metrics={"steps": 3}, history=[], events=[], checkpoint=None, recoveries=[], ledger=[])
    stopped = pickle.loads(pickle.dumps(TrainingStopped("run 'x' stopped after step 3", result)))
    assert str(stopped) == "run 'x' stopped after step 3" and stopped.result.metrics == {"steps": 3}
    error = pickle.loads(pickle.dumps(WorkerError(2, "ValueError: bad batch")))
    assert (error.rank, error.message, str(error)) == (2, "ValueError: bad batch",
                                                      "worker rank 2 raised:\nValueError: bad batch")


def test_an_address_is_shown_without_credentials_or_query():
    from elastic.address import shown

    assert shown("admin:pw@head:8265") == "***@head:8265"
    assert shown("http://admin:pw@head:8265?token=abc") == "http://***@head:8265"
    assert shown("ray://head:10001?token=abc") == "ray://head:10001"
    with pytest.raises(ConfigError) as info:
        _trainer(address="ray://head:10001?token=abc")
    assert "abc" not in str(info.value)


def test_bucket_cap_must_be_positive():
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        ScalingConfig(num_workers=2, bucket_cap_mb=0)
    assert ScalingConfig(num_workers=2, bucket_cap_mb=4).bucket_cap_mb == 4
    with pytest.raises(ConfigError, match=r"bucket_cap_mb must be .* <= 1.04858e\+06"):
        ScalingConfig(num_workers=2, bucket_cap_mb=1e300)  # failed in DDP's reducer, inside the worker


def test_a_straggler_window_no_deque_can_hold_is_refused():
    with pytest.raises(ConfigError, match="FailureConfig.straggler_window must be <= 1000000"):
        FailureConfig(straggler_window=2 ** 63)  # an OverflowError from deque(maxlen=...) in the controller


@pytest.mark.parametrize("value", [-1, 2.5, True, "8"])
def test_late_backoff_steps_must_be_a_count(value):
    with pytest.raises(ConfigError, match="ScalingConfig.late_backoff_steps must be an integer >= 0"):
        ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n", late_backoff_steps=value)
    assert ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n", late_backoff_steps=0).late_backoff_steps == 0


def test_background_spare_start_must_be_a_bool():
    with pytest.raises(ConfigError, match="background_spare_start must be True or False"):
        ScalingConfig(num_workers=2, background_spare_start="no")
    assert ScalingConfig(num_workers=2).background_spare_start is True


def test_evicting_stragglers_needs_a_hot_spare():
    evict = FailureConfig(evict_stragglers=True)
    with pytest.raises(ConfigError, match=r"set ScalingConfig.num_backups >= 1, or evict_stragglers=False"):
        _trainer(failure=evict)
    first_n = ScalingConfig(num_workers=4, num_backups=1, aggregation="first_n")
    with pytest.raises(ConfigError, match=r"set ScalingConfig.num_spares >= 1"):
        _trainer(scaling=first_n, failure=evict)
    _trainer(scaling=ScalingConfig(num_workers=4, num_backups=1), failure=evict)  # a spare: fine


def test_find_unused_parameters_is_a_flag_for_data_parallel():
    with pytest.raises(ConfigError, match="find_unused_parameters must be True or False"):
        ScalingConfig(num_workers=2, find_unused_parameters="yes")
    with pytest.raises(ConfigError, match="first-N handles unused parameters without it"):
        ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n", find_unused_parameters=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch_size": True}, r"Trainer\.global_batch_size must be an integer >= 1, got True \(bool\)"),
    ({"global_batch_size": 32.0}, r"Trainer\.global_batch_size must be an integer >= 1"),
    ({"requeue_dropped": "False"}, r"Trainer\.requeue_dropped must be True or False, got 'False' \(str\)"),
    ({"scaling": {"num_workers": 4}}, r"Trainer\.scaling must be an elastic\.ScalingConfig\(\.\.\.\) or None, got dict"),
    ({"run": "my-run"}, r"Trainer\.run must be an elastic\.RunConfig"),
    ({"failure": FailureConfig}, r"Trainer\.failure must be an elastic\.FailureConfig"),
])
def test_trainer_arguments_of_the_wrong_type_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _trainer(**kwargs)


@pytest.mark.parametrize("value", [True, 2.0, "3", 0])
def test_fit_steps_must_be_a_whole_positive_number(value):
    with pytest.raises(ConfigError, match=r"Trainer\.fit's steps must be an integer >= 1"):
        _trainer().fit(steps=value)


@pytest.mark.parametrize("value", [0, -1.0, "1", True, float("nan"), float("inf")])
def test_max_grad_norm_must_be_a_positive_number(value):
    with pytest.raises(ConfigError, match="Trainer.max_grad_norm must be a number > 0"):
        _trainer(max_grad_norm=value)


@pytest.mark.parametrize("value", ["fp32", "FP16", "float16", True, 16, torch.float16])
def test_mixed_precision_must_be_bf16_fp16_or_none(value):
    with pytest.raises(ConfigError, match=r"Trainer\.mixed_precision must be None, 'bf16' or 'fp16', got "):
        _trainer(mixed_precision=value)


def test_bf16_on_a_gpu_without_it_is_refused_when_the_worker_builds(monkeypatch):
    # torch emulates bfloat16 before Ampere (is_bf16_supported() says True, counting emulation):
    # far slower than fp16. No GPU here: the device choice is checked with CUDA's answers stood in.
    from elastic.actors.worker import mixed_precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(ValueError, match=r"'bf16': Tesla V100-SXM2-16GB has no native bfloat16 .*'fp16'"):
        mixed_precision("bf16", torch.device("cuda", 0))
    assert mixed_precision("bf16", torch.device("cpu")) == (torch.bfloat16, None)


@pytest.mark.parametrize("schedule, match", [
    ([(3, 64)], r"Trainer\.batch_schedule must be a dict \{step: global batch size\} or None, got list"),
    ({1: 64}, r"batch_schedule's step 1 must be an integer >= 2 .*step 1 takes Trainer\.global_batch_size"),
    ({"10": 64}, r"batch_schedule's step '10' must be an integer >= 2"),
    ({10: 66}, r"batch_schedule\[10\]=66 must be an integer >= 1 divisible by ScalingConfig\.num_workers=4"),
    ({10: 0}, r"batch_schedule\[10\]=0 must be an integer >= 1"),
    ({10: 64.0}, r"batch_schedule\[10\]=64\.0 must be an integer"),
])
def test_a_batch_schedule_names_the_step_or_size_to_change(schedule, match):
    with pytest.raises(ConfigError, match=match):
        _trainer(batch_schedule=schedule)


def test_a_batch_schedule_and_a_shrink_are_refused_together():
    # A shrink keeps one global batch over fewer ranks, which a schedule changes.
    with pytest.raises(ConfigError, match=r"batch_schedule changes the global batch, and a shrink keeps one"):
        _trainer(batch_schedule={10: 64}, failure=FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=2))
    assert _trainer(batch_schedule={10: 64, 20: 128}).batch_schedule == {10: 64, 20: 128}


def test_mixed_precision_and_a_step_fn_are_refused_together_naming_both():
    # A step_fn runs the forward and backward itself: the autocast and the fp16 loss scaling
    # would have to be inside it, so the option would silently do half its job.
    with pytest.raises(ConfigError, match=r"mixed_precision='fp16' runs loss_fn's forward under autocast.*step_fn"):
        _trainer(mixed_precision="fp16", step_fn=lambda model, batch: None)
    assert _trainer(mixed_precision="bf16").spec.mixed_precision == "bf16"


@pytest.mark.parametrize("failure, run, match", [
    (FailureConfig(when_no_spare="restart"), None, r"when_no_spare='restart'.*RunConfig.storage"),
    (FailureConfig(on_failure="restart"), elastic.RunConfig(storage="file:///tmp/x",
                                                            checkpoint=elastic.CheckpointConfig(every_n_steps=0)),
     r"on_failure='restart'.*every_n_steps >= 1"),
    # shrink without min_workers: min_workers defaults to num_workers, so it could never shrink
    (FailureConfig(when_no_spare="shrink", allow_shrink=True), None,
     r"min_workers is None \(never fewer than num_workers=4\) leaves no smaller size"),
    (FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=4), None, "min_workers=4 leaves no smaller size"),
    (FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=3), None,
     "global_batch_size=32 divides over none of the sizes 3..3"),
])
def test_a_failure_action_that_could_never_heal_is_refused_before_start(failure, run, match):
    with pytest.raises(ConfigError, match=match):
        _trainer(failure=failure, **({"run": run} if run else {}))


def test_a_one_worker_run_asked_to_shrink_is_told_it_cannot_not_to_lower_min_workers():
    # "set min_workers below num_workers=1" asked for the impossible: min_workers is at least 1.
    with pytest.raises(ConfigError, match=r"num_workers=1 has no smaller size: raise num_workers, or choose another "
                                          r"action \(wait, restart, fail\)"):
        _trainer(scaling=ScalingConfig(num_workers=1),
                 failure=FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=1))


def test_failure_actions_that_can_heal_are_accepted(tmp_path):
    t = _trainer(failure=FailureConfig(when_no_spare="restart"), run=elastic.RunConfig(storage=str(tmp_path)))
    assert (t.failure.on_failure, t.failure.when_no_spare) == ("replace", "restart")
    t = _trainer(failure=FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=2))  # 32 over 2
    assert (t.failure.when_no_spare, t.failure.min_workers) == ("shrink", 2)


def test_a_worker_bundle_of_no_resource_is_refused():
    with pytest.raises(ConfigError, match="resources_per_worker.*asks for no resource"):
        ScalingConfig(resources_per_worker={"CPU": 0})


def test_the_runs_loss_is_the_newest_known_one():
    from elastic.trainer import last_loss

    kept = {"loss": float("nan"), "loss_known": False}  # kept after a failure, its result gone with the ranks
    assert last_loss([{"loss": 0.5}, {"loss": 0.4}, kept]) == 0.4
    assert last_loss([]) is None and last_loss([kept]) is None
    # A loss the model computed is the run's, finite or not: a diverged run reads as one.
    assert math.isnan(last_loss([{"loss": 0.5}, {"loss": float("nan"), "loss_known": True}, kept]))
    assert last_loss([{"loss": 0.5}, {"loss": float("inf"), "loss_known": True}]) == float("inf")


def test_a_numpy_straggler_factor_is_a_number():
    import numpy as np

    assert FailureConfig(straggler_factor=np.float32(2.5)).straggler_factor == np.float32(2.5)


def test_a_storage_check_that_failed_is_made_again_once_the_config_is_put_back(tmp_path, monkeypatch):
    # The store was cleared or replaced before its check, and the key it stands for kept until the
    # check passed: after a failed check, putting the config back found the key unchanged. The
    # run then trained with no checkpoints (no resume), or into the name that had failed.
    from elastic.checkpoint import CheckpointStore

    t = _trainer(run=elastic.RunConfig(name="a", storage=str(tmp_path)))
    t.run.storage = "s3://"
    with pytest.raises(ConfigError, match="bucket"):
        t._prepare()
    t.run.storage = str(tmp_path)
    t._prepare()
    assert t._store is not None and t._store.run_name == "a"

    def down(self):
        raise ConfigError("storage down (test)")
    checked = CheckpointStore.validate
    monkeypatch.setattr(CheckpointStore, "validate", down)
    t.run.name = "b"
    with pytest.raises(ConfigError, match="down"):
        t._prepare()
    monkeypatch.setattr(CheckpointStore, "validate", checked)
    t.run.name = "a"
    t._prepare()
    assert t._store.run_name == "a"


def test_a_stop_in_a_wait_says_what_the_run_waited_for_and_where_it_will_resume(tmp_path):
    t = _trainer(run=elastic.RunConfig(name="stops", storage=f"file://{tmp_path}/ckpt"))
    waited = "stopped while waiting for checkpoint storage file:///x to answer"
    msg = t._stopped_message("KeyboardInterrupt", {"steps": 0, "checkpoint": None, "stopped_while": waited,
                                                   "restored_from": None})
    assert f"stopped after step 0 ({waited})" in msg
    assert "checkpoints on storage were not read" in msg and "no checkpoint was committed" not in msg
    msg = t._stopped_message("SIGTERM", {"steps": 7, "checkpoint": {"latest_step": 7, "location": "file:///x"},
                                         "stopped_while": "stopped while waiting for capacity to replace rank(s) [1]",
                                         "restored_from": 5})
    assert "latest committed checkpoint: step 7" in msg
    bare = _trainer(run=elastic.RunConfig(name="stops"))
    msg = bare._stopped_message("KeyboardInterrupt", {"steps": 3, "checkpoint": None, "stopped_while": waited,
                                                      "restored_from": None, "model_state": None})
    assert "no rank handed its weights back" in msg and ".result.model_state" not in msg
    msg = bare._stopped_message("KeyboardInterrupt", {"steps": 3, "checkpoint": None, "stopped_while": waited,
                                                      "restored_from": None, "model_state": {"w": 1}})
    assert "the weights are in .result.model_state" in msg


def test_a_run_configs_repr_shows_no_credentials():
    run = elastic.RunConfig(name="r", storage="s3://AKIAEXAMPLE:wJalr/XUtnFEMI@bucket/ckpt?X-Amz-Signature=deadbeef",
                            storage_options={"key": "AKIAOTHER", "secret": "hunter22-secret"})
    shown = repr(run)
    for secret in ("AKIAEXAMPLE", "wJalr", "XUtnFEMI", "deadbeef", "AKIAOTHER", "hunter22-secret"):
        assert secret not in shown and secret not in str(run)
    assert shown.startswith("RunConfig(name='r', storage='s3://***@bucket/ckpt', seed=0, checkpoint=CheckpointConfig(")
    assert "storage_options" not in shown
    assert "storage='/data/ckpt'" in repr(elastic.RunConfig(storage="/data/ckpt"))


@pytest.mark.parametrize("address", [5, "bogus", "10.0.0.1:99999", "ray://head", "2001:db8::1", "::1",
                                     "ray:/head:6379", "[::1:6379"])
def test_an_address_that_is_no_ray_address_is_refused_before_start(address):
    # "bogus" was a bare ValueError out of ray.init, 5 was taken as given.
    with pytest.raises(ConfigError, match="Trainer.address=.* is not a Ray address"):
        _trainer(address=address)


@pytest.mark.parametrize("address, why", [
    ("ray://admin:hunter22@127.0.0.1:1", r"Trainer.address='ray://\*\*\*@127.0.0.1:1' holds a user:password@"),
    ("admin:hunter22@127.0.0.1:6379", r"Trainer.address='\*\*\*@127.0.0.1:6379' holds a user:password@"),
    ("http://head:8265", r"Trainer.address='http://head:8265' is a dashboard address, which Ray Jobs"),
    ("s3://bucket:1234", r"Trainer.address='s3://bucket:1234' is not a Ray address"),
    # Ray imported "RAY" as a module: "Module: RAY does not exist", naming no setting.
    ("RAY://head:10001",
     r"Trainer.address='RAY://head:10001' has its scheme in capitals, .*\(write ray:// in lower case\)"),
])
def test_an_address_with_credentials_or_another_scheme_is_refused_without_echoing_them(address, why):
    # ray://user:pw@host:port passed (its host read as "user:pw@host"), and the unreachable error
    # printed the password; http:// (the dashboard's, which `elastic submit` takes) reached
    # ray.init, which blamed RAY_ADDRESS.
    with pytest.raises(ConfigError, match=why) as info:
        _trainer(address=address)
    assert "hunter22" not in str(info.value)


def test_host_port_reads_ipv6_only_in_brackets():
    from elastic.address import host_port

    assert host_port("[::1]:6379") == ("::1", 6379) and host_port("ray://[2001:db8::1]:10001") == ("2001:db8::1", 10001)
    assert host_port("head:6379") == ("head", 6379) and host_port("ray://10.0.0.1:10001/") == ("10.0.0.1", 10001)
    assert host_port("2001:db8::1") is None and host_port("::1") is None and host_port("ray:/h:1") is None


def test_an_address_where_nothing_answers_is_refused_in_seconds(monkeypatch):
    # ray.init retried for a minute, Ray's core logging every try, before it gave up.
    import socket
    import time

    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver process
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"Trainer.address='127.0.0.1:{port}': nothing answers there"):
        _trainer(address=f"127.0.0.1:{port}", scaling=ScalingConfig(num_workers=2)).fit(steps=1)
    assert time.monotonic() - start < 10
    # Ray's named address and a Ray Client address are taken as given when made: no probe, no error.
    for address in ("auto", "ray://head:10001"):
        _trainer(address=address)


@pytest.mark.parametrize("recorded", ["CLOSED", None])
def test_auto_where_ray_recorded_a_cluster_gone_since_is_refused_in_seconds(monkeypatch, recorded):
    # A cluster stopped uncleanly leaves its address in Ray's temp dir: ray.init("auto") retried
    # it for a minute, Ray's core logging each try; with none recorded, a bare ConnectionError.
    import socket
    import time

    import ray
    from ray._private import services

    if recorded == "CLOSED":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            recorded = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # no Ray process here
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: recorded)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver process
    start = time.monotonic()
    # Ray's resolution gives this machine's IP for 127.0.0.1.
    why = (rf"Trainer.address='auto': nothing answers there \(.* at [\d.]+:{recorded.rpartition(':')[2]}, the "
           r"cluster Ray recorded"
           if recorded else r"Trainer.address='auto': nothing answers there \(no running Ray cluster was found")
    with pytest.raises(ConfigError, match=why):
        _trainer(address="auto", scaling=ScalingConfig(num_workers=2)).fit(steps=1)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("value, why", [
    ("http://head:8265", r"the environment variable RAY_ADDRESS='http://head:8265' is a dashboard address"),
    ("admin:hunter22@127.0.0.1:6379", r"RAY_ADDRESS='\*\*\*@127.0.0.1:6379' holds a user:password@.*unset it"),
    ("CLOSED", r"RAY_ADDRESS='127.0.0.1:\d+': nothing answers there .*unset RAY_ADDRESS for an embedded"),
])
@pytest.mark.parametrize("address", [None, "auto"])
def test_a_ray_address_from_the_environment_is_checked_as_trainer_address_is(monkeypatch, value, why, address):
    """Trainer.address=None joins RAY_ADDRESS: a stale or wrong one went to ray.init unchecked
    (a minute of retries with Ray's core logging each, a password echoed by its messages).
    So does Trainer.address="auto", which ray.init replaces with RAY_ADDRESS when it is set."""
    import socket
    import time

    import ray

    if value == "CLOSED":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            value = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver process
    monkeypatch.setenv("RAY_ADDRESS", value)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=why) as info:
        _trainer(scaling=ScalingConfig(num_workers=2), address=address).fit(steps=1)
    assert time.monotonic() - start < 10 and "hunter22" not in str(info.value)


@pytest.mark.parametrize("name, value, what", [
    ("ELASTIC_HEARTBEAT_TIMEOUT_S", "10s", "seconds > 0"),  # was a bare "could not convert string to float"
    ("ELASTIC_HEARTBEAT_TIMEOUT_S", "nan", "seconds > 0"),  # blamed FailureConfig.heartbeat_timeout_s, never set
    ("ELASTIC_STEP_TIMEOUT_S", "0", "seconds >= 0.001"),
    # Below FailureConfig's floor: blamed on collective_timeout_s, which the user set to 5.
    ("ELASTIC_COLLECTIVE_TIMEOUT_S", "0.0005", "seconds >= 0.001"),
    ("ELASTIC_STORAGE_BACKOFF_S", "-1", "seconds >= 0"),  # failed in a sleep inside a rank's storage retry
    ("ELASTIC_CKPT_RETRY_MAX_S", "inf", "seconds >= 0"),
    ("ELASTIC_STORAGE_ATTEMPTS", "2.5", "an integer >= 1"),
    ("ELASTIC_STEP_TIMEOUT_S", "2e9", r"seconds >= 0.001 and <= 1e\+09"),  # it said "must be > 0"
])
def test_a_bad_environment_override_is_refused_by_its_name_before_start(monkeypatch, name, value, what):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"environment variable {name}='{re.escape(value)}' must be {what}"):
        _trainer(failure=FailureConfig(collective_timeout_s=5))


@pytest.mark.parametrize("value", [np.float32(60), Fraction(60), np.int64(60)])
def test_seconds_of_other_number_types_become_floats(value):
    # A numpy float32 or a Fraction passed the checks, then failed in a rank, in
    # timedelta(seconds=...) at the group's rendezvous, after every model was built.
    import datetime

    f = FailureConfig(collective_timeout_s=value, straggler_node_avoid_s=value)
    assert type(f.collective_timeout_s) is float and type(f.straggler_node_avoid_s) is float
    datetime.timedelta(seconds=f.collective_timeout_s)
    assert type(ScalingConfig(placement_timeout_s=value).placement_timeout_s) is float
    assert type(RunConfig(stop_timeout_s=value).stop_timeout_s) is float
    assert type(CheckpointConfig(resume_timeout_s=value).resume_timeout_s) is float
    with pytest.raises(ConfigError, match=r"FailureConfig\.straggler_node_avoid_s must be seconds >= 0"):
        FailureConfig(straggler_node_avoid_s=Fraction(10**400))  # float() of it overflowed at the first eviction


@pytest.mark.parametrize("name", ["num_backups", "num_spares"])
def test_hot_spares_have_a_bound(name):
    aggregation = "first_n" if name == "num_spares" else "all"
    for value in (10**6, 10**400):
        with pytest.raises(ConfigError, match=rf"ScalingConfig\.{name} must be at most 256"):
            ScalingConfig(aggregation=aggregation, num_backups=1 if name == "num_spares" else value,
                          **({name: value} if name == "num_spares" else {}))


@pytest.mark.parametrize("key, write", [("num_cpus", "CPU"), ("num_gpus", "GPU"), ("CPUs", "CPU"), (" GPU", "GPU"),
                                        ("gpu ", "gpu"), ("TPU ", "TPU")])
def test_a_misspelt_resource_name_is_named(key, write):
    # Accepted, no node had it: the run waited placement_timeout_s (a 'GPU ' passed the use_gpu check too).
    with pytest.raises(ConfigError, match=rf"resources_per_worker\[{re.escape(repr(key))}\] .*; write '{write}'"):
        ScalingConfig(resources_per_worker={key: 1})


def test_an_integer_too_long_to_print_still_names_its_field():
    with pytest.raises(ConfigError, match=r"ScalingConfig\.steps_per_dispatch must be <= 1024, got an integer of"):
        ScalingConfig(steps_per_dispatch=10**5000)
    for field in ("straggler_node_avoid_s", "straggler_factor"):
        with pytest.raises(ConfigError, match=rf"FailureConfig\.{field} must be .*got an integer of"):
            FailureConfig(**{field: 10**5000})


def test_a_pathlib_storage_is_taken_as_its_path(tmp_path):
    assert RunConfig(storage=tmp_path).storage == str(tmp_path)
    with pytest.raises(ConfigError, match=r"RunConfig\.storage must be a URL .* as a str, got a bytes"):
        RunConfig(storage=b"/tmp/x")


def test_environment_overrides_are_read_and_the_log_level_in_any_case(monkeypatch):
    from elastic.actors.controller_actor import _log_level
    from elastic.checkpoint.storage import RetryPolicy

    monkeypatch.setenv("ELASTIC_STORAGE_ATTEMPTS", "7")
    monkeypatch.setenv("ELASTIC_STEP_TIMEOUT_S", "2.5")
    assert RetryPolicy().attempts == 7 and FailureConfig().step_timeout_s == 2.5
    monkeypatch.setenv("ELASTIC_LOG_LEVEL", "info")  # failed in the controller actor's constructor
    assert _log_level() == "INFO" and _trainer()
    monkeypatch.setenv("ELASTIC_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError, match="ELASTIC_LOG_LEVEL='verbose' is not a logging level"):
        _trainer()
    assert _log_level() == "WARNING"  # set for the actors alone: the run goes on


def test_a_setting_changed_after_the_trainer_was_made_is_checked_again_by_fit(monkeypatch):
    # fit() went on with trainer.scaling.num_workers = 3 (a global batch of 32 does not divide)
    # and with use_gpu = True while the workers' spec still said False.
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    t = _trainer()
    t.scaling.num_workers = 3
    with pytest.raises(ConfigError, match="global_batch_size=32 is not divisible by ScalingConfig.num_workers=3"):
        t.fit(steps=1)
    t.scaling.num_workers = 4
    t.failure.evict_stragglers = True
    with pytest.raises(ConfigError, match="evict_stragglers puts a hot spare"):
        t.fit(steps=1)
    t.failure.evict_stragglers = False
    t.scaling.use_gpu = True
    t._prepare()
    assert t.spec.use_gpu is True  # the spec is built from the settings as they are now


def test_the_resource_ceiling_is_rays():
    # Written out in elastic/config.py (the config imports no Ray); a Ray that changes it shows here.
    from ray._private.ray_constants import MAX_RESOURCE_QUANTITY

    from elastic import config

    assert config._MAX_RESOURCE == MAX_RESOURCE_QUANTITY


def test_settings_this_run_never_reads_are_warned_about_once(caplog):
    # Accepted and then ignored in silence: a user who set one expected it to act.
    import logging

    from elastic.config import CheckpointConfig, RunConfig

    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        t = _trainer(scaling=ScalingConfig(num_workers=4, late_backoff_steps=2, steps_per_dispatch=4,
                                           dispatch_target_s=1.0),
                     failure=FailureConfig(allow_shrink=True, min_workers=2),
                     run=RunConfig(checkpoint=CheckpointConfig(keep_last=5)))
        t._prepare()  # as fit() does: nothing said twice
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 5 and len(set(said)) == 5
    for field in ("late_backoff_steps", "dispatch_target_s", "allow_shrink", "min_workers", "writes no checkpoints"):
        assert any(field in m for m in said), field
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _trainer(failure=FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=2))
        _trainer(run=RunConfig(storage="memory://warn", checkpoint=CheckpointConfig(every_n_steps=0, keep_every=10)))
    assert [r.getMessage() for r in caplog.records] == [
        "CheckpointConfig.keep_every keeps every Nth committed step, and every_n_steps=0 commits none but the "
        "last; it is ignored."]


def test_a_dispatch_target_first_n_with_requeueing_never_reads_is_warned_about(caplog):
    # With requeue_dropped a first-N step goes out only once the previous step's drops are known,
    # one step a call: the controller never sizes a window, and the target was ignored in silence.
    import logging

    first_n = dict(num_workers=2, num_backups=1, aggregation="first_n")
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _trainer(scaling=ScalingConfig(**first_n, dispatch_target_s=2.0), requeue_dropped=True)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "ScalingConfig.dispatch_target_s" in said[0] and "requeue_dropped" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):  # read in both: no word
        _trainer(scaling=ScalingConfig(**first_n, dispatch_target_s=2.0))
        _trainer(scaling=ScalingConfig(num_workers=2, dispatch_target_s=2.0))
        _trainer(scaling=ScalingConfig(**first_n), requeue_dropped=True)  # left at its default
    assert not caplog.records


@pytest.mark.parametrize("scaling, failure, run, said", [
    (ScalingConfig(num_workers=2, num_backups=1), FailureConfig(on_failure="restart"), {"storage": "memory://warn"},
     "on_failure='restart' does not take spares"),
    (ScalingConfig(num_workers=2, num_backups=1, num_spares=2, aggregation="first_n"), FailureConfig(max_failures=0),
     None, "ScalingConfig asks for 2 hot spare(s), but FailureConfig.max_failures=0 ends the run"),
    (ScalingConfig(num_workers=2, num_backups=1, placement_strategy="STRICT_SPREAD"), FailureConfig(), None,
     "placement_strategy='STRICT_SPREAD' holds for the ranks' own placement group"),
    (ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2}), FailureConfig(), None,
     "each rank trains on one GPU (its first); the others are held and idle"),
    (ScalingConfig(num_workers=2), FailureConfig(), {"storage_options": {"anon": True}},
     "RunConfig.storage_options is set but RunConfig.storage is None"),
])
def test_settings_that_cannot_act_in_this_run_are_warned_about(scaling, failure, run, said, caplog):
    # Spares that restart/fail (or max_failures=0) never take, a strict strategy spares break, a
    # second GPU a rank never uses, storage options with no storage: accepted without a word.
    import logging

    from elastic.config import RunConfig

    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _trainer(scaling=scaling, failure=failure, run=RunConfig(**(run or {})))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and said in messages[0], messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):  # spares an eviction takes: no word
        _trainer(scaling=ScalingConfig(num_workers=2, num_backups=1),
                 failure=FailureConfig(on_failure="fail", evict_stragglers=True))
    assert not caplog.records


def test_evicting_stragglers_with_one_rank_is_warned_about(caplog):
    # A lone rank always scores 1.0 against no peers: eviction could never happen, in silence.
    import logging

    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _trainer(scaling=ScalingConfig(num_workers=1, num_backups=1), failure=FailureConfig(evict_stragglers=True))
        _trainer(scaling=ScalingConfig(num_workers=2, num_backups=1), failure=FailureConfig(evict_stragglers=True))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "evict_stragglers" in said[0] and "never evicts" in said[0]


@pytest.mark.parametrize("resources, why", [
    ({"neuron_cores": 0.5}, r"\['neuron_cores'\]=0.5: neuron_cores resource quantity must be whole numbers"),
    ({"HPU": 1.5}, r"\['HPU'\]=1.5: HPU resource quantity must be whole numbers"),
    ({"TPU": 3}, r"\['TPU'\]=3: .*not a supported chip configuration"),
])
def test_an_accelerator_amount_ray_refuses_is_refused_before_start(resources, why):
    # Accepted before; Ray refused it when the controller created the actors, naming no setting.
    with pytest.raises(ConfigError, match=rf"ScalingConfig.resources_per_worker{why}"):
        ScalingConfig(num_workers=2, resources_per_worker=resources)
    # Amounts Ray takes, and resources that are no accelerator, pass as before.
    ScalingConfig(num_workers=2, resources_per_worker={"TPU": 4, "neuron_cores": 2, "HPU": 1, "custom": 0.5})


@pytest.mark.parametrize("name", ["step-000000001", "step-123456789012"])
def test_a_run_named_like_a_step_directory_is_refused(name):
    # It sat beside the other runs, and `elastic checkpoints ROOT` took the root for a run directory.
    with pytest.raises(ConfigError, match=rf"RunConfig.name='{name}' is the name of a checkpoint step directory"):
        elastic.RunConfig(name=name)
    elastic.RunConfig(name="step-1")  # no step directory's name (those have 9 to 18 digits)


def test_a_factory_or_storage_option_that_cannot_be_pickled_is_named_before_ray_starts(monkeypatch):
    # The bare TypeError ("cannot pickle '_thread.lock' object") came from inside fit(), after an
    # embedded Ray had started, naming no setting.
    import threading

    import ray

    from elastic.config import RunConfig

    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a))
    lock = threading.Lock()

    def dataset_fn():  # its closure holds a lock
        with lock:
            return make_dataset()

    with pytest.raises(ConfigError, match=r"Trainer\.dataset_fn cannot be sent to the workers, which get it pickled "
                                          r"\(cloudpickle\): TypeError: .*lock"):
        _trainer(dataset_fn=dataset_fn).fit(steps=1)
    with pytest.raises(ConfigError, match=r"RunConfig\.storage_options cannot be sent to the run's actors"):
        _trainer(run=RunConfig(storage="memory://pickle", storage_options={"client": threading.Lock()})).fit(steps=1)
    assert started == []


def _stubbed_controller_run(monkeypatch, trainer_module, t, ready_after_s: float, wait_s: float):
    """The progress loop of ``Trainer._wait_with_progress`` against a stand-in controller whose
    run ends ``ready_after_s`` from now, with Ray's ``wait`` taking ``wait_s`` a call."""
    import time
    from types import SimpleNamespace

    end, steps = time.monotonic() + ready_after_s, []

    def status_remote():
        steps.append(len(steps) + 1)  # a step further at every poll: each status differs from the last
        return ("status", steps[-1])

    def wait(refs, timeout):
        time.sleep(wait_s)
        return (refs, []) if time.monotonic() >= end else ([], refs)

    def get(ref, timeout=None):
        if isinstance(ref, tuple):
            return {"step": ref[1], "total_steps": 1000, "loss": 0.5, "samples_per_s": 1234.5, "world_size": 4,
                    "spares": 1, "state": "running"}
        return {"out": ref}

    monkeypatch.setattr(trainer_module.ray, "wait", wait)
    monkeypatch.setattr(trainer_module.ray, "get", get)
    t.controller = SimpleNamespace(status=SimpleNamespace(remote=status_remote))
    return steps


def test_progress_in_a_log_file_is_plain_lines_not_a_bar_redrawn_with_carriage_returns(monkeypatch):
    # The tqdm bar was redrawn every 0.25 s with '\r' whatever stderr was. Under Ray Jobs the
    # driver's stderr is a log file read back as text, where each '\r' is a line break: four bar
    # lines a second (some 14,000 an hour) in `ray job logs`, burying the warnings.
    import io
    import sys

    from elastic import trainer as trainer_module

    t = _trainer(run=RunConfig(name="logged", progress=True))
    log = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    polls = _stubbed_controller_run(monkeypatch, trainer_module, t, ready_after_s=1.0, wait_s=0.05)
    assert t._wait_with_progress("run-ref") == {"out": "run-ref"}
    text = log.getvalue()
    assert len(polls) > 5 and "\r" not in text
    # The first status at once, and the newest at the end; none in between (one per 30 s at most).
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n"), text
    assert lines[0] == ("run 'logged': step 1/1000 loss=0.5 samples_s=1234 world=4 spares=1 state=running")
    assert lines[1].startswith(f"run 'logged': step {len(polls)}/1000 ")


def test_progress_that_cannot_be_written_does_not_end_the_run(monkeypatch):
    # A plain progress line written to a closed stderr (or a log on a failing mount) raised out
    # of the wait, and the run's controller was killed; tqdm, before, stopped drawing instead.
    import io
    import sys

    from elastic import trainer as trainer_module

    t = _trainer(run=RunConfig(name="closed", progress=True))
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    _stubbed_controller_run(monkeypatch, trainer_module, t, ready_after_s=0.3, wait_s=0.05)
    assert t._wait_with_progress("run-ref") == {"out": "run-ref"}


def test_progress_in_a_terminal_is_a_bar_redrawn_a_few_times_a_second_at_most(monkeypatch):
    # bar.refresh() draws whatever tqdm's mininterval says: redrawn at every status, as often as
    # the controller answered.
    import io
    import sys

    from elastic import trainer as trainer_module

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    t = _trainer(run=RunConfig(name="bar", progress=True))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    polls = _stubbed_controller_run(monkeypatch, trainer_module, t, ready_after_s=1.0, wait_s=0.0)
    assert t._wait_with_progress("run-ref") == {"out": "run-ref"}
    assert len(polls) > 100
    # tqdm's first draw and its close, and at most one redraw every _PROGRESS_REDRAW_S (0.5 s) between.
    assert 2 <= terminal.getvalue().count("\r") <= 6, terminal.getvalue().count("\r")
    assert "samples_s=1234" in terminal.getvalue()


def test_use_gpu_on_an_embedded_ray_torch_sees_no_gpu_for_is_refused_before_ray_starts(monkeypatch):
    # Ray started with num_gpus=0 (torch's count), and the cluster check then said Ray had not
    # counted the GPUs through NVML and to `ray start --num-gpus=N`: no fix for an embedded Ray.
    from elastic import trainer as trainer_module

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(trainer_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_module.ray, "init", lambda **kw: pytest.fail("Ray started"))
    monkeypatch.setattr(trainer_module, "check_cluster_fits", lambda *a: pytest.fail("Ray started"))
    for refused in (lambda: trainer_module.connect(None, 1, use_gpu=True),
                    lambda: _trainer(scaling=ScalingConfig(num_workers=2, use_gpu=True)).fit(steps=1)):
        with pytest.raises(ConfigError, match=r"ScalingConfig\.use_gpu=True, but torch sees no CUDA device") as err:
            refused()
        told = str(err.value)
        assert "ray start" not in told and "use_gpu=False" in told
        assert "CPU-only" in told or "built for CUDA" in told
        assert "CUDA_VISIBLE_DEVICES=''" in told


@pytest.mark.parametrize("interrupted_exit", [1, 2])
def test_an_interrupt_as_the_fitting_lock_is_released_leaves_nothing_claimed(monkeypatch, interrupted_exit):
    # The claims were made under the lock and the try/finally that drops them began after it: a
    # KeyboardInterrupt taken as the lock's __exit__ returned (where CPython checks for signals)
    # kept them, and every later fit() of the Trainer (the 1st exit) or of the run name in this
    # process (the 2nd) was refused as "in fit() already" / "another fit() of that run".
    import threading

    from elastic import trainer as trainer_module

    class InterruptedOnce:
        def __init__(self):
            self.lock, self.exits = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            self.exits += 1
            if self.exits == interrupted_exit:
                raise KeyboardInterrupt
            return False

    t = _trainer()
    monkeypatch.setattr(trainer_module, "_FITTING_LOCK", InterruptedOnce())
    monkeypatch.setattr(trainer_module, "_FITTING", set())
    monkeypatch.setattr(trainer_module, "_ray_for_fit", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(t, "_check_cluster_address", lambda: None)
    monkeypatch.setattr(t, "_fit", lambda steps, epochs, packed: "done")
    with pytest.raises(KeyboardInterrupt):
        t.fit(steps=1)
    assert not t._fitting and trainer_module._FITTING == set()
    assert t.fit(steps=1) == "done"
