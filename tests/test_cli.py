"""The ``elastic`` CLI: one-line errors with a non-zero exit and no traceback, in bounded time.

``status`` and ``submit`` against a cluster run as subprocesses (Ray's C++ core writes straight to
fd 2, and the token reaches Ray the normal way, through the environment); the rest runs in-process
through Typer's CliRunner.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

import elastic
from elastic.checkpoint import CheckpointStore
from elastic.cli import CliError, app, parse_storage_options
from test_jobs_e2e import ROOT, RayHead, free_ports

runner = CliRunner(env={"COLUMNS": "200"})  # tables unabridged whatever the terminal


def run_cli(args: list[str], env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, COLUMNS="200")  # tables unabridged whatever the terminal
    return subprocess.run([sys.executable, "-m", "elastic.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def one_line_error(returncode: int, stdout: str, stderr: str) -> str:
    """The single error line; fails unless the exit is non-zero and nothing else went to stderr."""
    assert returncode != 0, stdout
    assert "Traceback" not in stdout + stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("elastic: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead(num_cpus=2).start()
    yield head
    head.stop()


# ---- status -----------------------------------------------------------------------------------

def test_status_unreachable_address_fails_fast():
    port = free_ports(1)[0]  # closed again by the time the CLI connects
    start = time.monotonic()
    result = runner.invoke(app, ["status", "--address", f"127.0.0.1:{port}", "digits"])
    assert time.monotonic() - start < 10
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}" in line


def test_status_unreachable_address_subprocess_one_line():
    port = free_ports(1)[0]
    out = run_cli(["status", "--address", f"127.0.0.1:{port}", "digits"])
    assert "cannot reach a Ray cluster" in one_line_error(out.returncode, out.stdout, out.stderr)


@pytest.mark.parametrize("command", [["status", "r"], ["stop", "r"]])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_a_usage_error(command, value):
    # 0 blamed the cluster ("cannot reach a Ray cluster"), -1 and inf failed in the socket module or
    # int(), nan passed the probe; none named --timeout.
    result = runner.invoke(app, [*command, "--address", "127.0.0.1:1", "--timeout", value])
    assert result.exit_code == 2 and "--timeout" in result.output and "seconds > 0" in result.output, result.output


def test_status_rejects_dashboard_url():
    result = runner.invoke(app, ["status", "--address", "http://127.0.0.1:8265", "digits"])
    assert result.exit_code == 2
    assert "dashboard URL" in one_line_error(result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("command", [["status", "r"], ["stop", "r"]])
def test_a_bad_ray_address_in_the_environment_is_named_as_such(command, monkeypatch):
    # RAY_ADDRESS=headnode was reported as "--address 'headnode' is not HOST:PORT", an option
    # the user never passed.
    monkeypatch.setenv("RAY_ADDRESS", "headnode")
    result = runner.invoke(app, command)
    assert result.exit_code == 2
    assert "RAY_ADDRESS 'headnode' is not HOST:PORT" in one_line_error(result.exit_code, result.stdout, result.stderr)
    result = runner.invoke(app, [*command, "--address", "headnode"])
    assert "--address 'headnode' is not HOST:PORT" in one_line_error(result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("command", [["status", "r"], ["stop", "r"], ["submit", "examples/digits.py"]])
def test_an_empty_address_is_a_usage_error_not_the_default_cluster(command, monkeypatch):
    # --address "$HEAD" with HEAD unset: it went to RAY_ADDRESS or the local cluster.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    result = runner.invoke(app, [*command, "--address", ""])
    assert result.exit_code == 2
    assert "--address is empty" in one_line_error(result.exit_code, result.stdout, result.stderr)


def test_status_unknown_run_on_a_real_cluster(ray_head):
    out = run_cli(["status", "--address", ray_head.gcs_address, "no-such-run"], env=ray_head.env())
    line = one_line_error(out.returncode, out.stdout, out.stderr)
    assert "no run 'no-such-run'" in line and "elastic-no-such-run" in line


def test_status_without_a_run_name_and_no_runs(ray_head):
    out = run_cli(["status", "--address", ray_head.gcs_address], env=ray_head.env())
    assert "no elastic run is live" in one_line_error(out.returncode, out.stdout, out.stderr)


def test_status_without_the_token_says_how_to_pass_it(ray_head):
    start = time.monotonic()
    out = run_cli(["status", "--address", ray_head.gcs_address, "--timeout", "20", "digits"],
                  env=ray_head.env(auth=False))
    line = one_line_error(out.returncode, out.stdout, out.stderr)
    assert "authentication failed" in line and "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line
    assert ray_head.token not in out.stdout + out.stderr
    assert time.monotonic() - start < 90  # torch import + at most --timeout


def test_stop_unknown_run_on_a_real_cluster(ray_head):
    """(A live run stopped by `elastic stop`: tests/test_checkpoint_e2e.py.)"""
    out = run_cli(["stop", "--address", ray_head.gcs_address, "no-such-run"], env=ray_head.env())
    line = one_line_error(out.returncode, out.stdout, out.stderr)
    assert "no run 'no-such-run'" in line and "no elastic run is live there" in line


# ---- submit -----------------------------------------------------------------------------------

def test_submit_unreachable_dashboard():
    port = free_ports(1)[0]
    result = runner.invoke(app, ["submit", "--address", f"http://127.0.0.1:{port}", "examples/digits.py"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert f"127.0.0.1:{port}" in line


def test_submit_to_a_cluster_address_nothing_listens_on_says_so_without_asking_ray():
    # HEAD:6379 (the GCS) rather than the dashboard's URL: Ray's client reads the dashboard's
    # address from the GCS and retried for 40 s, its messages quieted. The probe answers first.
    port = free_ports(1)[0]
    result = runner.invoke(app, ["submit", "--address", f"127.0.0.1:{port}", "examples/digits.py"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}" in line and "http://HEAD:8265" in line


def test_submit_to_a_ray_client_address_nothing_listens_on_says_so_without_asking_ray(monkeypatch):
    # ray://HEAD:10001 was not probed (only addresses without "://" were): Ray's client retried
    # for ~30 s, and the error blamed "the Ray dashboard". http(s):// still goes to the client.
    import ray.job_submission

    asked = []

    class Client:
        def __init__(self, address):
            asked.append(address)
            raise ConnectionError("stop here")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    port = free_ports(1)[0]
    result = runner.invoke(app, ["submit", "--address", f"ray://127.0.0.1:{port}", "examples/digits.py"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1 and not asked, line
    assert f"cannot reach a Ray cluster at ray://127.0.0.1:{port}" in line and "dashboard at" not in line
    # As status refuses them: a scheme in capitals (a module's name to Ray) and no port.
    for address, said in ((f"RAY://127.0.0.1:{port}", "scheme in capitals"), ("ray://head", "not ray://HOST:PORT")):
        result = runner.invoke(app, ["submit", "--address", address, "examples/digits.py"])
        assert result.exit_code == 2 and said in result.stderr and not asked, result.stderr
    result = runner.invoke(app, ["submit", "--address", f"http://127.0.0.1:{port}", "examples/digits.py"])
    assert asked == [f"http://127.0.0.1:{port}"] and "cannot reach the Ray dashboard" in result.stderr


def test_submit_to_a_dashboard_that_never_answers_fails_within_its_bound(monkeypatch, tmp_path):
    # A port that takes the connection (the kernel's backlog) and never answers, as a stale
    # port-forward or a hung head does: Ray's Jobs client has no timeout and waited forever.
    import socket

    import elastic.cli as cli

    monkeypatch.setattr(cli, "ANSWER_TIMEOUT_S", 1.0)
    (tmp_path / "job.py").write_text("print('hi')\n")
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        result = runner.invoke(app, ["submit", "--address", f"http://127.0.0.1:{port}", "--working-dir",
                                     str(tmp_path), "job.py"])
        took = time.monotonic() - t0
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1 and took < 30, (took, line)
    assert f"no answer from the Ray dashboard at http://127.0.0.1:{port} within 1 s" in line


def test_submit_to_the_dashboards_port_without_http_says_it_was_read_as_a_gcs_address(monkeypatch, tmp_path):
    # HEAD:8265 passes the probe (the dashboard listens there), Ray reads it as the cluster's GCS
    # address, and after ~30 s the error blamed the dashboard with no word of the missing http://.
    import socket
    import threading

    import ray.job_submission

    import elastic.cli as cli

    hint = ("an address without http:// is read as the cluster's GCS address, HEAD:6379; give the dashboard's "
            "URL, --address http://HEAD:8265")
    release = threading.Event()

    class Client:
        hangs = False

        def __init__(self, address):
            if Client.hangs:  # Ray's retries to read the dashboard's address from the GCS
                release.wait(10)
            raise ConnectionError("Could not read 'dashboard' from GCS. Did GCS start successfully?")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    monkeypatch.setattr(cli, "ANSWER_TIMEOUT_S", 0.5)
    (tmp_path / "job.py").write_text("print('hi')\n")
    with socket.create_server(("127.0.0.1", 0)) as dashboard:
        port = dashboard.getsockname()[1]
        args = ["submit", "--address", f"127.0.0.1:{port}", "--working-dir", str(tmp_path), "job.py"]
        result = runner.invoke(app, args)
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert f"cannot reach the Ray dashboard at 127.0.0.1:{port}: Could not read 'dashboard'" in line, line
        assert hint in line, line
        Client.hangs = True
        try:
            result = runner.invoke(app, args)
        finally:
            release.set()
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert f"no answer from the Ray dashboard at 127.0.0.1:{port} within 0.5 s ({hint})" in line, line
    # The dashboard's URL is taken as given: no hint about a scheme it has.
    Client.hangs = False
    result = runner.invoke(app, ["submit", "--address", f"http://127.0.0.1:{port}", "--working-dir", str(tmp_path),
                                 "job.py"])
    assert result.exit_code == 1 and "without http://" not in result.stderr, result.stderr


def test_submit_bounds_the_upload_by_its_timeout(monkeypatch, tmp_path):
    import threading

    import ray.job_submission

    never, ids = threading.Event(), []

    class Client:  # takes the connection, then never finishes the submission (the upload)
        def __init__(self, address):
            self.address = address

        def submit_job(self, submission_id, **kw):
            ids.append(submission_id)
            never.wait(60)

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    (tmp_path / "job.py").write_text("print('hi')\n")
    try:
        result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--address",
                                     "http://head:8265", "--timeout", "1"])
    finally:
        never.set()
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1 and len(ids) == 1 and ids[0].startswith("raysubmit_")
    # The job's id, made here: the dashboard may have taken the job after all, and a retry trains twice.
    assert f"no answer from the Ray dashboard at http://head:8265 within 1 s (--timeout); the job may have been " \
           f"submitted all the same: `ray job status {ids[0]}` says" in line


def recorded_submissions(monkeypatch) -> list[dict]:
    """A Jobs client that takes every submission: the list it returns gets each one's keyword
    arguments (entrypoint, runtime_env, submission_id) and the client's ``address``."""
    import ray.job_submission

    submitted: list[dict] = []

    class Client:
        def __init__(self, address):
            self.address = address

        def submit_job(self, **kw):
            submitted.append({"address": self.address, **kw})
            return "raysubmit_test"

        def get_address(self):
            return self.address

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    return submitted


@pytest.mark.parametrize("given, expected", [([], "70"), (["--stop-wait", "300"], "300")])
def test_submit_gives_the_job_time_for_a_clean_stop(monkeypatch, tmp_path, given, expected):
    """`ray job stop` kills the driver RAY_JOB_STOP_WAIT_TIME_S after SIGTERM, 3 s by Ray's
    default, which cuts a clean stop short; the job's supervisor reads it from the job's env_vars."""
    submitted = recorded_submissions(monkeypatch)
    (tmp_path / "job.py").write_text("print('hi')\n")
    result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--address",
                                 "http://head:8265", *given])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert submitted[0]["runtime_env"]["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": expected}
    refused = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--stop-wait", "0"])
    assert refused.exit_code == 2


class FollowedJob:
    """A Jobs client of one job for ``_follow``: its log stream sends ``chunks``, then stays quiet
    (a quiet job, or a partition); each status ask takes the next of ``statuses`` (an exception
    instance is raised, the last one repeats)."""

    def __init__(self, chunks, statuses, breaks=None):
        self.chunks, self.statuses, self.asks, self.breaks = chunks, list(statuses), 0, breaks

    async def tail_job_logs(self, job_id):
        import asyncio

        for chunk in self.chunks:
            yield chunk
        if self.breaks is not None:  # the stream's websocket dropped (Ray's tail_job_logs raises)
            raise self.breaks
        await asyncio.Event().wait()  # quiet for good

    def get_job_status(self, job_id):
        self.asks += 1
        answer = self.statuses[0] if len(self.statuses) == 1 else self.statuses.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_follow_asks_the_status_when_the_log_stream_is_quiet(monkeypatch, capsys):
    # The stream of a finished job that never closed (a partition, a proxy) held --follow forever.
    from ray.job_submission import JobStatus

    import elastic.cli as cli

    monkeypatch.setattr(cli, "FOLLOW_QUIET_S", 0.2)
    job = FollowedJob(["step 1\n"], [JobStatus.RUNNING, ConnectionError("reset"), JobStatus.SUCCEEDED])
    cli._follow(job, "raysubmit_1")  # returns: the job succeeded
    assert capsys.readouterr().out.splitlines() == ["step 1", "job raysubmit_1: SUCCEEDED"]
    assert job.asks == 3  # one unanswered ask in between is no loss
    job = FollowedJob([], [JobStatus.RUNNING, JobStatus.FAILED])
    with pytest.raises(cli.typer.Exit) as exit_:
        cli._follow(job, "raysubmit_2")
    assert exit_.value.exit_code == 1 and "job raysubmit_2: FAILED" in capsys.readouterr().out


def test_follow_waits_for_the_job_when_the_log_stream_breaks(monkeypatch, capsys):
    # A dropped port-forward closes Ray's websocket (code 1006), and tail_job_logs raises. That
    # ended --follow with exit 1 while the job went on: a script that resubmits trained twice.
    from ray.job_submission import JobStatus

    import elastic.cli as cli

    monkeypatch.setattr(cli, "FOLLOW_QUIET_S", 0.05)
    broke = RuntimeError("WebSocket connection closed unexpectedly with close code 1006 (ws://a:pw@head:8265)")
    job = FollowedJob(["step 1\n"], [JobStatus.RUNNING, JobStatus.RUNNING, JobStatus.SUCCEEDED], breaks=broke)
    cli._follow(job, "raysubmit_4", ": ray job logs --follow raysubmit_4")  # returns: the job succeeded
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 1", "job raysubmit_4: SUCCEEDED"] and job.asks == 3
    assert "the log stream broke (WebSocket connection closed unexpectedly with close code 1006" in err
    assert "waiting for job raysubmit_4 to end: ray job logs --follow raysubmit_4" in err and "pw" not in err


def test_quiet_ray_logs_quiets_the_job_sdk():
    # The job SDK sets its own logger to INFO and logs every stream's close: a stray line on
    # stderr after each --follow.
    import logging

    import elastic.cli as cli

    import ray.dashboard.modules.job.sdk  # noqa: F401 - sets its logger's level on import, as in submit

    names = ("ray", "ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk")
    before = {name: logging.getLogger(name).level for name in names}
    try:
        cli._quiet_ray_logs()
        assert logging.getLogger(names[-1]).getEffectiveLevel() >= logging.ERROR
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_follow_ends_when_the_dashboard_stops_answering(monkeypatch):
    import elastic.cli as cli

    monkeypatch.setattr(cli, "FOLLOW_QUIET_S", 0.05)
    job = FollowedJob(["step 1\n"], [ConnectionError("Failed to connect to http://admin:pw@head:8265/api")])
    with pytest.raises(CliError) as lost:
        cli._follow(job, "raysubmit_3", ": ray job logs --follow --address http://head:8265 raysubmit_3")
    message = str(lost.value)
    assert job.asks == cli.FOLLOW_LOST_ASKS and lost.value.hard_exit
    assert message.startswith("lost the Ray dashboard while following job raysubmit_3 (Failed to connect to "
                              "http://***@head:8265/api); the job goes on: ray job logs --follow")
    assert "pw" not in message


def test_submit_missing_script(tmp_path):
    result = runner.invoke(app, ["submit", "--working-dir", str(tmp_path), "nope.py"])
    assert result.exit_code == 2
    assert "nope.py not found" in one_line_error(result.exit_code, result.stdout, result.stderr)


def test_submit_takes_a_script_whose_name_starts_with_two_dots(tmp_path):
    from elastic.cli import CliError, _script_in

    (tmp_path / "..train.py").write_text("print('hi')\n")
    assert _script_in(str(tmp_path), "..train.py") == "..train.py"
    (tmp_path / "sub").mkdir()
    with pytest.raises(CliError, match="outside the working directory"):
        _script_in(str(tmp_path / "sub"), "../..train.py")


def test_submit_runs_a_script_with_its_working_dir(ray_head, tmp_path):
    (tmp_path / "hello.py").write_text("import sys\nprint('hello from', sys.argv[1:])\n")
    out = run_cli(["submit", "--address", ray_head.dashboard_url, "--working-dir", str(tmp_path), "--follow",
                   "hello.py", "--", "--flag", "x"], env=ray_head.env(), timeout_s=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job: raysubmit_" in out.stdout
    assert f"dashboard: {ray_head.dashboard_url}/#/jobs/raysubmit_" in out.stdout
    assert "hello from ['--flag', 'x']" in out.stdout
    assert "SUCCEEDED" in out.stdout


# ---- checkpoints ------------------------------------------------------------------------------

def write_run(root: str, run: str, steps: dict[int, str]) -> None:
    """Steps of a 2-rank run: ``committed`` (manifest written), ``partial`` (no manifest) or ``corrupt``
    (committed, then one shard byte flipped)."""
    store = CheckpointStore(root, run)
    state = {"model": {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}, "step": 0}
    for step, kind in steps.items():
        entries, rng = [], {}
        for rank in range(2):
            mine = store.write_rank_files(step, rank, 2, state)
            if not mine:
                rng[rank] = None  # one tensor: rank 1 has no share and writes no file
            entries += mine
        if kind != "partial":
            store.commit(step, entries, 2, rng=rng)
        if kind == "corrupt":
            path = os.path.join(root, run, f"step-{step:09d}", "shard-r0-of-2.safetensors")
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0xFF
            open(path, "wb").write(bytes(data))


def test_checkpoints_lists_steps_and_marks_partial_and_corrupt(tmp_path):
    write_run(str(tmp_path), "digits", {10: "committed", 20: "corrupt", 30: "partial"})
    result = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "digits"])
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in result.stdout.splitlines() if ln.count("│") > 3}
    assert "valid" in rows["10"]
    assert "corrupt" in rows["20"] and "sha256 mismatch" in rows["20"]
    assert "partial" in rows["30"]
    assert "latest usable: step 10" in result.stdout

    as_json = runner.invoke(app, ["checkpoints", f"file://{tmp_path}", "--run", "digits", "--json"])
    steps = {s["step"]: s for s in json.loads(as_json.stdout)}
    assert [steps[s]["status"] for s in (10, 20, 30)] == ["valid", "corrupt", "partial"]
    assert steps[10]["size_bytes"] > 0 and steps[10]["committed_at"] and steps[10]["world_size"] == 2


def test_checkpoints_of_a_run_names_the_run_holding_its_lease(tmp_path):
    from elastic.checkpoint import CheckpointStore
    from elastic.checkpoint.lease import RunLease

    write_run(str(tmp_path), "held", {10: "committed"})
    free = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "held"])
    assert free.exit_code == 0 and "lease" not in free.stdout
    RunLease(CheckpointStore(str(tmp_path), "held").storage,
             {"gcs": "10.1.2.3:6379", "job": "03000000", "host": "trainer-7", "pid": 99}).acquire()
    held = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "held"])
    assert held.exit_code == 0, held.stdout + held.stderr
    line = next(ln for ln in held.stdout.splitlines() if ln.startswith("lease:"))
    assert "10.1.2.3:6379" in line and "trainer-7" in line and "renewed 0 s ago" in line
    as_json = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "held", "--json"])
    assert [s["step"] for s in json.loads(as_json.stdout)] == [10]  # the JSON stays a list of steps


def test_checkpoints_without_run_lists_runs(tmp_path):
    write_run(str(tmp_path), "a", {1: "committed", 2: "partial"})
    write_run(str(tmp_path), "b", {5: "committed"})
    (tmp_path / "not-a-run").mkdir()
    result = runner.invoke(app, ["checkpoints", str(tmp_path)])
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in result.stdout.splitlines() if ln.count("│") > 3}
    assert set(rows) == {"a", "b"}
    # Given a run directory itself, it lists that run.
    run_dir = runner.invoke(app, ["checkpoints", str(tmp_path / "b")])
    assert run_dir.exit_code == 0 and "latest usable: step 5" in run_dir.stdout


def test_checkpoints_never_prints_credentials_from_the_url_and_takes_brackets_literally():
    import uuid

    from elastic.checkpoint.testing import clear_memory

    url = f"memory://alice:hunter2secret@root-{uuid.uuid4().hex[:8]}"
    try:
        write_run(url, "a[red]b", {1: "committed"})
        listing = runner.invoke(app, ["checkpoints", url])
        one = runner.invoke(app, ["checkpoints", url, "--run", "a[red]b"])
        empty = runner.invoke(app, ["checkpoints", url, "--run", "x[bold]y"])
    finally:
        clear_memory(url)
    for result in (listing, one, empty):
        assert result.exit_code == (4 if result is empty else 0), result.stdout + result.stderr
        assert "hunter2secret" not in result.stdout + result.stderr
    assert "a[red]b" in listing.stdout and "a[red]b: 1 step(s)" in one.stdout
    assert "no checkpoints for run 'x[bold]y'" in one_line_error(empty.exit_code, empty.stdout, empty.stderr)


def test_checkpoints_names_the_url_and_options_it_was_given_and_refuses_memory(tmp_path):
    # The storage's ConfigError named RunConfig.storage and RunConfig.storage_options, which the
    # user of this command never set, and exited 1 as if the storage were unreadable.
    result = runner.invoke(app, ["checkpoints", "foo://x"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 2 and "RunConfig" not in line and "ConfigError" not in line, line
    assert line.startswith("elastic: error: URL: the URL 'foo://x' has an unknown URL scheme 'foo://'"), line
    result = runner.invoke(app, ["checkpoints", "s3://key:pw-in-the-url@bucket/p", "--run", "r"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 2 and "RunConfig" not in line and "pw-in-the-url" not in line, line
    assert "the URL 's3://***@bucket/p/r' carries credentials" in line and "--storage-option (key, secret" in line
    # memory:// is the training driver's own: listed here, it was this process's, always empty,
    # and "no checkpoints" with exit 0 said the run had none.
    for args in (["memory://name"], ["memory://name", "--run", "r"], ["memory://bob:hunter2secret@name"]):
        result = runner.invoke(app, ["checkpoints", *args])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == 2 and "lives in the memory of the training driver" in line, line
        assert "hunter2secret" not in line


def test_checkpoints_shows_control_characters_in_names_escaped_and_survives_an_odd_timestamp():
    # Names come from a listing anyone who can write the bucket controls; rich passed escape
    # sequences through to the terminal. A created_at of 1e300 that checks out overflowed.
    import uuid

    from elastic.checkpoint.codec import canonical_json, sha256
    from elastic.checkpoint.store import step_dir
    from elastic.checkpoint.testing import clear_memory

    url = f"memory://root-{uuid.uuid4().hex[:8]}"
    run = "evil\x1b]0;pwned\x07"
    try:
        write_run(url, run, {1: "committed"})
        store = CheckpointStore(url, run)
        manifest = f"{step_dir(1)}/manifest.json"
        doc = json.loads(store.storage.read_bytes(manifest))
        doc["created_at"] = 1e300
        doc["checksum"] = sha256(canonical_json({k: v for k, v in doc.items() if k != "checksum"}))
        store.storage.write_bytes(manifest, json.dumps(doc).encode())
        listing = runner.invoke(app, ["checkpoints", url])
        one = runner.invoke(app, ["checkpoints", url, "--run", run])
    finally:
        clear_memory(url)
    for result in (listing, one):
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "evil\\x1b]0;pwned\\x07" in listing.stdout and "evil\\x1b]0;pwned\\x07" in one.stdout
    assert "│ ?" in one.stdout  # its committed-at cell


def test_checkpoints_empty_dir(tmp_path):
    result = runner.invoke(app, ["checkpoints", str(tmp_path)])
    assert result.exit_code == 0
    assert "no checkpoints" in result.stdout
    result = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "digits"])
    assert result.exit_code == 4  # a run with no step there: nothing to resume from (a wrong name?)
    assert "no checkpoints for run 'digits'" in one_line_error(result.exit_code, result.stdout, result.stderr)


def test_checkpoints_run_without_a_usable_step_exits_4_after_the_listing(tmp_path):
    # Exit 0 whatever the run held: `elastic checkpoints URL --run R && resume` went on with
    # nothing to resume from.
    write_run(str(tmp_path), "bad", {1: "corrupt", 2: "partial"})
    result = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "bad"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 4 and "run 'bad' has no usable checkpoint step" in line and "none verifies" in line
    assert "2 step(s): 1 partial, 1 corrupt; no usable step" in result.stdout  # the listing is still there
    as_json = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "bad", "--json"])
    assert as_json.exit_code == 4
    assert [s["status"] for s in json.loads(as_json.stdout)] == ["corrupt", "partial"]
    missing = runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "nope", "--json"])
    assert missing.exit_code == 4 and json.loads(missing.stdout) == []
    write_run(str(tmp_path), "bad", {3: "committed"})
    assert runner.invoke(app, ["checkpoints", str(tmp_path), "--run", "bad"]).exit_code == 0


def refuse_in_memory(monkeypatch, listing: str, reads: str) -> None:
    """The memory filesystem refuses to list paths ending in ``listing`` and to read paths
    holding ``reads``, as S3 answers AccessDenied on a prefix or an archived object (Glacier)
    with InvalidObjectState; permanent errors, not an outage. The errors name the path, as
    real ones do."""
    from fsspec.implementations.memory import MemoryFileSystem

    real_ls, real_cat = MemoryFileSystem.ls, MemoryFileSystem.cat_file

    def ls(self, path, detail=True, **kwargs):
        if path.rstrip("/").endswith(listing):
            raise PermissionError(f"AccessDenied listing {path}")
        return real_ls(self, path, detail=detail, **kwargs)

    def cat_file(self, path, *args, **kwargs):
        if reads in path:
            raise PermissionError(f"InvalidObjectState: {path} is archived")
        return real_cat(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "ls", ls)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)


def test_checkpoints_shows_what_storage_refuses_as_unreadable_and_lists_the_rest(monkeypatch):
    # One refused key (a manifest archived to Glacier, AccessDenied on one run's prefix) ended
    # the listing with "cannot list ...", exit 1: one bad run hid every other run.
    import uuid

    from elastic.checkpoint.testing import clear_memory

    url = f"memory://alice:hunter2secret@root-{uuid.uuid4().hex[:8]}"
    try:
        write_run(url, "a", {1: "committed"})
        write_run(url, "b", {1: "committed"})
        write_run(url, "c", {1: "committed", 2: "committed"})
        with monkeypatch.context() as patch:  # undone before clear_memory lists the root
            refuse_in_memory(patch, listing="/b", reads="/c/step-000000001/manifest.json")
            listing = runner.invoke(app, ["checkpoints", url])
            as_json = runner.invoke(app, ["checkpoints", url, "--json"])
            one = runner.invoke(app, ["checkpoints", url, "--run", "c"])
            one_json = runner.invoke(app, ["checkpoints", url, "--run", "c", "--json"])
    finally:
        clear_memory(url)
    for result in (listing, as_json, one, one_json):
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "hunter2secret" not in result.stdout + result.stderr
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")] for ln in listing.stdout.splitlines()
            if ln.count("│") > 3 and ln.split("│")[1].strip()}  # not a wrapped problem's next line
    assert set(rows) == {"a", "b", "c"}
    assert rows["b"][2] == "unreadable" and "AccessDenied" in rows["b"][-2]
    header = next(ln for ln in listing.stdout.splitlines() if "unreadable" in ln and "run" in ln)
    at = [c.strip() for c in header.split("┃")].index("unreadable")
    assert (rows["a"][at], rows["c"][at]) == ("0", "1") and "InvalidObjectState" in rows["c"][-2]
    runs = json.loads(as_json.stdout)
    assert "AccessDenied" in runs["b"]["error"] and [s["status"] for s in runs["c"]] == ["unreadable", "committed"]
    steps = {ln.split("│")[1].strip(): ln for ln in one.stdout.splitlines() if ln.count("│") > 3}
    assert "unreadable" in steps["1"] and "read step-000000001/manifest.json failed" in steps["1"]
    assert "valid" in steps["2"] and "1 valid, 1 unreadable; latest usable: step 2" in one.stdout
    assert [s["status"] for s in json.loads(one_json.stdout)] == ["unreadable", "valid"]


def test_checkpoints_json_is_strict_json(monkeypatch, tmp_path):
    # A NaN created_at never gets this far (the manifest's checksum is over strict JSON, so such
    # a manifest lists as corrupt); the listing's JSON is strict whatever a StepInfo holds.
    from elastic.checkpoint import StepInfo

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    store = CheckpointStore(str(tmp_path), "r")
    write_run(str(tmp_path), "r", {1: "committed"})
    manifest = os.path.join(str(tmp_path), "r", "step-000000001", "manifest.json")
    doc = json.loads(open(manifest).read())
    doc["created_at"] = float("nan")
    open(manifest, "w").write(json.dumps(doc))
    assert store.list_steps()[0].status == "corrupt"
    odd = [StepInfo(step=1, status="committed", size_bytes=1, num_files=1, committed_at=float("nan"), world_size=1)]
    monkeypatch.setattr(CheckpointStore, "list_steps", lambda self, verify=True: odd)
    for args in (["--run", "r"], []):
        result = runner.invoke(app, ["checkpoints", str(tmp_path), *args, "--json"])
        assert result.exit_code == 0, result.stdout + result.stderr
        out = json.loads(result.stdout, parse_constant=refuse)
        assert (out if args else out["r"])[0]["committed_at"] is None


def test_json_output_escapes_control_characters_from_storage(monkeypatch, tmp_path):
    """A run name (a key anyone with write access to the bucket can make) or a problem text
    holding U+009B, the C1 CSI that starts a terminal escape sequence: ``--json`` wrote it raw
    (rich's print_json keeps non-ASCII as it is); now it is the JSON escape, parsed back
    unchanged."""
    import elastic.cli as cli

    csi = "\u009b"
    run = f"r{csi}2J"
    write_run(str(tmp_path), run, {1: "committed", 2: "corrupt"})
    for args in ([], ["--run", run]):
        result = runner.invoke(app, ["checkpoints", str(tmp_path), *args, "--json"])
        assert result.exit_code == 0, result.stdout + result.stderr
        assert csi not in result.stdout and "\\u009b" in result.stdout
        out = json.loads(result.stdout)
        steps = out[run] if not args else out
        assert [s["status"] for s in steps] == (["committed", "committed"] if not args else ["valid", "corrupt"])
        if args:
            assert csi in steps[1]["problem"]  # the step's path names the run
    st = {"run": run, "state": "running", "step": 7, "problem": f"{csi}31m"}
    monkeypatch.setattr(cli, "_cluster_address", lambda address: "127.0.0.1:1")
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller_status", lambda run, addr, timeout_s: st)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    result = runner.invoke(app, ["status", "r2J", "--json"])  # a run's name on the cluster is RunConfig's
    assert result.exit_code == 0, result.stdout + result.stderr
    assert csi not in result.stdout and json.loads(result.stdout) == st


def test_checkpoints_of_a_run_directory_honours_no_verify_and_a_malformed_url_is_a_usage_error(tmp_path):
    write_run(str(tmp_path), "digits", {10: "committed", 20: "corrupt"})
    run_dir = str(tmp_path / "digits")  # the run's own directory, not the root with --run
    verified = runner.invoke(app, ["checkpoints", run_dir])
    assert "sha256 mismatch" in verified.stdout
    quick = runner.invoke(app, ["checkpoints", run_dir, "--no-verify"])  # it read and hashed every file
    assert quick.exit_code == 0 and "sha256 mismatch" not in quick.stdout and "2 committed" in quick.stdout
    for url in ("s3:/bucket/x", "s3://"):
        result = runner.invoke(app, ["checkpoints", url])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == 2 and line.startswith("elastic: error: URL:") and "RunConfig" not in line
        assert "traceback" not in line


def test_checkpoints_missing_local_dir(tmp_path):
    result = runner.invoke(app, ["checkpoints", str(tmp_path / "nowhere")])
    assert "does not exist" in one_line_error(result.exit_code, result.stdout, result.stderr)


def test_checkpoints_in_a_bucket_that_does_not_exist_is_an_error_not_an_empty_listing(moto_s3):
    # s3fs lists a missing bucket as empty: a misspelt bucket said "no checkpoints" and exited 0
    # (with --run, "no checkpoints for run 'r'", sending the user after the run's name).
    from elastic.checkpoint.testing import TEST_SECRET

    bucket = moto_s3.create_bucket()
    options = ["-o", f"key={moto_s3.storage_options()['key']}", "-o", f"secret={TEST_SECRET}",
               "-o", f"endpoint_url={moto_s3.endpoint_url}", "-o", "client_kwargs.region_name=us-east-1"]
    empty = runner.invoke(app, ["checkpoints", f"s3://{bucket}/prefix", *options])
    assert empty.exit_code == 0 and "no checkpoints in" in empty.stdout, empty.stdout + empty.stderr
    for extra in ([], ["--run", "r"], ["--json"], ["--json", "--run", "r"]):
        result = runner.invoke(app, ["checkpoints", f"s3://{bucket}-typo/prefix", *options, *extra])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == 1 and f"bucket '{bucket}-typo' does not exist" in line, line
        assert TEST_SECRET not in result.stdout + result.stderr


def test_checkpoints_unreachable_s3_fails_fast():
    port = free_ports(1)[0]
    secret = "cli-test-secret-0123456789"
    start = time.monotonic()
    result = runner.invoke(app, ["checkpoints", "s3://bucket/prefix", "-o", "key=testing", "-o", f"secret={secret}",
                                 "-o", f"endpoint_url=http://127.0.0.1:{port}",
                                 "-o", "client_kwargs.region_name=us-east-1"])
    assert time.monotonic() - start < 30
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert "s3://bucket/prefix" in line
    assert secret not in result.stdout + result.stderr


def test_debug_logging_keeps_the_s3_request_signing_out_of_it():
    # -v is DEBUG on the root logger; botocore at DEBUG prints every request's signed headers
    # (x-amz-security-token, Authorization's Credential=<access key id>), which no redactor sees.
    port = free_ports(1)[0]
    result = run_cli(["-v", "checkpoints", "s3://bucket/prefix", "-o", "key=AKIAFAKEKEYID0123", "-o",
                      "secret=cli-debug-secret-0123", "-o", "token=SESSIONTOKENFAKE999",
                      "-o", f"endpoint_url=http://127.0.0.1:{port}", "-o", "client_kwargs.region_name=us-east-1"],
                     env=dict(os.environ, ELASTIC_STORAGE_ATTEMPTS="1"))
    assert result.returncode != 0 and "s3://bucket/prefix" in result.stderr
    assert "DEBUG elastic" in result.stderr  # still elastic's own debug log
    for secret in ("AKIAFAKEKEYID0123", "cli-debug-secret-0123", "SESSIONTOKENFAKE999"):
        assert secret not in result.stdout + result.stderr


def test_verbose_prints_the_traceback_without_credentials(monkeypatch, capsys):
    # -v re-raised an unexpected error: its traceback went out past the redaction every other
    # message has, with Ray's text of the address (a dashboard behind basic auth) in it.
    import typer

    import elastic.cli as cli

    @cli._friendly
    def command():
        raise RuntimeError("Request to http://admin:Pw0rdSecret@head:8265/api/jobs/ failed")

    monkeypatch.setattr(cli, "_verbose", True)
    with pytest.raises(typer.Exit) as exit_:
        command()
    err = capsys.readouterr().err
    assert exit_.value.exit_code == 1 and "Pw0rdSecret" not in err
    assert "Traceback" in err and "RuntimeError: Request to http://***@head:8265/api/jobs/ failed" in err


@pytest.mark.parametrize("command, said", [
    (["status", "my run"], "must be 1-100 characters of letters, digits"),  # looked for all the same
    (["stop", ""], "must be 1-100 characters of letters, digits"),
    (["checkpoints", "/tmp", "--run", "../other"], "is not the name of a run's directory"),  # read outside the URL
    (["checkpoints", "/tmp", "--run", ""], "is not the name of a run's directory"),  # listed every run
])
def test_a_run_name_no_run_can_have_is_a_usage_error(command, said):
    result = runner.invoke(app, command)
    assert result.exit_code == 2 and said in result.stdout + result.stderr


def test_checkpoints_bad_storage_option():
    result = runner.invoke(app, ["checkpoints", "/tmp", "-o", "novalue"])
    assert result.exit_code == 2
    assert "KEY=VALUE" in one_line_error(result.exit_code, result.stdout, result.stderr)
    # config_kwargs that is no object: named, not a TypeError from inside dict()
    for value in ("5", "abc"):
        result = runner.invoke(app, ["checkpoints", "s3://bkt/runs", "-o", f"config_kwargs={value}"])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == 2 and "--storage-option config_kwargs must be an object" in line


def test_parse_storage_options_nests_and_parses_json():
    opts = parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1",
                                  "config_kwargs.retries={\"max_attempts\": 1}", "key=abc"])
    assert opts == {"anon": True, "client_kwargs": {"region_name": "eu-west-1"},
                    "config_kwargs": {"retries": {"max_attempts": 1}}, "key": "abc"}


def test_storage_option_secrets_stay_strings_and_errors_never_show_them():
    # A secret of digits was parsed as an int: the redactor collects strings, and s3fs wants one.
    opts = parse_storage_options(["secret=12345678901234567890", "token=true", "client_kwargs.x=1"])
    assert opts == {"secret": "12345678901234567890", "token": "true", "client_kwargs": {"x": 1}}
    from elastic.checkpoint.storage import Storage

    assert "12345678901234567890" not in Storage("memory://cli-redact", {"key": 12345678901234567890}).redact(
        "failed with key 12345678901234567890")
    # The conflict used to be reported with the whole pair, the secret in it.
    with pytest.raises(CliError) as info:
        parse_storage_options(["client_kwargs=x", "client_kwargs.aws_secret_access_key=SuperSecret99"])
    assert "SuperSecret99" not in str(info.value) and "client_kwargs.aws_secret_access_key" in str(info.value)
    with pytest.raises(CliError) as info:
        parse_storage_options(["anon=false", "SuperSecret99"])  # a value pasted without its key
    assert "SuperSecret99" not in str(info.value) and "#2 is not KEY=VALUE" in str(info.value)


@pytest.mark.parametrize("command", [["status", "r"], ["stop", "r"]])
@pytest.mark.parametrize("address", ["admin:S3cretPw@127.0.0.1:6379", "ray://admin:S3cretPw@127.0.0.1:10001",
                                     "admin:S3cretPw@head"])
def test_an_address_with_a_password_is_refused_and_the_password_never_printed(command, address, monkeypatch):
    # Without a scheme it parsed as HOST:PORT (host "admin:S3cretPw@127.0.0.1"), and "cannot reach
    # a Ray cluster at admin:S3cretPw@..." printed it: the redaction only knows scheme://user:pw@.
    for args, source in (([*command, "--address", address], "--address"), (command, "RAY_ADDRESS")):
        monkeypatch.setenv("RAY_ADDRESS", address)
        result = runner.invoke(app, args)
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == 2 and line.startswith(f"elastic: error: {source} "), line
        assert "S3cretPw" not in result.stdout + result.stderr and "***@" in line


class FakeController:
    """A run's controller as `elastic stop` sees it: ``stop`` answers, ``wait_ended`` answers
    ``ended`` (a status dict, None for a timeout, or an exception to raise)."""

    def __init__(self, ended):
        self.ended = ended
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                return (outer, self.name)

        self.stop, self.wait_ended = Method("stop"), Method("wait_ended")


def fake_ray_get(ref, timeout=None):
    controller, name = ref
    if name == "stop":
        if getattr(controller, "stop_queued", False):  # waiting in the actor's queue
            from ray.exceptions import GetTimeoutError
            raise GetTimeoutError("timed out")
        if getattr(controller, "stop_lost", None) is not None:  # the answer lost on its way
            raise controller.stop_lost
        return None
    if isinstance(controller.ended, BaseException):
        raise controller.ended
    return controller.ended


@pytest.mark.parametrize("ended, code, text", [
    ({"state": "stopped", "step": 7, "checkpoint": {"latest": 7}}, 0, "run r stopped after step 7; latest committed"),
    ({"state": "finished", "step": 9, "checkpoint": {}}, 0, "run r finished after step 9"),
    ({"state": "errored", "step": 4, "checkpoint": {"latest": 3}}, 1, "run r errored after step 4"),
    ("actor died", 3, "its controller exited before it said how: outcome unknown"),
    (None, 3, "did not stop within 5 s; it is still stopping"),
])
def test_stop_exits_0_only_when_the_run_stopped(ended, code, text, monkeypatch):
    # "errored" and a controller that died printed a line and exited 0, so `elastic stop R && ...`
    # went on after a failed run.
    import ray
    from ray.exceptions import RayActorError

    import elastic.cli as cli

    controller = FakeController(RayActorError() if ended == "actor died" else ended)
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller", lambda run, addr, timeout_s: controller)
    monkeypatch.setattr(ray, "get", fake_ray_get)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    result = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--timeout", "5"])
    assert result.exit_code == code, result.stdout + result.stderr
    if code == 0:
        assert text in result.stdout and not result.stderr
    else:
        assert text in one_line_error(result.exit_code, result.stdout, result.stderr)
    # --no-wait only asks: 0 once the request is delivered, whatever then happens.
    no_wait = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--no-wait"])
    assert no_wait.exit_code == 0 and "asked run r to stop" in no_wait.stdout


def test_stop_not_confirmed_in_time_exits_3_saying_it_may_still_take_effect(monkeypatch):
    # The stop call waits in the controller's queue (it is still in its constructor): sent, it
    # can run after the command exits. Exit 1 said "not delivered".
    import ray

    import elastic.cli as cli

    controller = FakeController(None)
    controller.stop_queued = True
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller", lambda run, addr, timeout_s: controller)
    monkeypatch.setattr(ray, "get", fake_ray_get)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    for args in ([], ["--no-wait"]):
        result = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--timeout", "5", *args])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        assert result.exit_code == cli.EXIT_OUTCOME_UNKNOWN, line
        assert "did not confirm the stop within 5 s; the request was sent and may still take effect" in line


def fake_stop(monkeypatch, controller: FakeController) -> None:
    import ray

    import elastic.cli as cli

    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller", lambda run, addr, timeout_s: controller)
    monkeypatch.setattr(ray, "get", fake_ray_get)
    monkeypatch.setattr(ray, "shutdown", lambda: None)


@pytest.mark.parametrize("lost", ["unavailable", "connection", "died"])
def test_stop_whose_answer_is_lost_exits_3_and_only_a_dead_controller_1(lost, monkeypatch):
    # An ActorUnavailableError is a RayActorError, and was read as "the controller has exited",
    # exit 1 ("not delivered"), though Ray says the call may or may not have run; so was the
    # ConnectionError of a dropped ray:// connection (the generic error, exit 1).
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    import elastic.cli as cli

    controller = FakeController({"state": "stopped", "step": 7, "checkpoint": {}})
    controller.stop_lost = {"unavailable": ActorUnavailableError("the actor is restarting", None),
                            "connection": ConnectionError("GRPC connection failed: <_MultiThreadedRendezvous>"),
                            "died": ActorDiedError()}[lost]
    fake_stop(monkeypatch, controller)
    for args in ([], ["--no-wait"]):
        result = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--timeout", "5", *args])
        line = one_line_error(result.exit_code, result.stdout, result.stderr)
        if lost == "died":
            assert result.exit_code == 1 and "the controller of run 'r' has exited" in line, line
        else:
            assert result.exit_code == cli.EXIT_OUTCOME_UNKNOWN, line
            assert "the request was sent and may still take effect" in line and "exited" not in line, line


def test_status_says_an_unavailable_controller_did_not_answer_not_that_it_exited(monkeypatch):
    import ray
    from ray.exceptions import ActorUnavailableError

    import elastic.cli as cli

    def unavailable(ref, timeout=None):
        raise ActorUnavailableError("the actor is restarting", None)

    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller", lambda run, addr, timeout_s: StatusController(run, False, []))
    monkeypatch.setattr(ray, "get", unavailable)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    result = runner.invoke(app, ["status", "r", "--address", "127.0.0.1:1"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1 and "the controller of run 'r' did not answer (unavailable" in line, line
    assert "exited" not in line


@pytest.mark.parametrize("error, said", [("connection", "lost the cluster while waiting for run r to stop"),
                                         ("node died", "lost the cluster while waiting for run r to stop"),
                                         ("unavailable", "controller of run r became unavailable while waiting"),
                                         ("its own error", "controller of run r failed to say how the run ended")])
def test_stop_exits_3_when_the_cluster_is_lost_while_it_waits_for_the_run(error, said, monkeypatch):
    # Delivered, the stop then waits for the run's end; a ConnectionError (ray:// dropped) or a
    # RayError other than the actor's fell to the generic error: exit 1, "not delivered". An
    # unavailable controller was said to have exited; the controller's own error in its wait is
    # no lost cluster.
    from ray.exceptions import ActorUnavailableError, NodeDiedError, RayTaskError

    import elastic.cli as cli

    fake_stop(monkeypatch, FakeController({"connection": ConnectionError("GRPC connection failed"),
                                           "node died": NodeDiedError("the head node died"),
                                           "unavailable": ActorUnavailableError("restarting", None),
                                           "its own error": RayTaskError("wait_ended", "Traceback ...",
                                                                         KeyError("state"))}[error]))
    result = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--timeout", "5"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == cli.EXIT_OUTCOME_UNKNOWN, line
    assert said in line and "the stop was delivered, outcome unknown" in line and "exited" not in line, line


def test_a_long_error_cut_to_one_line_never_prints_the_start_of_a_password(monkeypatch):
    # The reason was cut to 200 characters before _fail redacted it: a cut inside
    # user:password@ left no '@', and the password's first characters were printed.
    from ray.exceptions import NodeDiedError

    password = "hunter2secretpw"
    error = NodeDiedError("x" * 180 + f" lost ray://admin:{password}@head:10001 on the way")
    fake_stop(monkeypatch, FakeController(error))
    result = runner.invoke(app, ["stop", "r", "--address", "127.0.0.1:1", "--timeout", "5"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert "lost the cluster while waiting for run r to stop" in line, line
    assert "hunter" not in result.stdout + result.stderr, line


class StatusController:
    """A run's controller as `elastic status` sees it: ``status.remote()`` is sent at once (and
    noted in ``events``); ray.get of it (``status_ray_get``) answers, or, for a hung controller,
    waits out the timeout it is given."""

    def __init__(self, run: str, hung: bool, events: list):
        outer = self
        self.run, self.hung, self.events = run, hung, events

        class Status:
            @staticmethod
            def remote():
                events.append(("sent", run))
                return outer

        self.status = Status


def status_ray_get(controller, timeout=None):
    from ray.exceptions import GetTimeoutError

    controller.events.append(("waited", controller.run, timeout))
    if controller.hung:
        time.sleep(timeout)
        raise GetTimeoutError("timed out")
    return {"run": controller.run, "state": "running", "step": 3}


def fake_runs(monkeypatch, runs: dict[str, bool]) -> list:
    """Live runs ``{name: hung}`` behind fake controllers; returns the list of their events."""
    import ray

    import elastic.cli as cli

    events: list = []
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_live_runs", lambda: list(runs))
    monkeypatch.setattr(cli, "_controller", lambda run, addr, timeout_s: StatusController(run, runs[run], events))
    monkeypatch.setattr(ray, "get", status_ray_get)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return events


def test_status_of_several_runs_exits_1_when_one_does_not_answer(monkeypatch):
    # The table said "no answer" for a hung controller and exited 0: `elastic status && ...`
    # passed over it, where one run's silence exits 1.
    fake_runs(monkeypatch, {"a": False, "b": True})
    result = runner.invoke(app, ["status", "--address", "127.0.0.1:1", "--timeout", "0.5"])
    assert result.exit_code == 1 and "2 live runs" in result.stdout  # the table is still printed
    assert "no answer from the controller of run(s) b within 0.5 s" in one_line_error(
        result.exit_code, result.stdout, result.stderr)
    as_json = runner.invoke(app, ["status", "--json", "--address", "127.0.0.1:1", "--timeout", "0.5"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout) == {"a": {"run": "a", "state": "running", "step": 3},
                                                                "b": None}
    fake_runs(monkeypatch, {"a": False, "c": False})
    assert runner.invoke(app, ["status", "--address", "127.0.0.1:1"]).exit_code == 0


def test_status_of_several_runs_waits_for_them_all_within_one_timeout(monkeypatch):
    # Each controller was asked in turn with the whole --timeout: three hung ones held the
    # command three times as long. Now every call goes out first, and the answers share one deadline.
    events = fake_runs(monkeypatch, {"a": True, "b": True, "c": False, "d": True})
    t0 = time.monotonic()
    result = runner.invoke(app, ["status", "--address", "127.0.0.1:1", "--timeout", "1"])
    took = time.monotonic() - t0
    assert result.exit_code == 1 and "4 live runs" in result.stdout
    assert "no answer from the controller of run(s) a, b, d within 1 s" in one_line_error(
        result.exit_code, result.stdout, result.stderr)
    sent = [e for e in events if e[0] == "sent"]
    assert events[:4] == sent and len(sent) == 4, events  # all sent before any answer is awaited
    waits = [e[2] for e in events if e[0] == "waited"]
    assert len(waits) == 4 and all(w <= 1 for w in waits) and sum(waits) < 1.5, waits
    assert took < 3, took


@pytest.mark.parametrize("as_json, where", [(False, "answer"), (True, "answer"), (False, "get_actor")])
def test_status_of_several_runs_prints_the_table_when_the_connection_to_the_cluster_drops(as_json, where,
                                                                                           monkeypatch):
    # Ray Client raises ConnectionError from ray.get_actor, .remote() and ray.get once its channel
    # to ray://HEAD drops; only CliError was caught, so no table printed at all and the error was
    # a generic "ConnectionError: GRPC ...".
    import ray

    import elastic.cli as cli

    events = fake_runs(monkeypatch, {"a": False, "b": False, "c": False})
    dropped = ConnectionError("GRPC connection failed: ray://admin:S3cretPw@head:10001")

    def dropped_after_a(controller, timeout=None):
        if controller.run == "a":
            return status_ray_get(controller, timeout)
        raise dropped

    def get_actor_dropped_after_a(run, addr, timeout_s):
        if run != "a":
            raise dropped
        return StatusController(run, False, events)

    if where == "answer":
        monkeypatch.setattr(ray, "get", dropped_after_a)
    else:
        monkeypatch.setattr(cli, "_controller", get_actor_dropped_after_a)
    result = runner.invoke(app, ["status", "--address", "127.0.0.1:1", *(["--json"] if as_json else [])])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1, line
    if as_json:
        assert json.loads(result.stdout) == {"a": {"run": "a", "state": "running", "step": 3}, "b": None, "c": None}
    else:
        assert "3 live runs" in result.stdout and "no answer" in result.stdout
    # Lost while the calls went out, nothing more is awaited: a's answer is not waited for either.
    silent = "b, c" if where == "answer" else "a, b, c"
    assert ("running" in result.stdout) == (where == "answer")
    assert "lost the connection to the cluster at 127.0.0.1:1 (GRPC connection failed" in line, line
    assert f"run(s) {silent} not asked or not answered" in line and "no answer from the controller" not in line, line
    assert "S3cretPw" not in result.stdout + result.stderr


def test_status_of_several_runs_lists_the_rest_when_one_controllers_status_raises(monkeypatch):
    # A RayTaskError from one controller's status() (a bug of ours, an older elastic build) ended
    # the listing with a generic error instead of marking one row.
    import ray
    from ray.exceptions import RayTaskError

    fake_runs(monkeypatch, {"a": False, "b": False})

    def b_fails(controller, timeout=None):
        if controller.run == "b":
            raise RayTaskError("status", "Traceback ...", KeyError("ranks"))
        return status_ray_get(controller, timeout)

    monkeypatch.setattr(ray, "get", b_fails)
    result = runner.invoke(app, ["status", "--address", "127.0.0.1:1", "--timeout", "5"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1 and "2 live runs" in result.stdout and "running" in result.stdout, line
    assert "no answer from the controller of run(s) b within 5 s" in line and "lost the connection" not in line


def test_a_ctrl_c_while_ray_init_connects_exits_without_waiting_for_it(monkeypatch):
    # The exit ran Ray's shutdown hook, which waits for the lock ray.init holds while it
    # connects (minutes): the Ctrl-C'd command hung.
    import threading

    import ray

    import elastic.cli as cli

    release = threading.Event()
    monkeypatch.setattr(ray, "init", lambda **kw: release.wait(30))

    class CtrlC:  # the Ctrl-C lands in the wait for ray.init's thread
        @staticmethod
        def search(text):
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_AUTH_FAILURE", CtrlC)
    try:
        with pytest.raises(CliError) as interrupted:
            cli._connect("127.0.0.1:1", "elastic-cli", 10)
        assert interrupted.value.code == 130 and interrupted.value.hard_exit
    finally:
        release.set()


def test_status_summary_says_when_checkpoint_storage_does_not_answer():
    from elastic.cli import _summary

    st = {"run": "r", "state": "starting", "step": 0, "checkpoint": {"latest": None, "lag": None,
                                                                      "storage_outage": True}}
    assert "checkpoint storage not answering" in _summary(st)
    st["checkpoint"]["storage_outage"] = False
    assert "not answering" not in _summary(st)


def test_status_table_shows_how_far_a_rank_is_behind():
    from rich.console import Console

    from elastic.cli import _ranks_table

    row = {"role": "active", "name": "rank-", "state": "late", "step_time_s": 0.1, "heartbeat_age_s": 0.2,
           "straggler_score": 3.0, "node_ip": "10.0.0.1", "pid": 1}
    st = {"ranks": [{**row, "rank": 0, "name": "rank-0", "step": 57, "behind_steps": 0},
                    {**row, "rank": 1, "name": "rank-1", "step": 49, "behind_steps": 8},
                    {"rank": None, "name": "spare-0", "role": "spare", "step": None, "behind_steps": None}]}
    console = Console(width=200, record=True)
    console.print(_ranks_table(st))
    lines = console.export_text().splitlines()
    header = next(ln for ln in lines if "behind" in ln)
    cells = {ln.split("│")[2].strip(): [c.strip() for c in ln.split("│")] for ln in lines if ln.count("│") > 5}
    at = [c.strip() for c in header.split("┃")].index("behind")
    assert (cells["rank-0"][at], cells["rank-1"][at], cells["spare-0"][at]) == ("0", "8", "-")


def test_status_table_colours_a_heartbeat_age_against_the_runs_timeout():
    # A rank silent mid-step showed its growing age in plain text, like every other rank's,
    # until the controller counted it lost.
    from elastic.cli import _heartbeat

    assert _heartbeat(45.0, 10.0) == "[red]45.00 s[/]"
    assert _heartbeat(6.0, 10.0) == "[yellow]6.00 s[/]"
    assert _heartbeat(0.2, 10.0) == "200.0 ms"
    assert _heartbeat(45.0, None) == "45.00 s" and _heartbeat(None, 10.0) == "-"


def test_status_says_the_heartbeat_timeout_it_colours_ages_against(rayless_controller):
    c = rayless_controller(failure=elastic.FailureConfig(heartbeat_timeout_s=7.5))
    assert c.status()["heartbeat_timeout_s"] == 7.5


def test_status_without_ranks_says_what_the_controller_waits_on(monkeypatch):
    import elastic.cli as cli

    st = {"run": "r", "state": "scheduling", "step": 0, "ranks": [],
          "waiting_for": "found the lease of another run of this name at [::1] (x); watching it for up to 30 s"}
    monkeypatch.setattr(cli, "_cluster_address", lambda address: "127.0.0.1:1")
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller_status", lambda run, addr, timeout_s: st)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    result = runner.invoke(app, ["status", "r"])
    assert result.exit_code == 0, result.stdout + result.stderr
    # Not read as markup: the brackets stay.
    assert f"no ranks yet ({st['waiting_for']})" in " ".join(result.stdout.split())
    st["waiting_for"] = None
    result = runner.invoke(app, ["status", "r"])
    assert "no ranks yet (the controller is still placing workers)" in " ".join(result.stdout.split())


def test_status_counts_spares_still_building_beside_the_ready_ones():
    from elastic.cli import _runs_table, _summary
    from rich.console import Console

    st = {"run": "r", "state": "running", "step": 5, "world_size": 4, "spares": 0, "spares_building": 1,
          "failures": 1, "recoveries": 1, "checkpoint": {}}
    assert "spares 0 (+1 building)" in Console(width=300).render_str(_summary(st)).plain
    st["spares"], st["spares_building"] = 1, 0
    assert "(+" not in _summary(st) and "spares[/] 1" in _summary(st)
    console = Console(width=200, record=True)
    console.print(_runs_table([("r", {**st, "spares": 1, "spares_building": 2})]))
    assert "1 (+2 building)" in console.export_text()


def test_status_names_the_nodes_spares_are_kept_off_and_for_how_long():
    from elastic.cli import _summary
    from rich.console import Console

    st = {"run": "r", "state": "running", "step": 5, "checkpoint": {},
          "avoided_nodes": {"b" * 40: None, "a" * 40: 3541.6}}
    plain = Console(width=300).render_str(_summary(st)).plain
    assert f"spares kept off {'a' * 12} (3542 s), {'b' * 12} (the run)" in plain
    assert "kept off" not in _summary({**st, "avoided_nodes": {}})


def test_status_json_writes_null_for_a_nan_loss(monkeypatch):
    # A step kept after a recovery has no loss (NaN); `json.dumps` wrote NaN, which jq rejects.
    import elastic.cli as cli

    st = {"run": "r", "state": "running", "step": 7, "loss": float("nan"), "ranks": [{"straggler_score": float("inf")}]}
    monkeypatch.setattr(cli, "_cluster_address", lambda address: "127.0.0.1:1")
    monkeypatch.setattr(cli, "_probe", lambda addr, timeout_s, source: None)
    monkeypatch.setattr(cli, "_connect", lambda addr, namespace, timeout_s: addr)
    monkeypatch.setattr(cli, "_controller_status", lambda run, addr, timeout_s: st)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    result = runner.invoke(app, ["status", "r", "--json"])
    assert result.exit_code == 0, result.stdout + result.stderr

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    out = json.loads(result.stdout, parse_constant=refuse)
    assert out["loss"] is None and out["ranks"][0]["straggler_score"] is None and out["step"] == 7


def test_submit_address_wins_over_the_environment(monkeypatch, tmp_path):
    # Ray's client takes RAY_API_SERVER_ADDRESS / RAY_ADDRESS over the address it is given.
    import ray.job_submission
    from ray.dashboard.utils import get_address_for_submission_client

    seen = []

    class Client:
        def __init__(self, address):
            seen.append(get_address_for_submission_client(address))
            raise ConnectionError("stop here")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    monkeypatch.setenv("RAY_ADDRESS", "http://a.example:8265")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://a.example:8265")
    (tmp_path / "job.py").write_text("print('hi')\n")
    result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path),
                                 "--address", "http://b.example:8265"])
    assert result.exit_code != 0 and seen == ["http://b.example:8265"]
    assert os.environ["RAY_ADDRESS"] == "http://a.example:8265"  # put back
    runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path)])
    assert seen[-1] == "http://a.example:8265"  # without --address the environment still counts


def test_submit_never_prints_the_dashboards_credentials(monkeypatch, tmp_path):
    # A dashboard behind basic auth: Ray's client keeps the user:password@ of the address, and
    # submit printed it in its dashboard and logs lines, and in the error when unreachable.
    import ray.job_submission

    class Client:
        reachable = True

        def __init__(self, address):
            self.address = address
            if not Client.reachable:
                raise ConnectionError(f"Failed to connect to Ray at address: {address}")

        def submit_job(self, **kw):
            return "raysubmit_1"

        def get_address(self):
            return self.address

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    (tmp_path / "job.py").write_text("print('hi')\n")
    args = ["submit", "job.py", "--working-dir", str(tmp_path), "--address", "http://alice:S3cretPw@head:8265"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "S3cretPw" not in result.stdout + result.stderr
    # A URL's credentials among the script's arguments: refused (test_submit_refuses_...), never printed.
    result = runner.invoke(app, [*args, "--", "--storage", "https://bob:ArgPassw0rd@store/p"])
    assert result.exit_code == 2 and "ArgPassw0rd" not in result.stdout + result.stderr
    result = runner.invoke(app, [*args, "--", "--storage", "https://store/p"])
    assert result.exit_code == 0 and "entrypoint: python job.py --storage https://store/p" in result.stdout
    assert "dashboard: http://***@head:8265/#/jobs/raysubmit_1" in result.stdout
    Client.reachable = False
    result = runner.invoke(app, args)
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert "S3cretPw" not in result.stdout + result.stderr and "cannot reach the Ray dashboard at http://***@head" in line
    # With no scheme (a cluster's GCS address to Ray), which the redaction of URLs in text does not
    # know: refused before any lookup of the host (the probe's DNS query carried the password).
    result = runner.invoke(app, [*args[:-1], "alice:S3cretPw@head:8265"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 2 and "S3cretPw" not in result.stdout + result.stderr
    assert "--address '***@head:8265' holds a user:password@" in line
    result = runner.invoke(app, [*args[:-1], "head"])  # no port: neither a dashboard URL nor HOST:PORT
    assert result.exit_code == 2 and "is neither the dashboard's URL" in one_line_error(
        result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("error, auth", [
    ("Request failed with status code 401: Unauthorized", True),
    ("403 Forbidden", True),
    ("Failed to connect to Ray at address: {address}", False),  # its digits are the host's, not a status
    ("Failed to resolve http://401.example.com/api", False),
    ("cannot reach //403-gw:8265 behind the proxy", False),
])
def test_submit_tells_an_auth_refusal_from_an_address_with_its_digits(error, auth, monkeypatch, tmp_path):
    import ray.job_submission

    address = "http://node401:8265"

    def client(target):
        raise ConnectionError(error.format(address=target))

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", client)
    (tmp_path / "job.py").write_text("print('hi')\n")
    result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--address", address])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 1
    assert ("RAY_AUTH_TOKEN" in line) == auth
    assert ("cannot reach the Ray dashboard at http://node401:8265" in line) == (not auth)


@pytest.mark.parametrize("arg", [
    "https://bob:ArgPassw0rd@store/p",
    "--storage=s3://bkt/p?X-Amz-Credential=AKIAARGKEYID0123%2F20240101&X-Amz-Signature=ArgPassw0rd",
    "/bkt/k?AWSAccessKeyId=AKIAARGKEYID0123&Signature=ArgPassw0rd",
    "Authorization: Bearer ArgPassw0rd",
    "X-Ray-Authorization: Bearer ArgPassw0rd",
    "AKIAIOSFODNN7EXAMPLE",
    # By name: the entrypoint line printed these without the query, while Ray's job table kept them.
    "https://hooks.example/x?token=ArgPassw0rd",
    "s3://bkt/p?versionId=3&api_key=ArgPassw0rd",
    "--password=ArgPassw0rd",
    "--client-secret=ArgPassw0rd",
    "--hub_token=ArgPassw0rd",
    "AWS_SECRET_ACCESS_KEY=ArgPassw0rd",
    "HF_TOKEN=ArgPassw0rd",
    "PASSWORD=ArgPassw0rd",
    "wandb.api_key=ArgPassw0rd",
    # Not only at the argument's start: Hydra's append and force overrides, and a setting that is
    # an option's value. Refused only when the name started the argument, these went to Ray.
    "+wandb.api_key=ArgPassw0rd",
    "++db.password=ArgPassw0rd",
    "--env=HF_TOKEN=ArgPassw0rd",
    "--set=a.password=ArgPassw0rd",
    # As an entry of a JSON object or a dict: fsspec's storage options handed to the script.
    '{"key": "minio", "secret": "ArgPassw0rd"}',
    "--storage-options={'token': 'ArgPassw0rd'}",
    # camelCase names, as JavaScript, Java and the AWS SDKs spell them.
    "--awsSecretAccessKey=ArgPassw0rd",
    '{"accessKeyId": "minio", "awsSecretAccessKey": "ArgPassw0rd"}',
    "dbPassword=ArgPassw0rd",
    "--AWSSecretAccessKey=ArgPassw0rd",  # an acronym's end is a hump too (.NET's spelling)
    '{"DBPassword": "ArgPassw0rd"}',
    "--OpenAIAPIKey=ArgPassw0rd",
])
def test_submit_refuses_credentials_in_the_scripts_arguments(arg, monkeypatch, tmp_path):
    # The terminal's entrypoint line was redacted, but Ray got the command line as it was: kept in
    # its job table, on the dashboard's Jobs page and in `ray job list` for anyone to read.
    import ray.job_submission

    submitted = recorded_submissions(monkeypatch)
    (tmp_path / "job.py").write_text("print('hi')\n")
    base = ["submit", "job.py", "--working-dir", str(tmp_path), "--address", "http://head:8265", "--", "--lr", "0.1"]
    result = runner.invoke(app, [*base, arg])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 2 and submitted == [], line
    assert "argument #3 carries a credential" in line and "ray job list" in line
    assert "ArgPassw0rd" not in result.stdout + result.stderr and "EXAMPLE" not in line
    # What only looks like one goes: a query that signs nothing, an '@' in a path, the words, and
    # names that only hold a secret's name (--max-tokens, a page token, a sort key).
    harmless = ["s3://bkt/p?versionId=3", "s3://bkt/key@v1/x", "--note=authorization failed", "signature",
                "--max-tokens=512", "--tokenizer", "gpt2", "https://api.example/v1?page_token=3", "--sort-key", "id",
                "MAX_TOKENS=5", "--passes=3", "EOS_TOKEN=</s>", "--pad-token=0", "--use-auth-token", "--pwd", "/tmp",
                '{"pad_token": 0, "max_tokens": 512, "key": "id", "token": null}', '{"token": true}', "--tok={'secret': ''}",
                "--padToken=0", "--maxTokens=512", "--useAuthToken", "pageToken=3", '{"sortKey": "id"}',
                "--EOSToken=</s>", "--HFTokenizer=gpt2", "--APIVersion=2", "--PIDToken=3",
                "+model.pad_token=0", "--set=eos_token=x", "~model.max_tokens=5", "--env=MAX_TOKENS=5"]
    result = runner.invoke(app, [*base, *harmless])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert [job["entrypoint"] for job in submitted] == [shlex.join(["python", "job.py", "--lr", "0.1", *harmless])]
    # The entrypoint printed as Ray keeps it: a query redacted from it was still on the Jobs page.
    assert f"entrypoint: {submitted[0]['entrypoint']}" in result.stdout


def test_submit_refuses_the_value_of_a_password_option(monkeypatch, tmp_path):
    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", lambda address: pytest.fail("submitted"))
    (tmp_path / "job.py").write_text("print('hi')\n")
    result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--address", "http://head:8265",
                                 "--", "--lr", "0.1", "--password", "ArgPassw0rd"])
    line = one_line_error(result.exit_code, result.stdout, result.stderr)
    assert result.exit_code == 2 and "argument #4 carries a credential" in line and "ArgPassw0rd" not in line


def test_submit_refuses_a_mistyped_option_and_passes_the_scripts_arguments_after_the_double_dash(
        monkeypatch, tmp_path):
    # A mistyped --address used to go to the script as an argument, and the job to the default cluster.
    submitted = recorded_submissions(monkeypatch)
    (tmp_path / "job.py").write_text("print('hi')\n")
    for typo in (["--adress", "http://prod.example:8265"], ["--folow"]):
        result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), *typo])
        assert result.exit_code == 2 and f"No such option: {typo[0]}" in result.stdout + result.stderr
    assert submitted == []
    result = runner.invoke(app, ["submit", "job.py", "--working-dir", str(tmp_path), "--address",
                                 "http://prod.example:8265", "--", "--lr", "0.1", "--adress", "x"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert [(job["address"], job["entrypoint"]) for job in submitted] == [
        ("http://prod.example:8265", "python job.py --lr 0.1 --adress x")]


def test_straggler_scores_are_coloured_against_the_runs_eviction_threshold():
    # Red at a fixed 2.0 showed 2.5 as a straggler in a run that evicts above 3, and never would.
    from elastic.cli import _straggler

    assert _straggler(2.5, 3.0) == "[yellow]2.50[/]" and _straggler(3.2, 3.0) == "[red]3.20[/]"
    assert _straggler(1.9, 3.0) == "1.90" and _straggler(3.0, 3.0) == "[yellow]3.00[/]"  # evicted above it
    assert _straggler(2.1, None) == "[red]2.10[/]" and _straggler(None, 3.0) == "-"
