"""The ``elastic`` command: live status of a run, a clean stop, checkpoint listings, and Ray Jobs submission.

``status`` and ``stop`` ask the named ``controller`` actor of namespace ``elastic-<run>``; ``checkpoints`` lists step
directories through ``CheckpointStore``; ``submit`` wraps ``JobSubmissionClient``. Any failure ends the
command with one line on stderr and a non-zero exit code, never a traceback (``-v`` shows it).

Exit codes: 0 done; 1 failed; 2 usage error (a bad option or address); 3 ``stop`` asked the run
to stop but could not learn how it ended; 4 ``checkpoints --run`` found no usable step; 130
interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import secrets
import shlex
import string
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from elastic.config import ConfigError, RunConfig
from elastic.address import host_port, shown, trainer_address_problem, unreachable
from elastic.redact import carries_credentials, configure_logging, redact_url, redact_urls_in

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "elastic-"
CONTROLLER_NAME = "controller"
DEFAULT_TIMEOUT_S = 15.0
# An unreachable address must fail in seconds; ray.init against a closed port retries for minutes.
PROBE_TIMEOUT_S = 3.0
EXIT_OUTCOME_UNKNOWN = 3  # `stop`: the request was delivered, the run's end was not seen
EXIT_NO_USABLE_STEP = 4  # `checkpoints --run`: nothing to resume from (no step, or none checks out)
# Entries of the working directory that never belong in a job package (Ray's own defaults cover
# .git and .venv in recent versions; listing them keeps older clusters fast too).
SUBMIT_EXCLUDES = [".git", ".venv", "venv", "__pycache__", ".pytest_cache", "*.egg-info"]
# `submit`: the dashboard's answers. Ray's Jobs client sends its HTTP requests without a timeout,
# so a dashboard that takes the connection and never answers (a stale port-forward, a hung head)
# held the command forever. ANSWER_TIMEOUT_S bounds each small request (the client's version
# check, which a hung dashboard does not answer either, and a status); --timeout, if given, the
# submission itself (its upload has no limit by default: a large working directory on a slow
# link takes what it takes). With --follow, a log stream quiet for FOLLOW_QUIET_S has the job's
# status asked, and FOLLOW_LOST_ASKS unanswered asks in a row end the command (the job itself
# goes on): a websocket through a network partition waits forever otherwise.
ANSWER_TIMEOUT_S = 30.0
FOLLOW_QUIET_S = 30.0
FOLLOW_LOST_ASKS = 3

app = typer.Typer(
    name="elastic",
    help="Inspect and launch elastic training runs on a Ray cluster.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _stdout() -> Console:
    """A console on the current sys.stdout (test runners swap it), made per use.

    Piped output (scripts, ``| grep``, tests) gets 200 columns instead of ellipsised table cells.
    """
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=200 if wide else None)


err_console = Console(stderr=True)

_verbose = False
# True only under main(): a hard exit must never end a process that merely calls ``app`` (tests).
_standalone = False


class CliError(Exception):
    """A failure the user can act on; printed as one line.

    ``hard_exit``: a Ray call is still blocked in a background thread, so the process must exit
    without running Ray's shutdown hooks (they would wait on that thread).
    """

    def __init__(self, message: str, code: int = 1, hard_exit: bool = False):
        super().__init__(message)
        self.code = code
        self.hard_exit = hard_exit


def _one_line(text: str, limit: int = 400) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters, its URLs' credentials
    redacted before the cut: a cut inside user:password@ leaves no '@' for ``redact_urls_in``
    (run again later, by ``_fail``) to find, and the password's first characters were printed."""
    lines = [ln.strip() for ln in redact_urls_in(str(text)).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _fail(message: str, code: int, hard_exit: bool = False) -> None:
    # soft_wrap: a long reason must stay on one line however narrow the terminal is. Every URL's
    # user:password@ and query go: an address given as http://user:pw@head:8265 (a dashboard
    # behind basic auth) reaches errors through Ray's own messages too.
    err_console.print(f"elastic: error: {_one_line(redact_urls_in(message), 1000)}", markup=False,
                      highlight=False, soft_wrap=True)
    if hard_exit and _standalone:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


def _friendly(fn: Callable) -> Callable:
    """Turn every exception of a command into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except CliError as exc:
            _fail(str(exc), exc.code, exc.hard_exit)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as exc:  # noqa: BLE001 - the CLI contract is one line, whatever broke
            if _verbose:
                # The traceback, redacted as every message is: raised as it was, Ray's own
                # messages printed an address's user:password@ (a dashboard behind basic auth).
                err_console.print(redact_urls_in("".join(traceback.format_exception(exc))).rstrip(), markup=False,
                                  highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None
            logger.debug("unexpected error", exc_info=True)
            # Redacted before it is cut: a cut inside user:password@ leaves no '@' to find.
            _fail(f"{type(exc).__name__}: {_one_line(redact_urls_in(str(exc)))} (run with -v for the traceback)", 1)

    return wrapper


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging; tracebacks on errors.")):
    global _verbose
    _verbose = verbose
    configure_logging(logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# ---- formatting -------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN``. Why: run and file names come
    from a storage listing that anyone who can write the bucket names, and rich passes escape
    sequences (``\\x1b]0;...``, ``\\x1b[2J``) through to the operator's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _plain(line: str) -> None:
    """One line as is: no markup, no highlighting, no wrapping (ids and URLs get copied)."""
    _stdout().print(_printable(line), markup=False, highlight=False, soft_wrap=True)


def _dash(value: Any) -> str:
    """A table or summary cell: '-' for None, and never read as rich markup (run names are free text)."""
    return "-" if value is None else escape(_printable(str(value)))


def _seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    return f"{value / 60:.1f} min"


def _number(value: Optional[float], fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    try:  # a manifest's created_at is whatever was written (1e300 overflowed and ended the listing)
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError, TypeError):
        return "?"


def _straggler(score: Optional[float], factor: Optional[float] = None) -> str:
    """A rank's straggler score: red over the run's eviction threshold (``straggler_factor``,
    from ``status()``; 2.0, the default, for a run that does not say), yellow halfway there.
    With fixed colours a score of 2.5 showed red in a run that evicts above 3, and never would."""
    if score is None:
        return "-"
    text = f"{score:.2f}"
    factor = factor if isinstance(factor, (int, float)) and factor > 1 else 2.0
    if score > factor:
        return f"[red]{text}[/]"
    if score >= 1 + (factor - 1) / 2:
        return f"[yellow]{text}[/]"
    return text


def _heartbeat(age: Optional[float], timeout_s: Optional[float]) -> str:
    """A rank's heartbeat age: red past the run's ``heartbeat_timeout_s`` (the rank is about to
    be counted lost), yellow past half of it. Plain, a rank silent mid-step looked like the
    others until the controller declared it dead."""
    text = _seconds(age)
    if age is None or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        return text
    if age > timeout_s:
        return f"[red]{text}[/]"
    return f"[yellow]{text}[/]" if age > timeout_s / 2 else text


# ---- connecting to Ray ------------------------------------------------------------------------

_AUTH_FAILURE = re.compile(r"Unauthenticated|InvalidAuthToken|AuthenticationError|authentication token", re.I)
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*(\S+:\d+:\s*)?")


def _given(address: Optional[str]) -> Optional[str]:
    """``--address`` as given; an empty one is refused (``--address "$HEAD"`` with HEAD unset fell
    back to the environment or the local cluster: another cluster than the one meant)."""
    if address is not None and not address.strip():
        raise CliError("--address is empty: give the cluster's address, or leave the option out for "
                       "the default", code=2)
    return address


def _cluster_address(address: Optional[str]) -> str:
    addr = _given(address) or os.environ.get("RAY_ADDRESS") or "auto"
    if addr.startswith(("http://", "https://")):
        raise CliError(f"{addr} ({_address_source(address)}) is a dashboard URL; this command needs the cluster "
                       "address (HOST:6379, or ray://HOST:10001): pass --address", code=2)
    return addr


def _address_source(address: Optional[str]) -> str:
    """Where the cluster address came from, for errors: a bad RAY_ADDRESS was blamed on an
    --address the user never gave."""
    return "--address" if _given(address) else "RAY_ADDRESS"


def _probe(address: str, timeout_s: float, source: str = "--address",
           not_an_address: str = "not HOST:PORT (e.g. 10.0.0.1:6379)", hint: str = "") -> None:
    """Fail in seconds when nothing listens at ``address`` (``source``: where it came from;
    ``not_an_address``: what an address without a port is said to be; ``hint``: added to the
    message that nothing answers).

    Refused first, as the Trainer refuses it (``trainer_address_problem``): an address no Ray
    cluster has, above all one with a ``user:password@``. Why: ``admin:pw@head:6379`` parses as
    HOST:PORT (host ``admin:pw@head``), and the error that followed printed it whole, since the
    redaction of messages (``redact_urls_in``) only knows ``scheme://user:pw@``. Messages show
    an address through ``shown``, which takes a ``user:password@`` off with or without a scheme."""
    if address != "auto" and host_port(address) is None:
        raise CliError(f"{source} {shown(address)!r} is {not_an_address}", code=2)
    problem = trainer_address_problem(address)
    if problem is not None:
        raise CliError(f"{source} {shown(address)!r} {problem}", code=2)
    reason = unreachable(address, timeout_s)
    if reason is not None:
        raise CliError(f"cannot reach a Ray cluster at {address}: {reason}{hint}") from None


@contextlib.contextmanager
def _captured_stderr():
    """Send fd 2 to a temporary file; yields a function that returns what was written so far.

    Ray's C++ core logs connection retries straight to fd 2, many lines each; the CLI reports one.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): capture nothing
        yield lambda: ""
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)

        def read() -> str:
            # pread: the offset is shared with the writers, so never seek.
            return os.pread(tmp.fileno(), 1 << 20, 0).decode(errors="replace")

        try:
            yield read
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _last_warning(captured: str) -> str:
    lines = [_LOG_PREFIX.sub("", ln).strip() for ln in captured.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _auth_hint(address: str) -> str:
    return (f"authentication failed at {address} (token missing or wrong): the cluster uses Ray token auth; "
            "export RAY_AUTH_MODE=token and the cluster's token as RAY_AUTH_TOKEN (or in ~/.ray/auth_token; "
            "`ray get-auth-token` prints it on the head node)")


def _connect(address: str, namespace: str, timeout_s: float) -> str:
    """``ray.init`` bounded by ``timeout_s``, with Ray's retry noise reduced to one reason.

    Returns the cluster's GCS address (what ``auto`` resolved to), for messages.
    """
    import ray

    outcome: dict[str, Any] = {}

    def init() -> None:
        try:
            ray.init(address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False)
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            outcome["error"] = exc

    with _captured_stderr() as captured:
        thread = threading.Thread(target=init, name="elastic-ray-init", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.2)
                # Ray retries a rejected token for ~20 s before giving up; the first rejection is enough.
                if _AUTH_FAILURE.search(captured()):
                    break
        except KeyboardInterrupt:
            # Ray's exit hook (shutdown) waits for the lock ray.init holds while it connects,
            # which can take minutes: an exit that ran it held the Ctrl-C'd command as long.
            raise CliError("interrupted", 130, hard_exit=thread.is_alive()) from None
        noise = captured()
    if outcome.get("ok"):
        try:
            return ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - only used in messages
            return address
    error = outcome.get("error")
    still_running = thread.is_alive()
    if _AUTH_FAILURE.search(noise) or type(error).__name__ == "AuthenticationError":
        raise CliError(_auth_hint(address), hard_exit=still_running)
    if still_running:
        detail = _last_warning(noise)
        raise CliError(f"no answer from the Ray cluster at {address} within {timeout_s:g} s"
                       + (f" ({detail})" if detail else ""), hard_exit=True)
    detail = _one_line(str(error)) or _last_warning(noise)
    raise CliError(f"cannot connect to the Ray cluster at {address}: {detail}")


def _live_runs() -> list[str]:
    """Runs with a live controller: actors named ``controller`` in namespaces ``elastic-*``, as the
    cluster ``_connect`` joined knows them (its GCS). Not the state API: ``list_actors`` finds a
    cluster of its own (RAY_ADDRESS, the one recorded under /tmp/ray, a GCS process on this
    machine), so on cluster A's head ``--address B`` listed A's runs."""
    import ray

    namespaces = [a.get("namespace") for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("name") == CONTROLLER_NAME]
    return sorted({ns[len(NAMESPACE_PREFIX):] for ns in namespaces if ns and ns.startswith(NAMESPACE_PREFIX)})


def _controller(run: str, address: str, timeout_s: float) -> Any:
    """The live run's controller actor, or a CliError that lists the runs that are live."""
    import ray

    namespace = NAMESPACE_PREFIX + run
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        others = [r for r in _live_runs() if r != run]
        hint = f"; live runs: {', '.join(others)}" if others else "; no elastic run is live there"
        raise CliError(f"no run {run!r} on the cluster at {address} "
                       f"(no actor {CONTROLLER_NAME!r} in namespace {namespace!r}){hint}") from None


def _ask(run: str, call: Any, timeout_s: float, sent: str | None = None) -> Any:
    """The answer to one call on a run's controller, or a CliError that says why there is none.
    ``sent``: the call acts though unanswered (it waits in the actor's queue, and can run after
    this command exits): a timeout says that, exit EXIT_OUTCOME_UNKNOWN, not "no answer".

    So does an answer lost on its way: ActorUnavailableError (a RayActorError, but Ray says of
    it that the call may or may not have run: the actor is restarting, or its node did not
    answer) and a ConnectionError (Ray Client's, when its connection to ray://HEAD drops after
    the call went out). Only ActorDiedError (and the base RayActorError) says the controller has
    exited, so that the call went nowhere: read as "not delivered", an unavailable controller
    that then ran the stop raced the script that started the run again."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    try:
        return ray.get(call, timeout=timeout_s)
    except GetTimeoutError:
        if sent is not None:
            raise CliError(f"the controller of run {run!r} did not confirm {sent} within {timeout_s:g} s; the "
                           "request was sent and may still take effect", code=EXIT_OUTCOME_UNKNOWN) from None
        raise CliError(f"the controller of run {run!r} did not answer within {timeout_s:g} s") from None
    except ActorUnavailableError:
        if sent is not None:
            raise CliError(f"the controller of run {run!r} did not confirm {sent} (it is unavailable: restarting, "
                           "or its node does not answer); the request was sent and may still take effect",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        raise CliError(f"the controller of run {run!r} did not answer (unavailable: restarting, or its node does "
                       "not answer); try again") from None
    except RayActorError:
        raise CliError(f"the controller of run {run!r} has exited (the run ended or its driver died)") from None
    except ConnectionError as exc:
        if sent is not None:
            raise CliError(f"lost the connection to the cluster before the controller of run {run!r} confirmed "
                           f"{sent} ({_one_line(str(exc), 200)}); the request was sent and may still take effect",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        raise


def _controller_status(run: str, address: str, timeout_s: float) -> dict:
    return _ask(run, _controller(run, address, timeout_s).status.remote(), timeout_s)


def _statuses(runs: list[str], address: str,
              timeout_s: float) -> tuple[list[tuple[str, Optional[dict]]], Optional[str]]:
    """Each run's status, None for a run whose controller did not answer (or has exited, or whose
    ``status()`` raised), all within ``timeout_s``: every call is sent first, then the answers are
    awaited against one deadline. Asked one after another, each with the whole timeout, N hung
    controllers held ``elastic status`` N times --timeout.

    Also returns why the connection to the cluster was lost (one line, credentials redacted), or
    None. Why caught here: Ray Client raises ConnectionError from ``get_actor``, ``.remote()`` and
    ``ray.get`` once its channel to ray://HEAD drops, and one such error ended the listing with no
    table at all. Once it is lost, nothing more is asked or awaited (each call would fail the same
    way, or wait on a reconnection): the runs left are rows without an answer. Likewise one
    controller's own error (a RayTaskError from a bug in its status(), or an older elastic build)
    is one row, not the end of the listing."""
    from ray.exceptions import RayError

    lost: Optional[str] = None
    calls: list[tuple[str, Any]] = []
    for name in runs:
        if lost is not None:
            calls.append((name, None))
            continue
        try:
            calls.append((name, _controller(name, address, timeout_s).status.remote()))
        except CliError:  # gone since it was listed
            calls.append((name, None))
        except ConnectionError as exc:
            lost = _one_line(str(exc), 200)
            calls.append((name, None))
    deadline = time.monotonic() + timeout_s
    rows: list[tuple[str, Optional[dict]]] = []
    for name, call in calls:
        if call is None or lost is not None:
            rows.append((name, None))
            continue
        try:
            # 0 once the deadline has passed: an answer already there is taken, none is waited for.
            rows.append((name, _ask(name, call, max(0.0, deadline - time.monotonic()))))
        except CliError:
            rows.append((name, None))
        except ConnectionError as exc:
            lost = _one_line(str(exc), 200)
            rows.append((name, None))
        except RayError as exc:
            logger.debug("the controller of run %r failed to answer its status: %s", name, _one_line(str(exc)))
            rows.append((name, None))
    return rows, lost


# ---- status -----------------------------------------------------------------------------------

def _summary(st: dict) -> str:
    total = st.get("total_steps")
    step = f"{_dash(st.get('step'))}/{total}" if total else _dash(st.get("step"))
    ckpt = st.get("checkpoint") or {}
    parts = [
        f"[bold]run[/] {_dash(st.get('run'))}", f"[bold]state[/] {_dash(st.get('state'))}", f"[bold]step[/] {step}",
        f"[bold]loss[/] {_number(st.get('loss'))}", f"[bold]samples/s[/] {_number(st.get('samples_per_s'), '.0f')}",
        f"[bold]world[/] {st.get('world_size')}", f"[bold]spares[/] {_spares(st)}",
        f"[bold]failures[/] {st.get('failures')}", f"[bold]recoveries[/] {st.get('recoveries')}",
    ]
    if ckpt.get("latest") is not None or ckpt.get("lag") is not None:
        parts.append(f"[bold]checkpoint[/] {_dash(ckpt.get('latest'))} (lag {_dash(ckpt.get('lag'))})")
    if ckpt.get("storage_outage"):
        parts.append("[bold red]checkpoint storage not answering[/]")
    if st.get("avoided_nodes"):
        parts.append(f"[bold]spares kept off[/] {_avoided(st['avoided_nodes'])}")
    return "  ".join(parts)


def _avoided(nodes: dict) -> str:
    """Nodes a straggler was evicted from, and for how long spares stay off them: ``a1b2c3 (55 s)``
    (seconds left; None: for the rest of the run)."""
    return ", ".join(f"{node[:12]} ({'the run' if left is None else f'{left:.0f} s'})"
                     for node, left in sorted(nodes.items()))


def _spares(st: dict) -> str:
    """Ready spares, and those still starting: ``1 (+1 building)``."""
    building = st.get("spares_building") or 0
    return _dash(st.get("spares")) + (f" (+{building} building)" if building else "")


def _node(row: dict) -> str:
    node = _dash(row.get("node_ip"))
    if row.get("node_rank") is not None:
        node += f" n{row['node_rank']}/l{_dash(row.get('local_rank'))}"
    return node


def _ranks_table(st: dict) -> Table:
    table = Table(title=None, header_style="bold", expand=False)
    for header, justify in (("rank", "right"), ("name", "left"), ("role", "left"), ("node", "left"),
                            ("pid", "right"), ("state", "left"), ("step", "right"), ("behind", "right"),
                            ("step time", "right"),
                            ("heartbeat age", "right"), ("straggler", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    for row in st.get("ranks", []):
        spare = row.get("role") == "spare"
        table.add_row(
            _dash(row.get("rank")), _dash(row.get("name")), "[cyan]spare[/]" if spare else "active", _node(row),
            _dash(row.get("pid")), _dash(row.get("state")), _dash(row.get("step")), _dash(row.get("behind_steps")),
            _seconds(row.get("step_time_s")), _heartbeat(row.get("heartbeat_age_s"), st.get("heartbeat_timeout_s")),
            _straggler(row.get("straggler_score"), st.get("straggler_factor")),
        )
    return table


def _runs_table(rows: list[tuple[str, Optional[dict]]]) -> Table:
    table = Table(header_style="bold")
    for header in ("run", "state", "step", "world", "spares", "failures"):
        table.add_column(header, no_wrap=True)
    for run, st in rows:
        if st is None:
            table.add_row(_dash(run), "[red]no answer[/]", "-", "-", "-", "-")
            continue
        total = st.get("total_steps")
        step = f"{_dash(st.get('step'))}/{total}" if total else _dash(st.get("step"))
        table.add_row(_dash(run), _dash(st.get("state")), step, _dash(st.get("world_size")), _spares(st),
                      _dash(st.get("failures")))
    return table


def _timeout_seconds(value: float | None) -> float | None:
    """``--timeout``: a finite number of seconds > 0 (0 failed as if the cluster did not answer,
    -1 in the socket module, nan after the probe, inf in int()); None where it is optional."""
    if value is not None and not (math.isfinite(value) and 0 < value <= 1e9):
        raise typer.BadParameter(f"must be a number of seconds > 0 and <= 1e9, got {value!r}")
    return value


def _run_name(value: Optional[str]) -> Optional[str]:
    """The RUN of ``status`` and ``stop``: RunConfig's rule, as a usage error (a name no run can
    have was looked for on the cluster all the same, and "no run" said)."""
    if value is not None:
        try:
            RunConfig(name=value)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _run_dir(value: Optional[str]) -> Optional[str]:
    """``checkpoints --run``: one directory under the URL, whatever its name (storage may hold a
    run written by other means, and the listing shows it), but never a path: ``--run ../other``
    read a directory outside the URL given, and an empty one listed every run instead."""
    if value is not None and (value in ("", ".", "..") or "/" in value):
        raise typer.BadParameter(f"{value!r} is not the name of a run's directory under the URL (one path "
                                 "component, not '', '.' or '..')")
    return value


@app.command()
@_friendly
def status(
    run: Optional[str] = typer.Argument(None, callback=_run_name,
                                        help="Run name (RunConfig.name); default: the only live run."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Cluster address HOST:PORT or ray://HOST:10001; default: RAY_ADDRESS or the local "
                                "cluster."),
    timeout_s: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", callback=_timeout_seconds,
                                    help="Seconds to wait for the cluster and the controller."),
    as_json: bool = typer.Option(False, "--json", help="Print the controller's status dict as JSON."),
) -> None:
    """Show the ranks of a live run: node, state, step, step time, heartbeat age, straggler score, spares."""
    import ray

    addr = _cluster_address(address)
    _probe(addr, min(PROBE_TIMEOUT_S, timeout_s), _address_source(address))
    addr = _connect(addr, NAMESPACE_PREFIX + (run or "cli"), timeout_s)
    try:
        if run is None:
            runs = _live_runs()
            if not runs:
                raise CliError(f"no elastic run is live on the cluster at {addr}")
            if len(runs) > 1:
                rows, lost = _statuses(runs, addr, timeout_s)
                if as_json:
                    _print_json({name: st for name, st in rows})
                else:
                    _stdout().print(_runs_table(rows))
                    _stdout().print(f"{len(runs)} live runs; `elastic status RUN` shows one.", highlight=False)
                silent = [name for name, st in rows if st is None]
                if lost is not None:
                    # Not "no answer from the controller": the controllers may be fine, the
                    # cluster's connection (ray://HEAD dropped) is what failed.
                    raise CliError(f"lost the connection to the cluster at {shown(addr)} ({lost}); run(s) "
                                   f"{', '.join(silent)} not asked or not answered")
                if silent:  # as for one run: `elastic status && ...` must not pass over a hung controller
                    raise CliError(f"no answer from the controller of run(s) {', '.join(silent)} within "
                                   f"{timeout_s:g} s (or it has exited, or its status failed: `elastic status "
                                   "RUN` says)")
                return
            run = runs[0]
        st = _controller_status(run, addr, timeout_s)
        if as_json:
            _print_json(st)
            return
        out = _stdout()
        out.print(_summary(st), highlight=False)
        if st.get("ranks"):
            out.print(_ranks_table(st))
        else:
            # What the controller waits on first (another run's lease, watched), else the placing.
            out.print(f"no ranks yet ({st.get('waiting_for') or 'the controller is still placing workers'})",
                      highlight=False, markup=False)
    finally:
        ray.shutdown()


# ---- stop -------------------------------------------------------------------------------------

@app.command()
@_friendly
def stop(
    run: str = typer.Argument(..., callback=_run_name, help="Run name (RunConfig.name)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Cluster address HOST:PORT or ray://HOST:10001; default: RAY_ADDRESS or the local "
                                "cluster."),
    timeout_s: float = typer.Option(120.0, "--timeout", callback=_timeout_seconds, help="Seconds to wait for the run to stop."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the run has stopped (default) or only "
                                                             "ask."),
) -> None:
    """Stop a live run cleanly: the steps already dispatched finish, their checkpoint commits, and
    the run's fit() raises TrainingStopped. Running fit() again with the same run name continues
    from that step.

    Exit codes:
    0: the run stopped (or finished first); with --no-wait, the request was delivered.
    1: the run ended errored, or the request was not delivered (no such run, no cluster).
    2: a usage error.
    3: asked, but how the run ended is unknown (its controller exited or became unavailable, the
       cluster was lost while waiting, or still stopping at --timeout), or the request was sent but
       not confirmed (in time, or the controller unavailable, or the connection lost): the stop may
       still take effect.
    """
    import ray

    addr = _cluster_address(address)
    _probe(addr, min(PROBE_TIMEOUT_S, timeout_s), _address_source(address))
    addr = _connect(addr, NAMESPACE_PREFIX + run, timeout_s)
    try:
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError

        actor = _controller(run, addr, timeout_s)
        # Sent, a stop may wait in the actor's queue (a controller still in its constructor) and
        # run after this command exits: unconfirmed is exit 3, not "not delivered" (a script
        # that then started the run again raced the stop it had asked for).
        _ask(run, actor.stop.remote("elastic stop"), min(timeout_s, DEFAULT_TIMEOUT_S), sent="the stop")
        if not wait:
            _plain(f"asked run {run} to stop after the steps already dispatched")
            return

        try:
            final = ray.get(actor.wait_ended.remote(timeout_s), timeout=timeout_s + DEFAULT_TIMEOUT_S)
        except ActorUnavailableError:
            # Not "exited": Ray says of an unavailable actor that it may come back (restarting, or
            # its node did not answer), and the run with it.
            raise CliError(f"the controller of run {run} became unavailable while waiting for the run to stop; the "
                           "stop was delivered, outcome unknown (`elastic status RUN` says whether it is back)",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        except RayActorError:
            # Not a success: a controller that dies (its node lost, the driver killed) says
            # nothing of how the run ended, so a script must not read this as "stopped".
            raise CliError(f"run {run} ended, but its controller exited before it said how: outcome unknown "
                           "(`elastic checkpoints URL --run RUN` shows the latest committed step)",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        except GetTimeoutError:
            final = None
        except RayTaskError as exc:
            # The controller's own wait_ended raised (a bug of ours, or its status failing): the
            # stop was delivered and the cluster is there; what the run did is not known.
            raise CliError(f"the controller of run {run} failed to say how the run ended ({_one_line(str(exc), 200)}); "
                           "the stop was delivered, outcome unknown (`elastic status RUN` says more)",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        except (ConnectionError, RayError) as exc:
            # The stop was delivered (confirmed above): whatever breaks the wait after it (Ray
            # Client's ConnectionError when ray://HEAD drops, a lost GCS or node) leaves the run
            # stopping or stopped, not "not delivered" (exit 1 read as "start it again").
            raise CliError(f"lost the cluster while waiting for run {run} to stop ({type(exc).__name__}: "
                           f"{_one_line(str(exc), 200)}); the stop was delivered, outcome unknown "
                           "(`elastic status RUN` or `elastic checkpoints URL --run RUN` says more)",
                           code=EXIT_OUTCOME_UNKNOWN) from None
        if final is None:
            raise CliError(f"run {run} did not stop within {timeout_s:g} s; it is still stopping",
                           code=EXIT_OUTCOME_UNKNOWN)
        latest = (final.get("checkpoint") or {}).get("latest")
        state = final.get("state")
        line = (f"run {run} {_printable(str(state))} after step {_dash(final.get('step'))}"
                + (f"; latest committed checkpoint: step {latest}" if latest is not None else ""))
        # Exit 0 only for the ends a stop asks for (or a run that finished first): "errored"
        # printed and exited 0, so `elastic stop RUN && next-step` went on after a failed run.
        if state in ("stopped", "finished"):
            _plain(line)
            return
        raise CliError(line, code=1 if state == "errored" else EXIT_OUTCOME_UNKNOWN)
    finally:
        ray.shutdown()


# ---- checkpoints ------------------------------------------------------------------------------

def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_storage_options(pairs: list[str]) -> dict:
    """``["k=v", "client_kwargs.region_name=eu-west-1"]`` -> nested dict; values parsed as JSON when
    they parse, except under a key that looks like a credential (``looks_secret``): a secret is a
    string to s3fs and to the redactor, though it may read as a number or ``true``. Errors name
    the key, never the value."""
    from elastic.checkpoint.storage import looks_secret

    out: dict[str, Any] = {}
    for i, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--storage-option #{i} is not KEY=VALUE (no '=' or no key); its text is not "
                           "shown, as it may hold a credential", code=2)
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CliError(f"--storage-option {key.strip()}=... conflicts with an earlier value of {part!r}",
                               code=2)
        node[leaf] = value if looks_secret(leaf) else _parse_value(value)
    return out


def _interactive_options(url: str, options: dict) -> dict:
    """A listing is interactive: bound botocore's connect retries so an unreachable endpoint fails in
    seconds rather than minutes. Values the user gave win."""
    import fsspec.core

    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in ("s3", "s3a"):
        return options
    opts = dict(options)
    given = opts.get("config_kwargs") or {}
    if not isinstance(given, dict):  # -o config_kwargs=5: botocore's Config takes keyword arguments
        raise CliError("--storage-option config_kwargs must be an object of botocore Config settings, e.g. "
                       "-o config_kwargs.connect_timeout=10", code=2)
    config = dict(given)
    config.setdefault("connect_timeout", 3)
    config.setdefault("read_timeout", 30)
    config.setdefault("retries", {"max_attempts": 2})
    opts["config_kwargs"] = config
    return opts


def _storage_error(exc: Exception, location: str) -> CliError:
    text = _one_line(str(exc))
    return CliError(text if location in text else f"cannot list {location}: {text}")


def _step_status(status_: str) -> str:
    colour = {"valid": "green", "committed": "green", "partial": "yellow", "corrupt": "red",
              "unreadable": "red"}.get(status_)
    return f"[{colour}]{status_}[/]" if colour else status_


def _problem(text: Optional[str]) -> str:
    """``checkpoint step 2 is corrupt: s3://b/p/run/step-000000002/x: why`` -> ``step-000000002/x: why``;
    ``read s3://b/p/run/step-000000002/x failed: ...`` -> ``read step-000000002/x failed: ...``."""
    if not text:
        return ""
    text = re.sub(r"^checkpoint step \d+ is corrupt: ", "", redact_urls_in(text))
    return escape(_printable(re.sub(r"\S*?(step-\d{9,}/)", r"\1", text, count=1)))


def _steps_table(steps: list) -> Table:
    table = Table(header_style="bold")
    for header, justify in (("step", "right"), ("status", "left"), ("size", "right"), ("files", "right"),
                            ("world", "right"), ("committed at", "left"), ("problem", "left")):
        table.add_column(header, justify=justify, no_wrap=header != "problem")
    for s in steps:
        table.add_row(str(s.step), _step_status(s.status), _size(s.size_bytes), str(s.num_files),
                      _dash(s.world_size), _when(s.committed_at), _problem(s.problem))
    return table


_STATUSES = ("valid", "committed", "partial", "corrupt", "unreadable")


def _list_run(url: str, run: str, options: dict, verify: bool, as_json: bool, retry) -> None:
    """One run's steps. Exits EXIT_NO_USABLE_STEP (after the listing) when none is usable: the
    run has no step (it does not exist there) or none checks out. Why: a script that asks
    "can this run resume?" (`elastic checkpoints URL --run R && ...`) got 0 either way."""
    from elastic.checkpoint import CheckpointStore, StorageError

    store = CheckpointStore(url, run, options, retry=retry)
    try:
        steps = store.list_steps(verify=verify)
    except (StorageError, OSError) as exc:
        raise _storage_error(exc, store.location) from None
    good = [s.step for s in steps if s.status in ("valid", "committed")]
    if not steps:
        _check_bucket(url, options, retry)
    if as_json:
        _print_json([s.to_dict() for s in steps])
    elif steps:
        _stdout().print(_steps_table(steps))
        counts = {k: sum(1 for s in steps if s.status == k) for k in _STATUSES}
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        latest = f"; latest usable: step {good[-1]}" if good else "; no usable step"
        _plain(f"{store.location}: {len(steps)} step(s): {summary}{latest}")
    if not as_json:
        _show_lease(store)
    if not steps:
        raise CliError(f"no checkpoints for run {run!r} in {store.location}", code=EXIT_NO_USABLE_STEP)
    if not good:
        raise CliError(f"run {run!r} has no usable checkpoint step in {store.location} "
                       f"({'none verifies' if verify else 'none is committed'})", code=EXIT_NO_USABLE_STEP)


def _show_lease(store) -> None:
    """The run's storage lease (``elastic.checkpoint.lease``), when a run holds it: who, and how
    long ago its holder renewed it by that holder's clock. Why: a run another cluster trains
    there refuses a ``fit()`` of that name here, and this says which run that is. Best effort:
    the listing above is what was asked for."""
    from elastic.checkpoint.lease import describe_holder, read_lease

    try:
        record = read_lease(store.storage)
    except Exception:  # noqa: BLE001 - a listing that answered stands
        return
    if record is None:
        return
    renewed = record.get("renewed_at")
    age = (f"; renewed {max(0.0, time.time() - renewed):.0f} s ago by its holder's clock"
           if isinstance(renewed, (int, float)) else "")
    _plain(f"lease: held by {describe_holder(record)}{age} (a run is training there, or ended without "
           f"releasing it; another run takes it over once it has not been renewed for "
           f"{record.get('ttl_s', 30)} s)")


def _list_runs(url: str, options: dict, as_json: bool, retry, verify: bool = True) -> None:
    from elastic.checkpoint import CheckpointStore, Storage, StorageError, StorageUnavailable
    from elastic.checkpoint.store import parse_step_dir

    root = Storage(url, options, retry=retry)
    try:
        entries = root.list_dir("", detail=True)
    except (StorageError, OSError) as exc:
        raise _storage_error(exc, root.location) from None
    if any(parse_step_dir(e["name"]) is not None for e in entries):
        # The URL is a run directory itself: list it as <parent> --run <name>.
        parent, _, name = url.rstrip("/").rpartition("/")
        if parent and name:
            _list_run(parent, name, options, verify, as_json, retry)
            return
    # name -> its steps, or the (redacted) error when storage refused to list the run. Why per
    # run: one run storage refuses (AccessDenied on its prefix, say) failed the whole listing and
    # hid every other run. An outage (StorageUnavailable) still fails it: nothing would answer.
    rows: list[tuple[str, Any]] = []
    for entry in entries:
        if entry["type"] != "directory":
            continue
        store = CheckpointStore(url, entry["name"], options, retry=retry)
        try:
            steps = store.list_steps(verify=False)
        except StorageUnavailable as exc:
            raise _storage_error(exc, store.location) from None
        except StorageError as exc:
            rows.append((entry["name"], redact_urls_in(str(exc))))
            continue
        except OSError as exc:
            raise _storage_error(exc, store.location) from None
        if steps:
            rows.append((entry["name"], steps))
    if not rows:
        _check_bucket(url, options, retry)
    if as_json:
        # A run that could not be listed maps to {"error": ...} instead of its list of steps.
        _print_json({name: {"error": steps} if isinstance(steps, str) else [s.to_dict() for s in steps]
                     for name, steps in rows})
        return
    if not rows:
        _stdout().print(f"no checkpoints in {root.location}", highlight=False, markup=False)
        return
    problems = any(isinstance(steps, str) or any(s.status == "unreadable" for s in steps) for _, steps in rows)
    table = Table(header_style="bold")
    headers = [("run", "left"), ("steps", "right"), ("committed", "right"), ("partial", "right"),
               ("corrupt", "right"), ("latest committed", "right"), ("size", "right"), ("committed at", "left")]
    if problems:  # the columns of a listing with nothing unreadable stay as they were
        headers[5:5] = [("unreadable", "right")]
        headers.append(("problem", "left"))
    for header, justify in headers:
        table.add_column(header, justify=justify, no_wrap=header != "problem")
    for name, steps in rows:
        if isinstance(steps, str):
            cells = [_dash(name), "[red]unreadable[/]", *["-"] * (len(headers) - 3), _problem(steps)]
            table.add_row(*cells)
            continue
        committed = [s for s in steps if s.status in ("valid", "committed")]
        cells = [_dash(name), str(len(steps)), str(len(committed)),
                 str(sum(1 for s in steps if s.status == "partial")),
                 str(sum(1 for s in steps if s.status == "corrupt")),
                 str(committed[-1].step) if committed else "-", _size(sum(s.size_bytes for s in steps)),
                 _when(committed[-1].committed_at) if committed else "-"]
        if problems:
            unreadable = [s for s in steps if s.status == "unreadable"]
            cells[5:5] = [str(len(unreadable))]
            cells.append(_problem(unreadable[0].problem) if unreadable else "")
        table.add_row(*cells)
    _stdout().print(table)
    # root.location, not url: the URL may carry credentials (user:secret@, a signed query).
    _stdout().print(f"`elastic checkpoints {root.location} --run RUN` lists one run's steps and verifies their files.",
                  highlight=False, markup=False)


@app.command()
@_friendly
def checkpoints(
    url: str = typer.Argument(..., help="Checkpoint root, as RunConfig.storage: /path, file:///path, "
                                        "s3://bucket/prefix."),
    run: Optional[str] = typer.Option(None, "--run", "-r", callback=_run_dir,
                                      help="Run name; default: list the runs under URL."),
    storage_option: list[str] = typer.Option(
        [], "--storage-option", "-o", help="KEY=VALUE for fsspec (repeatable); dotted keys nest "
                                           "(client_kwargs.region_name=eu-west-1); values parse as JSON if they can."),
    verify: bool = typer.Option(True, "--verify/--no-verify",
                                help="Read every file and check its size and sha256 (a run's listing: with --run "
                                     "or a run directory; the overview of all runs reads manifests only)."),
    as_json: bool = typer.Option(False, "--json", help="Print the listing as JSON (strict: no NaN); without "
                                                        "--run, a run storage refuses to list is {\"error\": ...}."),
) -> None:
    """List committed checkpoint steps with sizes and commit times; mark partial, corrupt and unreadable steps.

    Exit codes:
    0: listed (with --run: at least one step is usable; without: a run storage refuses is unreadable).
    1: the storage cannot be read.
    2: a usage error.
    4: with --run, no usable step: the run has none there (a wrong name?) or none checks out.
    """
    import fsspec.core

    from elastic.checkpoint import RetryPolicy, resolve_url

    try:
        url = resolve_url(url)
    except ConfigError as exc:
        raise _usage_error(exc) from None
    options = _interactive_options(url, parse_storage_options(storage_option))
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    if protocol == "memory" and not _in_this_process(url):
        raise CliError("URL: memory:// storage lives in the memory of the training driver, and no other process "
                       "can list it; use file:// or s3:// storage to list checkpoints from outside the run", code=2)
    if protocol in ("file", "local"):
        local = url.split("://", 1)[-1] if "://" in url else url
        if not os.path.isdir(local):
            raise CliError(f"{local} does not exist or is not a directory")
    retry = RetryPolicy(attempts=2, base_s=0.2, max_s=1.0)
    try:
        if run:
            _list_run(url, run, options, verify, as_json, retry)
        else:
            _list_runs(url, options, as_json, retry, verify)
    except ConfigError as exc:  # the storage refused the URL or the options: an unknown scheme, say
        raise _usage_error(exc) from None


def _check_bucket(url: str, options: dict, retry) -> None:
    """For a listing that found nothing: an s3:// URL's bucket must exist, as a local path's
    directory must. s3fs lists a missing bucket as empty, and the listing said "no checkpoints"
    (with --run, "no checkpoints for run R", sending the user after the run's name) of a misspelt
    bucket, and exited 0. Asked only then, and a HEAD that fails (a role allowed to list a prefix
    but not the bucket: 403) leaves the listing's answer: the listing needs no more than that."""
    import fsspec.core

    from elastic.checkpoint import Storage, StorageError

    if fsspec.core.split_protocol(url)[0] not in ("s3", "s3a"):
        return
    storage = Storage(url, options, retry=retry)
    try:
        bucket, found = storage.bucket_exists()
    except (StorageError, OSError, ConfigError):  # ConfigError: botocore's own credential check here
        return
    if not found:
        raise CliError(f"{storage.location}: bucket {bucket!r} does not exist (or these credentials cannot see it)")


def _in_this_process(url: str) -> bool:
    """Whether this process's memory:// holds ``url``. Only a driver that trained there does (it
    may call this command in-process, as the tests do); as a command of its own, the memory is
    this process's, empty, and the listing said "no checkpoints" of a run that had some."""
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


def _usage_error(exc: ConfigError) -> CliError:
    """A storage ConfigError as the usage error it is here (exit 2), naming what this command was
    given, the URL and --storage-option, not the RunConfig fields the message was written for."""
    text = re.sub(r"\bRunConfig\.storage_options\b", "--storage-option", str(exc))
    text = re.sub(r"\bRunConfig\.storage\b=?", "the URL ", text).replace("the URL  ", "the URL ")
    return CliError(f"URL: {text}", code=2)


def _print_json(obj: Any) -> None:
    """``obj`` as strict JSON (``_strict_json``) on stdout, every non-ASCII character escaped.

    Why escaped: rich's ``print_json`` writes them as they are by default, and the names and
    problem texts it prints come from storage listings (a bucket anyone with write access can
    name keys in): a C1 control character such as U+009B (CSI) reached the terminal raw, where
    it starts an escape sequence. Escaped, it is ``\\u009b``, and a JSON parser reads it back."""
    _stdout().print_json(_strict_json(obj), ensure_ascii=True)


def _strict_json(obj: Any) -> str:
    """JSON that strict parsers (jq) read: a non-finite float (the NaN loss of a step kept after a
    recovery, a diverged loss, an infinite avoid time) is null, where ``json.dumps`` writes NaN."""
    from elastic.jsonable import strict_dumps

    return strict_dumps(obj)


# ---- submit -----------------------------------------------------------------------------------

def _quiet_ray_logs() -> None:
    """Ray logs every packaging step of the upload at INFO on import-time handlers; -v keeps them."""
    if not _verbose:
        # The latter two set their own level (the job SDK logs every stream's close at INFO).
        for name in ("ray", "ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _job_address(address: Optional[str]) -> Optional[str]:
    """Like ``ray job submit``: --address, then RAY_API_SERVER_ADDRESS, then RAY_ADDRESS, then the local cluster."""
    return _given(address) or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or None


# Ray's client resolves its address with these first, over the one it is given
# (``get_address_for_submission_client``): --address must win, as the help says.
_ADDRESS_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


@contextlib.contextmanager
def _env_without(*names: str):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _script_in(working_dir: str, script: str) -> str:
    """The script's path relative to the working directory (the job's cwd on the cluster)."""
    wd = os.path.abspath(working_dir)
    path = os.path.abspath(script if os.path.isabs(script) else os.path.join(wd, script))
    if not os.path.isfile(path):
        raise CliError(f"{script} not found in the working directory {wd}", code=2)
    rel = os.path.relpath(path, wd)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise CliError(f"{script} is outside the working directory {wd}; it would not be uploaded", code=2)
    return rel


def _new_submission_id() -> str:
    """A job id as Ray's Jobs server makes one (``raysubmit_`` and 16 characters without the
    confusable ``IlOo0``), made here; Ray's own generator lives in its dashboard's job manager."""
    alphabet = sorted(set(string.ascii_letters + string.digits) - set("IlOo0"))
    return "raysubmit_" + "".join(secrets.choice(alphabet) for _ in range(16))


def _within(call: Callable[[], Any], timeout_s: float, who: str, hint: str = "") -> Any:
    """``call()``'s result, or its exception, if it returns within ``timeout_s``; else a CliError
    that ends the process (``hard_exit``: the call still blocks a thread). Why a thread: Ray's
    Jobs client sends its requests without a timeout, and takes none."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="elastic-cli-request", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if thread.is_alive():
        raise CliError(f"no answer from {who} within {timeout_s:g} s{hint}", hard_exit=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# What carries a secret on a command line besides ``carries_credentials``' forms, by name: a
# query parameter (``?token=``, ``&api_key=``: a webhook's, an API's), an option (``--password X``,
# ``--hf-token=X``) and a setting (``AWS_SECRET_ACCESS_KEY=...``, ``HF_TOKEN=``, Hydra's
# ``wandb.api_key=``). A name is a secret's when it ends in a password, secret or API key word, or
# is a token of a known kind (or a bare ``token``). Not any name with "token" in it: ``--max-tokens``,
# ``--pad-token``, ``EOS_TOKEN=``, ``?page_token=`` and ``--tokenizer`` are no credentials, and
# refusing them would stop jobs for nothing; nor ``--use-auth-token`` (a flag of Hugging Face's).
_SECRET_WORD = r"passw(?:or)?d|secret|secret[_-]?(?:access[_-]?)?key|api[_-]?key|apikey|private[_-]?key"
_TOKEN_KIND = r"hf|hub|huggingface|github|gh|gitlab|wandb|auth|access|api|bearer|refresh|id|private|session|bot|" \
              r"slack|discord|openai|npm|pypi|oauth|jwt|ray"
# A word of the name starts after a separator or at a camelCase hump (``awsSecretAccessKey``,
# ``dbPassword``: the spelling of JavaScript, Java and the AWS SDKs' options), an acronym's end
# included (``DBPassword``, ``AWSSecretKey``: .NET's spelling; ``OpenAIAPIKey``: an acronym
# before API's key or token). Only the hump test is case-sensitive. ``padToken`` is still no
# ``token``, and ``useAuthToken`` is the flag that ``--use-auth-token`` is.
_HUMP = r"(?-i:(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])|(?<=[A-Z])(?=API[_-]?(?:Key|Token)))"
_SECRET_NAME = rf"(?!use(?:[_-]|{_HUMP}))(?:[\w.-]*(?:[_.-]|{_HUMP}))?(?:{_SECRET_WORD}|(?:{_TOKEN_KIND})[_-]?token)|token"
_SECRET_QUERY = re.compile(rf"(?i)[?&](?:{_SECRET_NAME})=")
_SECRET_OPTION = re.compile(rf"(?i)--(?:{_SECRET_NAME})(?P<value>=.*)?")
# A setting starts the argument, after Hydra's ``+``/``++``/``~`` (append, force, delete:
# ``+wandb.api_key=S``), or follows an ``=`` (``--env=HF_TOKEN=S``, ``--set=db.password=S``): only
# at the argument's start, each of these went to the job table. Not after any character: the
# ``token`` of ``eos_token=`` is no setting of its own.
_SECRET_SETTING = re.compile(rf"(?i)(?:^[+~]{{0,2}}|(?<==))(?:{_SECRET_NAME})=.")
# A secret by name as an entry of a JSON object or a Python dict inside an argument, with a value:
# fsspec's storage options handed to a script (``--storage-options '{"key": "K", "secret": "S"}'``)
# passed every form above, and went to the job table as they were. The name starts the argument or
# follows a brace, comma, space or quote (so ``"pad_token": 0`` is no ``token``); an empty, null
# or boolean value carries nothing (``"token": true``: Hugging Face's "use the token cached").
_SECRET_ENTRY = re.compile(rf"""(?i)(?:^|[{{,\s"'])(?:{_SECRET_NAME})["']?\s*:\s*(?!""|''|null\b|none\b|true\b|false\b|["']?\s*[,}}])\S""")


def _argument_with_a_secret(args: list[str]) -> int | None:
    """The number (from 1) of the first script argument that carries a credential, or None."""
    for i, arg in enumerate(args, 1):
        option = _SECRET_OPTION.fullmatch(arg)
        if option is not None and option.group("value") is None:
            if i < len(args) and not args[i].startswith("--"):
                return i + 1  # --password VALUE: the value is the secret
            continue
        if (carries_credentials(arg) or _SECRET_QUERY.search(arg) or _SECRET_SETTING.search(arg)
                or _SECRET_ENTRY.search(arg)
                or (option is not None and option.group("value") != "=")):
            return i
    return None


def _refuse_credentials_in(args: list[str]) -> None:
    """Refuse a script argument that carries a credential: the forms ``carries_credentials``
    knows (a URL's user:password@, a presigned URL's signature, an Authorization header, an
    access key id), and secrets by name (``_SECRET_NAME``), as an option, a setting or an entry.

    Why refused, not redacted: the entrypoint goes to Ray as it is, which keeps it in its job
    table and shows it to everyone who can see the dashboard's Jobs page or run ``ray job list``.
    The argument is not shown (by its number only): it holds the secret."""
    i = _argument_with_a_secret(args)
    if i is not None:
        raise CliError(
            f"the script's argument #{i} carries a credential (a URL's user:password@, a signed query or a "
            "token, key or password parameter, an Authorization or Cookie header, Ray's auth token, an access key "
            "id, an option, NAME=value setting or JSON or dict entry named as a password, secret, API key or "
            "token), and Ray keeps the command line in its job table, shown on the dashboard and by "
            "`ray job list`; give the job its credentials off the command line: the nodes' environment or role (AWS_* variables, ~/.aws, an "
            "instance profile) or a file the script reads",
            code=2)


# What `elastic submit` gives a job between `ray job stop`'s SIGTERM and its SIGKILL: above
# RunConfig.stop_timeout_s (60 s), after which the driver kills the run itself and says so.
STOP_WAIT_S = 70


# Not ``ignore_unknown_options``: with it a mistyped option (``--adress http://prod:8265``) went
# to the script as an argument, and the job to the default cluster. The script's own arguments
# come after ``--``, which click passes on as they are.
@app.command(context_settings={"allow_extra_args": True})
@_friendly
def submit(
    script: str = typer.Argument(..., help="Python script, relative to the working directory."),
    args: Optional[list[str]] = typer.Argument(None, help="Arguments for the script (put them after --)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Dashboard URL, e.g. http://HEAD:8265 (it wins over the environment); default: RAY_API_SERVER_ADDRESS, RAY_ADDRESS "
                                "or the local cluster."),
    working_dir: str = typer.Option(".", "--working-dir", help="Directory uploaded as the job's working_dir."),
    submission_id: Optional[str] = typer.Option(None, "--submission-id", help="Job id to use (default: generated)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream the job's logs and exit with its outcome."),
    timeout: Optional[float] = typer.Option(
        None, "--timeout", callback=_timeout_seconds,
        help="Seconds the submission may take, upload included (default: no limit; the dashboard must answer "
             "within 30 s either way)."),
    stop_wait: int = typer.Option(
        STOP_WAIT_S, "--stop-wait", min=1, max=86_400,
        help="Seconds `ray job stop` gives the job between SIGTERM and SIGKILL (the job's RAY_JOB_STOP_WAIT_TIME_S; "
             "Ray's 3 s default cuts a clean stop short: the steps already sent finish and their checkpoint "
             "commits). Keep it above the script's RunConfig.stop_timeout_s (60 s by default)."),
) -> None:
    """Submit SCRIPT as a Ray job, uploading the working directory (runtime_env working_dir)."""
    from ray.job_submission import JobSubmissionClient

    _quiet_ray_logs()
    if not os.path.isdir(working_dir):
        raise CliError(f"--working-dir {working_dir} is not a directory", code=2)
    rel = _script_in(working_dir, script)
    _refuse_credentials_in(args or [])
    entrypoint = shlex.join(["python", rel, *(args or [])])
    target = _job_address(address)
    if target and "://" not in target and target != "auto":
        # A cluster's GCS address (HEAD:6379): Ray reads the dashboard's URL from the GCS, retrying
        # 20 times 2 s apart, and the retries' messages are quieted here, so nothing at that
        # address was a silent wait of 40 s or more. Probed as status probes its address: refused
        # first without HOST:PORT or with a user:password@ (the probe would look the host up with
        # the password in it), then a TCP connect says in seconds that nothing answers.
        _probe(target, PROBE_TIMEOUT_S, "--address" if address else "RAY_API_SERVER_ADDRESS/RAY_ADDRESS",
               not_an_address="neither the dashboard's URL (http://HEAD:8265) nor a cluster's HOST:PORT (HEAD:6379)",
               hint=" (give the dashboard's URL, --address http://HEAD:8265, or the cluster's HEAD:6379)")
    elif target and target.split("://", 1)[0].lower() == "ray":
        # A Ray Client address (ray://HEAD:10001): Ray's client joins it with ray.init to read the
        # dashboard's URL, retrying ~30 s where nothing listens, and the error then blamed "the
        # Ray dashboard". Probed as status probes it (a scheme in capitals refused there too: Ray
        # reads it as a module's name). Only ray://: http(s):// is the dashboard's, asked as it is.
        _probe(target, PROBE_TIMEOUT_S, "--address" if address else "RAY_API_SERVER_ADDRESS/RAY_ADDRESS",
               not_an_address="not ray://HOST:PORT (e.g. ray://HEAD:10001)",
               hint=" (give the head's Ray Client server, ray://HEAD:10001, or the dashboard's URL, "
                    "--address http://HEAD:8265)")
    where = shown(target) if target else "the local cluster"
    # RAY_JOB_STOP_WAIT_TIME_S is read by the job's supervisor actor, which Ray starts with the
    # job's runtime_env env_vars (ray/dashboard/modules/job/job_manager.py), so it is the job's
    # own: a cluster-wide setting on the head is not needed.
    runtime_env = {"working_dir": os.path.abspath(working_dir), "excludes": SUBMIT_EXCLUDES,
                   "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait)}}
    # HEAD:8265 (the dashboard's port without http://) passes the probe, since something listens
    # there, and Ray reads it as a GCS address: after its retries the error blamed the dashboard,
    # with nothing to say that the scheme was what was missing.
    gcs_hint = (" (an address without http:// is read as the cluster's GCS address, HEAD:6379; give the "
                "dashboard's URL, --address http://HEAD:8265)"
                if target and "://" not in target and target != "auto" else "")

    def connect():
        with _env_without(*(_ADDRESS_VARS if address else ())):
            return JobSubmissionClient(target)

    try:
        client = _within(connect, ANSWER_TIMEOUT_S if timeout is None else min(timeout, ANSWER_TIMEOUT_S),
                         f"the Ray dashboard at {where}", gcs_hint)
    except CliError:
        raise
    except Exception as exc:  # noqa: BLE001 - ConnectionError, auth or version errors: one line each
        # Shown without a user:password@ also when the address has no scheme (Ray adds http://
        # to admin:pw@head:8265; redact_urls_in knows only scheme://user:pw@), nor the variables'.
        text = redact_urls_in(str(exc)).replace(target or "\0", where)
        # An HTTP 401/403 as a status of its own, not digits of the address (http://node401:8265).
        if _AUTH_FAILURE.search(text) or re.search(r"(?<![\w.:/@-])40[13](?![\w-]|\.\w)", text.replace(where, "")):
            raise CliError(_auth_hint(where)) from None
        raise CliError(f"cannot reach the Ray dashboard at {where}: {_one_line(text)}{gcs_hint}") from None
    if timeout is None:
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)
    else:
        # Named here, so that a submission cut off at --timeout can say which job it may have
        # become: the dashboard may have taken it after all, and a retry would train twice.
        submission_id = submission_id or _new_submission_id()
        job_id = _within(lambda: client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                                   submission_id=submission_id),
                         timeout, f"the Ray dashboard at {where}",
                         f" (--timeout); the job may have been submitted all the same: `ray job status {submission_id}` "
                         "says, and `ray job stop` stops it")
    # Printed, so without credentials: Ray keeps an address's user:password@ (basic auth in front
    # of the dashboard), and the logs command below then needs it given again.
    dashboard = redact_url(client.get_address().rstrip("/"))
    # The entrypoint as Ray keeps it (no argument carries a credential: _refuse_credentials_in).
    # Redacted here, it hid what the dashboard's Jobs page shows anyone (a URL's query).
    for line in (f"job: {job_id}", f"entrypoint: {entrypoint}",
                 f"dashboard: {dashboard}/#/jobs/{job_id}"):
        _plain(line)
    logs = f"ray job logs --follow --address {dashboard} {job_id}"
    if not follow:
        _plain(f"logs: {logs}")
        return
    _follow(client, job_id, f": {logs}")


def _follow(client, job_id: str, logs_hint: str = "") -> None:
    """Stream the job's logs, then exit with its outcome. Bounded: a stream quiet for
    FOLLOW_QUIET_S has the job's status asked (a quiet job is not a lost dashboard), and
    FOLLOW_LOST_ASKS unanswered asks in a row end the command with how to follow it again. A
    stream that breaks (its websocket dropped) is said on stderr, and the status is asked until
    the job ends."""
    import asyncio

    from ray.job_submission import JobStatus

    unanswered = 0

    def status():
        """The job's status, or None when the dashboard did not answer (counted)."""
        nonlocal unanswered
        try:
            answer = _within(lambda: client.get_job_status(job_id), ANSWER_TIMEOUT_S, "the Ray dashboard")
        except Exception as exc:  # noqa: BLE001 - a CliError (no answer) or the client's error: counted
            unanswered += 1
            if unanswered >= FOLLOW_LOST_ASKS:
                raise CliError(f"lost the Ray dashboard while following job {job_id} ({_one_line(redact_urls_in(str(exc)))}"
                               f"); the job goes on{logs_hint}", hard_exit=True) from None
            return None
        unanswered = 0
        return answer

    async def tail():
        """Until the stream ends (None), or the job's status, asked in a quiet spell, is final (it)."""
        chunks = client.tail_job_logs(job_id).__aiter__()
        pending = None
        while True:
            # One read stays pending across quiet spells: cancelling it would close the stream.
            pending = pending or asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=FOLLOW_QUIET_S)
            if not done:
                now = status()
                if now is not None and now.is_terminal():
                    pending.cancel()
                    return now
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return None
            except Exception as exc:  # noqa: BLE001 - the stream broke, not the job
                # Ray's stream raises when its websocket closes abnormally (a kubectl port-forward
                # or a proxy dropped it: close code 1006) or is refused. The job goes on: an exit 1
                # here read as its failure, and a script that resubmits then trained twice.
                err_console.print(f"elastic: the log stream broke ({_one_line(redact_urls_in(str(exc)))}); "
                                  f"waiting for job {job_id} to end{logs_hint}",
                                  markup=False, highlight=False, soft_wrap=True)
                return None
            pending = None
            sys.stdout.write(chunk)
            sys.stdout.flush()

    final = asyncio.run(tail()) or status()
    pause = 0.5
    while final is None or not final.is_terminal():
        # A stream that ended can end a moment before the status flips: asked again soon. One that
        # broke leaves a job that may run for hours: the asks thin out to one per FOLLOW_QUIET_S.
        time.sleep(pause)
        pause = min(2 * pause, FOLLOW_QUIET_S)
        final = status()
    _plain(f"job {job_id}: {final.value}")
    if final != JobStatus.SUCCEEDED:
        raise typer.Exit(1)


def main() -> None:
    """Entry point of the ``elastic`` console script."""
    global _standalone
    _standalone = True
    app()


if __name__ == "__main__":
    main()
