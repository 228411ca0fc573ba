"""Issue #5: throughput with one rank slowed 3x, plain sync vs first-N-of-M vs first-N plus eviction.

    python benchmarks/straggler.py [--steps 300 --evict-steps 400 --slow-from 10 --factor 3 --digits-epochs 6]

Five runs on the MLP workload, 4 active ranks: healthy plain sync; plain sync with rank 3 slowed
``factor``x from step ``slow-from`` (each of its steps takes ``factor`` times its healthy step);
first-N-of-M (b=1, M=5) with the same slowdown; first-N plus eviction (one hot spare,
``evict_stragglers=True``); and first-N with no straggler, which shows what the fifth replica
alone costs when five processes share this machine's cores (``--no-first-n-healthy`` skips it).
The five repeat ``--rounds`` times (default 2), the order reversed every other round, so load
drift on a shared machine reaches every mode alike; each ratio is taken within a round over that
round's healthy plain run over the same steps, and the figure is the mean of the rounds (each
round is listed). Every mode runs as many steps as the eviction run, so every ratio's base, per
step or by the wall clock, covers the very steps its mode measured; a round whose ratio cannot be
taken fails the benchmark.
Throughput is samples/s over the controller's per-step wall times of the steps from ``slow-from`` on
(for eviction: the steps after the eviction; its figure also gives
the ratio over the steps after the replacement spare is ready: the spare that refills the pool
builds on idle CPU, so it may come up late or not within the run). Three more runs
on the digits example (same epochs) give the accuracy cost of dropping the late gradient: healthy
plain minus first-N with the straggler, and for its scale a healthy run with another seed
(``seed_to_seed_delta``: one run a side is one draw of a noisy figure). On digits the model is
tiny, so the slowdown (a multiple of the rank's own compute time) is small; which gradient is
dropped still follows arrival order.

The runs default to 400 steps, the eviction run's (``--evict-steps``; ``--steps``, 300, without
the eviction mode). At 50 steps (41 measured, about two seconds of
training) the onset of the slowdown and the dispatch window still growing from one step dominate:
first-N read 0.597 at 50 steps and 0.956 at 300 steps on the same code, and over 1,200 steps
first-N with the straggler ran as fast as first-N without it (19.2-21.5 against 19.9 steps/s).

On a lent 16-core machine (CPU ranks, one round, ``--skip-accuracy``, 2026-11-26) the fifth
replica costs no cores, and what first-N costs is its exchange: the gradient's all-reduce starts
only once the fast set is known (DDP overlaps it with the backward) and two store round trips,
~1.5 ms a step. On the default 5.6 ms step: plain 0.309, first-N 0.768 (0.994 of first-N with no
straggler), evict 0.856. With ``--batch-per-worker 512 --steps 200`` (a 23 ms healthy step; that
run was cut off before the eviction mode and its figure lines, so these come from its per-mode
log lines): healthy 89,012 samples/s, plain with the straggler 32,980 (0.371), first-N 92,409
(1.038). Those 16-core figures predate the known-set steps (elastic/actors/sitout.py): since
then a step in which exactly N replicas may compute skips the store agreement, which on this
workload is 85-90% of the first-N steps (``agreed_steps`` per mode: 35 of 300 with the
straggler, 43-50 of 300 with none); not yet measured on a machine with cores to spare.

On the 2-vCPU VM, 2026-11-26, one clean run of this script with that change (``--skip-accuracy``):
plain 0.356, first-N 0.879, evict 0.742 (healthy 9,431 and 9,067 samples/s). Alternating
``--modes first_n,evict,first_n_healthy --rounds 1`` runs of the code before and after it could
not tell them apart: first-N 9,684 and 8,705 samples/s before against 9,788 and 8,735 after,
with healthy plain moving between 9,730 and 12,843 from run to run. With every core busy, what
a step costs is its CPU, and the agreement's round trips were mostly waiting.

Where the eviction's figure stands on the 2-vCPU VM (2026-11-27, ``--modes evict,first_n_healthy
--rounds 2 --skip-accuracy --evict-steps 1200``): evict 0.829/0.856 of healthy plain over the
1,115-1,153 steps after the eviction; over the ~800 steps after the refill spare was ready (steps
405 and 383), 0.914/0.920, while first-N with no straggler ran at 0.917 of healthy plain: once
the pool is whole again the run is as fast as first-N without a straggler, and what remains is
the fifth replica on two cores. Per-process CPU from /proc over ~520 steady steps (healthy plain
against first-N with no straggler and late_backoff_steps=100000, so a step's fast set is known
and one replica rests): the four DDP ranks 27.3-30.0 ms of CPU a step in all, the five replicas
31.6-33.8 ms: the resting replica ~1.8-5 ms a step (receive the update, the optimizer step, its
share of Ray's calls) and each computing one ~0.7 ms more than a DDP rank (the leader's copy and
send to the resting one, the flat buffer's bookkeeping). With the default backoff (8), the steps
agreed on the store (15%, all five computing) bring it to 32.5-37 ms.
"""

from __future__ import annotations

import argparse
import logging
import time

import elastic
from elastic.controller import evictions_carried_out
from common import (add_workload_args, claim_stdout, elastic_trainer, emit, fail, finished_at, fit_polled,
                    history_throughput, ratio, require_clean, running_since, span_throughput, start_ray,
                    step_throughput, workload_from_args)

logger = logging.getLogger("bench.straggler")


def eviction(res) -> dict | None:
    """The EvictStraggler decision event of the first eviction carried out (its step: the last
    step before the eviction); one held back after its decision left the straggler in, and the
    steps after it would count as the evicted run's."""
    done = evictions_carried_out(res.events)
    return done[0] if done else None


def spare_ready_step(samples: list[dict], evicted_at: float) -> int | None:
    """First polled step after the eviction at which a hot spare is ready again.

    The controller requests a replacement spare after promoting one; on one small machine that
    actor's start-up (a process, torch, the model) competes with training for CPU. The controller
    notices a ready spare every 10 steps, so this step is late by up to 10.
    """
    for p in samples:
        if p["time"] > evicted_at and p["state"] == "running" and (p["spares"] or 0) >= 1:
            return p["step"]
    return None


def run_mode(w, mode: str, steps: int, slow: dict, evict_window: int, poll_s: float, backoff: int) -> dict:
    n = w.workers
    faults = [] if mode.endswith("healthy") else [slow]
    failure = None
    if mode in ("healthy", "plain"):
        scaling = elastic.ScalingConfig(num_workers=n, resources_per_worker={"CPU": 1})
    else:
        scaling = elastic.ScalingConfig(num_workers=n, num_backups=1, aggregation="first_n",
                                        num_spares=1 if mode == "evict" else 0,
                                        resources_per_worker={"CPU": 1}, late_backoff_steps=backoff)
    if mode == "evict":
        failure = elastic.FailureConfig(evict_stragglers=True, straggler_factor=2.0, straggler_window=evict_window)
    trainer = elastic_trainer(w, f"straggler-{mode.replace('_', '-')}", scaling=scaling, failure=failure,
                              faults=faults)
    # Every run is polled, so all carry its (small) cost alike.
    res, samples, t_call = fit_polled(trainer, steps, poll_s)
    wall = time.time() - t_call
    # Every mode, the eviction's too: an eviction carried out is no failure and no recovery
    # (require_clean), and a rank lost while evicting is one, whose rebuild and recomputed
    # steps no per-step figure of a straggler shows.
    require_clean(res, f"{mode} run")
    after = slow["from_step"] - 1
    evicted = ready = None
    extra = {}
    if mode == "evict":
        ev = eviction(res)
        if ev is None:
            fail("evict run: no EvictStraggler decision in the event log, so its figure would measure "
                 "first-N with an idle spare")
        if ev["details"].get("rank") != slow["rank"]:
            fail(f"evict run: rank {ev['details'].get('rank')} was evicted, not the slowed rank {slow['rank']}")
        after = evicted = ev["step"]
        extra = {"evicted_rank": ev["details"].get("rank"), "evict_reason": ev["message"]}
        ready = spare_ready_step(samples, ev["time"])
        if ready is not None:
            extra["after_spare_ready"] = step_throughput(res, after_step=ready)
    tp = step_throughput(res, after_step=after)
    whole = finished_at(res) - running_since(res)
    out = {"mode": mode, "run_steps": steps, "measured_after_step": after, "evicted_after_step": evicted,
           "spare_ready_step": ready, **tp, **extra,
           # By the wall clock from the end of the last step before the slowdown to FINISHED: what
           # the per-step figure leaves out of an eviction (the slow steps before it was decided,
           # the rebuild) is in here.
           "from_slowdown": span_throughput(res, slow["from_step"] - 1),
           "whole_run_samples_per_s": sum(h["samples"] for h in res.history) / whole,
           "dropped_samples": res.metrics["dropped_samples"], "late_gradients": res.metrics["late_gradients"],
           "agreed_steps": res.metrics["agreed_steps"],
           "wall_s": wall}
    logger.info("%s: %s", mode, out)
    out["history"] = res.history  # for the ratios over the same steps (main's base_over); not logged
    return out


def base_over(run: dict, after_step: int) -> float | None:
    """``run``'s samples/s over its steps after ``after_step``: a ratio's base over the steps its
    figure measures (every mode runs as many steps). Why not the base run's own figure (from the
    slowdown on): the eviction is measured from its decision (step ~40-70), and the base's steps
    before that hold the dispatch window's ramp (windows grow from one step), a slower base that
    flattered the ratio."""
    return history_throughput(run["history"], after_step)["samples_per_s"]


def ratio_over_healthy(run: dict, healthy: dict, after_step: int | None = None) -> float:
    """``run``'s samples/s (or, with ``after_step``, over its steps after that one) over the
    healthy run's over the same steps. A round whose ratio cannot be taken (no timed step on
    either side) fails the benchmark: the mean of the other rounds was printed as the figure."""
    if after_step is None:
        after_step, mine = run["measured_after_step"], run["samples_per_s"]
    else:
        mine = history_throughput(run["history"], after_step)["samples_per_s"]
    value = ratio(mine, base_over(healthy, after_step))
    if value is None:
        fail(f"{run['mode']}: no ratio over the healthy run after step {after_step} (no timed steps on one side)")
    return value


def evict_details(run: dict, healthy: dict) -> dict:
    """For the eviction run: who was evicted and why, its length, and the ratio over the steps
    after the replacement spare was ready (against the healthy run over those steps)."""
    out = {"run_steps": run["run_steps"], "evicted_after_step": run["evicted_after_step"],
           "evicted_rank": run.get("evicted_rank"), "evict_reason": run.get("evict_reason")}
    if "after_spare_ready" in run:
        later = run["after_spare_ready"]
        out.update(spare_ready_step=run["spare_ready_step"], steps_after_spare_ready=later["steps"])
        if later["steps"]:
            out["ratio_after_spare_ready"] = ratio_over_healthy(run, healthy, after_step=run["spare_ready_step"])
        else:
            # The spare was noticed at the run's last step (the pool is looked at every 10
            # steps): no step to measure. A side detail, which must not fail the benchmark
            # (ratio_over_healthy would) after every round ran and lose every figure.
            out.update(ratio_after_spare_ready=None,
                       ratio_after_spare_ready_note="no timed step after the spare was ready (noticed at the "
                                                    "run's last step); run more --evict-steps to measure it")
    return out


def digits_accuracy(mode: str, workers: int, epochs: int, slow: dict, backoff: int, seed: int = 0) -> float:
    import digits

    if mode == "healthy":
        scaling, faults = elastic.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}), []
    else:
        scaling = elastic.ScalingConfig(num_workers=workers, num_backups=1, aggregation="first_n",
                                        resources_per_worker={"CPU": 1}, late_backoff_steps=backoff)
        faults = [slow]
    trainer = elastic.Trainer(digits.make_model, digits.make_optimizer, digits.train_dataset, digits.loss_fn,
                              64, scaling=scaling,
                              run=elastic.RunConfig(name=f"straggler-digits-{mode}-{seed}", seed=seed),
                              faults=faults)
    res = trainer.fit(epochs=epochs)
    # A recovery (a rank lost, the group rebuilt) is no part of the straggler's cost, and one
    # that shrank the group would change the training the delta compares.
    require_clean(res, f"digits {mode} (seed {seed}) run")
    acc = digits.test_accuracy(res.model_state)
    logger.info("digits %s: accuracy %.4f after %d steps, dropped %d samples", mode, acc, res.metrics["steps"],
                res.metrics["dropped_samples"])
    return acc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, steps=300)
    p.add_argument("--slow-rank", type=int, default=3)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--slow-from", type=int, default=10)
    p.add_argument("--evict-window", type=int, default=5, help="FailureConfig.straggler_window for the evict run")
    p.add_argument("--evict-steps", type=int, default=400,
                   help="steps of every run when the eviction mode runs (--steps otherwise): long enough for the replacement spare (started after the eviction, ~10 s on a loaded 2-core machine) to be ready, and to measure well after it")
    p.add_argument("--poll-s", type=float, default=0.2, help="controller status() poll interval")
    p.add_argument("--digits-epochs", type=int, default=6)
    p.add_argument("--no-first-n-healthy", dest="first_n_healthy", action="store_false",
                   help="skip first-N-of-M with no straggler (the cost of M = N + 1 replicas alone)")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--late-backoff-steps", type=int, default=elastic.ScalingConfig.late_backoff_steps,
                   help="ScalingConfig.late_backoff_steps of the first-N runs (0: a late replica never sits out)")
    p.add_argument("--modes", default="",
                   help="comma-separated subset of the throughput runs to make (healthy is always made); "
                        "for experiments: the figures need all of them")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of every mode, alternating the order; each ratio is the mean of its rounds")
    args = p.parse_args(argv)
    claim_stdout()
    modes = ("healthy", "plain", "first_n", "evict") + (("first_n_healthy",) if args.first_n_healthy else ())
    if args.modes:
        modes = ("healthy",) + tuple(m for m in modes if m != "healthy" and m in args.modes.split(","))
    # Every mode as long as the longest (the eviction's, which needs the steps for its refill
    # spare): each ratio then compares the same steps, per step and by the wall clock alike.
    longest = args.evict_steps if "evict" in modes else args.steps
    # The data sized for the steps every mode runs, not --steps: at 300 of 400 the epoch
    # wrapped, and the last quarter saw the first samples again. And for first-N's five
    # replicas (num_backups=1 below), each handed a worker's shard a step.
    w = workload_from_args(args, min_steps=longest, replicas=args.workers + 1)
    start_ray(args.num_cpus)  # at most 5 replicas + 1 spare + 1 replacement spare hold a CPU
    slow = {"kind": "slow", "rank": args.slow_rank, "factor": args.factor, "from_step": args.slow_from}

    # Rounds alternate the order (forward, then backward, ...), so load drift on a shared machine
    # reaches every mode alike; each ratio is taken within a round and the figure is their mean.
    rounds = []
    for i in range(args.rounds):
        order = modes if i % 2 == 0 else tuple(reversed(modes))
        rounds.append({m: run_mode(w, m, longest, slow, args.evict_window, args.poll_s, args.late_backoff_steps)
                       for m in order})
    common = {"workers": w.workers, "batch_per_worker": w.batch_per_worker, "model": w.describe()["model"],
              "steps": longest, "slow_rank": args.slow_rank, "factor": args.factor, "slow_from": args.slow_from,
              "rounds": args.rounds, "late_backoff_steps": args.late_backoff_steps}

    def mean_ratio(mode: str, over: str) -> tuple[float, list]:
        per_round = [ratio_over_healthy(r[mode], r[over]) for r in rounds]
        return sum(per_round) / len(per_round), per_round

    # The accuracy runs before any figure is printed: a failure there must not leave part of
    # the figures on stdout.
    accuracy = None
    if not args.skip_accuracy:
        accuracy = (digits_accuracy("healthy", w.workers, args.digits_epochs, slow, 0),
                    digits_accuracy("first_n", w.workers, args.digits_epochs, slow, args.late_backoff_steps),
                    # The scale of the delta: two healthy runs whose seeds (initial weights,
                    # data order) differ, with no straggler and no dropped gradient.
                    digits_accuracy("healthy", w.workers, args.digits_epochs, slow, 0, seed=1))

    # Every figure is worked out before any is printed: a round that yields no ratio fails the
    # benchmark (ratio_over_healthy), and must not leave the figures before it on stdout.
    figures = []
    for mode in (m for m in ("plain", "first_n", "evict") if m in modes):
        value, per_round = mean_ratio(mode, "healthy")
        details: dict = {"per_round": per_round,
                         "samples_per_s": [r[mode]["samples_per_s"] for r in rounds],
                         "healthy_samples_per_s": [r["healthy"]["samples_per_s"] for r in rounds],
                         # The base of each round's ratio: the healthy run over the same steps.
                         "healthy_samples_per_s_same_steps": [base_over(r["healthy"], r[mode]["measured_after_step"])
                                                              for r in rounds],
                         "measured_after_step": [r[mode]["measured_after_step"] for r in rounds],
                         "measured_steps": [r[mode]["steps"] for r in rounds],
                         # Wall clock from the slowdown to the end, against the healthy run's
                         # over the same steps (every mode runs as many).
                         "wall_ratio_from_slowdown_per_round": [
                             ratio(r[mode]["from_slowdown"]["samples_per_s"],
                                   r["healthy"]["from_slowdown"]["samples_per_s"]) for r in rounds]}
        if mode != "plain" and "first_n_healthy" in modes:
            # The straggler's own cost, apart from what a fifth replica costs on this machine.
            details["ratio_vs_first_n_healthy"], details["per_round_vs_first_n_healthy"] = \
                mean_ratio(mode, "first_n_healthy")
        if mode == "evict":
            details["rounds_detail"] = [evict_details(r["evict"], r["healthy"]) for r in rounds]
        figures.append((f"straggler_throughput_ratio_{mode}", value, details))
    for figure, value, details in figures:
        emit(figure, value, "ratio", **details, **common)
    for mode in modes:
        runs = [r[mode] for r in rounds]
        emit(f"straggler_samples_per_s_{mode}", sum(r["samples_per_s"] for r in runs) / len(runs), "samples/s",
             per_round=[r["samples_per_s"] for r in runs], mean_step_time_s=[r["mean_step_time_s"] for r in runs],
             measured_after_step=[r["measured_after_step"] for r in runs],
             whole_run_samples_per_s=[r["whole_run_samples_per_s"] for r in runs],
             dropped_samples=[r["dropped_samples"] for r in runs],
             late_gradients=[r["late_gradients"] for r in runs], agreed_steps=[r["agreed_steps"] for r in runs],
             **common)

    if accuracy is not None:
        healthy, first_n, healthy_other_seed = accuracy
        emit("first_n_accuracy_delta", healthy - first_n, "accuracy", healthy_plain_accuracy=healthy,
             first_n_straggler_accuracy=first_n, healthy_plain_accuracy_seed_1=healthy_other_seed,
             seed_to_seed_delta=healthy - healthy_other_seed, epochs=args.digits_epochs, dataset="sklearn digits",
             workers=w.workers, global_batch=64, slow=slow)


if __name__ == "__main__":
    main()
