"""Shared pieces of the benchmarks: the workload (MLP, synthetic data), Ray start-up, JSON output,
readings taken from a ``Result``, and the peer run on Ray Train (``TorchTrainer``, DDP on gloo).

Imported by the benchmark drivers and by Ray workers (``benchmarks/`` is on their PYTHONPATH).
Every figure goes to stdout as one JSON line; everything else goes to stderr.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
EXAMPLES_DIR = os.path.join(ROOT, "examples")
for _p in (ROOT, BENCH_DIR, EXAMPLES_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

logger = logging.getLogger("bench")

# ---- output -------------------------------------------------------------------------------------
_FIGURES = sys.stdout


def claim_stdout() -> None:
    """Keep the real stdout for figures only; point fd 1 at stderr.

    Ray forwards worker output and Ray Train prints status lines to the driver's stdout; at the
    file-descriptor level nothing but our JSON lines can reach the real stdout.
    """
    global _FIGURES
    sys.stdout.flush()
    _FIGURES = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("werkzeug", "botocore", "s3fs", "aiobotocore", "urllib3"):  # moto's request log, S3 clients
        logging.getLogger(noisy).setLevel(logging.WARNING)


def emit(figure: str, value: float | None, unit: str, **details: Any) -> None:
    """One figure, one JSON line on the real stdout. A value that is no finite number goes out as
    null with ``value_note`` saying what it was (JSON has no inf or NaN), as does a missing one
    (a null with no word read like a result); a detail that is no finite number goes out as null."""
    if value is not None and not math.isfinite(value):
        details = {"value_note": f"not a finite number ({value})", **details}
        value = None
    elif value is None and "value_note" not in details:
        details = {"value_note": "not measured in this run (see the details and the log)", **details}
    from elastic.jsonable import strict_dumps  # json.dumps wrote NaN, which is no JSON

    line = strict_dumps({"figure": figure, "value": value, "unit": unit, **details})
    _FIGURES.write(line + "\n")
    _FIGURES.flush()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least ``q`` percent of the values at
    or below it (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))]


def fail(message: str) -> None:
    """A run did not do what its figures measure (no failure injected, no eviction, a step left
    uncommitted): exit non-zero before printing them. A figure from such a run would read well
    (no crash costs no time) and mean nothing."""
    logger.error("benchmark check failed: %s", message)
    raise SystemExit(f"benchmark check failed: {message}")


def require_clean(res, what: str) -> None:
    """``fail`` unless ``res`` (an elastic ``Result``) ran with no failure and no recovery.

    For every run whose figures assume none: a recovered run prints per-step figures that read
    normal (a recovery is no step, and ``timed_steps`` leaves out a step kept from before it),
    and ``first_step_done`` read too good if step 1 failed. A straggler eviction carried out is
    neither (``Controller._evict`` counts no failure and records no recovery); a rank lost while
    evicting is both, so this holds for an eviction run too."""
    failures, recoveries = res.metrics["failures"], res.recoveries
    if failures or recoveries:
        fail(f"{what}: {failures} failure(s) and {len(recoveries)} recovery(ies) "
             f"({[(r.get('kind'), r.get('step')) for r in recoveries]}) in a run whose figures assume none; rerun")


# ---- Ray ----------------------------------------------------------------------------------------
def start_ray(num_cpus: int = 8, extra_env: dict | None = None) -> None:
    """An embedded Ray of our own (never a bare ``ray.init()``, which can join a stale cluster)."""
    import ray

    env = {
        # Ours first, then whatever the driver was given (packages installed outside site-packages).
        "PYTHONPATH": os.pathsep.join(p for p in [ROOT, BENCH_DIR, EXAMPLES_DIR, os.environ.get("PYTHONPATH")] if p),
        # Ray Train's PlacementGroupCleaner asks the state API whether its controller lives. With
        # no dashboard here it would auto-detect "the latest cluster" on this machine, which may
        # be someone else's, fail to find our controller there and remove our placement group.
        # A dead API address makes each query fail, and on failure it keeps monitoring.
        "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9",
        **(extra_env or {}),
    }
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             configure_logging=False, runtime_env={"env_vars": env})


def quiet_ray_train() -> None:
    """Ray Train v2 prints progress tables; keep the driver's log readable."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


def add_raytrain_args(p) -> None:
    p.add_argument("--raytrain-poll-s", type=float, default=None,
                   help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for the peer (Ray's default, 2 s, when not given). "
                        "Its controller polls workers this often: that paces train.report() (a queue of one "
                        "result) and bounds how fast it sees a dead worker")


def configure_raytrain(args) -> dict:
    """Environment for the peer, set before TorchTrainer is built (Ray Train propagates it)."""
    quiet_ray_train()
    if args.raytrain_poll_s is not None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.raytrain_poll_s)
    return {"raytrain_poll_s": float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0))}


# ---- the workload -------------------------------------------------------------------------------
def make_mlp(in_dim: int, hidden: int, classes: int) -> torch.nn.Module:
    """The default model: Linear in->h, ReLU, h->h, ReLU, h->classes."""
    return torch.nn.Sequential(
        torch.nn.Linear(in_dim, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def synthetic_dataset(size: int, in_dim: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(size, in_dim, generator=g), torch.randint(0, classes, (size,), generator=g))


def make_sgd(params, lr: float = 0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass
class Workload:
    """Model, data and batch shared by our run and the peer run. Picklable: workers rebuild it."""

    workers: int = 4
    batch_per_worker: int = 64
    in_dim: int = 256
    hidden: int = 512
    classes: int = 10
    dataset_size: int = 32768
    seed: int = 0
    lr: float = 0.05

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_per_worker

    @property
    def model_fn(self):
        return functools.partial(make_mlp, self.in_dim, self.hidden, self.classes)

    @property
    def dataset_fn(self):
        return functools.partial(synthetic_dataset, self.dataset_size, self.in_dim, self.classes, self.seed)

    @property
    def optimizer_fn(self):
        return functools.partial(make_sgd, lr=self.lr)

    def describe(self) -> dict:
        return {"model": f"MLP {self.in_dim}-{self.hidden}-{self.hidden}-{self.classes}", **asdict(self)}


def add_workload_args(p, steps: int) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-per-worker", type=int, default=64)
    p.add_argument("--in-dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the embedded Ray")


def workload_from_args(args, min_steps: int | None = None, replicas: int | None = None) -> Workload:
    """The workload the arguments describe. ``replicas``: how many ranks a step hands a shard to,
    when more than ``workers`` (first-N's M = N + b: each replica takes a worker's shard)."""
    w = Workload(workers=args.workers, batch_per_worker=args.batch_per_worker, in_dim=args.in_dim,
                 hidden=args.hidden, classes=args.classes, seed=args.seed)
    steps = min_steps or args.steps
    # Every step sees fresh samples: sized by the shards a step hands out, not by the global
    # batch, which first-N's backups add to (sized by the batch, its runs wrapped at 4/5 of theirs).
    w.dataset_size = max(4096, steps * w.batch_per_worker * max(replicas or 0, w.workers))
    return w


def elastic_trainer(w: Workload, name: str, *, scaling=None, run=None, failure=None, faults=None, **kw):
    import elastic

    scaling = scaling or elastic.ScalingConfig(num_workers=w.workers, resources_per_worker={"CPU": 1})
    run = run or elastic.RunConfig(name=name, seed=w.seed)
    return elastic.Trainer(w.model_fn, w.optimizer_fn, w.dataset_fn, loss_fn, w.global_batch,
                           scaling=scaling, run=run, failure=failure, faults=faults, **kw)


# ---- readings from an elastic Result ------------------------------------------------------------
def running_since(res) -> float:
    """Time of the transition into RUNNING: the controller sends step 1 right after it."""
    for e in res.events:
        if e["kind"] == "transition" and e["details"].get("new") == "running":
            return e["time"]
    raise ValueError("no transition into RUNNING in the event log")


def finished_at(res) -> float:
    for e in reversed(res.events):
        if e["kind"] == "transition" and e["details"].get("new") == "finished":
            return e["time"]
    raise ValueError("no transition into FINISHED in the event log")


def first_step_done(res) -> float:
    """Wall-clock time step 1 finished: RUNNING transition + step 1's wall time."""
    return running_since(res) + res.history[0]["step_time_s"]


def timed_steps(history: list[dict], after_step: int = 0) -> list[dict]:
    """Steps of ``history`` (``Result.history``) the controller timed (a step kept from before a
    failure has step_time_s 0)."""
    return [h for h in history if h["step"] > after_step and h["step_time_s"] > 0]


def step_throughput(res, after_step: int = 0) -> dict:
    """Samples/s and steps/s over the steps after ``after_step``, from per-step controller wall times."""
    return history_throughput(res.history, after_step)


def history_throughput(history: list[dict], after_step: int = 0) -> dict:
    """``step_throughput`` of a run's ``Result.history``."""
    hs = timed_steps(history, after_step)
    total = sum(h["step_time_s"] for h in hs)
    return {
        "steps": len(hs),
        "samples_per_s": sum(h["samples"] for h in hs) / total if total else None,
        "steps_per_s": len(hs) / total if total else None,
        "mean_step_time_s": total / len(hs) if hs else None,
        "median_step_time_s": statistics.median(h["step_time_s"] for h in hs) if hs else None,
        "mean_controller_time_s": statistics.fmean(h["controller_time_s"] for h in hs) if hs else None,
    }


def span_throughput(res, warmup: int) -> dict:
    """Samples/s over steps warmup+1..end by the wall clock, between-step work included.

    The steady span starts when step ``warmup`` ended (RUNNING + the warm-up steps' wall times;
    the small gaps between warm-up steps are left out, which lengthens the span: conservative)
    and ends at the FINISHED transition.
    """
    t0 = running_since(res) + sum(h["step_time_s"] for h in res.history if h["step"] <= warmup)
    span = finished_at(res) - t0
    samples = sum(h["samples"] for h in res.history if h["step"] > warmup)
    steps = sum(1 for h in res.history if h["step"] > warmup)
    return {"samples_per_s": samples / span if span > 0 else None, "steps_per_s": steps / span if span > 0 else None,
            "span_s": span, "steps": steps}


class StatusPoller(threading.Thread):
    """Samples the controller's ``status()`` (its own thread in the actor) while ``fit`` runs.

    Each sample: time, step, state, spares and the checkpoint's latest/lag. Not free for the
    controller, so a script polls all the runs it compares or none.
    """

    def __init__(self, trainer, interval_s: float):
        super().__init__(daemon=True, name="status-poller")
        self.trainer, self.interval_s = trainer, interval_s
        self.samples: list[dict] = []
        self._done = threading.Event()

    def run(self) -> None:
        import ray

        while not self._done.is_set():
            handle = self.trainer.controller
            if handle is not None:
                asked = time.time()  # before the call: a status taken just before an event, and
                # back after it, was dated after the event (a spare still counted after its eviction)
                try:
                    st = ray.get(handle.status.remote(), timeout=2)
                except Exception:  # the actor is starting or gone; try again next tick
                    st = None
                if st:
                    ckpt = st.get("checkpoint") or {}
                    self.samples.append({"time": asked, "step": st["step"], "state": st["state"],
                                         "spares": st.get("spares"), "world_size": st.get("world_size"),
                                         "latest": ckpt.get("latest"), "lag": ckpt.get("lag")})
            self._done.wait(self.interval_s)

    def stop(self) -> list[dict]:
        self._done.set()
        self.join(timeout=5)
        return self.samples


def fit_polled(trainer, steps: int, poll_s: float):
    """``trainer.fit(steps)`` with a ``StatusPoller`` running; returns (result, samples, call time)."""
    poller = StatusPoller(trainer, poll_s)
    poller.start()
    t_call = time.time()
    try:
        res = trainer.fit(steps=steps)
    finally:
        samples = poller.stop()
    return res, samples, t_call


def events_of(res, kind: str) -> list[dict]:
    return [e for e in res.events if e["kind"] == kind]


# ---- the peer: Ray Train TorchTrainer, DDP on gloo ----------------------------------------------
def _raytrain_loop(cfg: dict) -> None:
    """Per-worker loop. Same model init, same shards (``elastic.data.ShardPlan``), same per-item
    indexing + ``default_collate`` as our workers, one report at the end (plus one per step
    with a checkpoint when ``ckpt_every``)."""
    import ray.train
    import ray.train.torch
    from torch.utils.data import default_collate

    from elastic.data import ShardPlan

    w = Workload(**cfg["workload"])
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(w.seed)
    model = ray.train.torch.prepare_model(w.model_fn())  # DDP on gloo (CPU)
    opt = w.optimizer_fn(model.parameters())
    ds = w.dataset_fn()
    plan = ShardPlan(len(ds), w.seed)
    start = 0
    t_run_first = None  # end of step 1 in the first attempt; carried through checkpoints
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            # weights_only: the file is state dicts, an int and a float (or None), all of which the
            # restricted unpickler loads; a full unpickle of a file on shared storage would run code.
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, t_run_first = state["step"], state["first_step_time"]
    for _ in range(start):
        plan.take(world, w.batch_per_worker)
    steps, warmup = cfg["steps"], cfg["warmup"]
    t_first = t_warm = None
    t_attempt = time.time()
    ckpt_s, timed_reports = 0.0, 0  # the reports of the timed steps (after the warm-up)
    loss_v = float("nan")
    for step in range(start + 1, steps + 1):
        if cfg.get("kill_step") == step and rank == cfg.get("kill_rank") and not os.path.exists(cfg["marker"]):
            open(cfg["marker"], "w").close()  # first attempt only
            os.kill(os.getpid(), signal.SIGKILL)
        _, shards = plan.take(world, w.batch_per_worker)
        batch = default_collate([ds[i] for i in shards[rank]])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())
        if step == 1:
            t_first = t_run_first = time.time()
        every = cfg.get("ckpt_every", 0)
        if every and step % every == 0:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                "first_step_time": t_run_first}, os.path.join(d, "state.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step, "loss": loss_v}, checkpoint=checkpoint)
            if step > warmup:  # a warm-up report (the first one sets up the storage) is not a step's cost
                ckpt_s += time.perf_counter() - t0
                timed_reports += 1
        # After the step's checkpoint: the timed steps (warmup, steps] carry exactly their own
        # reports, as ours do (step ``warmup``'s snapshot falls before our clock starts too).
        if step == warmup:
            t_warm = time.perf_counter()
    t_end, end_time = time.perf_counter(), time.time()
    done = steps - max(start, warmup)
    span = t_end - t_warm if t_warm is not None else None
    metrics = {
        "loss": loss_v, "start_step": start, "first_step_time": t_first, "attempt_start_time": t_attempt,
        "run_first_step_time": t_run_first, "end_time": end_time,
        "steady_steps": done, "steady_s": span,
        "samples_per_s": done * w.global_batch / span if span else None,
        "steps_per_s": done / span if span else None,
        "mean_ckpt_report_s": ckpt_s / timed_reports if timed_reports else None,
    }
    # Ray Train v2's Result.metrics are those attached to the newest checkpoint, so the one
    # report at the end carries a tiny checkpoint (after the timed loop; it costs every run alike).
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(d, "metrics.json"), "w") as f:
                json.dump(metrics, f)
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def run_raytrain(w: Workload, steps: int, warmup: int = 0, *, ckpt_every: int = 0, storage_path: str | None = None,
                 max_failures: int = 0, kill_rank: int | None = None, kill_step: int | None = None,
                 name: str = "raytrain-bench") -> dict:
    """Fit a ``TorchTrainer`` on the same workload; returns rank 0's last report plus timings."""
    import ray.train
    from ray.train.torch import TorchTrainer

    own_tmp = None
    if storage_path is None:
        own_tmp = storage_path = tempfile.mkdtemp(prefix="raytrain-bench-")
    cfg = {"workload": asdict(w), "steps": steps, "warmup": warmup, "ckpt_every": ckpt_every,
           "kill_rank": kill_rank, "kill_step": kill_step, "marker": os.path.join(storage_path, f"{name}.killed")}
    trainer = TorchTrainer(
        _raytrain_loop,
        train_loop_config=cfg,
        torch_config=ray.train.torch.TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=w.workers, use_gpu=False,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=3),
        ),
    )
    t_call = time.time()
    try:
        result = trainer.fit()
    finally:
        if own_tmp is not None:
            import shutil

            shutil.rmtree(own_tmp, ignore_errors=True)
    wall = time.time() - t_call
    out = dict(result.metrics)
    out["wall_s"] = wall
    out["time_to_first_step_s"] = out["first_step_time"] - t_call if out.get("first_step_time") else None
    out["train_span_s"] = out["end_time"] - out["run_first_step_time"]  # end of step 1 -> end of the loop
    out["storage_path"] = storage_path
    return out
