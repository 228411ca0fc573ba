"""A fake worker group for controller tests: real Ray actors, no torch model, no process group.

Each fake rank answers the controller's calls the way a TrainWorker would, and can be told to die
at a step. The controller under test is the real one.
"""

from __future__ import annotations

import os
import signal
import time

import ray

from elastic.actors.worker import StepResult
from elastic.actors.worker_group import WorkerGroup


class FakeWorker:
    def __init__(self, spec, name="", background_start=False):
        self.name, self.rank, self.world, self.done, self.started = name, -1, 0, 0, 0
        self.kill_at, self.kill_after_update = None, False
        self.refusing = False  # refuse_state
        self.background_start = background_start  # asked for; the real worker also needs the right

    def info(self):
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": "127.0.0.1", "pid": os.getpid(), "gpu_ids": [],
                "device": "cpu", "backend": "gloo", "name": self.name, "started_in_background": self.background_start, "dataset_size": 64}

    @ray.method(concurrency_group="control")
    def heartbeat(self):
        phase, since = getattr(self, "beat_phase", ("idle", None))  # not "phase": subclasses use that name
        return {"time": time.time(), "step": None, "completed_step": self.done, "rank": self.rank,
                "phase": phase, "phase_since": since or time.time()}

    def stall_in_collective_at(self, step, seconds):
        """Test aid: at ``step`` this rank waits ``seconds`` in an all-reduce (its heartbeat
        says so), then raises a CollectiveError, as a survivor of a peer lost with its node does
        at the group's timeout (the peer's sockets never close)."""
        self.collective_stall = (step, seconds)

    def host_rendezvous(self, timeout_s):
        return 1

    @ray.method(concurrency_group="control")
    def sees_file(self, path):
        if getattr(self, "blind", None) == "hung":
            time.sleep(60)
        return os.path.exists(path) and not getattr(self, "blind", False)

    def blind_to_files(self, how=True):
        """Test aid: ``sees_file`` answers False, as on a node whose disk is not the controller's
        (``how="hung"``: it answers nothing for a minute, as on a hung mount)."""
        self.blind = how

    def fast_sets(self, first, last):
        return {}  # first-N fast sets: a fake rank records none

    @ray.method(concurrency_group="control")
    def reap(self, pid):
        """As TrainWorker.reap: SIGKILL a hung peer's process on this node."""
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False

    def join(self, rank, world, *args):
        self.rank, self.world = rank, world
        return {"rank": rank}

    def leave(self):
        return None

    def stall(self, seconds):
        """Test aid: busy this actor's calls for ``seconds`` (a rank stuck in its own code; the
        calls queued behind, leave() included, wait)."""
        time.sleep(seconds)

    def inject_kill(self, at_step, after_update=False, mark=None):
        self.kill_at, self.kill_after_update = at_step, after_update  # ``mark``: the real worker's bench aid

    def train_step(self, step, indices, generation):
        self.started = step
        stall_step, seconds = getattr(self, "collective_stall", (None, 0))
        if step == stall_step:
            from elastic.actors.protocol import CollectiveError

            self.beat_phase = ("allreduce", time.time())
            time.sleep(seconds)
            self.beat_phase = ("idle", None)
            raise CollectiveError(f"allreduce of step {step} timed out: a peer is gone (test)")
        if step == self.kill_at and not self.kill_after_update:
            self._die()
        self.done = step
        if step == self.kill_at:
            self._die()
        return StepResult(self.rank, step, 1.0 / step, 0.001, 0.001, len(indices), step, {"local_time_s": 0.001})

    @staticmethod
    def _die():
        # A real rank dies some way into a step; exiting at once could also take the previous
        # step's reply along (a core-worker thread sends it), and the run would then stop a step
        # earlier than the tests of where it stops expect (seen under load).
        time.sleep(0.2)
        os._exit(1)

    def model_state(self):
        return {}

    def train_steps(self, first, shards, generation):
        results = []
        try:
            for i, indices in enumerate(shards):
                results.append(self.train_step(first + i, indices, generation))
        except BaseException:
            if results:  # as TrainWorker.train_steps: kept for the recovery's unreported_results
                self.unreported = (generation, results)
            raise
        return results

    def unreported_results(self, first, last, generation):
        stashed, results = getattr(self, "unreported", (-1, []))
        self.unreported = (-1, [])
        return [r for r in results if first <= r.step <= last] if stashed == generation else []

    def get_state(self):
        time.sleep(getattr(self, "state_delay_s", 0.0))
        return {"completed_step": self.done}

    def delay_state(self, seconds):
        """Test aid: every get_state takes ``seconds`` first (a large state slow to copy)."""
        self.state_delay_s = seconds

    def refuse_state(self):
        """Test aid: the next set_state fails (as when the state's fetch fails)."""
        self.refusing = True

    def set_state(self, state):
        if self.refusing:
            raise RuntimeError("set_state refused (test)")
        self.done = self.started = state["completed_step"]
        return self.done

    def progress(self, discard_begun=False):
        out = (self.done, self.started)
        if discard_begun:
            self.started = self.done
        return out

    def begin(self, step):
        """Test aid: a step begun and never finished (the group broke under it)."""
        self.started = step

    def param_checksum(self):
        return 7

    def snapshot_checkpoint(self, step):
        return {}  # as TrainWorker.snapshot_checkpoint of a rank that writes no checkpoints

    def flush_checkpoint(self, final):
        return {}  # as TrainWorker.flush_checkpoint of a rank with nothing left to report

    @ray.method(concurrency_group="control")
    def abandon_first_n(self, generation):
        """As TrainWorker.abandon_first_n; recorded for the tests (``abandoned``)."""
        self.abandoned_generations = getattr(self, "abandoned_generations", []) + [generation]
        return True

    @ray.method(concurrency_group="control")
    def abandoned(self):
        return getattr(self, "abandoned_generations", [])

    def shutdown(self):
        return None


class FakeGroup(WorkerGroup):
    def __init__(self, scaling, spec, namespace):
        super().__init__(scaling, spec, namespace)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1})(FakeWorker)


class BrokenFakeWorker(FakeWorker):
    """A worker whose constructor fails, as on a node without the user's dependencies."""

    def __init__(self, spec, name="", background_start=False):
        raise RuntimeError(f"{name}: this node cannot build the model")


class FlakyJoinWorker(FakeWorker):
    """Rank 0's first join after the start fails as a group failure (a peer's connection refused)."""

    failed = False

    def join(self, rank, world, *args):
        generation = args[2]
        if rank == 0 and generation == 2 and not FlakyJoinWorker.failed:
            FlakyJoinWorker.failed = True  # per actor process: each fake rank is one
            from elastic.actors.protocol import CollectiveError

            raise CollectiveError("rank 0 could not join generation 2: connection refused")
        return super().join(rank, world, *args)


class FlakyJoinGroup(FakeGroup):
    def __init__(self, scaling, spec, namespace):
        super().__init__(scaling, spec, namespace)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1})(FlakyJoinWorker)


class SparesThatFailToBuild(FakeGroup):
    """The spares the run starts with build; every spare started later fails in its constructor."""

    def __init__(self, scaling, spec, namespace):
        super().__init__(scaling, spec, namespace)
        self._broken_cls = ray.remote(concurrency_groups={"control": 1})(BrokenFakeWorker)
        self._first_spares = {f"spare-{i}" for i in range(scaling.num_hot_spares)}

    def _spawn(self, pg, index, name, background=False):
        if name.startswith("spare-") and name not in self._first_spares:
            return self._broken_cls.options(**self._options(pg, index, name)).remote(self.spec, name, background)
        return super()._spawn(pg, index, name, background)


class NcclFakeWorker(FakeWorker):
    """A worker that says it trains on NCCL, and records the aborts the controller asks of it."""

    def __init__(self, spec, name="", background_start=False):
        super().__init__(spec, name, background_start)
        self.aborted = []

    def info(self):
        return {**super().info(), "backend": "nccl"}

    @ray.method(concurrency_group="control")
    def abort_collectives(self, generation):
        self.aborted.append(generation)
        return True

    def aborts(self):
        return list(self.aborted)


class NcclFakeGroup(FakeGroup):
    def __init__(self, scaling, spec, namespace):
        super().__init__(scaling, spec, namespace)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1})(NcclFakeWorker)


class SparesThatNeverPlace(FakeGroup):
    """Every spare asked for during the run needs more CPUs than any node has, and no freed bundle
    of the ranks' group is offered to it: it stays pending, as on a cluster with no capacity left."""

    def _placed_free_bundle(self, avoid_nodes):
        return None

    def _spare_group(self, idx, avoid):
        from ray.util.placement_group import placement_group

        pg = placement_group([{"CPU": 10_000}], name=f"{self.namespace}/spare-{idx}")
        self._pgs.append(pg)
        return pg


class SlowBuildWorker(FakeWorker):
    """Rank 1's build never ends (a model_fn stuck on a download, a dataset on a dead mount)."""

    def __init__(self, spec, name="", background_start=False):
        super().__init__(spec, name, background_start)
        if name == "rank-1":
            time.sleep(600)


class SlowBuildGroup(FakeGroup):
    def __init__(self, scaling, spec, namespace):
        super().__init__(scaling, spec, namespace)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1})(SlowBuildWorker)
