"""A manifest whose checksum matches is still checked for what ``commit`` writes: every field of
the right type, and every file inside its step's directory. One that is not is a corrupt step,
which resuming skips for the previous one (file://, plain path, memory://, S3 via moto)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from elastic.checkpoint import CorruptCheckpoint, StorageError
from elastic.checkpoint.codec import canonical_json, sha256
from elastic.checkpoint.store import MANIFEST, VERSION, CheckpointStore, FileEntry, shard_name, step_dir
from elastic.checkpoint.testing import TEST_SECRET
from test_checkpoint_store import (RUN, assert_same, backend, commit_tiny,  # noqa: F401 - backend: a fixture
                                   make_store, tiny_state)

ESCAPE = f"{step_dir(2)}/../../outside.bin"  # relative to the run directory: beside it


def rewrite_manifest(store: CheckpointStore, step: int, change) -> None:
    """``change`` the manifest's body in place and write it back with its checksum recomputed:
    a manifest that checks out as a whole."""
    rel = f"{step_dir(step)}/{MANIFEST}"
    body = {k: v for k, v in json.loads(store.storage.read_bytes(rel)).items() if k != "checksum"}
    change(body)
    store.storage.write_bytes(rel, canonical_json({**body, "checksum": sha256(canonical_json(body))}))


def without(key: str):
    return lambda body: body.pop(key)


def setting(key: str, value):
    return lambda body: body.__setitem__(key, value)


def size_as_text(body: dict) -> None:
    body["files"][0]["size"] = str(body["files"][0]["size"])  # the right size, as a string


def first_record(key: str | None, value):
    """Set ``key`` of the manifest's first file record to ``value`` (None: the record itself)."""
    def change(body: dict) -> None:
        if key is None:
            body["files"][0] = value
        else:
            body["files"][0][key] = value
    return change


# Each leaves the step's files as they are, so only the manifest's own fields can give it away.
@pytest.mark.parametrize("change, reason", [
    (without("world_size"), "world_size None is not a positive integer"),
    (setting("world_size", "1"), "world_size '1' is not a positive integer"),
    (setting("world_size", 0), "world_size 0 is not a positive integer"),
    (without("version"), "version None is not one this code reads"),
    (without("created_at"), "created_at None is not a time"),
    (without("meta"), "meta is a NoneType, not an object"),
    (setting("meta", ["data"]), "meta is a list, not an object"),
    (setting("rng", "0123"), "rng is not an object"),
    (setting("rng", [None]), "rng is not an object"),
    (setting("rng", {"7": {}}), "rng is not an object of ranks below 1"),
    (setting("rng", {"0": 5}), "rng is not an object"),
    (setting("files", {}), "files are a dict, not a list"),
    (setting("files", []), "lists no files"),
    (size_as_text, r"file records do not parse \(record 0: size '\d+' is not a byte count up to"),
    # another step's manifest, or another format's, checks out as a whole all the same
    (setting("step", 3), "manifest is for step 3, format 'elastic-checkpoint'"),
    (setting("format", "other"), "manifest is for step 2, format 'other'"),
    # bools are ints to Python: each of these refuses True by name
    (setting("version", True), r"manifest version True is not one this code reads \(1, 2, 3, 5\)"),
    (setting("world_size", True), "manifest's world_size True is not a positive integer"),
    (setting("created_at", True), "manifest's created_at True is not a time"),
    (first_record(None, "shard-r0-of-1.safetensors"), r"file records do not parse \(record 0: a str, not an object\)"),
    (first_record("sha256", 5), r"file records do not parse \(record 0: sha256 5 is not a hex digest\)"),
    (first_record("size", -1), r"file records do not parse \(record 0: size -1 is not a byte count up to 1099511627776\)"),
], ids=["no-world_size", "world_size-str", "world_size-0", "no-version", "no-created_at",
        "no-meta", "meta-list", "rng-str", "rng-list", "rng-rank-beyond-world", "rng-state-int", "files-dict",
        "files-empty", "size-str", "step-other", "format-other", "version-bool", "world_size-bool",
        "created_at-bool", "record-str", "sha256-int", "size-negative"])
def test_a_manifest_of_the_wrong_shape_is_corrupt_and_resume_falls_back(backend, caplog, change, reason):
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    rewrite_manifest(store, 2, change)
    with pytest.raises(CorruptCheckpoint, match=reason) as info:
        store.load_manifest(2)
    assert f"{step_dir(2)}/{MANIFEST}" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        assert store.latest_valid() == 1
        assert store.committed_steps() == [1]
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{step_dir(2)}/{MANIFEST}" in warnings and reason.split(" ")[0] in warnings
    assert TEST_SECRET not in warnings
    state, _ = store.read_state()  # a resume: the step before
    assert_same(state, tiny_state(1))
    assert {i.step: i.status for i in store.list_steps()} == {1: "valid", 2: "corrupt"}


def test_a_step_a_newer_elastic_wrote_is_neither_skipped_as_corrupt_nor_swept(backend):
    # Taken for corrupt, a downgraded run resumed from the step before and trained over it, and
    # once it had committed past it the sweep deleted it as uncommitted.
    from elastic.checkpoint import StorageError
    from elastic.checkpoint.store import NewerCheckpoint

    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    rewrite_manifest(store, 2, setting("version", VERSION + 1))
    with pytest.raises(NewerCheckpoint, match=rf"step 2 at .* was written by a newer elastic \(manifest version "
                                              rf"{VERSION + 1}; this one reads 1, 2, 3, {VERSION}\): upgrade elastic"):
        store.load_manifest(2)
    with pytest.raises(StorageError, match="newer than every readable committed step, so the run cannot tell where "
                                           "to resume"):
        store.committed_steps()  # the newest: no resume from step 1 over it
    commit_tiny(store, 3)
    assert store.committed_steps() == [1, 3]  # below a step this code reads: skipped, not an error
    assert store.gc_uncommitted().deleted == [] and store.step_dirs() == [1, 2, 3]
    # Listed as one this code cannot read, not as corrupt (`!= "valid"` let "corrupt" through).
    listed = {i.step: i for i in store.list_steps()}
    assert {step: i.status for step, i in listed.items()} == {1: "valid", 2: "unreadable", 3: "valid"}
    assert listed[2].problem is not None
    assert f"was written by a newer elastic (manifest version {VERSION + 1}; " in listed[2].problem


def test_a_step_of_version_3_resumes_a_schedule_that_hands_over_to_multisteplr(monkeypatch, tmp_path):
    # Version 3 stored a Counter (MultiStepLR's milestones) as a dict; read as written, a
    # SequentialLR resumed from it raised AttributeError (.elements()) at its hand-over.
    import collections

    from torch.optim import lr_scheduler as lr

    from elastic.checkpoint import codec

    def schedule():
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        return opt, lr.SequentialLR(opt, [lr.LinearLR(opt, 0.1, total_iters=3), lr.MultiStepLR(opt, [5, 8])], [3])

    opt, sched = schedule()
    opt.step()
    sched.step()
    store = CheckpointStore(str(tmp_path), RUN)
    with monkeypatch.context() as old_writer:
        old_writer.setattr(codec, "_COUNTER", "__dict__")  # what version 3 wrote for a Counter
        store.commit(1, store.write_rank_files(1, 0, 1, {**tiny_state(1), "scheduler": sched.state_dict()}), 1, {})
    rewrite_manifest(store, 1, setting("version", 3))
    state, _ = store.read_state(1)
    assert type(state["scheduler"]["_schedulers"][1]["milestones"]) is collections.Counter
    opt2, resumed = schedule()
    resumed.load_state_dict(state["scheduler"])
    for _ in range(12):  # past the hand-over at step 3 and both milestones
        opt2.step()
        resumed.step()
    assert resumed.get_last_lr() == pytest.approx([0.001])
    # A step this version writes says so: a reader of 3 would take its Counter marker for corruption.
    store.commit(2, store.write_rank_files(2, 0, 1, {**tiny_state(2), "scheduler": sched.state_dict()}), 1, {})
    assert store.load_manifest(2)["version"] == VERSION > 3


def test_a_version_3_step_whose_schedule_does_not_upgrade_is_skipped_as_corrupt(tmp_path, caplog):
    # Its bytes check out but this code did not write them: the upgrade of its scheduler raised
    # a TypeError outside every check, and the resume failed instead of falling back.
    store = CheckpointStore(str(tmp_path), RUN)
    commit_tiny(store, 1)
    state = {**tiny_state(2), "scheduler": {"milestones": {"5": 1}, "_schedulers": 5}}
    store.commit(2, store.write_rank_files(2, 0, 1, state), 1, {})
    rewrite_manifest(store, 2, setting("version", 3))
    with pytest.raises(CorruptCheckpoint, match="does not upgrade from version 3: the LR scheduler's '_schedulers' "
                                                "is a int, not a list"):
        store.read_state(2)
    with caplog.at_level(logging.WARNING):
        state, _ = store.read_state()
    assert state["completed_step"] == 1 and "falling back to an older step" in caplog.text


def test_version_4_the_reverted_crc32_format_is_refused_not_swept(backend):
    # Read as corrupt, the sweep deleted such a step once a newer one committed; the elastic that
    # wrote it (an elastic of 3 took it for newer) reads it.
    store = make_store(backend)
    for step in (1, 2, 3):
        commit_tiny(store, step)
    rewrite_manifest(store, 2, setting("version", 4))
    assert {i.step: i.status for i in store.list_steps()} == {1: "valid", 2: "unreadable", 3: "valid"}
    assert store.committed_steps() == [1, 3]  # an older one skipped, as an archived manifest is
    assert store.gc_uncommitted().deleted == [] and store.step_dirs() == [1, 2, 3]
    rewrite_manifest(store, 3, setting("version", 4))
    with pytest.raises(StorageError, match="manifest version 4, a format elastic gave up"):
        store.committed_steps()  # the newest: no resume from step 1 over it


def test_a_manifest_naming_a_file_outside_its_step_is_corrupt(backend, caplog):
    """``..`` in a record's path: the bytes there match the record, but a manifest vouches for
    its own step's files only, and ``verify`` must not read outside the run directory."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    store.storage.write_bytes(ESCAPE, b"outside")
    outside = FileEntry(ESCAPE, 7, sha256(b"outside")).to_dict()
    rewrite_manifest(store, 2, lambda body: body["files"].append(outside))
    with pytest.raises(CorruptCheckpoint, match=r"record 1: path '.*outside.bin' is not the name of a file a writer"):
        store.verify(2)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        assert store.latest_valid() == 1
    assert f"{step_dir(2)}/{MANIFEST}" in caplog.text


@pytest.mark.parametrize("path", [
    ESCAPE,
    f"{step_dir(2)}/../{step_dir(1)}/shard-r0-of-1.safetensors",
    f"{step_dir(2)}/..",
    f"{step_dir(2)}//shard.bin",
    f"{step_dir(2)}/./shard.bin",
    f"{step_dir(2)}/",
    f"{step_dir(2)}/a\\..\\..\\outside.bin",
    # Names no writer gives: a subdirectory, a NUL, a component too long for a filesystem, a
    # name that is not a shard's or a version-1 meta's, non-ASCII digits, a rank of 10 digits.
    f"{step_dir(2)}/extra/notes.bin",
    f"{step_dir(2)}/shard-r0-of-1.safetensors\0",
    f"{step_dir(2)}/{'x' * 300}",
    f"{step_dir(2)}/notes.bin",
    f"{step_dir(2)}/shard-r\u0661-of-2.safetensors",
    f"{step_dir(2)}/shard-r1234567890-of-2.safetensors",
    f"{step_dir(2)}/meta-r01.json",
], ids=["escape", "sibling", "dotdot", "empty-part", "dot", "trailing-slash", "backslash", "subdir", "nul",
        "long", "other-name", "arabic-digit", "long-rank", "leading-zero"])
def test_commit_refuses_a_file_outside_its_step(backend, path):
    store = make_store(backend)
    commit_tiny(store, 1)
    entries = store.write_rank_files(2, 0, 1, tiny_state(2))
    with pytest.raises(ValueError, match="cannot commit step 2: .* is not the name of a file a writer makes inside"):
        store.commit(2, entries + [FileEntry(path, 1, "0" * 64)], 1, {})
    assert not store.storage.exists(f"{step_dir(2)}/{MANIFEST}")  # nothing written
    assert store.latest_valid() == 1


def test_every_manifest_commit_writes_loads(backend):
    """What ``commit`` writes passes the same checks: here ranks with no file of their own, one
    with an RNG state in the manifest and one with none."""
    store = make_store(backend)
    entries = store.write_rank_files(5, 0, 3, tiny_state(5), {"rank": 0})
    store.commit(5, entries, 3, {"data": {"cursor": 1}}, rng={1: {"rank": 1}, 2: None})
    assert store.latest_valid() == 5
    assert [store.read_rng(5, r) for r in range(3)] == [{"rank": 0}, {"rank": 1}, None]
    state, meta = store.read_state(5)
    assert_same(state, tiny_state(5))
    assert meta == {"data": {"cursor": 1}}


# ---- what a manifest that checks out may still hold (from a security review) ----------------
LOCAL = ("file", "path")


def manifest_path(store: CheckpointStore, step: int) -> str:
    """The local path of ``step``'s manifest (file:// and plain-path backends)."""
    return store.storage.full_path(f"{step_dir(step)}/{MANIFEST}")


def promptly(fn, timeout_s: float = 20.0):
    """``fn()``'s result, or a failure if it has not returned after ``timeout_s``: a read that
    blocks (a FIFO opened for reading) fails the test instead of hanging the suite."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still blocked after {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def assert_resumes_from_1(store: CheckpointStore, corrupt: int = 2, its_manifest: bool = True) -> None:
    """Step ``corrupt`` is skipped as corrupt by resuming and listed as such; step 1 is read.
    ``its_manifest``: the manifest is what is corrupt (not committed), not one of its files."""
    assert promptly(store.latest_valid) == 1
    assert promptly(store.committed_steps) == ([1] if its_manifest else [1, corrupt])
    assert_same(promptly(store.read_state)[0], tiny_state(1))
    assert {i.step: i.status for i in promptly(store.list_steps)} == {1: "valid", corrupt: "corrupt"}


@pytest.mark.parametrize("key", ["1" * 5000, "1" * 10, "00", "1\n"], ids=["5000-digits", "10-digits",
                                                                         "leading-zero", "newline"])
def test_a_rank_key_no_commit_writes_is_corrupt_and_cleanup_goes_on(backend, key):
    """An "rng" key of 5,000 digits matched the rank pattern, and its int() raised ValueError
    (Python's 4,300-digit limit) out of the manifest's checks: ``committed_steps`` raised, so
    every resume failed, retention and GC died each pass and the listing failed."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    rewrite_manifest(store, 2, setting("rng", {key: None}))
    with pytest.raises(CorruptCheckpoint, match="rng is not an object of ranks below 1"):
        store.load_manifest(2)
    assert_resumes_from_1(store)
    commit_tiny(store, 3)
    report = store.gc_uncommitted()
    assert report.error is None and report.deleted == [2]
    assert store.apply_retention(keep_last=1).deleted == [1] and store.committed_steps() == [3]


def test_an_exception_out_of_the_manifest_checks_is_a_corrupt_step(backend, monkeypatch):
    """Whatever the checks of a manifest that checks out raise, the step is corrupt: never an
    exception that stops a resume or a cleanup pass."""
    import elastic.checkpoint.store as store_module

    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    real = store_module._manifest_problem
    monkeypatch.setattr(store_module, "_manifest_problem",
                        lambda manifest, step: 1 // 0 if step == 2 else real(manifest, step))
    with pytest.raises(CorruptCheckpoint, match=r"fields do not check \(ZeroDivisionError"):
        store.load_manifest(2)
    assert_resumes_from_1(store)


def test_a_manifest_larger_than_any_writer_makes_is_corrupt_and_not_read_whole(backend, monkeypatch):
    """Nothing records a manifest's size: a huge object named manifest.json was read whole, by
    every resume and cleanup pass. It is read up to one byte past MAX_MANIFEST_BYTES (made
    small here), in one request, and is a corrupt step."""
    import elastic.checkpoint.store as store_module

    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    rewrite_manifest(store, 2, lambda body: body["meta"].__setitem__("pad", "x" * 100_000))  # checks out
    monkeypatch.setattr(store_module, "MAX_MANIFEST_BYTES", 4096)
    reads, real = [], store.storage._call  # what each read got, before any check of it

    def call(op, rel, fn, retry=None):
        out = real(op, rel, fn, retry)
        if op == "read":
            reads.append((rel, len(out)))
        return out

    monkeypatch.setattr(store.storage, "_call", call)
    with pytest.raises(CorruptCheckpoint, match="larger than 4096 bytes"):
        store.load_manifest(2)
    assert_resumes_from_1(store)
    assert {n for rel, n in reads if rel == f"{step_dir(2)}/{MANIFEST}"} == {4097}


@pytest.mark.parametrize("backend", LOCAL, indirect=True)
def test_a_manifest_that_is_a_fifo_is_corrupt_at_once(backend):
    """A FIFO under the manifest's name blocked open() for good: every resume, and the cleanup
    thread under its lock."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    fifo = manifest_path(store, 2)
    os.unlink(fifo)
    os.mkfifo(fifo)
    try:
        with pytest.raises(CorruptCheckpoint, match="not a regular file"):
            promptly(lambda: store.load_manifest(2))
        assert_resumes_from_1(store)
        commit_tiny(store, 3)
        report = promptly(store.gc_uncommitted)
        assert report.error is None and report.deleted == [2]
    finally:
        with contextlib.suppress(OSError):  # a reader still blocked in open() (the old code) gets EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("backend", LOCAL, indirect=True)
def test_a_manifest_linked_to_dev_zero_is_corrupt_at_once(backend):
    """A link to /dev/zero under the manifest's name was read without end (until memory ran
    out, and the MemoryError was then taken for a storage outage). Run in a child process
    under a memory limit, so that code which reads it whole fails this test, not the machine."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    os.unlink(manifest_path(store, 2))
    os.symlink("/dev/zero", manifest_path(store, 2))
    _, url, options = backend
    code = textwrap.dedent(f"""
        import resource, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from elastic.checkpoint import CorruptCheckpoint, RetryPolicy
        from elastic.checkpoint.store import CheckpointStore
        resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, 1 << 30))  # 1 GiB of heap, once torch is in
        store = CheckpointStore({url!r}, {RUN!r}, {options!r}, retry=RetryPolicy(attempts=2, base_s=0.01))
        t0 = time.monotonic()
        try:
            store.load_manifest(2)
        except CorruptCheckpoint as exc:
            print("corrupt:", exc)
        print("latest_valid:", store.latest_valid(), "statuses:", [i.status for i in store.list_steps()])
        print("took_s:", round(time.monotonic() - t0, 1))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "not a regular file" in out.stdout and "latest_valid: 1 statuses: ['valid', 'corrupt']" in out.stdout
    assert float(out.stdout.split("took_s:")[1]) < 10


def add_record(path: str, size: int = 1):
    return lambda body: body["files"].append({"path": path, "size": size, "sha256": "0" * 64})


def shard_size(size: int):
    return lambda body: body["files"][0].__setitem__("size", size)


# A file record commit never writes: the manifest's checks refuse it (no read is made).
@pytest.mark.parametrize("change, reason", [
    (shard_size(2 ** 63), "size 9223372036854775808 is not a byte count up to"),
    (shard_size(2 ** 40 + 1), "is not a byte count up to 1099511627776"),
    (add_record(f"{step_dir(2)}/shard-r0-of-1.safetensors\0"), r"path '.*\\x00' is not the name of a file"),
    (add_record(f"{step_dir(2)}/{'x' * 300}"), "is not the name of a file a writer makes"),
    (add_record(f"{step_dir(2)}/sub/shard-r0-of-1.safetensors"), "is not the name of a file a writer makes"),
], ids=["size-2**63", "size-over-cap", "nul", "long-component", "subdirectory"])
def test_a_file_record_no_writer_makes_is_corrupt_and_resume_falls_back(backend, change, reason):
    """Such a record failed its read: a size of 2**63 with OverflowError, one larger than memory
    with MemoryError (both retried as an outage: resume waited, then failed), a NUL, an
    over-long component with a permanent StorageError, which ``read_state`` raised: the run
    failed instead of falling back to the step before."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    rewrite_manifest(store, 2, change)
    with pytest.raises(CorruptCheckpoint, match=reason):
        store.load_manifest(2)
    assert_resumes_from_1(store)


@pytest.mark.parametrize("backend", LOCAL, indirect=True)
@pytest.mark.parametrize("kind", ["directory", "fifo", "dev-zero", "huge-record"])
def test_a_file_a_record_names_that_is_no_file_a_writer_makes_is_corrupt(backend, kind):
    """A record that passes the checks, whose file is a directory, a FIFO or a link to
    /dev/zero; or whose size (within the cap) is more than memory: the read asks for no more
    than the file holds, and the step is corrupt, at once."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    shard = store.storage.full_path(shard_name(2, 0, 1))
    if kind == "huge-record":
        rewrite_manifest(store, 2, shard_size(2 ** 40))  # the file is ~1 KB; 1 TiB never allocated
        reason = "truncated"
    else:
        os.unlink(shard)
        {"directory": os.mkdir, "fifo": os.mkfifo, "dev-zero": lambda p: os.symlink("/dev/zero", p)}[kind](shard)
        reason = "not a regular file"
    try:
        with pytest.raises(CorruptCheckpoint, match=reason):
            promptly(lambda: store.verify(2))
        assert_resumes_from_1(store, its_manifest=False)
    finally:
        if kind == "fifo":
            with contextlib.suppress(OSError):
                os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))


# ---- content that checks out but is no training state ---------------------------------------
def _state(**change):
    state = tiny_state(2)
    for key, value in change.items():
        section, _, field = key.partition("__")
        if field:
            state[section] = {**state[section], field: value}
        elif value is _DROP:
            del state[section]
        else:
            state[section] = value
    return state


_DROP = object()


@pytest.mark.parametrize("state, reason", [
    (_state(optimizer__param_groups={"lr": 0.1}), "param_groups is a dict, not a list"),
    (_state(optimizer__param_groups=3), "param_groups is a int, not a list"),
    (_state(optimizer__param_groups=[{"lr": 0.1}]), "param group 0 is not a dict with string keys and a list of"),
    (_state(optimizer__param_groups=[{"params": 4}]), "param group 0 is not"),
    (_state(optimizer__param_groups=[{"params": [0], 7: 1}]), "param group 0 is not"),
    (_state(optimizer={"param_groups": []}), "optimizer is not a dict with string keys and its per-parameter"),
    (_state(model={0: torch.zeros(2)}), "model is not a dict with string keys"),
    (_state(model=_DROP), "model is not a dict"),
    (_state(scheduler=5), "scheduler is neither None nor a dict"),
    (_state(completed_step=_DROP), "completed_step None is not a step number"),
    (_state(completed_step="2"), "completed_step '2' is not a step number"),
    (_state(completed_step=-1), "completed_step -1 is not a step number"),
    (_state(scaler={"scale": 65536.0}), "fp16 loss scaler is not a dict of its numbers"),
    (_state(scaler=[65536.0]), "fp16 loss scaler is not a dict of its numbers"),
    (_state(optimizer_param_names=["0.weight", 3]), "optimizer_param_names is not a list of names"),
], ids=["groups-dict", "groups-int", "group-without-params", "params-int", "group-int-key", "no-optimizer-state",
        "model-int-keys", "no-model", "scheduler-int", "no-completed_step", "completed_step-str",
        "completed_step-negative", "scaler-partial", "scaler-list", "param-names-not-str"])
def test_a_state_that_checks_out_but_is_no_training_state_is_corrupt(backend, state, reason):
    """A step whose checksums match and whose content is malformed raised TypeError or KeyError
    in the comparison with the live model (``compat``) or in the rank's ``set_state``, which
    failed the run; it is a corrupt step, and the resume goes on to the one before."""
    from test_checkpoint_store import FakeWorker

    from elastic.checkpoint import state_mismatches

    store = make_store(backend)
    commit_tiny(store, 1)
    store.commit(2, store.write_rank_files(2, 0, 1, state), 1, {})
    assert store.latest_valid() == 2  # every checksum matches
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint step 2 is corrupt: .*{reason}"):
        store.read_state(2)
    # As the controller resumes: the newest committed step first, a corrupt one skipped.
    for step in reversed(store.committed_steps()):
        try:
            saved, _ = store.read_state(step)
            break
        except CorruptCheckpoint:
            continue
    assert step == 1 and saved["completed_step"] == 1
    worker = FakeWorker()
    live = worker.get_state()
    assert state_mismatches(live, saved)  # the tiny state does not fit; the comparison still runs


@pytest.mark.parametrize("meta, meta_keys, reason", [
    ({"data_position": [0, 5]}, (), r"data_position \[0, 5\] is not a data position"),
    ({"data_position": {"epoch": "0", "cursor": 5}}, (), "is not a data position"),
    ({"data_position": {"epoch": 0}}, (), "is not a data position"),
    ({"data_position": {"epoch": 0, "cursor": 5, "requeued": {"1": 2}}}, (), "is not a data position"),
    ({"data_position": {"epoch": 0, "cursor": 5, "requeued": ["1"]}}, (), "is not a data position"),
    ({"data": {"cursor": 5}}, ("data_position",), "meta has no 'data_position'"),
], ids=["list", "epoch-str", "no-cursor", "requeued-dict", "requeued-str", "missing"])
def test_a_meta_without_a_usable_data_position_is_corrupt(backend, meta, meta_keys, reason):
    """The controller reads the meta's data_position with int(): a malformed one raised out of
    the resume. A missing one is corrupt for a reader that asks for it (``meta_keys``)."""
    store = make_store(backend)
    commit_tiny(store, 1)
    store.commit(2, store.write_rank_files(2, 0, 1, tiny_state(2)), 1, meta)
    with pytest.raises(CorruptCheckpoint, match=reason):
        store.read_state(2, **({"meta_keys": meta_keys} if meta_keys else {}))
    good = {"data_position": {"epoch": 1, "cursor": 3, "requeued": [4]}}
    store.commit(3, store.write_rank_files(3, 0, 1, tiny_state(3)), 1, good)
    assert store.read_state(3, meta_keys=("data_position",))[1] == good


def test_the_saved_keys_a_mismatch_names_are_shown_escaped():
    """A key of the checkpoint's model (a string from storage) reaches the user's terminal in
    CheckpointMismatch: as its repr, its control characters escaped, and cut short."""
    from elastic.checkpoint import state_mismatches

    live = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": []}}
    saved = {"model": {"w": torch.zeros(2), "\x1b[2J\x9b31m": torch.zeros(1), "k" * 1000: torch.zeros(1)},
             "optimizer": {"state": {}, "param_groups": []}}
    problems = state_mismatches(live, saved)
    assert len(problems) == 1 and "'\\x1b[2J\\x9b31m'" in problems[0] and "\x1b" not in problems[0]
    assert "\x9b" not in problems[0] and len(problems[0]) < 600


# ---- step directory names ---------------------------------------------------------------------
@pytest.mark.parametrize("alias", ["step-0000000005", "step-00000000\u0665", "step-000000005\n"],
                         ids=["ten-digits", "arabic-indic-digit", "trailing-newline"])
def test_another_name_for_a_step_is_no_step(backend, alias):
    """``step-0000000005`` beside ``step-000000005`` (or a name with a Unicode digit, or a
    trailing newline, which the old pattern took) named step 5 twice: committed [3, 4, 5, 5],
    and retention with keep_last=2 kept only step 5 and deleted step 4."""
    kind, _, _ = backend
    if kind == "s3" and alias != "step-0000000005":
        pytest.skip("S3 keys: the ten-digit alias is enough")
    store = make_store(backend)
    for step in (3, 4, 5):
        commit_tiny(store, step)
    store.storage.write_bytes(f"{alias}/{MANIFEST}", b"an alias")  # the directory exists
    assert store.step_dirs() == [3, 4, 5] and store.committed_steps() == [3, 4, 5]
    assert [i.step for i in store.list_steps()] == [3, 4, 5]
    report = store.apply_retention(keep_last=2)
    assert report.deleted == [3] and store.committed_steps() == [4, 5]
    assert store.gc_uncommitted().deleted == []
    assert store.storage.read_bytes(f"{alias}/{MANIFEST}") == b"an alias"  # not ours: left alone


def test_a_step_directory_name_parses_only_as_step_dir_writes_it():
    from elastic.checkpoint.store import parse_step_dir

    assert [parse_step_dir(step_dir(s)) for s in (0, 5, 10 ** 9, 10 ** 18 - 1)] == [0, 5, 10 ** 9, 10 ** 18 - 1]
    for name in ("step-0000000005", "step-00000000\u0665", "step-000000005\n", "step-5", "step-" + "1" * 5000,
                 "step-000000005x", " step-000000005", "step-1000000000000000000"):
        assert parse_step_dir(name) is None, name
