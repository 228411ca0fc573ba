"""One driver at a time in a run's storage: the lease the run's controller holds while it trains.

Why: the run-name claim (``Trainer._claim_run_name``) keeps two runs of one name apart on one
Ray cluster only. Two drivers on two clusters that share ``RunConfig.storage`` and
``RunConfig.name`` (a job submitted again to another cluster while the first still ran, two
laptops with one bucket) wrote into one run directory: each one's retention deleted the
other's steps as its own, each resume took whichever run's step was newest, and the shards of a
step number both wrote overwrote each other (both manifests' checksums then failed, and both
runs lost the step).

The lease is ``<run>/lease.json``: who holds it (an owner id, the Ray cluster's session name,
its GCS address, the job, the controller's host and pid), a counter its holder raises every
``renew_s``, and the holder's wall time. Nothing here needs a compare-and-swap, which fsspec
does not offer on S3 (no conditional PUT through s3fs) and a local path offers only through
locks that not every filesystem honours. What holds without one:

- A run that finds another holder's lease decides by watching it, not by clocks: if its bytes
  change within ``ttl_s`` the holder is alive, and the run is refused before any worker starts
  (a ``LeaseHeld`` ConfigError, naming the holder and the fields to change). Unchanged for
  ``ttl_s``, the holder is gone (killed, its cluster down) and the lease is taken over. Only a
  lease last renewed ``STALE_AFTER_S`` ago by the reader's clock is watched for less: two of
  its holder's renewals and a margin, not ``ttl_s`` (a clock wrong by that much is rarer than
  a driver restarted after a crash, and the look still finds a live holder whatever the clocks).
- A lease of this Ray cluster (the same session name) whose holder is not this controller is
  taken over at once: a live holder would hold the run's controller name on this cluster,
  which this controller now holds (the claim refused any other).
- Every renewal reads the lease before it writes. A holder that finds another owner's lease
  has lost it (two runs that started in the same moment, each reading no lease; or a holder cut
  off from storage for longer than ``ttl_s`` while another run took it over) and stops: no
  renewal, no manifest and no delete after that (``on_lost``). Two writers converge on one
  owner within a renewal: the one that reads the other's lease stops writing, so the other
  reads its own from then on.

What is left: between a takeover and the old holder's next renewal (at most ``renew_s``, or
the length of its outage) both write. The old holder's commits and deletes stop at its next
renewal; its shards of a step number the new holder also writes may overwrite the new
holder's, which that step's checksums then refuse (the step is skipped, the one before it
loads): no wrong state is ever loaded.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from elastic.checkpoint.storage import RetryPolicy, Storage, StorageError
from elastic.config import ConfigError

logger = logging.getLogger(__name__)


def _since_boot() -> float:
    """Seconds on a clock that goes on while the machine sleeps (a laptop's lid closed, a VM
    paused), unlike ``time.monotonic`` on Linux: how long ago a renewal was, counted as another
    run watching the lease counts it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


LEASE_FILE = "lease.json"
MAX_LEASE_BYTES = 64 * 1024  # a lease is a few hundred bytes; a larger file is no lease of ours


class LeaseHeld(ConfigError):
    """Another live run holds the run's storage."""


def _when(wall: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(wall)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "an unknown time"


def describe_holder(record: dict | None) -> str:
    """Who holds a lease, for a message: never a credential (a lease holds none)."""
    if not isinstance(record, dict) or not record:
        return "a holder whose lease file is not elastic's (unreadable JSON)"
    bits = []
    if record.get("gcs"):
        bits.append(f"the Ray cluster at {record['gcs']}")
    if record.get("job"):
        bits.append(f"job {record['job']}")
    if record.get("host"):
        bits.append(f"controller on host {record['host']}, pid {record.get('pid')}")
    since = f", holding it since {_when(record.get('started_at'))}" if record.get("started_at") is not None else ""
    return (", ".join(bits) or "an unnamed holder") + since


def _read(storage: Storage) -> tuple[bytes | None, dict | None]:
    """The lease file's bytes and record in the run directory ``storage`` ((None, None) when
    there is none; a record of None for a file that is no JSON object). StorageError when
    storage does not answer."""
    try:
        data = storage.read_bytes(LEASE_FILE, max_size=MAX_LEASE_BYTES)
    except FileNotFoundError:
        return None, None
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return data, None
    return data, record if isinstance(record, dict) else None


def read_lease(storage: Storage) -> dict | None:
    """The lease in the run directory ``storage`` as its holder wrote it, None when there is
    none, ``{}`` for a file that is no JSON object. StorageError when storage does not answer."""
    data, record = _read(storage)
    return None if data is None else record or {}


class RunLease:
    """The lease of one run's storage (module docstring). ``storage`` is the run's directory."""

    RENEW_S = 5.0
    TTL_S = 30.0
    STALE_AFTER_S = 600.0

    def __init__(self, storage: Storage, owner: dict, *, renew_s: float | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = _since_boot,
                 sleep: Callable[[float], None] = time.sleep):
        self.storage = storage
        self.renew_s = self.RENEW_S if renew_s is None else renew_s
        self.ttl_s = self.TTL_S if ttl_s is None else ttl_s
        self._clock, self._monotonic, self._sleep = clock, monotonic, sleep
        self._renewed: float | None = None  # ``monotonic`` when the newest write that landed began
        now = clock()
        self.record = {"owner": uuid.uuid4().hex, "started_at": now, "renewed_at": now, "count": 0,
                       "renew_s": self.renew_s, "ttl_s": self.ttl_s, **owner}
        self.held = False
        self.lost: str | None = None  # why, once another owner's lease was found at a renewal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: renew now (``current`` found the last renewal old)
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None  # monotonic, the first renewal of an outage that failed

    @classmethod
    def for_this_process(cls, storage: Storage, run_name: str, **kwargs) -> "RunLease":
        """A lease whose holder is this process, on the Ray cluster it is connected to."""
        import ray

        owner: dict[str, Any] = {"run": run_name, "host": socket.gethostname(), "pid": os.getpid()}
        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            # get_session_name is Ray's since 2.53 or so; without it no lease is taken for this
            # cluster's (each is watched), which costs a takeover ttl_s, never a live run.
            session = getattr(ctx, "get_session_name", None)
            owner.update(cluster=session() if session is not None else None, gcs=ctx.gcs_address,
                         job=ctx.get_job_id())
        return cls(storage, owner, **kwargs)

    @property
    def where(self) -> str:
        return self.storage.describe(LEASE_FILE)

    # ---- reading and writing the file -------------------------------------------------------
    def _read(self) -> tuple[bytes | None, dict | None]:
        return _read(self.storage)

    def _write(self) -> None:
        started = self._monotonic()
        self.record["renewed_at"] = self._clock()
        self.record["count"] += 1
        self.storage.write_bytes(LEASE_FILE, json.dumps(self.record, sort_keys=True).encode())
        self._renewed = started  # from when the write began: a watcher may have read just before it landed

    def current(self) -> bool:
        """Whether no other run can have taken the lease over yet: held, and the newest renewal
        began less than ``ttl_s - renew_s`` ago. Why that holds: a watcher takes over only after
        ``ttl_s`` of unchanged reads, and a watcher whose first read saw this renewal's bytes
        read them after the write began; so no takeover comes before ``ttl_s`` from then, and
        ``renew_s`` is the margin for the write a caller makes next. A holder cut off from storage
        (or asleep) for longer may have lost the lease without knowing: its commits and deletes
        wait (the committer's ``gate``) until a renewal says whether it still holds it. A False
        answer asks for that renewal now."""
        renewed = self._renewed
        if self.held and self.lost is None and renewed is not None \
                and self._monotonic() - renewed < self.ttl_s - self.renew_s:
            return True
        self._wake.set()
        return False

    def _mine(self, record: dict | None) -> bool:
        return isinstance(record, dict) and record.get("owner") == self.record["owner"]

    # ---- taking it --------------------------------------------------------------------------
    def acquire(self, on_watch: Callable[[str], None] | None = None) -> str | None:
        """Hold the lease, or raise ``LeaseHeld`` when another live run holds it. Returns what was
        taken over (a sentence for the event log), None when nothing was. ``on_watch(message)``
        before another run's lease is watched (up to ``ttl_s``). ``StorageError`` when storage
        does not answer: the caller decides whether to wait for it."""
        data, record = self._read()
        took = None
        if data is not None and not self._mine(record):
            took = self._take_over(data, record, on_watch)
        self._write()
        # Read back: a run that wrote in the same moment may have written after this one. Its
        # lease then stands, and this run is the one refused. (One whose write lands after this
        # read is found at this run's first renewal: see the module docstring.)
        _, back = self._read()
        if not self._mine(back):
            raise self._held_error(back, "wrote its lease in the same moment as this run")
        with self._lock:
            self.held = True
        return took

    def _take_over(self, data: bytes, record: dict | None, on_watch: Callable[[str], None] | None = None) -> str:
        """Decide about another holder's lease: a sentence when it is taken over, ``LeaseHeld``
        when its holder is alive."""
        holder = describe_holder(record)
        if isinstance(record, dict) and self.record.get("cluster") and record.get("cluster") == self.record["cluster"]:
            return (f"took over the lease of a run of this name that ended on this Ray cluster without releasing it "
                    f"({holder})")
        # Watched: a live holder rewrites it every renew_s. For ttl_s, or, when its time says it
        # was last renewed long ago, for two of its renewals and a margin: a clock that far off
        # is rare, but a live holder is never taken over without one look at it.
        renewed = record.get("renewed_at") if isinstance(record, dict) else None
        watch_s = self.ttl_s
        age = self._clock() - renewed if isinstance(renewed, (int, float)) else None
        if age is not None and age > self.STALE_AFTER_S:
            theirs = record.get("renew_s")
            theirs = float(theirs) if isinstance(theirs, (int, float)) and 0 < theirs < self.ttl_s else self.renew_s
            watch_s = min(self.ttl_s, 2 * theirs + 2.0)
        if on_watch is not None:
            on_watch(f"found the lease of another run of this name at {self.where} ({holder}); watching it for up to "
                     f"{watch_s:g} s: renewed, that run is alive and this one is refused; not renewed, it is taken over")
        deadline = self._monotonic() + watch_s
        while self._monotonic() < deadline:
            self._sleep(min(max(0.1, self.renew_s / 2), max(0.0, deadline - self._monotonic())))
            now_data, now_record = self._read()
            if now_data is None:
                return f"the lease of {holder} was released while this run waited"
            if now_data != data:
                raise self._held_error(now_record, f"renewed its lease within the {self.ttl_s:g} s this run watched it")
        if watch_s < self.ttl_s:
            return f"took over a lease last renewed {age:.0f} s ago and not since ({holder})"
        return f"took over a lease not renewed for {self.ttl_s:g} s ({holder})"

    def _held_error(self, record: dict | None, how: str) -> LeaseHeld:
        run = self.record.get("run")
        return LeaseHeld(
            f"RunConfig.storage holds a live run named {run!r} that another driver trains: {describe_holder(record)} "
            f"{how} ({self.where}). Two drivers in one run directory delete and overwrite each other's checkpoints. "
            f"Stop that run, or choose another RunConfig.name or RunConfig.storage. (A lease whose run died "
            f"without releasing it is taken over once it has not changed for {self.ttl_s:g} s.)")

    # ---- keeping it -------------------------------------------------------------------------
    def renew(self) -> bool:
        """One renewal: read, then write if the lease is still this run's (or is gone: written
        again). False once it is lost (``lost`` says to whom). Raises StorageError when storage
        does not answer."""
        if self.lost is not None:
            return False
        data, record = self._read()
        if data is not None and not self._mine(record):
            with self._lock:
                self.held = False
                self.lost = (f"another driver took over this run's storage: {describe_holder(record)} holds the lease "
                             f"at {self.where} now")
            return False
        self._write()
        with self._lock:
            self.held = True
        return True

    def start_renewing(self, on_lost: Callable[[str], None], on_event: Callable[[str, str], None] | None = None
                       ) -> None:
        """Renew every ``renew_s`` on a thread of its own until ``stop``. ``on_lost(why)`` once the
        lease is lost; ``on_event(kind, message)`` when storage stops and starts answering the
        renewals (kinds ``lease_renewal_failed`` and ``lease_renewed``)."""
        def loop() -> None:
            while True:
                self._wake.wait(self.renew_s)
                self._wake.clear()
                if self._stop.is_set():
                    return
                try:
                    if not self.renew():
                        on_lost(self.lost or "the lease was lost")
                        return
                except StorageError as exc:
                    if self._failing_since is None:
                        self._failing_since = self._monotonic()
                        logger.warning("could not renew the run's lease at %s (retried every %g s): %s", self.where,
                                       self.renew_s, exc)
                        if on_event is not None:
                            on_event("lease_renewal_failed", f"could not renew the run's lease ({exc}); another run "
                                     f"may take it over after {self.ttl_s:g} s without renewals, and this run then "
                                     "stops at its next renewal")
                    continue
                except Exception:  # noqa: BLE001 - a bug here must not end the renewals silently
                    logger.exception("the run's lease renewal failed")
                    continue
                if self._failing_since is not None:
                    gap = self._monotonic() - self._failing_since
                    self._failing_since = None
                    if on_event is not None:
                        on_event("lease_renewed", f"the run's lease is renewed again, after {gap:.0f} s of failures")

        self._thread = threading.Thread(target=loop, name="elastic-lease", daemon=True)
        self._thread.start()

    RELEASE_WAIT_S = 2.0  # how long ``release`` waits for a renewal under way

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop renewing; True once no renewal is under way (waited for up to ``timeout_s``,
        None: as long as storage's own retries take)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout=timeout_s)
        return not thread.is_alive()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this run's: one try each, so a run's
        end in an outage is not held up (a stop's ``stop_timeout_s`` is counting). Never raises:
        a lease left behind is taken over by the next run (at once on this Ray cluster, after
        ``ttl_s`` elsewhere). Not deleted while a renewal is still under way, which could write
        it again after the delete, for no one to renew."""
        stopped = self.stop(self.RELEASE_WAIT_S)
        if not self.held or not stopped:
            return
        once = Storage(self.storage.url, self.storage.storage_options, retry=RetryPolicy(attempts=1))
        try:
            _, record = _read(once)
            if self._mine(record):
                once.delete(LEASE_FILE)
        except Exception as exc:  # noqa: BLE001 - the run's end stands
            logger.warning("could not release the run's lease at %s: %s", self.where, exc)
        with self._lock:
            self.held = False
