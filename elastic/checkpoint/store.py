"""The on-storage checkpoint layout of one run: per-rank shard files, a manifest written last, and cleanup.

A step is committed iff ``step-NNNNNNNNN/manifest.json`` exists and its self-checksum matches; it is
valid iff, in addition, every file it lists has the recorded size and sha256. Nothing depends on a
rename: object stores have none, and there the manifest is the commit marker. On local files each
file is still written to a temporary name and renamed over (``storage._write_local``), so that a
reader (a live ``elastic checkpoints``, a resume) never meets a half-written manifest or shard.

Each writing rank writes one safetensors file a step: its share of the tensors, with its JSON meta
(RNG state; with shard 0 the skeleton of the non-tensor state) in the header's ``__metadata__``.
Version 1 wrote that meta as a second file per rank (``meta-rN.json``): one more write, checksum,
fsync and, on S3, PUT per rank per step. Version 3: a rank whose share is empty (a small state is
spread over fewer ranks, ``CheckpointConfig.min_shard_bytes``) writes no file, and the manifest
carries its RNG state. Version 1 and 2 steps still load.

Why sha256 for the files, not a cheaper CRC-32: a format with CRC-32 was built and measured. It
hashes 1.6 MB in 0.41 ms against sha256's 0.99 ms (SHA-NI), but on the checkpoint benchmark (4
ranks on 2 cores, a checkpoint every step, file://) five alternating pairs gave mean steps of
24.7, 22.8, 23.4, 22.8 and 22.3 ms with sha256 against 23.0, 21.5, 23.3, 23.1 and 23.5 ms with
CRC-32: 23.2 against 22.9 ms on average, within this machine's run-to-run noise. With no gain
to show, the format (and what older readers accept) stays as it is.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    import torch

from elastic.checkpoint.codec import (
    RawRng,
    canonical_json,
    decode_metadata,
    decode_tensors,
    encode_tensor_buffers,
    encoded_rng,
    flatten_state,
    rank_share,
    sha256,
    skeleton_tensor_names,
    tensor_nbytes,
    unflatten_state,
)
from elastic.checkpoint.compat import saved_state_problem, shown
from elastic.checkpoint.storage import (FileRefused, RetryPolicy, Storage, StorageError, StorageUnavailable,
                                        resolve_url)
from elastic.config import STEP_DIR_NAME, ConfigError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "elastic-checkpoint"
# 5: a Counter in the state is marked as one in the skeleton (``__counter__``, codec.py); a
# reader of 3 took the marker for corruption and skipped every such step, and a step of 3 holds
# its Counters as dicts (``_upgraded``). 4 is not written: the reverted CRC-32 format (f8b14f0)
# used it, and its readers would check these shards as CRC-32.
VERSION = 5
_READS = frozenset({1, 2, 3, VERSION})
_REVERTED = 4


def _reads_text() -> str:
    return ", ".join(map(str, sorted(_READS)))
_META_KEY = "elastic"  # the rank's JSON meta, under this key of the shard's safetensors __metadata__
# The most a manifest may hold. Nothing records its size, so without a bound a huge object (or,
# on local storage, a link to /dev/zero) named manifest.json was read whole, by every resume
# and cleanup pass. One is ~200 bytes a rank plus the meta and the RNG states of ranks with no
# file (a few KB each): far below this for any world size there is.
MAX_MANIFEST_BYTES = 64 << 20
# The largest file a manifest's record may name (1 TiB): a record's size is how much a read may
# ask for, and one of 2**63 bytes failed as OverflowError, one larger than memory as MemoryError.
MAX_FILE_BYTES = 1 << 40


class NewerCheckpoint(StorageError):
    """A step whose manifest checks out but was written by a newer elastic (a manifest version
    this code does not read). Not corrupt: never skipped as a corrupt step, nor swept as an
    uncommitted one. As a ``StorageError`` (a manifest this process cannot use) it is what
    ``committed_steps`` does with a refused manifest: raised on the newest step, so a downgraded
    run does not resume from an older one and train over it; skipped with a warning below it."""


class CorruptCheckpoint(RuntimeError):
    """A committed step whose manifest or files do not match what was recorded. Names the file."""

    def __init__(self, step: int, path: str, reason: str):
        super().__init__(f"checkpoint step {step} is corrupt: {path}: {reason}")
        self.step, self.path, self.reason = step, path, reason

    def __reduce__(self):
        # A rank finds it while restoring and the controller catches it, so it crosses pickled;
        # the default (the message as the only argument) does not fit __init__.
        return type(self), (self.step, self.path, self.reason)


@dataclass(frozen=True)
class FileEntry:
    """One written file, ``path`` relative to the run directory."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: "dict | FileEntry") -> "FileEntry":
        if isinstance(d, FileEntry):
            return d
        return cls(path=str(d["path"]), size=int(d["size"]), sha256=str(d["sha256"]))


@dataclass
class Snapshot:
    """What one rank writes for one step: its share of tensors (host copies), RNG, and on rank 0 the
    JSON skeleton of the whole state."""

    step: int
    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]
    skeleton: Any = None
    rng: RawRng | dict | None = None  # raw when read inside the step: the writer encodes it (``encoded_rng``)
    taken_at: float = field(default_factory=time.time)  # wall clock when the copies were made

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in self.tensors.values())

    @classmethod
    def of_state(cls, state: dict, step: int, rank: int, world_size: int, rng: RawRng | dict | None = None,
                 min_shard_bytes: int = 0, copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 every_n_steps: int = 1) -> Snapshot:
        """``rank``'s share of ``state`` (a ``get_state()``-shaped dict) at ``step``, and with the
        first share the state skeleton. ``copy`` makes the private copies a background write
        needs; without it the snapshot references ``state``'s tensors. ``every_n_steps``: the
        run's checkpoint schedule, which the writers' rotation follows (``rank_share``)."""
        tensors, skeleton = flatten_state(state)
        share, with_skeleton = rank_share(tensors, rank, world_size, min_shard_bytes, step, every_n_steps)
        return cls(step, rank, world_size, {n: copy(tensors[n]) if copy else tensors[n] for n in share},
                   skeleton if with_skeleton else None, rng)

    @property
    def writes_file(self) -> bool:
        """False for a rank with no share of this step: its RNG goes to the manifest instead."""
        return bool(self.tensors) or self.skeleton is not None


def with_age(part: dict, now: float | None = None) -> dict:
    """A rank's written part (``{"entries", "taken_at", ...}``) as it leaves the host that took
    its snapshot: with ``age_s``, how long ago that was, read on the clock that took it.

    Why: ``taken_at`` is that host's wall clock. The controller, on another host, measured a
    commit's persist time as its own clock minus ``taken_at``, which adds the offset between
    the two clocks (up to seconds with NTP, any amount without; a negative persist time when
    the worker's clock is ahead). A duration means the same on both hosts (``taken_at_here``)."""
    taken_at = part.get("taken_at")
    if taken_at is None:
        return part
    return {**part, "age_s": max(0.0, (time.time() if now is None else now) - float(taken_at))}


def with_ages(parts: dict) -> dict:
    """``{rank: part}`` as it leaves this host (``with_age``, one clock reading for all)."""
    now = time.time()
    return {rank: with_age(part, now) for rank, part in parts.items()}


def taken_at_here(part: dict) -> float | None:
    """When a part's snapshot was taken, on this host's clock: now minus the part's ``age_s``
    (``with_age``), so the message's way here counts as persisting, as it does; ``taken_at``
    itself for a part that carries no age (one that never left its host)."""
    if part.get("age_s") is not None:
        return time.time() - float(part["age_s"])
    taken_at = part.get("taken_at")
    return None if taken_at is None else float(taken_at)


@dataclass
class StepInfo:
    """One step directory, for listings (``elastic checkpoints URL``).

    ``status``: "valid" (manifest and every file check out), "committed" (manifest checks out, files
    not verified), "corrupt" (manifest or a file does not match), "partial" (no manifest: torn write
    or still being written) or "unreadable" (storage refused to hand over its listing, manifest or a
    file, say an object archived to Glacier or an AccessDenied on one key; ``problem`` says which).
    """

    step: int
    status: str
    size_bytes: int
    num_files: int
    committed_at: float | None = None
    world_size: int | None = None
    problem: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CleanupReport:
    """Steps removed by retention or GC, and the ones whose delete failed (retried on the next call)."""

    deleted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # the listing itself failed; nothing was decided
    fenced: bool = False  # stopped by a fence (``CheckpointStore.fence``): the next pass decides again


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory's name, or None for any other name. Only the name
    ``step_dir`` gives counts: ``step-0000000005`` beside ``step-000000005`` named step 5
    twice, so retention's "newest keep_last" counted it twice and deleted one step too many.
    Parsed with ``STEP_DIR_NAME`` (elastic/config.py, which refuses a run of such a name): ASCII
    digits only (``\\d`` is any Unicode digit), at most 18 of them (a step below 10**18; an int()
    of thousands of digits raises), matched whole (``$`` passes a trailing newline)."""
    m = STEP_DIR_NAME.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name else None


def is_milestone(keep_every: int, step: int) -> bool:
    """Whether retention keeps ``step`` for good (``CheckpointConfig.keep_every``). Its snapshot is
    never replaced by a newer one on its way to storage, in a rank's writer, in its node agent's or
    in the committer: replaced, the step was never whole, never committed, and the milestone the
    user asked for never existed. Only the newest snapshot waits otherwise."""
    return keep_every > 0 and step % keep_every == 0


def shard_name(step: int, rank: int, world_size: int) -> str:
    return f"{step_dir(step)}/shard-r{rank}-of-{world_size}.safetensors"


def rank_meta(step: int, rank: int, world_size: int, tensor_names: Iterable[str], rng: dict | None,
              skeleton: Any = None) -> dict:
    """The JSON a rank's shard carries in its header: what it is, its tensors, its RNG (when
    given; the node agent adds it later) and, with the first share, the skeleton of the
    non-tensor state."""
    meta: dict[str, Any] = {
        "format": FORMAT + "-rank-meta",
        "version": VERSION,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "tensors": sorted(tensor_names),
    }
    if rng is not None:
        meta["rng"] = rng
    if skeleton is not None:
        meta["state"] = skeleton
    return meta


def shard_metadata(meta: dict | bytes) -> dict[str, str]:
    """A rank's meta (a dict, or its ``canonical_json``) as a shard header's ``__metadata__``."""
    return {_META_KEY: (meta if isinstance(meta, bytes) else canonical_json(meta)).decode()}


def meta_name(step: int, rank: int) -> str:
    """Version 1 only: the rank's meta as a file of its own."""
    return f"{step_dir(step)}/meta-r{rank}.json"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# str(rank), as ``commit`` writes the keys of "rng": ASCII digits, at most 9 (a rank below 10**9,
# which int() turns into a number without fail; thousands of digits made it raise ValueError).
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,8}", re.ASCII)
# The names of the files a writer makes in a step's directory: a rank's shard (``shard_name``)
# and, in version 1, its meta (``meta_name``). Nothing else, and no subdirectory.
_FILE_NAME = re.compile(r"shard-r(?:0|[1-9][0-9]{0,8})-of-[1-9][0-9]{0,8}\.safetensors"
                        r"|meta-r(?:0|[1-9][0-9]{0,8})\.json", re.ASCII)


def _path_problem(path: Any, step: int) -> str | None:
    """Why ``path`` is not the name of a file a writer makes inside ``step``'s directory, or
    None. A ``..`` (or a backslash, which some filesystems take for a separator) would let a
    manifest vouch for, and ``verify`` read, a file outside the step, even outside the run;
    and a name no writer gives (a NUL in it, a component too long, a subdirectory) failed its
    read with a permanent storage error, which ended the resume instead of falling back."""
    prefix = step_dir(step) + "/"
    if not isinstance(path, str) or not path.startswith(prefix) or not _FILE_NAME.fullmatch(path[len(prefix):]):
        return (f"path {shown(path)} is not the name of a file a writer makes inside {prefix} "
                "(shard-rN-of-M.safetensors, meta-rN.json)")
    return None


def _record_problem(record: Any) -> str | None:
    """Why a manifest's file record (``FileEntry.to_dict``) does not parse, or None; its path aside."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not an object"
    missing = [key for key in ("path", "size", "sha256") if key not in record]
    if missing:
        return f"no {missing[0]!r}"
    if not _is_int(record["size"]) or not 0 <= record["size"] <= MAX_FILE_BYTES:
        return f"size {shown(record['size'])} is not a byte count up to {MAX_FILE_BYTES}"
    if not isinstance(record["sha256"], str):
        return f"sha256 {shown(record['sha256'])} is not a hex digest"
    return None


def _as_read(meta: dict, step: int) -> dict:
    """``meta`` as a reader of the manifest gets it back: through JSON once. Why: the checksum is
    taken over the body as built, and a key that is not a string (an int, say) is written as
    one, and sorted otherwise once read ({2, 10} against {"10", "2"}); every such step's
    checksum then failed, and resume found no committed step."""
    try:
        return json.loads(canonical_json(dict(meta)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta for step {step} must be plain JSON data: {exc}") from None


def _upgraded(state: dict, version: int) -> dict:
    """A state read from a step of an older version, as this version writes it. Before 5 a
    Counter was stored as a dict: the LR scheduler's milestones (MultiStepLR, alone or inside
    SequentialLR or ChainedScheduler) come back a Counter, or a schedule handed over to
    MultiStepLR after the resume raised AttributeError (``.elements()``) at that step. Other
    Counters of the user's own cannot be told from dicts; none is in torch's state dicts."""
    if version >= 5:
        return state
    pending = [state.get("scheduler")]
    while pending:
        sched = pending.pop()
        if not isinstance(sched, dict):
            continue
        if type(sched.get("milestones")) is dict:
            sched["milestones"] = Counter(sched["milestones"])
        inner = sched.get("_schedulers")
        if inner is not None and not isinstance(inner, list):
            # Bytes that check out, not written by this code (a step's checks cover its bytes,
            # not who wrote them): skipped as corrupt by the caller, where it escaped as a
            # TypeError and failed the resume instead of falling back to an older step.
            raise ValueError(f"the LR scheduler's '_schedulers' is a {type(inner).__name__}, not a list")
        pending.extend(inner or [])
    return state


def _manifest_problem(manifest: dict, step: int) -> str | None:
    """Why ``manifest`` (parsed, or the body ``commit`` is about to write) is not a manifest of
    ``step`` that the readers can use, or None.

    Its checksum only says the bytes are the ones written; this says they are what ``commit``
    writes, in every version it reads (``_READS``): a manifest that checks out but lacks a field
    would fail later, in ``read_state``, with a KeyError rather than as a corrupt step that
    resuming skips. ``commit`` checks its own manifest with it, so what it writes always loads."""
    if manifest.get("format") != FORMAT or not _is_int(manifest.get("step")) or manifest["step"] != step:
        return f"manifest is for step {shown(manifest.get('step'))}, format {shown(manifest.get('format'))}"
    version, world_size = manifest.get("version"), manifest.get("world_size")
    if not _is_int(version) or version not in _READS:
        return f"manifest version {shown(version)} is not one this code reads ({_reads_text()})"
    if not _is_int(world_size) or world_size < 1:
        return f"manifest's world_size {shown(world_size)} is not a positive integer"
    created_at = manifest.get("created_at")
    if isinstance(created_at, bool) or not isinstance(created_at, (int, float)):
        return f"manifest's created_at {shown(created_at)} is not a time"
    if not isinstance(manifest.get("meta"), dict):
        return f"manifest's meta is a {type(manifest.get('meta')).__name__}, not an object"
    rng = manifest.get("rng", {})
    if not isinstance(rng, dict) or not all(
            isinstance(rank, str) and _RANK_KEY.fullmatch(rank) and int(rank) < world_size
            and (state is None or isinstance(state, dict))
            for rank, state in rng.items()):
        return f"manifest's rng is not an object of ranks below {world_size} and their RNG states"
    files = manifest.get("files")
    if not isinstance(files, list):
        return f"manifest's files are a {type(files).__name__}, not a list of file records"
    if not files:
        return "manifest lists no files"
    for i, record in enumerate(files):
        problem = _record_problem(record)
        if problem:
            return f"manifest's file records do not parse (record {i}: {problem})"
        problem = _path_problem(record["path"], step)
        if problem:
            return f"manifest's file record {i}: {problem}"
    return None


def _state_problem(state: dict) -> str | None:
    """Why ``state`` (a whole training state, its checksums matched) is not one the ranks can
    load, or None. Its bytes are the ones written, but not necessarily by this code: an
    optimizer whose ``param_groups`` is a dict, or a ``completed_step`` that is not a number,
    raised a TypeError or KeyError in the comparison with the live state (``compat``) or in
    the rank's ``set_state``, which failed the run instead of falling back to an older step."""
    problem = saved_state_problem(state)
    if problem:
        return problem
    done = state.get("completed_step")
    if not _is_int(done) or done < 0:
        return f"the state's completed_step {shown(done)} is not a step number"
    return None


def _meta_problem(meta: dict, keys: Iterable[str]) -> str | None:
    """Why a step's meta (the manifest's, parsed) lacks what a resume reads, or None: each of
    ``keys``, and a well-formed ``data_position`` when it has one (``DataPosition.from_dict``'s
    fields), which the controller read with int() and a KeyError or TypeError ended the run."""
    for key in keys:
        if key not in meta:
            return f"the manifest's meta has no {key!r}"
    if "data_position" not in meta:
        return None
    position = meta["data_position"]
    requeued = position.get("requeued", []) if isinstance(position, dict) else None
    if not (isinstance(position, dict) and _is_int(position.get("epoch")) and _is_int(position.get("cursor"))
            and isinstance(requeued, list) and all(_is_int(i) for i in requeued)):
        return f"the manifest's data_position {shown(position)} is not a data position (epoch, cursor, requeued)"
    return None


def join_url(url: str, name: str) -> str:
    """``<url>/<name>`` as a string; never through pathlib, which would mangle ``s3://``."""
    return url + name if url.endswith("/") else f"{url}/{name}"



def unreadable_newer(exc: StorageError, why: str = "it is newer than every readable committed step") -> StorageError:
    """The error of a resume that would go back below a step whose manifest cannot be read here
    (``exc``: refused by storage, or written by a newer elastic): resuming from an older step
    would train over one that may well be whole. ``why`` it would go back below it."""
    return StorageError(f"{exc}; {why}, so the run cannot tell where to resume: make it readable here (its read "
                        "access, or the elastic that wrote it), or remove the step")


class CheckpointStore:
    """Checkpoints of one run under ``<url>/<run_name>``."""

    def __init__(self, url: str, run_name: str, storage_options: dict | None = None,
                 retry: RetryPolicy | None = None):
        # A relative plain path is made absolute here, in the process that configures the run, so
        # workers (each with its own cwd) that get ``store.url`` write to the same place.
        if not isinstance(url, str) or not url:
            raise ConfigError(f"RunConfig.storage must be a non-empty string URL or path, got {url!r}.")
        self.url = resolve_url(url)
        self.run_name = run_name
        self.storage = Storage(join_url(self.url, run_name), storage_options, retry=retry)
        # Failed deletes, retried by later retention passes: step -> (failures, not before, monotonic).
        self._retry_deletes: dict[int, tuple[int, float]] = {}
        # The delete fence (``fence``): a cleanup pass carries the epoch it began in, and none of
        # its deletes starts once a fence has moved the epoch on; ``_deleting`` is the delete
        # call under way, which ``fence`` waits for.
        self._delete_cv = threading.Condition()
        self._epoch = 0
        self._deleting: frozenset[int] = frozenset()
        self._delete_warned_at = float("-inf")
        # Deletes storage refused one after another (``_note_refusal``), and when the hold they
        # put on every delete ends (monotonic).
        self._refusals = 0
        self._refused_until = 0.0

    def __getstate__(self) -> dict:
        # Sent to the controller actor: the delete fence's condition stays here (a new one there).
        state = self.__dict__.copy()
        del state["_delete_cv"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._delete_cv = threading.Condition()

    @property
    def storage_options(self) -> dict:
        """The options to build the same store elsewhere (e.g. on a worker). Holds credentials: never log it."""
        return dict(self.storage.storage_options)

    @property
    def location(self) -> str:
        """The run directory with credentials removed; safe to log and show."""
        return self.storage.location

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r})"

    def validate(self) -> None:
        """Raise ConfigError now if the storage cannot work (scheme, credentials, bucket, write access)."""
        self.storage.validate()

    def warm_up(self, check: bool = False) -> None:
        """Open the storage client now, before training, with one cheap request. Why: an S3
        client (s3fs/aiobotocore) sets itself up on its first request, 0.43 s for the first
        0.8 MB PUT against moto on loopback where the next ones took 0.016 s, and in a
        writer's first checkpoint that delay is lag. A failure here is only logged: the writes
        retry and report an outage on their own.

        ``check``: at a run's start, the request is ``Storage.check_here``'s probe, and a
        storage that refuses this process (credentials or s3fs missing on this node, no write
        permission) raises ConfigError; an outage is still only logged."""
        if check:
            self.storage.check_here()
            return
        try:
            self.storage.exists("", retry=RetryPolicy(attempts=1))
        except Exception as exc:  # noqa: BLE001 - storage may be down now; training must still start
            logger.warning("checkpoint storage %s did not answer a warm-up request: %s", self.location, exc)

    # ---- writing ----------------------------------------------------------------------------
    def write_rank_files(self, step: int, rank: int, world_size: int, state: dict, rng: dict | None = None,
                         min_shard_bytes: int = 0) -> list[FileEntry]:
        """Write this rank's share of ``state`` (a ``get_state()`` dict) and its RNG; blocking."""
        return self.write_snapshot(Snapshot.of_state(state, step, rank, world_size, rng, min_shard_bytes))

    def write_snapshot(self, snap: Snapshot) -> list[FileEntry]:
        """Write one rank's shard, its meta in the header; returns its FileEntry record. A rank
        with no share (no tensors, not the skeleton) writes nothing and returns no record: its RNG
        state goes to the manifest (``commit(rng=...)``)."""
        if not 0 <= snap.rank < snap.world_size:
            raise ValueError(f"rank {snap.rank} is outside world_size {snap.world_size}")
        if not snap.writes_file:
            return []
        meta = rank_meta(snap.step, snap.rank, snap.world_size, snap.tensors, encoded_rng(snap.rng), snap.skeleton)
        return [self.write_shard(snap.step, snap.rank, snap.world_size,
                                 encode_tensor_buffers(snap.tensors, shard_metadata(meta)))]

    def write_shard(self, step: int, rank: int, world_size: int, buffers: list) -> FileEntry:
        """Write the safetensors ``buffers`` (header first) as ``rank``'s shard of ``step``;
        returns its record (size and sha256) for the manifest."""
        rel = shard_name(step, rank, world_size)
        self.storage.write_bytes(rel, buffers)
        return FileEntry(rel, sum(memoryview(b).nbytes for b in buffers), sha256(buffers))

    def commit(self, step: int, entries: Iterable[FileEntry | dict], world_size: int,
               meta: dict | None = None, rng: dict[int, dict | None] | None = None) -> dict:
        """Write the manifest: the step becomes committed the moment this write completes.

        ``entries`` are every rank's FileEntry records; ``rng`` the RNG state of each rank that
        wrote no shard. Every rank must be accounted for by one or the other, and at least one
        shard (the one with the state skeleton) must be there. Every file must be inside the
        step's directory: a normalized relative path (``_path_problem``).
        """
        files = sorted((FileEntry.from_dict(e) for e in entries), key=lambda e: e.path)
        paths = {e.path for e in files}
        unwritten = {r: name for r in range(world_size) if (name := shard_name(step, r, world_size)) not in paths}
        rng = {int(r): state for r, state in (rng or {}).items() if int(r) in unwritten}
        missing = sorted(name for r, name in unwritten.items() if r not in rng)
        if missing or not paths:
            raise ValueError(f"cannot commit step {step}: missing files {missing}")
        body = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(step),
            "world_size": int(world_size),
            "created_at": time.time(),
            "files": [e.to_dict() for e in files],
            "meta": _as_read(meta or {}, step),
        }
        if rng:
            body["rng"] = {str(r): rng[r] for r in sorted(rng)}
        problem = _manifest_problem(body, step)
        if problem:
            raise ValueError(f"cannot commit step {step}: {problem}")
        try:
            checksum = sha256(canonical_json(body))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint meta for step {step} must be plain JSON data: {exc}") from None
        manifest = {**body, "checksum": checksum}
        # Compact, not indented: json's C encoder does not indent, and this runs every step
        # (``python -m json.tool`` prints it readably).
        data = canonical_json(manifest)
        self.storage.write_bytes(f"{step_dir(step)}/{MANIFEST}", data)
        return manifest

    # ---- reading ----------------------------------------------------------------------------
    def step_dirs(self) -> list[int]:
        """Every step that has a directory, committed or not, oldest first: each once, by the
        name ``step_dir`` gives it (``parse_step_dir``). On local storage a step "directory"
        that is a symbolic link is no step of this run (``Storage._refuse_links``): listed, its
        target's manifest vouched for it, and retention and GC deleted its target's files. A
        file of a step's name is none either: its manifest's read failed as no directory, a
        storage error that, for the newest step, stopped every resume and cleanup pass."""
        steps = {parse_step_dir(entry["name"]) for entry in self.storage.list_dir("", detail=True, skip_links=True)
                 if entry["type"] == "directory"}
        return sorted(step for step in steps if step is not None)

    def load_manifest(self, step: int) -> dict:
        """The parsed manifest of ``step``. FileNotFoundError if absent, CorruptCheckpoint if it does not check."""
        return self._load_manifest(step)[0]

    def _load_manifest(self, step: int) -> tuple[dict, list[FileEntry]]:
        """``load_manifest``, with its file records parsed (once, for the readers that verify them)."""
        rel = f"{step_dir(step)}/{MANIFEST}"
        where = self.storage.describe(rel)
        try:
            data = self.storage.read_bytes(rel, max_size=MAX_MANIFEST_BYTES)
        except FileRefused as exc:  # larger than any manifest, or (local) a FIFO, a device
            raise CorruptCheckpoint(step, where, f"manifest is not one a writer makes: {exc.reason}") from None
        try:
            manifest = json.loads(data)
            body = {k: v for k, v in manifest.items() if k != "checksum"}
            recorded = manifest["checksum"]
            actual = sha256(canonical_json(body))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, MemoryError) as exc:
            # RecursionError: a manifest nested thousands deep (b"[" * 5000) is JSON that does
            # not parse here; uncaught, it stopped every listing (resume, retention, GC, the CLI).
            raise CorruptCheckpoint(step, where, f"manifest does not parse ({type(exc).__name__}: "
                                                 f"{shown(str(exc))})") from None
        if recorded != actual:
            raise CorruptCheckpoint(step, where, "manifest checksum mismatch (truncated or edited)")
        version = manifest.get("version")
        if _is_int(version) and version > VERSION and manifest.get("format") == FORMAT:
            # Whole, and written by a newer elastic: taken for corrupt, resume skipped it (an older
            # step resumed, training over the newer one) and the sweep deleted it as uncommitted.
            raise NewerCheckpoint(f"checkpoint step {step} at {where} was written by a newer elastic (manifest "
                                  f"version {version}; this one reads {_reads_text()}): upgrade elastic to use it")
        if version == _REVERTED and manifest.get("format") == FORMAT:
            # Refused, not corrupt: as corrupt, the sweep deleted such steps below the newest
            # committed one, where an elastic of 3 had left them alone as newer than it reads.
            raise StorageError(f"checkpoint step {step} at {where} is of manifest version {version}, a format "
                               f"elastic gave up (CRC-32 file records), which this one does not read "
                               f"({_reads_text()}): the elastic that wrote it reads it")
        try:
            problem = _manifest_problem(manifest, step)  # e.g. a file record without its checksum vouches for nothing
            entries = [] if problem else [FileEntry.from_dict(record) for record in manifest["files"]]
        except Exception as exc:  # noqa: BLE001 - see below
            # Whatever a manifest that checks out holds, its checks end in a verdict: an
            # exception out of them (a ValueError from an int of 5,000 digits, once) passed
            # ``committed_steps`` by, failed every resume, and stopped every cleanup pass.
            problem = f"manifest's fields do not check ({type(exc).__name__}: {shown(str(exc))})"
        if problem:
            raise CorruptCheckpoint(step, where, problem)
        return manifest, entries

    def committed_steps(self, refused: list | None = None) -> list[int]:
        """Steps whose manifest exists and checks out (files not verified), oldest first.

        A manifest that storage refuses to hand over (a permanent error, not an outage: say an
        S3 lifecycle rule moved a step ``keep_every`` kept to Glacier) is left out with a warning
        naming it when a newer step's manifest is readable, as a corrupt one is: one archived
        step used to stop every resume. Refused on the newest step, it is raised: resuming from
        an older step would train over one that may well be whole. ``refused``, if given, gets
        the (step, StorageError) of each one left out: a resume whose newer steps' files turn
        out corrupt must not fall back below one of them either (``unreadable_newer``)."""
        refused = [] if refused is None else refused
        out = []
        for step in self.step_dirs():
            try:
                self.load_manifest(step)
            except FileNotFoundError:
                continue
            except CorruptCheckpoint as exc:
                logger.warning("%s", exc)
                continue
            except StorageUnavailable:
                raise
            except StorageError as exc:
                refused.append((step, exc))
                continue
            out.append(step)
        for step, exc in refused:
            if not out or step > out[-1]:
                raise unreadable_newer(exc)
            logger.warning("skipping checkpoint step %d: its manifest cannot be read (%s)", step, exc)
        return out

    def _read_verified(self, step: int, entry: FileEntry) -> bytes:
        where = self.storage.describe(entry.path)
        try:
            data = self.storage.read_bytes(entry.path, size=entry.size)
        except FileNotFoundError:
            raise CorruptCheckpoint(step, where, "file is missing") from None
        except FileRefused as exc:  # (local) a FIFO, a device or a directory under a shard's name
            raise CorruptCheckpoint(step, where, f"file is not one a writer makes: {exc.reason}") from None
        if len(data) > entry.size:  # read_bytes stops one byte past the record
            raise CorruptCheckpoint(step, where, f"larger than the recorded {entry.size} bytes (replaced or appended to?)")
        if len(data) != entry.size:
            raise CorruptCheckpoint(step, where, f"size {len(data)} != recorded {entry.size} (truncated?)")
        if sha256(data) != entry.sha256:
            raise CorruptCheckpoint(step, where, "sha256 mismatch (bytes changed)")
        return data

    def verify(self, step: int) -> dict:
        """Check the manifest and every file of ``step``; returns the manifest or raises CorruptCheckpoint."""
        manifest, entries = self._load_manifest(step)
        self._verify_files(step, entries)
        return manifest

    def _verify_files(self, step: int, entries: list[FileEntry]) -> None:
        """Every file of ``entries`` (``step``'s manifest records) at its recorded size and sha256,
        or CorruptCheckpoint naming the first that is not. One file in memory at a time: the bytes
        are dropped once hashed. (Hashing in chunks would need a streaming read, which ``Storage``
        does not offer: it reads whole files, with its retries and redaction around each.)"""
        for entry in entries:
            self._read_verified(step, entry)

    def _verify_for_listing(self, step: int) -> dict | None:
        """``verify(step)`` for a listing of a run that may be live: None when the step was deleted
        (or replaced) while its files were read, rather than a CorruptCheckpoint.

        Why this holds: a step is committed iff its manifest exists, and every delete takes the
        manifest away before the files (``_delete_step``, ``_delete_steps_in_bulk``). So a file
        found missing or wrong while the manifest that vouched for it is gone is a step retention
        or GC was deleting, not a corrupt one; a manifest that checks out and is still the same
        one after the failure (same checksum) means the failure is real. A manifest replaced in
        between (training went back and wrote the step again) is verified once more, from the
        new one; a second failure is reported as it is."""
        manifest, entries = self._load_manifest(step)
        retried = False
        while True:
            try:
                self._verify_files(step, entries)
                return manifest
            except CorruptCheckpoint as exc:
                problem = exc
            try:
                again, again_entries = self._load_manifest(step)
            except FileNotFoundError:
                logger.debug("checkpoint step %d was deleted while it was listed (%s)", step, problem)
                return None
            if retried or again["checksum"] == manifest["checksum"]:
                raise problem
            manifest, entries, retried = again, again_entries, True

    def latest_valid(self) -> int | None:
        """The newest committed step whose files all check out; corrupt steps are skipped with a warning."""
        for step in reversed(self.step_dirs()):
            try:
                self.verify(step)
            except FileNotFoundError:
                logger.debug("step %d has no manifest (uncommitted); ignoring it", step)
                continue
            except CorruptCheckpoint as exc:
                logger.warning("%s; falling back to an older step", exc)
                continue
            return step
        return None

    def read_state(self, step: int | None = None, meta_keys: Iterable[str] = ()) -> tuple[dict, dict]:
        """``(state, meta)`` of a committed step (default: the newest that reads), verifying checksums as it reads.

        ``state`` has the shape of ``TrainWorker.get_state()`` whatever world size wrote it:
        checked (``_state_problem``), as is the meta's ``data_position`` when it has one, and
        that it has each of ``meta_keys``; a step that fails is a CorruptCheckpoint.
        """
        if step is None:
            # The newest step that reads, as ``latest_valid`` chooses it, but each file read once:
            # verifying a step and then reading it fetched and hashed every file twice.
            for candidate in reversed(self.step_dirs()):
                try:
                    return self.read_state(candidate, meta_keys)
                except FileNotFoundError:
                    logger.debug("step %d has no manifest (uncommitted); ignoring it", candidate)
                except CorruptCheckpoint as exc:
                    logger.warning("%s; falling back to an older step", exc)
            raise FileNotFoundError(f"no valid checkpoint in {self.location}")
        try:
            manifest, entries = self._load_manifest(step)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint step {step} is not committed in {self.location}") from None
        tensors: dict[str, torch.Tensor] = {}
        skeleton = None
        world_size = int(manifest["world_size"])
        for entry in entries:
            data = self._read_verified(step, entry)
            where = self.storage.describe(entry.path)
            try:
                if entry.path.endswith(".safetensors"):
                    part = decode_tensors(data)
                    overlap = set(part) & set(tensors)
                    if overlap:
                        raise CorruptCheckpoint(step, where, f"tensors written twice: {shown(sorted(overlap)[:3])}")
                    tensors.update(part)
                if skeleton is None and (entry.path.endswith(".safetensors") or "/meta-r" in entry.path):
                    meta = self._decode_meta(entry.path, data)  # version 3: any rank's shard may hold it
                    if meta is not None and "state" in meta:
                        skeleton = meta["state"]
            except CorruptCheckpoint:
                raise
            except Exception as exc:  # noqa: BLE001 - any decode failure of checksummed bytes is corruption
                raise CorruptCheckpoint(step, where,
                                        f"cannot decode ({type(exc).__name__}: {shown(str(exc))})") from None
        if skeleton is None:
            raise CorruptCheckpoint(step, self.storage.describe(step_dir(step)),
                                    "no shard holds the state skeleton (the non-tensor state)")
        where = self.storage.describe(step_dir(step))
        try:
            needed = set(skeleton_tensor_names(skeleton))
        except Exception as exc:  # noqa: BLE001 - a skeleton that checks out and does not decode is corruption
            raise CorruptCheckpoint(step, where, f"the state skeleton does not decode ({type(exc).__name__}: "
                                                 f"{shown(str(exc))})") from None
        if needed != set(tensors):
            missing, extra = sorted(needed - set(tensors)), sorted(set(tensors) - needed)
            raise CorruptCheckpoint(step, where, f"shards of world size {world_size} do not match the state "
                                                 f"(missing {shown(missing[:3])}, unexpected {shown(extra[:3])})")
        try:
            state = unflatten_state(tensors, skeleton)
        except Exception as exc:  # noqa: BLE001 - as above: skipped for an older step, never raised raw
            raise CorruptCheckpoint(step, where, f"the state does not rebuild ({type(exc).__name__}: "
                                                 f"{shown(str(exc))})") from None
        if not isinstance(state, dict) or not all(isinstance(state.get(k, {}), dict) for k in ("model", "optimizer")):
            raise CorruptCheckpoint(step, where, "the state is not a training state (a dict, its model and "
                                                 "optimizer dicts)")
        try:
            state = _upgraded(state, int(manifest["version"]))
        except ValueError as exc:
            raise CorruptCheckpoint(step, where, f"the state does not upgrade from version {manifest['version']}: "
                                                 f"{exc}") from None
        meta = manifest.get("meta", {})
        problem = _state_problem(state) or _meta_problem(meta, meta_keys)
        if problem:
            raise CorruptCheckpoint(step, where, problem)
        return state, meta

    @staticmethod
    def _decode_meta(path: str, data: bytes) -> dict | None:
        """A rank's JSON meta: the shard's header (version 2) or its own file (version 1)."""
        if path.endswith(".safetensors"):
            text = decode_metadata(data).get(_META_KEY)
            return json.loads(text) if text is not None else None
        return json.loads(data)

    def read_rng(self, step: int, rank: int) -> dict | None:
        """The RNG state rank ``rank`` saved at ``step`` (verified against the manifest), or None."""
        manifest, entries = self._load_manifest(step)
        if str(rank) in manifest.get("rng", {}):  # a rank that wrote no shard (version 3)
            return manifest["rng"][str(rank)]
        files = {e.path: e for e in entries}
        for path in (meta_name(step, rank), shard_name(step, rank, int(manifest["world_size"]))):
            if path in files:
                data = self._read_verified(step, files[path])
                try:
                    meta = self._decode_meta(path, data)
                    return meta.get("rng") if meta is not None else None
                except Exception as exc:  # noqa: BLE001 - as read_state: checksummed bytes that do not decode
                    raise CorruptCheckpoint(step, self.storage.describe(path),
                                            f"cannot decode ({type(exc).__name__}: {shown(str(exc))})") from None
        return None

    # ---- cleanup ----------------------------------------------------------------------------
    # A delete that keeps failing (a bucket whose policy or object lock forbids deletes) is tried
    # again after 1, 2, 4 ... s, at most every DELETE_BACKOFF_MAX_S, not on every retention pass
    # (once a second while training runs): each pass used to retry every failed step and log a
    # warning for each, so 40 steps into such an outage a pass made ~40 requests and 40 log lines.
    DELETE_BACKOFF_MAX_S = 300.0

    def epoch(self) -> int:
        """The delete epoch a cleanup pass begins in (``fence``)."""
        with self._delete_cv:
            return self._epoch

    def fence(self, timeout_s: float) -> frozenset[int]:
        """No delete of a cleanup pass that began before this call starts after it, and the one
        under way (if any) is waited for, up to ``timeout_s``. Returns the steps of a delete
        still under way when the wait ran out (empty when none).

        Why: training that goes back to an earlier step (a rollback, a restart from a checkpoint)
        writes the later step numbers again. A pass that read the committed steps and the
        uncommitted directories before it would otherwise go on deleting by that old picture:
        a step the new timeline had just committed (retention), or the directory its ranks were
        writing (the sweep), which then committed a manifest naming deleted files. A pass's
        decisions are only as good as the epoch it began in; the next pass decides again."""
        with self._delete_cv:
            self._epoch += 1
            self._delete_cv.wait_for(lambda: not self._deleting, timeout=timeout_s)
            return self._deleting

    def wait_deletes(self, steps: Iterable[int], timeout_s: float | None = None) -> bool:
        """Wait until no delete of any of ``steps`` is under way; False if one still is after ``timeout_s``."""
        steps = set(steps)
        with self._delete_cv:
            return self._delete_cv.wait_for(lambda: not (self._deleting & steps), timeout=timeout_s)

    def missing_file(self, step: int, entries: Iterable[FileEntry]) -> str | None:
        """The first of ``entries`` (``step``'s files) not on storage at its recorded size, or None:
        one listing of the step's directory."""
        listing = {e["name"]: e.get("size") for e in self.storage.list_dir(step_dir(step), detail=True)}
        prefix = step_dir(step) + "/"
        for entry in entries:
            name = entry.path[len(prefix):] if entry.path.startswith(prefix) else entry.path
            present = self.storage.exists(entry.path) if "/" in name else listing.get(name) == entry.size
            if not present:
                return self.storage.describe(entry.path)
        return None

    def _delete_steps(self, steps: list[int], report: CleanupReport, delete: Callable[[], Any],
                      epoch: int | None = None) -> None:
        """Run ``delete`` (which removes ``steps``) and record the outcome: deleted, or failed and
        retried by a later retention pass (with backoff). Not run once a fence has passed ``epoch``
        (``report.fenced``). Never raises."""
        with self._delete_cv:
            if epoch is not None and epoch != self._epoch:
                report.fenced = True
                return
            self._deleting = frozenset(steps)
        try:
            delete()
        except (StorageError, OSError) as exc:
            # One failed delete (a transient remote error) must not stop training or later cleanup.
            now = time.monotonic()
            for step in steps:
                failures = self._retry_deletes.get(step, (0, 0.0))[0] + 1
                # The exponent capped before the power: 2.0 ** 1024 raises OverflowError, which
                # after ~1,000 failures of one step (GC every 10 s: ~3 h) stopped every later pass.
                backoff = min(self.DELETE_BACKOFF_MAX_S, 2.0 ** min(failures - 1, 30))
                self._retry_deletes[step] = (failures, now + backoff)
            report.failed.update({step: str(exc) for step in steps})
            self._note_refusal(exc, now)
            # One warning a minute at most (the event log has every failure): a bucket that
            # forbids deletes fails every step's.
            if now - self._delete_warned_at >= 60.0:
                self._delete_warned_at = now
                waiting = sum(1 for f, _ in self._retry_deletes.values() if f)
                logger.warning("could not delete checkpoint steps %s (%d step(s) now wait for a retry, with "
                               "backoff): %s", steps, waiting, exc)
            else:
                logger.debug("could not delete checkpoint steps %s: %s", steps, exc)
            return
        finally:
            with self._delete_cv:
                self._deleting = frozenset()
                self._delete_cv.notify_all()
        for step in steps:
            self._retry_deletes.pop(step, None)
        self._refusals = 0
        report.deleted.extend(steps)

    # Two deletes refused in a row (a StorageError that is not an outage: no delete permission, a
    # bucket policy) say the storage refuses deletes, not one object. Then no
    # delete is tried until a hold of 1, 2, 4 ... s (at most DELETE_BACKOFF_MAX_S) is over, and
    # then one: the step tried least often (``_probe_order``). Why: each step's own backoff alone
    # bounded the retries of one step, not their number; with every step refused, every step
    # past keep_last joined the list, and a pass tried each whose backoff was over, so the
    # requests (and the events) grew with the run: after 10 h at a step a second, ~120 deletes
    # a second. Why two in a row, not one: a refusal of one object (a legal hold on one step's
    # files) must not hold back the others: the next step's delete succeeds and ends the count,
    # and a probe asks about the step tried least often, which is not that one.
    def _note_refusal(self, exc: BaseException, now: float) -> None:
        if isinstance(exc, StorageUnavailable) or not isinstance(exc, StorageError):
            return  # an outage or a local error: each step's own backoff is enough
        self._refusals += 1
        if self._refusals >= 2:
            self._refused_until = now + min(self.DELETE_BACKOFF_MAX_S, 2.0 ** min(self._refusals - 2, 30))

    def _deletes_held(self, now: float) -> bool:
        """Storage refused deletes (``_note_refusal``) and the hold is not over: try none."""
        return self._refusals >= 2 and now < self._refused_until

    def _probe_order(self, step: int) -> tuple[int, int]:
        """The order steps are tried in after a hold: the one tried least often first (then the
        oldest), so a step refused for its own sake (a locked object) is not what every probe
        asks about."""
        return self._retry_deletes.get(step, (0, 0.0))[0], step

    def schedule_deletes(self, steps: list[int]) -> None:
        """Delete ``steps`` at the next retention pass (below the newest committed step only, as
        any step on the retry list)."""
        for step in steps:
            self._retry_deletes.setdefault(step, (0, 0.0))

    def forget_deletes_above(self, step: int | None) -> list[int]:
        """Training went back to ``step`` (None: the start): a failed delete of a later step must
        not be retried, since that step is about to be written again. Returns the steps
        forgotten: still on storage, for the caller to keep track of (the committer deletes
        them once passed again, or the run commits over them)."""
        dropped = sorted(s for s in self._retry_deletes if step is None or s > step)
        self._retry_deletes = {s: v for s, v in self._retry_deletes.items() if step is not None and s <= step}
        return dropped

    def delete_steps(self, steps: Iterable[int]) -> CleanupReport:
        """Delete ``steps`` now, outside retention, each as retention does (``_delete_step``:
        manifest first): for a caller that knows them unwanted (the committer at a run's end, the
        steps of a timeline it went back from). A failure is in the report, and later passes
        retry it as any. Never raises."""
        report = CleanupReport()
        for step in steps:
            self._delete_step(step, report)
        return report

    def _delete_step(self, step: int, report: CleanupReport, files: list[str] | None = None,
                     has_manifest: bool = True, epoch: int | None = None) -> None:
        """Manifest first: a step half-deleted by a failure is then merely uncommitted, never a
        committed step with missing files; GC or the next call finishes the job. ``files``: the
        step's files when the caller knows them (no listing needed). ``has_manifest=False``: the
        caller has just found none (GC), so there is no manifest to take away first (on S3, one
        request a step less)."""
        def delete() -> None:
            if has_manifest:
                self.storage.delete(f"{step_dir(step)}/{MANIFEST}")
            if not (files and self.storage.delete_files(files, step_dir(step))):
                self.storage.delete_tree(step_dir(step))

        self._delete_steps([step], report, delete, epoch)

    def apply_retention(self, keep_last: int, keep_every: int = 0,
                        committed: list[int] | None = None, files: dict[int, list[str]] | None = None,
                        epoch: int | None = None) -> CleanupReport:
        """Keep the newest ``keep_last`` committed steps, every step divisible by ``keep_every`` (if > 0),
        and always the newest committed step; delete the other committed steps. Never raises.

        ``committed``: the committed steps, oldest first, when the caller already knows them (the
        committer does: it wrote them), which saves listing storage and reading every manifest.
        ``files``: step -> its files, for the steps whose files the caller knows. ``epoch``: the
        delete epoch the caller's picture of storage is from (``fence``). A step whose delete
        failed waits out its backoff before it is tried again."""
        report = CleanupReport()
        try:
            committed = self.committed_steps() if committed is None else sorted(committed)
        except (StorageError, OSError) as exc:
            report.error = str(exc)
            logger.warning("retention skipped: cannot list %s: %s", self.location, exc)
            return report
        keep = set(committed[-max(1, keep_last):])
        if keep_every > 0:
            keep |= {s for s in committed if s % keep_every == 0}
        now = time.monotonic()
        doomed = (set(committed) - keep) | {s for s in self._retry_deletes if committed and s < committed[-1]}
        doomed = {s for s in doomed - keep if self._retry_deletes.get(s, (0, 0.0))[1] <= now}
        known = {s: (files or {}).get(s) for s in doomed}
        if doomed and self._refusals >= 2:  # storage refused deletes: none in the hold, then one probe
            if self._deletes_held(now):
                return report
            probe = min(doomed, key=self._probe_order)
            self._delete_step(probe, report, known[probe], epoch=epoch)
            if probe not in report.deleted:
                return report
            doomed.discard(probe)
        if self.storage.is_object_store and len(doomed) > 1 and all(known.values()):
            self._delete_steps_in_bulk(sorted(doomed), known, report, epoch)  # type: ignore[arg-type]
            return report
        for step in sorted(doomed):
            self._delete_step(step, report, known[step], epoch=epoch)
            if report.fenced or self._deletes_held(time.monotonic()):
                break
        return report

    def _delete_steps_in_bulk(self, steps: list[int], files: dict[int, list[str]], report: CleanupReport,
                              epoch: int | None = None) -> None:
        """Several steps whose files are known, on an object store: one bulk DELETE of their
        manifests, then one of their files, instead of two requests a step. Same order as
        ``_delete_step`` (manifests first), so a failure leaves steps uncommitted, never
        committed with missing files; a failed step is retried like a single one."""
        def delete() -> None:
            self.storage.delete_files([f"{step_dir(s)}/{MANIFEST}" for s in steps], "")
            self.storage.delete_files([f for s in steps for f in files[s]], "")

        self._delete_steps(steps, report, delete, epoch)

    def gc_uncommitted(self, older_than: int | None = None, keep: Iterable[int] = (),
                       epoch: int | None = None) -> CleanupReport:
        """Delete step directories without a valid manifest that are older than ``older_than`` (default:
        the newest committed step). Steps in ``keep`` (still being written) are left alone; the
        sweep stops at a fence that passed ``epoch`` (see ``fence``). Never raises."""
        report = CleanupReport()
        keep = set(keep)
        try:
            dirs = self.step_dirs()
            if older_than is None:
                committed = self.committed_steps()
                older_than = committed[-1] if committed else None
            if older_than is None:
                return report
            now = time.monotonic()
            if self._refusals >= 2:  # after a hold, the probe first
                dirs = sorted(dirs, key=self._probe_order)
            for step in dirs:
                if self._deletes_held(time.monotonic()):
                    break  # storage refuses deletes: nothing more until the hold is over
                if step >= older_than or step in keep:
                    continue
                if self._retry_deletes.get(step, (0, 0.0))[1] > now:
                    continue  # its delete failed: tried again after its backoff, as retention's are
                try:
                    self.load_manifest(step)
                    continue  # committed: retention's business, not GC's
                except FileNotFoundError:
                    has_manifest = False
                except CorruptCheckpoint:
                    has_manifest = True
                except StorageUnavailable:
                    raise
                except StorageError as exc:  # refused (an archived manifest): not known uncommitted
                    logger.debug("GC leaves step %d alone: its manifest cannot be read (%s)", step, exc)
                    continue
                logger.info("removing uncommitted checkpoint directory %s", self.storage.describe(step_dir(step)))
                self._delete_step(step, report, has_manifest=has_manifest, epoch=epoch)
                if report.fenced:
                    break
        except (StorageError, OSError) as exc:
            report.error = str(exc)
            logger.warning("GC of uncommitted steps in %s failed (will retry): %s", self.location, exc)
        return report

    def list_steps(self, verify: bool = True) -> list[StepInfo]:
        """Every step directory with its status, total size and commit time, oldest first.

        Made for listing a run that may be live (``elastic checkpoints``): a committed step that
        retention or GC deletes while it is being verified is left out (``_verify_for_listing``):
        it no longer exists, and it is not corrupt. A step storage refuses to hand over (a
        ``StorageError``: an archived manifest, an AccessDenied on one key) is listed as
        "unreadable" with the (redacted) error, as ``committed_steps`` skips such a step: one
        refused key used to end the whole listing. An outage (``StorageUnavailable``: the
        endpoint does not answer) still raises, since then every step would be unreadable."""
        out = []
        for step in self.step_dirs():
            info = self._step_info(step, verify)
            if info is not None:
                out.append(info)
        return out

    def _step_info(self, step: int, verify: bool) -> StepInfo | None:
        """``list_steps``'s row for ``step``; None when the step was deleted while it was read."""
        info = StepInfo(step=step, status="partial", size_bytes=0, num_files=0)
        try:
            listing = self.storage.list_dir(step_dir(step), detail=True)
            files = [e for e in listing if e["type"] != "directory"]
            info.size_bytes, info.num_files = sum(e["size"] for e in files), len(files)
            manifest = self._verify_for_listing(step) if verify else self.load_manifest(step)
        except FileNotFoundError:
            return info
        except CorruptCheckpoint as exc:
            info.status, info.problem = "corrupt", str(exc)
            return info
        except StorageUnavailable:
            raise
        except StorageError as exc:  # its message is redacted by Storage
            info.status, info.problem = "unreadable", str(exc)
            return info
        if manifest is None:
            return None
        info.status = "valid" if verify else "committed"
        info.committed_at = manifest.get("created_at")
        info.world_size = manifest.get("world_size")
        return info
