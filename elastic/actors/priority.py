"""Start a replacement spare on idle CPU only, so its start-up never slows the ranks that train.

A spare that refills the pool while training runs costs a process, the torch import, the model,
the optimizer and the dataset: about 4 s of CPU on top of Ray's own worker start-up, measured on
the benchmark workload. On a node whose cores the ranks already fill, those seconds came straight
out of training: 200 steps ran at ~75% speed after every eviction.

``idle_priority`` runs that start-up with the calling thread in ``SCHED_IDLE``, the Linux policy
that gets a core only when no normal thread wants it (threads and processes the start-up creates
inherit it). On the way out every thread of the process still in ``SCHED_IDLE`` goes back to
``SCHED_OTHER``, and so does every thread of the processes the start-up left running under it (a
``dataset_fn`` that starts a loader pool or a tokenizer server, say): those would otherwise serve
the promoted spare's steps from idle CPU and make it the next straggler. Why not ``nice``: Ray
already starts its workers at nice 15, and nice 19 against 15 is only a 2.4x weight; the ranks
still lost most of that CPU.

Where it does not hold: on the 2-vCPU VM of the benchmarks, idle CPU is not free. A plain
``SCHED_IDLE`` busy loop (no memory traffic) cut first-N training from ~13.3k to ~10.2k
samples/s: the ranks leave ~12% of the CPU idle while they wait for each other, the loop takes
it, and the ranks' wake-ups then cost more. So a spare refilling there still slows training
while it builds: steps of ~25 ms against ~19 ms once it is ready, for ~315 steps. At normal
priority they took ~30 ms, for ~200 steps (same run, one eviction each).

Going back from ``SCHED_IDLE`` needs the right to raise priority (``CAP_SYS_NICE``, or an
``RLIMIT_NICE`` that covers the thread's nice value; the kernel's ``can_nice``). Without it the
spare would stay idle-class forever and become the next straggler, so then nothing changes and
the spare starts at normal priority. Tried on a thread of its own before anything is lowered
(``can_restore_priority``).

Not covered: a process the start-up detaches (a double fork, ``setsid`` and re-parented to
init) is no longer under this process, so it is not found and keeps SCHED_IDLE.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def can_restore_priority() -> bool:
    """Whether this process may move a thread out of SCHED_IDLE again: tried once, on a thread of
    its own that goes into SCHED_IDLE and back (then ends), and remembered.

    Why try instead of reading the rights: the kernel checks CAP_SYS_NICE against the initial
    user namespace, so inside another one (rootless podman, Docker or Kubernetes with user
    namespaces and SYS_NICE added) ``CapEff`` shows the bit while leaving SCHED_IDLE fails with
    EPERM; a seccomp profile can refuse it too. Read from CapEff, a spare started there stayed
    idle-class for good, the next straggler."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return False
    box: dict[str, bool] = {}

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            box["ok"] = False
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            box["ok"] = True
        except OSError:
            box["ok"] = False  # this thread ends idle-class; nothing else was lowered

    thread = threading.Thread(target=probe, name="elastic-priority-probe", daemon=True)
    thread.start()
    thread.join(10)
    return box.get("ok", False)


def _thread_ids() -> list[int]:
    """This process's threads; [0] (the calling thread) where /proc cannot say."""
    return _thread_ids_of("self") or [0]


def _descendants(pid: int) -> list[int]:
    """The live processes under ``pid`` (children, theirs, ...), from /proc; [] where unreadable."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # Fields after the command name, which may hold spaces and parentheses: state, ppid, ...
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def _thread_ids_of(pid: int | str) -> list[int]:
    """The threads of process ``pid`` (or "self"); [] where it is gone or /proc cannot say."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _restore(tid: int) -> bool:
    """Move thread ``tid`` from SCHED_IDLE back to SCHED_OTHER (others are left as they are);
    whether it found it in SCHED_IDLE."""
    try:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            return True
    except OSError as exc:  # ended meanwhile; or, against the check above, not allowed
        if not isinstance(exc, ProcessLookupError):
            logger.warning("thread %d: could not leave SCHED_IDLE: %s", tid, exc)
    return False


# Scans of the threads and processes at the end of an idle-priority build, at most: each one after
# a scan that found a thread still idle-class. Why more than one: a thread not yet restored can
# start another (a loader or tokenizer pool) during the scan, which then inherits SCHED_IDLE and
# is not among the ids the scan listed; a promoted spare trained with it served from idle CPU.
RESTORE_SCANS = 5


def _restore_all() -> int:
    """One scan: this process's threads, then its descendants'; how many were found idle-class.
    This process's threads first: a process they start from then on inherits the normal policy.
    Threads are addressed by id (the policy is per thread), a child's as this process's own; a
    child is ours to raise again: same user, and it inherited the rlimit checked before."""
    found = sum(_restore(tid) for tid in _thread_ids())
    for pid in _descendants(os.getpid()):
        found += sum(_restore(tid) for tid in _thread_ids_of(pid))
    return found


def idle_threads() -> int:
    """How many threads of this process are in SCHED_IDLE (0 off Linux)."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    count = 0
    for tid in _thread_ids():
        try:
            count += os.sched_getscheduler(tid) == os.SCHED_IDLE
        except OSError:  # the thread ended meanwhile
            pass
    return count


@contextmanager
def idle_priority(enabled: bool = True) -> Iterator[bool]:
    """Run the body on idle CPU only; yields whether it does. Restores every thread on exit."""
    if not enabled or not can_restore_priority():
        yield False
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        logger.debug("cannot start in the background (SCHED_IDLE): %s", exc)
        yield False
        return
    try:
        yield True
    finally:
        for _ in range(RESTORE_SCANS):
            if not _restore_all():
                break
