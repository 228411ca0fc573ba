"""Issue #3: what a checkpoint costs inside one rank's step, alone: the CPU of
``AgentCheckpointer.snapshot`` right after each real training step of the default workload.

    python benchmarks/snapshot_cost.py [--steps 300 --rank 0 --workers 4 ...workload args]

Why a figure of its own: with cores to spare (a lent 16-core machine), what is left of
``ckpt_every_step_overhead_*`` is this in-step snapshot (state_dict, the state's walk, the RNG
reads, the meta's JSON, the copy into shared memory, one message), a fixed time a step; the
full benchmark cannot show it on a 2-vCPU VM, where the agent's writes and hashing compete with
the ranks for the cores and the run-to-run noise is +-10%. Here nothing else runs: one process
trains (``--workers`` only sets which share of the state this rank writes, and on which steps),
and a stand-in agent in a forked process hands every slot straight back, so no snapshot is
dropped and the agent's own work is not timed.

The split is the default run's: ``--min-shard-bytes`` (``CheckpointConfig.min_shard_bytes`` unless
given) spreads the state over ``writer_count`` ranks, a duty that rotates with the step
(``elastic.checkpoint.codec.writer_slot``). For the default 3.2 MB state and 4 ranks that is two
writers of ~1.6 MB, so a rank writes every other step and on the others sends its RNG alone.

Each snapshot follows a training step (forward, backward, optimizer step) as in a real run, so
its caches are as cold as they are there: the same calls take 2-3x longer than in a hot loop.
Thread CPU time, not wall time, so a preempted snapshot does not count the preemption.

Figures: ``ckpt_snapshot_cpu_us`` (median over the steps on which this rank writes, what a
writing rank pays: with p90 and the wall-clock median, and the median of the steps it writes
nothing on as a detail), ``ckpt_snapshot_share_of_step`` (that median snapshot's CPU over the
median training step's CPU in this process; a real rank's step also waits for its all-reduce, so
this is an upper bound).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch

import elastic
from common import add_workload_args, claim_stdout, emit, fail, percentile, workload_from_args
from elastic.checkpoint.agent import receive_message, send_message
from elastic.checkpoint.codec import flatten_state, rank_share, tensor_nbytes, writer_count
from elastic.checkpoint.worker_hook import AgentCheckpointer, live_state


def stand_in_agent(path: str, ready) -> None:
    """The agent's side of the protocol, minus the writing: every snapshot's slot goes back at once."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    ready.set()
    conn, _ = server.accept()
    while True:
        message, fds = receive_message(conn)
        for fd in fds:  # rings and layouts: nothing reads them here
            os.close(fd)
        if message is None:
            return
        if message.get("op") == "snap" and "slot" in message:
            send_message(conn, {"op": "free", "ring": message["ring"], "slot": message["slot"]})
        elif message.get("op") == "flush":
            send_message(conn, {"op": "flushed", "id": message["id"], "ok": True, "done": [], "events": []})


class Rank:
    """What ``AgentCheckpointer.snapshot`` reads of a TrainWorker."""

    def __init__(self, w, rank: int):
        torch.manual_seed(w.seed)
        self.model, self.scheduler = w.model_fn(), None
        self.optimizer = w.optimizer_fn(self.model.parameters())
        self.rank, self.world_size, self.completed_step = rank, w.workers, 0
        g = torch.Generator().manual_seed(w.seed)
        self.x = torch.randn(w.batch_per_worker, w.in_dim, generator=g)
        self.y = torch.randint(0, w.classes, (w.batch_per_worker,), generator=g)

    def train_step(self) -> None:
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.optimizer.step()
        self.completed_step += 1


def share_at(tensors: dict, rank: int, world_size: int, min_shard_bytes: int, step: int) -> dict:
    """What ``rank`` writes of ``tensors`` at ``step`` (``rank_share``, as ``Snapshot.of_state``
    splits it): its bytes, its tensor count, whether the state skeleton comes with it, and
    whether it writes a file at all (``Snapshot.writes_file``)."""
    names, skeleton = rank_share(tensors, rank, world_size, min_shard_bytes, step)
    return {"bytes": sum(tensor_nbytes(tensors[n]) for n in names), "tensors": len(names), "skeleton": skeleton,
            "writes": bool(names) or skeleton}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, steps=300)
    p.add_argument("--rank", type=int, default=0,
                   help="whose share to snapshot (which ranks write, and which writes the skeleton, rotates "
                        "with the step)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-shard-bytes", type=int, default=elastic.CheckpointConfig().min_shard_bytes,
                   help="CheckpointConfig.min_shard_bytes (default: the config's, as a run gets it; "
                        "0: every rank writes a shard every step)")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    claim_stdout()
    w = workload_from_args(args)
    if not 0 <= args.rank < w.workers:
        p.error(f"--rank must be in [0, {w.workers})")
    if args.min_shard_bytes < 0:
        p.error("--min-shard-bytes must be at least 0")

    path = os.path.join(tempfile.mkdtemp(prefix="elastic-snapshot-cost-"), "agent.sock")
    ctx = multiprocessing.get_context("fork")  # before this process has threads of its own
    ready = ctx.Event()
    agent = ctx.Process(target=stand_in_agent, args=(path, ready), daemon=True)
    agent.start()
    link = None
    snap_cpu, snap_wall, step_cpu, snap_steps = [], [], [], []
    # From the agent's start: a stand-in that never came up, or a link refused, left the socket's
    # directory behind, and the link's error said nothing of the stand-in.
    try:
        if not ready.wait(30):
            fail(f"the stand-in agent did not listen on {path} within 30 s (exit code {agent.exitcode})")
        # As a rank trains (cpus_per_worker threads: 1 in the benchmarks), and as thread_time counts:
        # torch's own threads took part of the step's work, unseen, and the share read too high.
        torch.set_num_threads(1)
        rank = Rank(w, args.rank)
        # The worker's own split (worker.py passes CheckpointConfig.min_shard_bytes): with 0 here
        # every rank wrote a quarter of the state every step, a split no default run makes.
        link = AgentCheckpointer(path, 1, fallback=lambda: None, min_shard_bytes=args.min_shard_bytes)
        for i in range(args.warmup + args.steps):
            c = time.thread_time()
            rank.train_step()
            c1, t1 = time.thread_time(), time.perf_counter()
            events = link.snapshot(rank, rank.completed_step)
            c2, t2 = time.thread_time(), time.perf_counter()
            if events or link.fallback is not None:
                raise RuntimeError(f"snapshot of step {rank.completed_step} did not go to the agent: {events}")
            if i >= args.warmup:
                step_cpu.append(c1 - c)
                snap_cpu.append(c2 - c1)
                snap_wall.append(t2 - t1)
                snap_steps.append(rank.completed_step)
        if link.dropped:
            raise RuntimeError(f"{link.dropped} snapshots were dropped: the stand-in agent fell behind")
    finally:
        if link is not None:
            link.close()
        else:
            agent.terminate()  # it waits for a link that will not come
        agent.join(10)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    # Which timed steps this rank wrote on, split after the loop as the snapshot split it then:
    # the state's tensors and sizes are the same from step 1 on (the momentum buffers come with
    # the first optimizer step), and asking in the loop would add work to the timed rank's steps.
    tensors, _ = flatten_state(live_state(rank))
    shares = [share_at(tensors, args.rank, w.workers, args.min_shard_bytes, s) for s in snap_steps]
    writing = [i for i, sh in enumerate(shares) if sh["writes"]]
    idle = [i for i, sh in enumerate(shares) if not sh["writes"]]
    if not writing:
        fail(f"rank {args.rank} wrote on none of the {len(shares)} timed steps: no writing rank's cost to report "
             "(run more --steps)")
    state_bytes = sum(tensor_nbytes(t) for t in tensors.values())
    # The figure is what a writing rank pays: a median over every step would mix in the steps
    # that send the RNG alone (every other one in the default run) and read too low.
    write_cpu = [snap_cpu[i] for i in writing]
    idle_cpu = [snap_cpu[i] for i in idle]
    share = {"min_shard_bytes": args.min_shard_bytes,
             "writers": writer_count(state_bytes, w.workers, args.min_shard_bytes),
             "writing_steps": len(writing), "idle_steps": len(idle),
             "share_bytes": statistics.median(shares[i]["bytes"] for i in writing),
             "share_bytes_max": max(shares[i]["bytes"] for i in writing),
             "share_tensors": statistics.median(shares[i]["tensors"] for i in writing),
             "skeleton_steps": sum(1 for i in writing if shares[i]["skeleton"]),
             "state_bytes": state_bytes}
    median_snap, median_step = statistics.median(write_cpu), statistics.median(step_cpu)
    median_idle = statistics.median(idle_cpu) if idle_cpu else None
    details = {"rank": args.rank, "world_size": w.workers, "steps": args.steps, "torch_threads": 1, **share,
               **w.describe()}
    emit("ckpt_snapshot_cpu_us", median_snap * 1e6, "us",
         p90_us=percentile(write_cpu, 90) * 1e6,
         wall_median_us=statistics.median(snap_wall[i] for i in writing) * 1e6,
         idle_median_us=median_idle * 1e6 if median_idle is not None else None,
         idle_note="the steps this rank writes nothing on (its RNG goes to the manifest alone)", **details)
    emit("ckpt_snapshot_share_of_step", median_snap / median_step, "ratio",
         train_step_cpu_us=median_step * 1e6,
         idle_share_of_step=median_idle / median_step if median_idle is not None else None, **details)


if __name__ == "__main__":
    main()
