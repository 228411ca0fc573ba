"""Issue #2: data-parallel throughput and start-up against Ray Train's TorchTrainer (DDP on gloo).

    python benchmarks/throughput.py [--steps 400 --warmup 40 --repeats 4]

Same model, data, shards and worker count in one run. Ours: samples/s by the wall clock from the
end of step ``warmup`` to the FINISHED transition. Theirs: the train loop times itself on rank 0
over the same steps and reports once at the end. Time to first step is from the ``fit()`` call to
the end of step 1 (ours: RUNNING transition + step 1's wall time; theirs: time.time() on rank 0).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from common import (add_raytrain_args, add_workload_args, claim_stdout, configure_raytrain, elastic_trainer, emit,
                    first_step_done, ratio, require_clean, run_raytrain, span_throughput, start_ray,
                    step_throughput, workload_from_args)

logger = logging.getLogger("bench.throughput")


def run_ours(w, steps: int, warmup: int, name: str) -> dict:
    trainer = elastic_trainer(w, name)
    t_call = time.time()
    res = trainer.fit(steps=steps)
    wall = time.time() - t_call
    # Ours heals a failure and goes on, where the peer (max_failures=0) raises: a recovered run's
    # figures would leave the recovery out and set it against a peer run that had none.
    require_clean(res, f"ours {name}")
    span = span_throughput(res, warmup)
    per_step = step_throughput(res, after_step=warmup)
    return {
        "samples_per_s": span["samples_per_s"],
        "samples_per_s_step_times": per_step["samples_per_s"],
        "time_to_first_step_s": first_step_done(res) - t_call,
        "dispatch_overhead_fraction": per_step["mean_controller_time_s"] / per_step["mean_step_time_s"],
        "mean_step_time_s": per_step["mean_step_time_s"],
        "mean_controller_time_s": per_step["mean_controller_time_s"],
        "wall_s": wall,
        "steps_per_dispatch": ([e["details"]["steps_per_dispatch"] for e in res.events if e["kind"] == "dispatch"]
                               or [1])[-1],
        "loss": res.metrics["loss"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, steps=400)
    add_raytrain_args(p)
    p.add_argument("--warmup", type=int, default=40, help="steps left out of the steady-state figures")
    p.add_argument("--repeats", type=int, default=4,
                   help="pairs run, in ABBA order; the median of each figure is reported. On a shared machine "
                        "one pair's ratio can be off by 2x; use 4 or more for a decision")
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be at least 1 (the peer's clock starts at the end of step "
                f"--warmup) and below --steps ({args.steps})")
    claim_stdout()
    peer = configure_raytrain(args)
    w = workload_from_args(args)
    start_ray(args.num_cpus)

    ours, theirs = [], []
    for i in range(args.repeats):
        # Alternate the order (ABBA) so drift on a noisy machine does not favour one side.
        order = ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")
        for who in order:
            if who == "ours":
                ours.append(run_ours(w, args.steps, args.warmup, f"throughput-{i}"))
                logger.info("ours: %s", ours[-1])
            else:
                theirs.append(run_raytrain(w, args.steps, args.warmup, name=f"throughput-{i}"))
                logger.info("ray train: %s", theirs[-1])

    def med(runs, key):
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    common = {**peer, "workers": w.workers, "batch_per_worker": w.batch_per_worker, "model": w.describe()["model"],
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
    ours_sps, their_sps = med(ours, "samples_per_s"), med(theirs, "samples_per_s")
    ours_ttfs, their_ttfs = med(ours, "time_to_first_step_s"), med(theirs, "time_to_first_step_s")
    def per_pair(key):
        return [ratio(a[key], b[key]) for a, b in zip(ours, theirs)]

    def paired(key):
        """The median of each pair's ratio: the pairs ran side by side (ABBA), so each ratio
        cancels the drift a ratio of the two sides' medians keeps."""
        pairs = [r for r in per_pair(key) if r is not None]
        return statistics.median(pairs) if pairs else None

    emit("dp_throughput_ratio_vs_raytrain", paired("samples_per_s"), "ratio", ours_samples_per_s=ours_sps,
         raytrain_samples_per_s=their_sps, per_pair=per_pair("samples_per_s"),
         ratio_of_medians=ratio(ours_sps, their_sps),
         steps_per_dispatch=[r["steps_per_dispatch"] for r in ours], **common)
    emit("time_to_first_step_ratio_vs_raytrain", paired("time_to_first_step_s"), "ratio",
         ours_s=ours_ttfs, raytrain_s=their_ttfs, per_pair=per_pair("time_to_first_step_s"),
         ratio_of_medians=ratio(ours_ttfs, their_ttfs), **common)
    emit("dispatch_overhead_fraction", med(ours, "dispatch_overhead_fraction"), "fraction",
         note="controller busy time per step (dispatch, bookkeeping, policies; waiting on workers excluded)",
         mean_step_time_s=med(ours, "mean_step_time_s"), mean_controller_time_s=med(ours, "mean_controller_time_s"),
         **common)
    emit("dp_samples_per_s_ours", ours_sps, "samples/s",
         by_step_times=med(ours, "samples_per_s_step_times"), **common)
    emit("dp_samples_per_s_raytrain", their_sps, "samples/s", **common)
    emit("time_to_first_step_ours", ours_ttfs, "s", **common)
    emit("time_to_first_step_raytrain", their_ttfs, "s", **common)


if __name__ == "__main__":
    main()
