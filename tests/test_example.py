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


def test_a_run_stopped_before_any_rank_started_exits_130_without_a_traceback(monkeypatch, capsys):
    # Ctrl-C (or `ray job stop`) while the run still waits for placement: no rank, no model state.
    import elastic
    from elastic.trainer import Result, TrainingStopped

    def fit(self, epochs=None, steps=None):
        raise TrainingStopped("run 'digits-early' stopped before any step", Result(
            metrics={"steps": 0, "loss": None, "samples_per_s": 0.0}, history=[], events=[], checkpoint=None,
            recoveries=[], ledger=[], model_state=None, replica_checksums=[]))
    monkeypatch.setattr(elastic.Trainer, "fit", fit)
    with pytest.raises(SystemExit) as exit_:
        digits.main(["--no-progress", "--name", "digits-early"])
    assert exit_.value.code == 130
    out = capsys.readouterr().out
    assert "stopped before any step" in out and "test_accuracy" not in out
