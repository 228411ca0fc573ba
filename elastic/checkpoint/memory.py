"""``memory://`` for a run on Ray: the driver's memory, shared with the run's processes while it trains.

fsspec's memory filesystem lives in one process (a dict on the class). A run's controller and
ranks are processes of their own, so with plain fsspec each wrote into its own memory: the
controller's manifest vouched for shards that no other process could read, a later ``fit()``
found no step, and retention, which runs in the controller, never freed a rank's copies, so every
rank's memory grew by each shard it wrote (1.6 MB every other step on the benchmark workload).

So, on Ray, ``memory://`` is the driver's fsspec memory, as it is for any fsspec user in that
process, and the run works on a copy that every process shares:
- before the controller starts, the driver copies the run's directory (``<url>/<run name>``) into a
  ``MemoryHost`` actor (one fsspec ``MemoryFileSystem`` in a process of its own, on the driver's
  node, owned by the driver);
- the controller and the ranks reach it through ``ClusterMemoryFS``, which answers the few calls
  ``Storage`` makes on a filesystem by calling the host;
- when ``fit()`` returns or raises, the driver copies the run's directory back (what retention
  deleted is gone from it too) and ends the host.
So checkpoints survive a rank's death and a restart from a checkpoint within the run, and ``fit()``
again in the same driver resumes from them, even on an embedded Ray that ends with each ``fit()``.
They end with the driver process, as memory does. Outside the run's actors (the driver, the CLI,
unit tests) ``Storage`` uses fsspec's memory filesystem directly.

Why not fsspec's own remote options: it has no filesystem that shares memory between processes.
A ``file://`` path on local disk would, but it is not memory, and on a cluster of several nodes
no local path is shared at all.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import ray

logger = logging.getLogger(__name__)

# The hosts' namespace: one no run's can be ("elastic-" + RunConfig.name). "elastic-memory" was
# also the namespace of a run named "memory", whose actors then listed beside every driver's hosts.
NAMESPACE = "elastic_memory"
# The filesystem calls Storage makes (elastic/checkpoint/storage.py), fsspec's batch cat/pipe that
# DriverMirror copies a tree with, and the only calls the host runs.
OPS = frozenset({"pipe_file", "cat_file", "exists", "ls", "rm_file", "rm", "rmdir", "makedirs", "find",
                 "cat", "pipe"})
# Errors Storage tells apart, raised again as themselves on the caller's side.
_ERRORS = {e.__name__: e for e in (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                                   OSError, ValueError)}


class MemoryHost:
    """The actor: one fsspec ``MemoryFileSystem`` in a process of its own."""

    def __init__(self) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        self.fs = MemoryFileSystem()

    def call(self, op: str, args: tuple, kwargs: dict) -> tuple:
        """``("ok", value)`` or ``("err", error class name, message)``: an error travels as data,
        so the caller raises the same class (Ray would wrap it in its own task error)."""
        if op not in OPS:
            return ("err", "ValueError", f"memory host: unsupported call {op!r}")
        try:
            return ("ok", getattr(self.fs, op)(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the caller
            kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "OSError"
            return ("err", kind, str(exc))


class ClusterMemoryFS:
    """What ``Storage`` calls on an fsspec filesystem, answered by the run's ``MemoryHost``."""

    def __init__(self, host: Any):
        self._host = host

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing is cached on this side: every call reads the host."""

    def __getattr__(self, op: str):
        if op not in OPS:
            raise AttributeError(op)

        def call(*args, **kwargs):
            status, *rest = ray.get(self._host.call.remote(op, args, kwargs))
            if status == "ok":
                return rest[0]
            kind, message = rest
            raise _ERRORS.get(kind, OSError)(message)

        return call


# The run's host, as the driver named it (DriverMirror): set in the controller's runtime_env, which
# the ranks and agents it starts inherit (Trainer._controller_options).
HOST_ENV = "ELASTIC_MEMORY_HOST"


def host_name() -> str:
    """The host of this process's run: the one its driver named (``HOST_ENV``), else one per Ray
    job. Why per run: two fit() calls at once in one job (Tune trials as actors) shared one
    job-wide host, and the first to finish killed it under the other, whose checkpoints then
    failed to write for the rest of its run and were lost."""
    return os.environ.get(HOST_ENV) or f"memory-{ray.get_runtime_context().get_job_id()}"


_in_run = False


def join_run() -> None:
    """Called by the run's actors (the controller, every rank) as they start: from then on
    memory:// in this process is the run's shared copy. Why a flag and not "inside any Ray
    actor": a Trainer may itself run inside an actor (a Tune trial, say), and there memory://
    is that process's own memory, as for a driver."""
    global _in_run
    _in_run = True


def in_run_process() -> bool:
    """A process of the run (see ``join_run``): memory:// must go to the host."""
    return _in_run


def cluster_filesystem() -> ClusterMemoryFS:
    """The host of this job, for a process of the run. A process that finds none (started by
    something other than ``Trainer.fit``) starts one, which then lives as long as that process.
    Not for a run whose driver named its host (``HOST_ENV``): that host gone (killed, its node
    lost) is a StorageError. Started again, a new empty host of the same name took the run's
    writes, which then died with the rank that owned it; a replacement rank read "step N is not
    committed" from it, and the driver's copy at the end kept nothing committed after the loss."""
    try:
        return ClusterMemoryFS(ray.get_actor(host_name(), namespace=NAMESPACE))
    except ValueError:
        named = os.environ.get(HOST_ENV)
        if named:
            from elastic.checkpoint.storage import StorageError

            raise StorageError(f"the run's memory:// host {named!r} is gone (killed, or its node lost), and every "
                               "memory:// checkpoint of the run with it: memory:// lives in one process; use "
                               "file:// on shared storage, or s3://, for checkpoints that outlive one") from None
        logger.warning("no memory:// host for this job (runs started by Trainer.fit have one); starting one "
                       "owned by this process: its files end with it")
        return ClusterMemoryFS(_start_host())


def _start_host(name: str | None = None) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(MemoryHost).options(name=name or host_name(), namespace=NAMESPACE, get_if_exists=True,
                                          num_cpus=0, scheduling_strategy=here, max_restarts=0).remote()


class DriverMirror:
    """``with DriverMirror(root):`` the driver's files under ``root`` (a memory:// path) are on a
    ``MemoryHost`` for the run's processes, and come back into the driver's memory at the end."""

    def __init__(self, root: str):
        from fsspec.implementations.memory import MemoryFileSystem

        self.root = root
        self.local = MemoryFileSystem()
        self.host: Any = None
        # This run's own host (see host_name): the run's processes get the name in HOST_ENV.
        self.name = f"memory-{ray.get_runtime_context().get_job_id()}-{uuid.uuid4().hex[:12]}"

    def __enter__(self) -> "DriverMirror":
        self.host = _start_host(self.name)
        try:
            ClusterMemoryFS(self.host).pipe(_tree(self.local, self.root))
        except BaseException:
            _end(self.host, self.name)  # no run starts, so nothing comes back
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            files = _tree(ClusterMemoryFS(self.host), self.root)
        except Exception as exc:  # noqa: BLE001 - must never replace what fit() returns or raises
            # A RayError: the host's node is the driver's, so a cluster going down under the
            # driver. Anything else (the host's filesystem refusing a call) the same way: the
            # run's result, or its error, is what fit() hands back, with a warning for this.
            logger.warning("memory:// checkpoints of %s could not be copied back from the run (%s: %s); the "
                           "driver keeps the ones it had before the run", self.root, type(exc).__name__, exc)
        else:
            if self.local.exists(self.root):
                self.local.rm(self.root, recursive=True)
            self.local.pipe(files)
        finally:
            _end(self.host, self.name)
            self.host = None


def _tree(fs: Any, root: str) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (fsspec's ``cat`` of a list; it refuses an empty
    one). A file deleted between the listing and the read (a cleanup pass of a run being killed
    still going) is left out (``on_error="omit"``), not a FileNotFoundError for the whole tree."""
    paths = fs.find(root)
    return fs.cat(paths, on_error="omit") if paths else {}


def _end(host: Any, name: str | None = None, timeout_s: float = 10.0) -> None:
    """Kill the host and wait until its name is free. Why wait: ``ray.kill`` returns before the
    actor is gone, and a ``fit()`` right after this one would otherwise find the dying host by
    name (``get_if_exists``) and copy its files into it."""
    ray.kill(host, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name or host_name(), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    logger.warning("the memory:// host of this run was killed but still holds its name after %.0fs", timeout_s)
