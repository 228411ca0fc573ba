"""The digits example trains to >= 95% test accuracy on a real Ray cluster."""

from __future__ import annotations

import pytest

import digits

pytestmark = pytest.mark.slow


def test_digits_reaches_95_percent(ray_cluster):
    acc = digits.main(["--no-progress", "--workers", "2", "--spares", "1", "--name", "digits-test"])
    assert acc >= 0.95


def test_docstring_starts_with_both_launch_commands():
    doc = digits.__doc__
    assert "python examples/digits.py" in doc
    assert "ray job submit --working-dir . -- python examples/digits.py" in doc


def test_a_rerun_with_nothing_left_to_train_prints_its_result(monkeypatch, capsys):
    # fit() again on a finished run (same name and storage) trains no step: no loss to print.
    import elastic
    from elastic.trainer import Result

    def fit(self, epochs=None, steps=None):
        return Result(metrics={"steps": 315, "loss": None, "samples_per_s": 0.0}, history=[], events=[],
                      checkpoint={"latest_step": 315}, recoveries=[], ledger=[],
                      model_state=digits.make_model().state_dict(), replica_checksums=[])
    monkeypatch.setattr(elastic.Trainer, "fit", fit)
    digits.main(["--no-progress", "--name", "digits-rerun"])
    assert "steps=315 loss=- " in capsys.readouterr().out


def test_a_run_whose_final_weights_could_not_be_fetched_prints_its_result(monkeypatch, capsys):
    # fit() returns model_state=None when the weights' holder was lost right after the run
    # ended (it warns; the checkpoint has them): the demo then failed with a TypeError.
    import elastic
    from elastic.trainer import Result

    def fit(self, epochs=None, steps=None):
        return Result(metrics={"steps": 315, "loss": 0.09, "samples_per_s": 900.0}, history=[], events=[],
                      checkpoint=None, recoveries=[], ledger=[], model_state=None, replica_checksums=[])
    monkeypatch.setattr(elastic.Trainer, "fit", fit)
    assert digits.main(["--no-progress", "--name", "digits-no-weights"]) is None
    assert "steps=315 loss=0.0900 samples/s=900 test_accuracy=- (no final weights)" in capsys.readouterr().out


def demo_exit_code(monkeypatch, fit, name: str) -> int:
    """The demo's exit code with ``Trainer.fit`` replaced by ``fit`` (which raises)."""
    import elastic

    monkeypatch.setattr(elastic.Trainer, "fit", fit)
    with pytest.raises(SystemExit) as exit_:
        digits.main(["--no-progress", "--name", name])
    return exit_.value.code


def test_a_run_stopped_before_any_rank_started_exits_130_without_a_traceback(monkeypatch, capsys):
    # Ctrl-C (or `ray job stop`) while the run still waits for placement: no rank, no model state.
    from elastic.trainer import Result, TrainingStopped

    def fit(self, epochs=None, steps=None):
        raise TrainingStopped("run 'digits-early' stopped before any step", Result(
            metrics={"steps": 0, "loss": None, "samples_per_s": 0.0}, history=[], events=[], checkpoint=None,
            recoveries=[], ledger=[], model_state=None, replica_checksums=[]))
    assert demo_exit_code(monkeypatch, fit, "digits-early") == 130
    out = capsys.readouterr().out
    assert "stopped before any step" in out and "test_accuracy" not in out


def test_the_straggler_demo_flags_make_a_first_n_run_with_a_slow_rank():
    # The README's straggler demo: no Ray needed to check what it asks the Trainer for.
    args = ["--first-n", "1", "--spares", "1", "--slow-rank", "1", "--slow-factor", "3", "--slow-from-step", "10",
            "--evict-stragglers", "--no-progress"]
    t = digits.build_trainer(digits.parse_args(args))
    assert (t.scaling.aggregation, t.scaling.num_workers, t.scaling.num_backups, t.scaling.num_spares) == \
        ("first_n", 2, 1, 1)
    assert t.faults == [{"kind": "slow", "rank": 1, "from_step": 10, "factor": 3.0}]
    assert t.failure.evict_stragglers
    plain = digits.build_trainer(digits.parse_args(["--slow-rank", "0", "--slow-delay", "0.05", "--slow-from-step", "1"]))
    assert (plain.scaling.aggregation, plain.scaling.num_backups) == ("all", 1)  # --spares: hot spares
    assert plain.faults == [{"kind": "slow", "rank": 0, "from_step": 1, "delay_s": 0.05}]
    assert digits.build_trainer(digits.parse_args([])).faults == []


def test_the_mixed_precision_flag_asks_the_trainer_for_it():
    assert digits.build_trainer(digits.parse_args(["--mixed-precision", "fp16"])).spec.mixed_precision == "fp16"
    assert digits.build_trainer(digits.parse_args([])).spec.mixed_precision is None


@pytest.mark.parametrize("args, field, flags", [
    (["--slow-rank", "5"], "Trainer.faults",
     "--slow-rank/--slow-factor/--slow-delay/--slow-from-step/--kill-rank/--kill-at-step: "),
    (["--evict-stragglers", "--spares", "0"], "ScalingConfig.num_backups", "--evict-stragglers, --spares: "),
    (["--first-n", "-1"], "ScalingConfig.num_backups", "--first-n: "),
    (["--spares", "-1"], "ScalingConfig.num_backups", "--spares: "),  # plain: --spares are num_backups
    (["--first-n", "1", "--spares", "-1"], "ScalingConfig.num_spares", "--spares: "),
    (["--workers", "3"], "global_batch_size", "--batch, --workers: "),
    (["--name", "a/b"], "RunConfig.name", "--name: "),
    (["--epochs", "0"], "epochs must be an integer >= 1", "--epochs: "),  # from fit(), before Ray starts
    (["--slow-factor", "5"], "--slow-rank", "error: --slow-factor and --slow-delay"),
    (["--slow-rank", "1", "--slow-delay", "0.1", "--slow-factor", "5"], "not both", "error: give"),
    (["--slow-rank", "1", "--slow-delay", "1e10"], "Trainer.faults", "error: --slow-rank/"),
])
def test_bad_demo_flags_exit_with_the_setting_to_change_before_any_actor_starts(args, field, flags, capsys):
    # The message names the Trainer setting, and the flags behind it come first.
    with pytest.raises(SystemExit) as exit_:
        digits.main(["--no-progress", *args])
    assert exit_.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert field in err and flags in err and "Traceback" not in err


def test_the_cluster_checks_refusal_names_the_flags_behind_it():
    # Its first-N wording and its hint to wait for an autoscaler's nodes named no flag: the
    # demo's user read "--workers" alone, not --first-n or --wait-for-nodes.
    from elastic.actors import cluster_fit

    args = digits.parse_args(["--first-n", "2"])
    replicas, _ = cluster_fit._replica_settings(digits.build_trainer(args).scaling)
    refusal = cluster_fit._refuse(cluster_fit.Capacity({"CPU": 2.0}, [], live=True),
                                  f"The run needs 4 CPU; lower {replicas}.")
    assert digits.flags_named(str(refusal), args).startswith("--workers, --first-n, --wait-for-nodes: The run needs")


def test_a_config_error_that_no_flag_causes_exits_2_without_the_usage_line(monkeypatch, capsys):
    # A ConfigError from fit() after the ranks started (here: the workers built different
    # datasets) names no flag, so the usage line would send the user to the flags for nothing.
    import elastic

    def fit(self, epochs=None, steps=None):
        raise elastic.ConfigError("dataset_fn built datasets of different sizes on the workers (1797 rows on "
                                  "ranks [0], 1796 on ranks [1])")
    assert demo_exit_code(monkeypatch, fit, "digits-differs") == 2
    err = capsys.readouterr().err
    assert ": error: dataset_fn built datasets of different sizes" in err and "usage:" not in err


def test_the_kill_demo_loses_one_step_to_a_hot_spare(ray_cluster, capsys):
    # The docstring's failure demo: a rank SIGKILLed mid-run, a hot spare in its place, the run
    # goes on and says what it cost.
    acc = digits.main(["--no-progress", "--kill-rank", "1", "--kill-at-step", "20", "--epochs", "3",
                       "--name", "digits-kill"])
    out = capsys.readouterr().out
    assert "failures=1 " in out and "restored_from=None" in out, out
    recomputed = int(out.split("recomputed_steps=")[1].split()[0])
    assert recomputed <= 1 and acc > 0.5


def test_an_eviction_held_back_after_its_decision_is_not_counted_as_one():
    decision = {"kind": "decision", "message": "EvictStraggler: slow",
                "details": {"decision": "EvictStraggler", "rank": 1}}

    def running(why):
        return {"kind": "transition", "message": f"recovering -> running: {why}", "details": {"new": "running"}}

    assert digits.evicted_ranks([decision, running("eviction of rank 1 held back: no live spare")]) == []
    assert digits.evicted_ranks([decision, running("eviction of rank 1 held back: no live spare"),
                                 decision, running("rank 1 replaced by a spare in 0.30s")]) == [1]


def test_the_wait_for_nodes_flag_waits_for_an_autoscaler_up_to_fifteen_minutes(monkeypatch):
    monkeypatch.delenv("ELASTIC_PLACEMENT_TIMEOUT_S", raising=False)
    s = digits.build_trainer(digits.parse_args(["--wait-for-nodes", "--gpu"])).scaling
    assert s.wait_for_nodes and s.placement_timeout_s == 900.0 and s.use_gpu
    s = digits.build_trainer(digits.parse_args(["--wait-for-nodes", "--first-n", "1"])).scaling
    assert s.wait_for_nodes and s.aggregation == "first_n"
    assert not digits.build_trainer(digits.parse_args([])).scaling.wait_for_nodes
