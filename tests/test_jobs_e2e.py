"""End to end through Ray Jobs: ``examples/digits.py`` on a ``ray start --head`` cluster with token auth.

While the job runs, the test reads the named actors through the state API, runs ``elastic status``
and scrapes the Prometheus endpoint for the ``ray_elastic_*`` metrics; then ``ray job stop``
stops the run cleanly, with a checkpoint of the very step it stopped after. ``RayHead`` is reused by
tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)  # the virtualenv's bin: `ray`, and `python` for job entrypoints
EXCLUDES = [".venv", ".git", "**/__pycache__", ".pytest_cache", "*.egg-info", "build", "dist"]


def free_ports(n: int) -> list[int]:
    """Ports the kernel just handed out; held together so they are distinct."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_exc = exc
        time.sleep(interval_s)
    detail = f" (last error: {last_exc!r})" if last_exc else ""
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")


def _session_id(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[3])  # state, ppid, pgrp, session
    except (OSError, IndexError, ValueError):
        return None


# What ray start's components print when a port they were given is bound by another process.
PORT_TAKEN = re.compile(r"already in use|in use by|Address in use|[Ff]ailed to bind|port .* (is )?not available")


class _HeadExited(BaseException):
    """``ray start`` exited: a BaseException, as pytest.fail's, so wait_for's retries let it out."""

    def __init__(self, returncode: int, log: str):
        super().__init__(f"ray start exited with {returncode}")
        self.returncode, self.log = returncode, log


class RayHead:
    """A head node from ``ray start --head --block``, in its own session, ports and temp dir.

    Token auth is on the normal Ray way: ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` in the
    environment of the cluster and of every client (``env()``); HTTP clients in this process send
    the token as a bearer header (``auth_headers``). ``stop()`` ends only the processes it started.
    """

    def __init__(self, num_cpus: int = 8):
        self.num_cpus = num_cpus
        self.token = secrets.token_hex(32)
        self._prepare()
        self.proc: subprocess.Popen | None = None

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def auth_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def env(self, auth: bool = True) -> dict:
        """The environment of the cluster and of its clients: the virtualenv first on PATH, so job
        entrypoints' ``python`` has torch and elastic; no test-only ELASTIC_* overrides."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ELASTIC_", "RAY_AUTH_", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"))}
        env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
        if auth:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN"] = self.token
        return env

    def _prepare(self) -> None:
        """Fresh ports and temp dir (a failed start's stop() removes the dir)."""
        # Short: Ray puts unix sockets under it and their paths must stay below 108 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ray_e2e_", dir="/tmp")
        self.log_path = os.path.join(self.temp_dir, "head.log")
        (self.port, self.dashboard_port, self.agent_listen_port, self.agent_grpc_port, self.metrics_port,
         self.client_port, self.runtime_env_agent_port) = free_ports(7)

    def start(self, timeout_s: float = 90, attempts: int = 3) -> "RayHead":
        """Start the head; ``attempts`` times with fresh ports if one was taken in the meantime.
        Why: ``ray start`` needs its ports named (port 0 is not accepted for all of them), and a
        port free_ports saw free can be bound by another process before the head binds it."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except _HeadExited as exc:
                if attempt + 1 == attempts or not PORT_TAKEN.search(exc.log):
                    pytest.fail(f"ray start exited with {exc.returncode}:\n{exc.log}")
                self._prepare()
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> "RayHead":
        env = self.env()
        # Export metrics every 2 s instead of 10 s, so a short run shows up in Prometheus.
        env["RAY_metrics_report_interval_ms"] = "2000"
        cmd = [
            os.path.join(BIN, "ray"), "start", "--head", "--block", "--disable-usage-stats",
            f"--port={self.port}", f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1",
            "--include-dashboard=true", f"--dashboard-agent-listen-port={self.agent_listen_port}",
            f"--dashboard-agent-grpc-port={self.agent_grpc_port}", f"--metrics-export-port={self.metrics_port}",
            f"--ray-client-server-port={self.client_port}", f"--runtime-env-agent-port={self.runtime_env_agent_port}",
            f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp_dir}",
        ]
        with open(self.log_path, "wb") as log:
            # A session of its own: stop() finds every process it started by session id.
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            wait_for(self._jobs_api_ready, timeout_s, what=f"the Ray head to serve jobs ({self.log_path})")
        except BaseException:
            self.stop()
            raise
        return self

    def _jobs_api_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise _HeadExited(self.proc.returncode, self.log_tail())
        req = urllib.request.Request(f"{self.dashboard_url}/api/version", headers=self.auth_headers)
        with urllib.request.urlopen(req, timeout=3) as resp:
            if resp.status != 200:
                return False
        # The jobs API answers before the dashboard agent, which runs the jobs, is up: a job
        # submitted then fails with "No available agent to submit job" when the agent takes
        # longer than the head waits for it (a loaded machine). The agent opens its HTTP port
        # just before it registers with the GCS.
        with socket.create_connection(("127.0.0.1", self.agent_listen_port), timeout=3):
            return True

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def python(self, code: str, timeout_s: float = 60) -> str:
        """Run ``code`` in a fresh client process with the cluster's token; returns its stdout."""
        out = subprocess.run([sys.executable, "-c", code], env=self.env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout_s)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def stop(self) -> None:
        if self.proc is None:
            return
        sid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # Workers and anything that outlived the grace period: only our session, never other clusters.
        for _ in range(2):
            left = [int(p) for p in os.listdir("/proc") if p.isdigit() and _session_id(int(p)) == sid]
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not left:
                break
            time.sleep(1)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead().start()
    yield head
    head.stop()


LIST_ACTORS = """
import json
from ray.util.state import list_actors
actors = list_actors(address={url!r}, filters=[("ray_namespace", "=", {ns!r})], limit=1000,
                     raise_on_missing_output=False)
print(json.dumps([[a.name, a.state] for a in actors]))
"""


def alive_named_actors(head: RayHead, namespace: str) -> set[str]:
    rows = json.loads(head.python(LIST_ACTORS.format(url=head.dashboard_url, ns=namespace)).strip().splitlines()[-1])
    return {name for name, state in rows if name and state == "ALIVE"}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode(errors="replace")


def elastic_metrics(text: str, run: str) -> dict[str, list[str]]:
    """{metric name: [sample lines]} of the ray_elastic_* samples tagged with ``run``."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("ray_elastic_") and f'run="{run}"' in line:
            out.setdefault(line.split("{", 1)[0], []).append(line)
    return out


@pytest.mark.slow
def test_digits_job_named_actors_status_and_metrics(ray_head):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from elastic.checkpoint import CheckpointStore

    client = JobSubmissionClient(ray_head.dashboard_url, headers=ray_head.auth_headers)
    storage = f"file://{tempfile.mkdtemp(prefix='elastic_job_', dir=ray_head.temp_dir)}"
    # Far more epochs than the checks below need (the named actors, a metrics scrape and
    # `elastic status`, which pays a torch import before it connects); the job is then stopped.
    # Rank 0 sleeps 50 ms a step (the example's fault-injection flags), so the job trains at
    # ~20 steps a second instead of taking both cores from the other tests for the ~30 s it runs.
    job_id = client.submit_job(
        entrypoint=f"python examples/digits.py --workers 2 --spares 1 --epochs 1000 --no-progress --storage {storage} "
                   "--slow-rank 0 --slow-delay 0.05 --slow-from-step 1",
        # `ray job stop` sends SIGKILL this long after SIGTERM (3 s by Ray's default): room for
        # a loaded machine to finish the clean stop checked below. Per job, as `elastic submit`
        # and deploy/rayjob-digits.yaml set it (the job's supervisor reads its env_vars).
        runtime_env={"working_dir": ROOT, "excludes": EXCLUDES, "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "70"}},
    )
    status = None
    try:
        def job_running_actors():
            st = client.get_job_status(job_id)
            if st.is_terminal():
                pytest.fail(f"job ended ({st}) before its actors were seen:\n{client.get_job_logs(job_id)[-3000:]}")
            names = alive_named_actors(ray_head, "elastic-digits")
            return names if {"controller", "rank-0", "rank-1", "spare-0"} <= names else None

        names = wait_for(job_running_actors, 150, interval_s=1, what="the named actors of run 'digits'")
        assert {"controller", "rank-0", "rank-1", "spare-0"} <= names

        # `elastic status` starts now and imports torch while the metrics are polled.
        status = subprocess.Popen([sys.executable, "-m", "elastic.cli", "status", "--address", ray_head.gcs_address,
                                   "--timeout", "60", "digits"], env=dict(ray_head.env(), COLUMNS="200"), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def ranks_of(found, name):
            return {m.group(1) for ln in found.get(name, []) if (m := re.search(r'rank="(\d+)"', ln))}

        # A rank's straggler score is NaN ("no value", not exported) until the policy's warm-up
        # ends, so the scrape is awaited until both ranks have one, not just a heartbeat.
        def rank_metrics():
            found = elastic_metrics(scrape(ray_head.metrics_url), "digits")
            ready = (ranks_of(found, "ray_elastic_heartbeat_age_s") >= {"0", "1"}
                     and ranks_of(found, "ray_elastic_straggler_score") >= {"0", "1"}
                     and "ray_elastic_step_time_s_count" in found)
            return found if ready else None

        metrics = wait_for(rank_metrics, 90, interval_s=1, what="ray_elastic_* metrics with run and rank tags")
        for name in ("ray_elastic_straggler_score", "ray_elastic_rank_step_time_s", "ray_elastic_rank_behind_steps",
                     "ray_elastic_world_size",
                     "ray_elastic_spares_available", "ray_elastic_spares_building", "ray_elastic_samples_per_s",
                     "ray_elastic_step"):
            assert name in metrics, f"{name} missing from {sorted(metrics)}"
        assert {re.search(r'rank="(\d+)"', ln).group(1) for ln in metrics["ray_elastic_straggler_score"]} == {"0", "1"}

        out, err = status.communicate(timeout=120)
        assert status.returncode == 0, f"elastic status failed:\n{out}\n{err}"
        assert "Traceback" not in err
        assert "run digits" in out
        for name in ("rank-0", "rank-1", "spare-0"):
            assert name in out, out
        rows = {line.split("│")[2].strip(): line for line in out.splitlines() if line.count("│") > 5}
        assert "active" in rows["rank-0"] and "spare" in rows["spare-0"], out

        # `ray job stop`: SIGTERM to the driver, which stops the run cleanly and commits where it stopped.
        client.stop_job(job_id)

        def finished():
            st = client.get_job_status(job_id)
            return st if st.is_terminal() else None

        final = wait_for(finished, 90, interval_s=1, what="the job to stop")
        logs = client.get_job_logs(job_id)
        assert final == JobStatus.STOPPED, logs[-4000:]
        stop = re.search(r"SIGTERM: run 'digits' stopped after step (\d+); latest committed checkpoint: step (\d+)", logs)
        assert stop and stop.group(1) == stop.group(2), logs[-4000:]
        assert "test_accuracy so far=" in logs and "Traceback" not in logs, logs[-4000:]
        assert CheckpointStore(storage, "digits").latest_valid() == int(stop.group(1))
    finally:
        if status is not None and status.poll() is None:
            status.kill()
            status.wait()
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)
