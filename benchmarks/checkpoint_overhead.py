"""Issue #3: the cost of a checkpoint every step, on file:// and on S3 (moto on loopback), and against
Ray Train's ``train.report(checkpoint=...)`` every step.

    python benchmarks/checkpoint_overhead.py [--steps 100 --warmup 10 --raytrain-steps 20] [--skip-s3]

Five runs on the MLP workload, 4 ranks, in one Ray: ours without checkpoints (before and after the
two below, so load drift on a shared machine hits baseline and checkpointed runs alike), ours with
a checkpoint every step to file:// and to s3:// (a ``moto`` server on 127.0.0.1 in this process),
and Ray Train's TorchTrainer saving model + optimizer from rank 0 and reporting it every step
(SYNC upload to a local storage_path, ``num_to_keep=3`` like our ``keep_last=3``). Ray Train's
``report`` puts into a queue of one that its controller drains every health-check interval (2 s by
default), so with a report every step its rate is set by that interval; it runs ``--raytrain-steps``
steps (fewer than ours, to keep the run short; both are rates over steady-state steps).

Overhead = mean controller step wall time with checkpoints / without (the mean of the two
baseline runs), over the steps after ``warmup``. Steps/s against Ray Train: ours by the wall clock
from the end of step ``warmup`` to the FINISHED transition (which waits for the last commit),
theirs timed on rank 0 over its steady-state steps.

Each overhead figure also gives this process's CPU per step (``driver_cpu_ms_per_step``, against
the baselines'): in the s3 run it includes the moto server, which shares the cores with training
here and which a remote S3 endpoint would not.

Checkpoint lag (steps training is ahead of the newest committed checkpoint): after every step
past the warm-up, that step minus the newest step committed by then (``lag_after_each_step``).
Beside it, the lag each commit reports when it lands (the low point between commits), in order
of preference: ``checkpoint_commit`` events' ``details["lag"]``; else commit events' times
against the step timeline (RUNNING + cumulative step wall times); else the controller's
``status()`` (``checkpoint.lag``) polled every ``--poll-s`` during every run, baselines included. Persist
seconds (step end -> commit): ``checkpoint_commit`` details ``persist_s``; else commit event times
against the step timeline; else the retained steps' manifest ``created_at`` (``keep_last`` of
them). Size: the retained committed steps' bytes on storage. Each figure names its source.

Where the overhead goes on the 2-vCPU benchmark VM (CPU per process from /proc over 350 steps;
4 ranks, 3.25 MB state, a step of ~19-25 ms without checkpoints, when ~90% of the two cores are
busy): checkpointing adds ~15-20 ms of CPU a step in all, and with the cores full, wall time
follows CPU. With the node checkpoint agent (elastic/checkpoint/agent.py) the ranks spend +5-10
ms a step (the in-step snapshot, RNG, a message), the agent ~5-8 ms (hashing 1.1 ms and writing
plus fsync ~1.4 ms per 1.6 MB shard, two shards a step; the rest its threads and messages), the
controller +2.5-3 ms (one report a step, the manifest, retention). The writer threads inside the
ranks (before the agent) cost about the same in total, spread over the ranks: alternating runs
of ``--skip-s3 --skip-raytrain`` gave 1.533, 1.371 and 1.448 in process against 1.459, 1.517
and 1.349 with the agent. What did not move the mean step time beyond this machine's noise
(+-10% between identical runs): no fsync, CRC-32 instead of sha256, a 0.5 ms GIL switch
interval, the writer at nice 19 or SCHED_IDLE, and 0.8 MB instead of 2 MiB shards. The ~2.5 ms a
step of per-byte work alone (hash, page cache, fsync) is ~5% of the CPU a step has here.

Commit lag on the same VM (2026-11-27): the agent's idle-class writers now run at normal
priority while they are a step or more behind (``WriterPriority.hurry``), and retention and GC
no longer run on the commit thread (elastic/checkpoint/committer.py). A full run after both
printed lag p95 1 (max 3) on file and 3 (max 12) on S3, and another at b7487b1 1 (max 3) and 4
(max 8); the last full run before them (b5d9a5a) printed 3 (max 4) and 4, and one with the
hurry alone 2 (max 6) and 3 (max 23). The alternating rounds that isolate each change are in
those docstrings.

With cores to spare (a lent 16-core machine, the same CPU ranks, ``--skip-s3 --skip-raytrain``,
2026-11-26) the default workload's step is ~6 ms, and the in-step snapshot (state_dict, the
state's walk, RNG, the meta's JSON, a 1.6 MB copy, one message: ~1 ms of Python on the writing
ranks) is what remains: 1.20, 1.17 and 1.28, against 1.09 and 1.25 for the code before the walk
and RNG encoding were made faster (alternating, within the noise). With ``--batch-per-worker
512`` (a 22 ms step) the same machine gave 0.982, commit lag p95 0: the cost is a fixed time a
step, not a share of it.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import re
import shutil
import tempfile
import time

import elastic
from elastic.controller import ROUTINE_EVENTS_KEPT
from common import (add_raytrain_args, add_workload_args, claim_stdout, configure_raytrain, elastic_trainer, emit,
                    events_of, fail, fit_polled, percentile, ratio, require_clean, run_raytrain, running_since,
                    span_throughput, start_ray, step_throughput, workload_from_args)

logger = logging.getLogger("bench.checkpoint")

BUCKET = "elastic-bench"


def step_end_times(res) -> list[tuple[float, int]]:
    """(time step ended, step) from RUNNING + cumulative step wall times (between-step gaps left out)."""
    t, out = running_since(res), []
    for h in res.history:
        t += h["step_time_s"]
        out.append((t, h["step"]))
    return out


def lag_after_each_step(res, warmup: int) -> list[int]:
    """The lag as training sees it: after each step past ``warmup``, that step minus the newest
    step committed by then (commit times from the ``checkpoint_commit`` events, step ends from
    ``step_end_times``). Why not the lag a commit reports: taken when a commit lands, it is the
    low point between commits, and up to the steps a superseded commit skipped lower than the
    lag in between. Step ends computed without the gaps between steps come early, so a commit
    lands after more of them than it did: if anything this reads high."""
    commits = sorted((e["details"].get("time", e["time"]), e["details"]["step"])
                     for e in events_of(res, "checkpoint_commit") if "step" in e["details"])
    out, newest, i = [], 0, 0
    for t, step in step_end_times(res):
        while i < len(commits) and commits[i][0] <= t:
            newest = max(newest, commits[i][1])
            i += 1
        if step > warmup:
            out.append(step - newest)
    return out


def commit_readings(res, poll: list[dict]) -> dict:
    """Lag per commit, persist seconds and sizes, from whatever the event log carries (see docstring)."""
    commits = [e for e in events_of(res, "checkpoint_commit") if "step" in e["details"]]
    out: dict = {"lags": [], "lag_source": None, "persist_s": [], "persist_source": None, "sizes": []}
    if commits:
        details = [e["details"] for e in commits]
        if all("lag" in d for d in details):
            out["lags"], out["lag_source"] = [d["lag"] for d in details], "checkpoint_commit details.lag"
        ends = step_end_times(res)
        end_of = {s: t for t, s in ends}
        times = [t for t, _ in ends]
        if not out["lags"]:
            # steps finished by commit time, minus the committed step
            out["lags"] = [max(0, bisect.bisect_right(times, d.get("time", e["time"])) - d["step"])
                           for d, e in zip(details, commits)]
            out["lag_source"] = "checkpoint_commit times vs history step times"
        if any("persist_s" in d for d in details):
            out["persist_s"] = [d["persist_s"] for d in details if "persist_s" in d]
            out["persist_source"] = "checkpoint_commit details.persist_s"
        else:
            out["persist_s"] = [d.get("time", e["time"]) - end_of[d["step"]] for d, e in zip(details, commits)
                                if d["step"] in end_of]
            out["persist_source"] = "commit time minus the step's end"
        out["sizes"] = [d["bytes"] for d in details if "bytes" in d]
    if not out["lags"] and poll:
        running = [p for p in poll if p["state"] == "running" and p["lag"] is not None]
        out["lags"], out["lag_source"] = [p["lag"] for p in running], \
            f"controller status() polled ({len(running)} samples while running)"
    if not out["sizes"]:
        # The committer's messages, logged when training finishes: "committed step N (F files, X MB)".
        for e in res.events:
            m = re.search(r"committed step \d+ \(\d+ files, ([\d.]+) MB\)", e["message"])
            if m:
                out["sizes"].append(float(m.group(1)) * 1e6)
    return out


def run_ours(w, steps: int, warmup: int, name: str, storage: str | None, options: dict, poll_s: float,
             every: int = 1, min_shard_bytes: int | None = None) -> dict:
    sizes = {} if min_shard_bytes is None else {"min_shard_bytes": min_shard_bytes}
    ckpt = elastic.CheckpointConfig(every_n_steps=every if storage else 0, **sizes)  # validated like a user's
    run = elastic.RunConfig(name=name, storage=storage, storage_options=options, seed=w.seed, checkpoint=ckpt)
    trainer = elastic_trainer(w, name, run=run)
    # Every run is polled, baselines too: polling is not free for the controller (on this machine
    # runs with it were, if anything, faster), so all runs must carry it alike.
    cpu0 = time.process_time()
    res, samples, t_call = fit_polled(trainer, steps, poll_s)
    # Every run, baselines too: a recovery is no step, so a recovered run's mean step time leaves
    # it out (and a restart's checkpoint work with it), and any ratio taken with it means nothing.
    require_clean(res, name)
    # This process's CPU: the driver's own (alike in every run) and, in the s3 run, the moto
    # server's threads, on the cores training uses. A remote S3 endpoint costs the cluster none of it.
    commits = len(events_of(res, "checkpoint_commit"))
    if storage and commits >= ROUTINE_EVENTS_KEPT:
        # The event log keeps the newest ROUTINE_EVENTS_KEPT commits (and up to a tenth more):
        # with the early ones gone, their steps' lag would read as the step number.
        fail(f"{name}: {commits} commit events, at the event log's cap of {ROUTINE_EVENTS_KEPT}: the lag and "
             f"commit counts need every commit; run fewer than {ROUTINE_EVENTS_KEPT} steps")
    # A rank whose agent was lost, or had no shared memory, wrote in its own process: another
    # write path than the one measured, so no figure of this run stands for it.
    fell_back = {k: len(events_of(res, k)) for k in ("checkpoint_agent_lost", "checkpoint_shared_memory_failed")}
    if storage and any(fell_back.values()):
        fail(f"{name}: ranks fell back to writing in their own process ({fell_back}); rerun")
    out = {"name": name, "fit_wall_s": time.time() - t_call,
           "checkpoint_failed_events": len(events_of(res, "checkpoint_failed")),
           "driver_cpu_ms_per_step": (time.process_time() - cpu0) / steps * 1e3,
           "commits": commits,
           "snapshots_dropped": res.metrics.get("checkpoint_snapshots_dropped"),
           **step_throughput(res, after_step=warmup),
           "span": span_throughput(res, warmup), "checkpoint": res.checkpoint}
    if storage:
        out.update(commit_readings(res, samples))
        out["step_lags"] = lag_after_each_step(res, warmup)
        try:
            from elastic.checkpoint import CheckpointStore

            infos = CheckpointStore(storage, name, options).list_steps(verify=False)
            out["stored_steps"] = [i.to_dict() for i in infos]
            if not out["persist_s"]:
                end_of = {st: t for t, st in step_end_times(res)}
                out["persist_s"] = [i.committed_at - end_of[i.step] for i in infos
                                    if i.committed_at and i.step in end_of]
                out["persist_source"] = (f"manifest created_at minus the step's end "
                                         f"({len(out['persist_s'])} retained steps)")
        except Exception as exc:  # noqa: BLE001 - a listing problem must not lose the timings
            logger.warning("could not list %s: %s", storage, exc)
            out["stored_steps"] = []
    logger.info("ours %s: %s", name, {k: v for k, v in out.items() if k not in ("lags", "persist_s", "sizes")})
    return out


def start_moto():
    """An S3 endpoint on loopback with an empty bucket; returns (server, endpoint_url)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, url


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, steps=100)
    add_raytrain_args(p)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--raytrain-steps", type=int, default=20)
    p.add_argument("--raytrain-warmup", type=int, default=5)
    p.add_argument("--poll-s", type=float, default=0.2, help="controller status() poll interval (lag fallback)")
    p.add_argument("--skip-s3", action="store_true")
    p.add_argument("--skip-raytrain", action="store_true",
                   help="no Ray Train run (for experiments: the vs_raytrain figure needs it)")
    p.add_argument("--every-n-steps", type=int, default=1,
                   help="CheckpointConfig.every_n_steps of the checkpointed runs (the figures are named for 1)")
    p.add_argument("--min-shard-bytes", type=int, default=None,
                   help="CheckpointConfig.min_shard_bytes of the checkpointed runs (default: the config's; "
                        "0: every rank writes a shard)")
    args = p.parse_args(argv)
    if not args.skip_raytrain and not 1 <= args.raytrain_warmup < args.raytrain_steps:
        p.error(f"--raytrain-warmup ({args.raytrain_warmup}) must be at least 1 (the peer's clock starts at "
                f"the end of that step) and below --raytrain-steps ({args.raytrain_steps}), or pass --skip-raytrain")
    if args.every_n_steps != 1:
        logger.warning("--every-n-steps %d: the figures keep their every-step names; every_n_steps is in "
                       "each line's details", args.every_n_steps)
    claim_stdout()
    peer = configure_raytrain(args)
    w = workload_from_args(args)
    start_ray(args.num_cpus)
    tmp = tempfile.mkdtemp(prefix="elastic-ckpt-bench-")
    server = None
    try:
        none = run_ours(w, args.steps, args.warmup, "ckpt-none", None, {}, args.poll_s)
        file_ = run_ours(w, args.steps, args.warmup, "ckpt-file", f"file://{tmp}/ours", {}, args.poll_s,
                         args.every_n_steps, args.min_shard_bytes)
        s3 = None
        if not args.skip_s3:
            server, url = start_moto()
            opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": url}}
            s3 = run_ours(w, args.steps, args.warmup, "ckpt-s3", f"s3://{BUCKET}/ours", opts, args.poll_s,
                          args.every_n_steps, args.min_shard_bytes)
        none_after = run_ours(w, args.steps, args.warmup, "ckpt-none-after", None, {}, args.poll_s)
        theirs = None
        if not args.skip_raytrain:
            theirs = run_raytrain(w, args.raytrain_steps, args.raytrain_warmup, ckpt_every=args.every_n_steps,
                                  storage_path=f"{tmp}/raytrain", name="ckpt-raytrain")
            logger.info("ray train: %s", theirs)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    common = {**peer, "workers": w.workers, "batch_per_worker": w.batch_per_worker, "model": w.describe()["model"],
              "steps": args.steps, "warmup": args.warmup, "every_n_steps": args.every_n_steps,
              "min_shard_bytes": args.min_shard_bytes if args.min_shard_bytes is not None
              else elastic.CheckpointConfig().min_shard_bytes}
    for run in (file_, s3):
        if run is None:
            continue
        latest = (run["checkpoint"] or {}).get("latest_step")
        if latest != args.steps:
            fail(f"{run['name']}: the newest committed step is {latest}, not the run's last step {args.steps}: "
                 "its overhead would leave out checkpoints that never happened")
    base_step_s = (none["mean_step_time_s"] + none_after["mean_step_time_s"]) / 2
    base_span = (none["span"]["steps_per_s"] + none_after["span"]["steps_per_s"]) / 2
    for label, run in (("file", file_), ("s3", s3)):
        if run is None:
            continue
        # Fewer checkpoints than steps flatter the ratio: said with it, not only as counts.
        dropped = run["snapshots_dropped"] or 0
        caveat = {"caveat": f"{dropped} snapshot(s) dropped and {run['checkpoint_failed_events']} failed write(s): "
                            "the ratio covers fewer checkpoints than steps"} \
            if dropped or run["checkpoint_failed_events"] else {}
        emit(f"ckpt_every_step_overhead_{label}", ratio(run["mean_step_time_s"], base_step_s), "ratio", **caveat,
             snapshots_dropped_per_step=dropped / args.steps, checkpoint_failed_events=run["checkpoint_failed_events"],
             mean_step_time_s=run["mean_step_time_s"], baseline_mean_step_time_s=base_step_s,
             driver_cpu_ms_per_step=run["driver_cpu_ms_per_step"],
             baseline_driver_cpu_ms_per_step=(none["driver_cpu_ms_per_step"] + none_after["driver_cpu_ms_per_step"]) / 2,
             baseline_runs_mean_step_time_s=[none["mean_step_time_s"], none_after["mean_step_time_s"]],
             span_steps_per_s=run["span"]["steps_per_s"], baseline_span_steps_per_s=base_span,
             # How much checkpointing the run did: a step whose snapshot was dropped (the agent
             # had no free slot) or whose commit a newer one superseded cost less, so these say
             # what the ratio covers.
             commits=run["commits"], snapshots_dropped=run["snapshots_dropped"],
             latest_committed=(run["checkpoint"] or {}).get("latest_step"), **common)
    if theirs is not None:
        emit("ckpt_step_throughput_ratio_vs_raytrain", ratio(file_["span"]["steps_per_s"], theirs["steps_per_s"]),
             "ratio", ours_steps_per_s=file_["span"]["steps_per_s"], raytrain_steps_per_s=theirs["steps_per_s"],
             raytrain_mean_report_s=theirs.get("mean_ckpt_report_s"), ours_storage="file://",
             # How much of the checkpointing ours did (Ray Train saves and reports every due step):
             # a snapshot dropped or a commit superseded is work ours skipped.
             ours_commits=file_["commits"], ours_snapshots_dropped=file_["snapshots_dropped"],
             raytrain_ckpt_every=args.every_n_steps,
             raytrain_storage="local path", raytrain_steps=args.raytrain_steps,
             raytrain_warmup=args.raytrain_warmup, **common)
    for label, run in (("file", file_), ("s3", s3)):
        if run is None:
            continue
        lags, at_commit = run["step_lags"], run["lags"]
        fig = "ckpt_lag_steps_p95" if label == "file" else "ckpt_lag_steps_p95_s3"
        emit(fig, percentile(lags, 95), "steps", storage=label,
             source="after each step past the warm-up: the step minus the newest committed by then",
             samples=len(lags), max=max(lags) if lags else None,
             at_commit_p95=percentile(at_commit, 95), at_commit_max=max(at_commit) if at_commit else None,
             at_commit_source=run["lag_source"], latest_committed=(run["checkpoint"] or {}).get("latest_step"),
             **common)
        stored = [s["size_bytes"] for s in run.get("stored_steps", []) if s.get("status") != "partial"]
        sizes, size_source = (stored, "retained committed steps on storage") if stored else \
            (run["sizes"], "commit events/messages")
        emit(f"ckpt_size_bytes_{label}", statistics_median(sizes), "bytes", samples=len(sizes), source=size_source,
             **common)
        persist = run["persist_s"]
        emit(f"ckpt_persist_seconds_{label}", statistics_median(persist), "s", p95=percentile(persist, 95),
             samples=len(persist), source=run["persist_source"], **common)
    if theirs is not None:
        emit("ckpt_report_seconds_raytrain", theirs.get("mean_ckpt_report_s"), "s",
             note="mean time in save + train.report(checkpoint=...) per step on rank 0", **common)


def statistics_median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


if __name__ == "__main__":
    main()
