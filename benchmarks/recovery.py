"""Issue #4: time lost to one SIGKILLed worker, ours (hot spare) vs Ray Train (restart from checkpoint).

    python benchmarks/recovery.py [--steps 24 --kill-step 12 --kill-rank 1] [--raytrain-poll-s 2]

Four runs on the MLP workload, 4 ranks, in one Ray: ours clean and with rank ``kill-rank``
SIGKILLed in step ``kill-step`` (``ScalingConfig(num_backups=1, steps_per_dispatch=1)``: one hot
spare, no storage, one step per call), and
Ray Train's ``TorchTrainer`` clean and with the same rank SIGKILLed at the start of the same step
(first attempt only; ``FailureConfig(max_failures=1)``, ``train.report(checkpoint=...)`` every step,
resume from ``train.get_checkpoint()``).

Lost seconds = training wall of the crash run minus that of the clean run, where training wall is
from the end of step 1 to the end of the last step (ours: RUNNING transition + step 1's wall time
-> FINISHED transition; theirs: rank 0's clock, step 1's end carried through checkpoints). That
leaves out the start-up before step 1, the same work in both runs of a pair and the noisiest part
on a loaded machine; the fit() wall-clock difference is printed alongside.

Steps recomputed per failure (ours): what the controller counted in ``recoveries[i]["recomputed"]``
from the ranks' own reports: steps some rank had begun but no survivor completed, plus any rolled
back to a checkpoint. Printed alongside: the history rows beyond one per step (a completed attempt
seen twice), which must be 0.

Time to detect: from the SIGKILL (the worker writes the time just before it: the fault's
``mark``) to the controller's transition to recovering; the controller's own ``detect_s``, from
the start of its wait on the window that held the failed step, is printed alongside.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import elastic
from common import (add_raytrain_args, add_workload_args, claim_stdout, configure_raytrain, elastic_trainer, emit,
                    fail, finished_at, first_step_done, ratio, run_raytrain, start_ray, workload_from_args)

logger = logging.getLogger("bench.recovery")


def run_ours(w, steps: int, kill: dict | None) -> dict:
    # One step per dispatch (both runs alike): the controller's own detect_s runs from the start
    # of its wait on the window holding the failed step, and a window of k steps would put the
    # k-1 healthy steps before the kill into it.
    scaling = elastic.ScalingConfig(num_workers=w.workers, num_backups=1, resources_per_worker={"CPU": 1},
                                    steps_per_dispatch=1)
    name = "recovery-crash" if kill else "recovery-clean"
    t_call = time.time()
    res = elastic_trainer(w, name, scaling=scaling, faults=[kill] if kill else None).fit(steps=steps)
    wall = time.time() - t_call
    completed_rows = len(res.history)
    detected_at = next((e["time"] for e in res.events if e["kind"] == "transition"
                        and e["details"].get("new") == "recovering"), None)
    out = {"fit_wall_s": wall, "train_span_s": finished_at(res) - first_step_done(res), "steps": res.metrics["steps"],
           "detected_at": detected_at,
           "failures": res.metrics["failures"], "recoveries": res.recoveries,
           "recomputed": [rec["recomputed"] for rec in res.recoveries], "history_rows": completed_rows,
           # rows beyond one per final step: completed attempts of a step number seen twice
           "duplicate_rows": completed_rows - len({h["step"] for h in res.history})}
    logger.info("ours %s: %s", name, out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, steps=24)
    add_raytrain_args(p)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--kill-rank", type=int, default=1)
    args = p.parse_args(argv)
    claim_stdout()
    peer = configure_raytrain(args)
    w = workload_from_args(args)
    start_ray(args.num_cpus)
    # The killed worker writes the time of its kill here (one machine: the controller's clock),
    # so the time to detect runs from the kill itself. Removed however the runs end: a run that
    # raises, or a check that fails (fail() exits), left the directory behind.
    with tempfile.TemporaryDirectory(prefix="elastic-recovery-bench-", ignore_cleanup_errors=True) as tmp:
        mark = os.path.join(tmp, "killed_at")
        kill = {"kind": "kill", "rank": args.kill_rank, "at_step": args.kill_step, "mark": mark}

        # Each system's pair back to back, so drift on a shared machine hits a pair's two runs alike.
        ours_clean = run_ours(w, args.steps, None)
        ours_crash = run_ours(w, args.steps, kill)
        their_crash = run_raytrain(w, args.steps, ckpt_every=1, max_failures=1, kill_rank=args.kill_rank,
                                   kill_step=args.kill_step, name="recovery-crash")
        logger.info("ray train crash: %s", their_crash)
        their_clean = run_raytrain(w, args.steps, ckpt_every=1, max_failures=1, name="recovery-clean")
        logger.info("ray train clean: %s", their_clean)

        ours_lost = ours_crash["train_span_s"] - ours_clean["train_span_s"]
        their_lost = their_crash["train_span_s"] - their_clean["train_span_s"]
        common = {**peer, "workers": w.workers, "batch_per_worker": w.batch_per_worker, "model": w.describe()["model"],
                  "steps": args.steps, "kill_step": args.kill_step, "kill_rank": args.kill_rank}
        if ours_crash["failures"] != 1 or not ours_crash["recoveries"]:
            fail(f"ours: expected exactly one failure and recovery, got {ours_crash}")
        if not their_crash.get("start_step"):
            fail(f"ray train: the crash run did not resume from a checkpoint: {their_crash}")
        # A clean run that failed on its own (a loaded machine's timeout) is slower, and the lost
        # time taken against it reads low.
        if ours_clean["failures"] or ours_clean["recoveries"]:
            fail(f"ours: the clean run had a failure of its own: {ours_clean}")
        if their_clean.get("start_step"):
            fail(f"ray train: the clean run resumed from a checkpoint (it failed on its own): {their_clean}")
        try:
            with open(mark) as f:
                killed_at = float(f.read())
        except (OSError, ValueError) as exc:
            fail(f"ours: the killed worker left no readable time of its kill in {mark}: {exc}")
    if ours_crash["detected_at"] is None:
        fail("ours: no transition to recovering in the crash run's event log")
    # A pair's runs differ by noise too: a lost time at or below zero (the crash run no slower
    # than the clean one) makes no ratio, and says so.
    lost_note = {} if ours_lost > 0 and their_lost > 0 else \
        {"value_note": f"no ratio: a lost time is not positive (ours {ours_lost:.3f} s, Ray Train {their_lost:.3f} s)"}

    def noise_note(lost: float) -> dict:  # a lost time at or below zero is the pair's noise, no measurement
        return {} if lost > 0 else {"caveat": "not positive: the crash run was no slower than the clean one "
                                              "(noise); rerun for a measurement"}

    emit("crash_lost_seconds_ours", ours_lost, "s", **noise_note(ours_lost), crash_train_s=ours_crash["train_span_s"],
         clean_train_s=ours_clean["train_span_s"], fit_wall_diff_s=ours_crash["fit_wall_s"] - ours_clean["fit_wall_s"],
         **common)
    emit("crash_lost_seconds_raytrain", their_lost, "s", **noise_note(their_lost),
         crash_train_s=their_crash["train_span_s"],
         clean_train_s=their_clean["train_span_s"], fit_wall_diff_s=their_crash["wall_s"] - their_clean["wall_s"],
         resumed_from_step=their_crash.get("start_step"), **common)
    emit("crash_lost_time_ratio_vs_raytrain", None if lost_note else ratio(ours_lost, their_lost), "ratio",
         ours_s=ours_lost, raytrain_s=their_lost, **lost_note, **common)
    rec = ours_crash["recomputed"]
    emit("steps_recomputed_per_failure", sum(rec) / len(rec) if rec else None, "steps", per_failure=rec,
         failures=ours_crash["failures"], duplicate_history_rows=ours_crash["duplicate_rows"],
         raytrain_steps_recomputed=(args.kill_step - their_crash["start_step"]) if their_crash.get("start_step")
         else None, **common)
    recs = ours_crash["recoveries"]
    emit("time_to_detect_seconds", ours_crash["detected_at"] - killed_at, "s",
         note="from the worker's SIGKILL (the time it wrote just before it) to the controller's transition to "
              "recovering", controller_detect_s=recs[0]["detect_s"] if recs else None,
         controller_detect_note="the controller's own figure: from the start of its wait on the window that "
                                "held the failed step",
         kind=recs[0]["kind"] if recs else None, **common)
    emit("time_to_rebuild_seconds", recs[0]["rebuild_s"] if recs else None, "s",
         note="from the failure to the rebuilt group (spare promoted, state synced, rendezvous)", **common)


if __name__ == "__main__":
    main()
