"""Background spare start-up: SCHED_IDLE for the building thread, every thread restored after.

Real threads and the real scheduler calls. The SCHED_IDLE path needs a process that may raise a
thread's priority again (root, CAP_SYS_NICE or RLIMIT_NICE); without it the tests check the
normal-priority fallback and are skipped.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import ROOT
from elastic.actors.priority import can_restore_priority, idle_priority, idle_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux")

# Where this process may not raise a thread's priority again, idle_priority never lowers it: the
# normal-priority fallback is checked, then the test is skipped, so -ra shows the idle path untested.
NO_PRIVILEGE = "no CAP_SYS_NICE or RLIMIT_NICE to leave SCHED_IDLE: only the fallback was checked"


def in_thread(fn):
    """Run ``fn`` in a fresh thread (the policy is per thread) and return what it returned."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_build_runs_idle_and_every_thread_is_restored():
    def body():
        child_policy, release, seen = {}, threading.Event(), threading.Event()

        def child():  # started during the build: it inherits the policy and must be restored too
            child_policy["inside"] = os.sched_getscheduler(0)
            seen.set()
            release.wait(10)
            child_policy["after"] = os.sched_getscheduler(0)

        with idle_priority(True) as idle:
            inside = os.sched_getscheduler(0)
            t = threading.Thread(target=child)
            t.start()
            seen.wait(10)
            idle_inside = idle_threads()
        after = os.sched_getscheduler(0)
        release.set()
        t.join(10)
        return idle, inside, after, child_policy, idle_inside

    idle, inside, after, child, idle_inside = in_thread(body)
    assert after == child["after"] == os.SCHED_OTHER
    assert idle_threads() == 0
    if not can_restore_priority():  # it could not come back, so it never went: normal priority
        assert idle is False
        assert inside == child["inside"] == os.SCHED_OTHER
        pytest.skip(NO_PRIVILEGE)
    assert idle is True
    assert inside == child["inside"] == os.SCHED_IDLE and idle_inside >= 2


def test_a_thread_started_while_the_threads_are_restored_is_restored_too(monkeypatch):
    # One scan of the threads restored those it listed; a thread that an idle-class one started
    # meanwhile (a loader pool) inherited SCHED_IDLE, was not listed, and kept it: a promoted
    # spare then trained with a helper served from idle CPU.
    from elastic.actors import priority as priority_module

    listed, started, release, policy = priority_module._thread_ids, [], threading.Event(), {}

    def child():
        policy["inside"] = os.sched_getscheduler(0)
        release.wait(10)
        policy["after"] = os.sched_getscheduler(0)

    def thread_ids():
        ids = listed()
        if not started:  # the first scan's list; then a thread it does not name, started idle-class
            started.append(threading.Thread(target=child))
            started[0].start()
        return ids

    monkeypatch.setattr(priority_module, "_thread_ids", thread_ids)

    def body():
        with idle_priority(True) as idle:
            pass
        release.set()
        started[0].join(10)
        return idle

    idle = in_thread(body)
    assert policy["after"] == os.SCHED_OTHER
    if not can_restore_priority():
        assert idle is False
        pytest.skip(NO_PRIVILEGE)
    assert idle is True and policy["inside"] == os.SCHED_IDLE


def test_disabled_changes_nothing():
    def body():
        with idle_priority(False) as idle:
            return idle, os.sched_getscheduler(0)

    assert in_thread(body) == (False, os.SCHED_OTHER)


def test_the_thread_is_restored_when_the_build_fails():
    def body():
        seen = {}
        with pytest.raises(RuntimeError, match="model_fn failed"):
            with idle_priority(True) as idle:
                seen["idle"], seen["inside"] = idle, os.sched_getscheduler(0)
                raise RuntimeError("model_fn failed")
        return seen, os.sched_getscheduler(0)

    seen, after = in_thread(body)
    assert after == os.SCHED_OTHER
    if not can_restore_priority():
        assert seen == {"idle": False, "inside": os.SCHED_OTHER}
        pytest.skip(NO_PRIVILEGE)
    # It did go idle, so the exit really restored it (not merely never lowered it).
    assert seen == {"idle": True, "inside": os.SCHED_IDLE}


def test_processes_started_during_the_build_are_restored_too():
    # A dataset_fn that starts a helper process (a loader pool, a tokenizer server) gave it the
    # build's SCHED_IDLE, and it kept it after the spare was promoted: the spare's steps then
    # waited on a process served from idle CPU. Its child (a grandchild of the build) as well.
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(p.pid, flush=True); time.sleep(60)")

    def body():
        with idle_priority(True) as idle:
            child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
            grandchild = int(child.stdout.readline())
            inside = (os.sched_getscheduler(child.pid), os.sched_getscheduler(grandchild))
        try:
            return idle, inside, (os.sched_getscheduler(child.pid), os.sched_getscheduler(grandchild))
        finally:
            os.kill(grandchild, 9)
            child.kill()
            child.wait(10)

    idle, inside, after = in_thread(body)
    assert after == (os.SCHED_OTHER, os.SCHED_OTHER)
    if not can_restore_priority():
        assert idle is False and inside == (os.SCHED_OTHER, os.SCHED_OTHER)
        pytest.skip(NO_PRIVILEGE)
    assert idle is True and inside == (os.SCHED_IDLE, os.SCHED_IDLE)


def test_inside_a_user_namespace_the_capability_bit_is_not_taken_for_the_right():
    """``unshare -rU``: CapEff shows CAP_SYS_NICE, but the kernel checks it against the initial
    user namespace and leaving SCHED_IDLE fails with EPERM. Read from CapEff, a spare built
    there stayed idle-class for good; now the probe says no and nothing is lowered."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rU", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces here (unshare -rU)")
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20 - os.getpriority(os.PRIO_PROCESS, 0):
        pytest.skip("RLIMIT_NICE lets this process leave SCHED_IDLE in any namespace")
    code = ("import os\n"
            "from elastic.actors.priority import can_restore_priority, idle_priority\n"
            "caps = int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)\n"
            "with idle_priority(True) as idle:\n"
            "    inside = os.sched_getscheduler(0)\n"
            "print(caps >> 23 & 1, can_restore_priority(), idle, inside == os.SCHED_OTHER)\n")
    out = subprocess.run([unshare, "-rU", sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "False", "False", "True"]
