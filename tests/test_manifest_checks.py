"""A manifest whose checksum matches is still checked for what ``commit`` writes: every field of
the right type, and every file inside its step's directory. One that is not is a corrupt step,
which resuming skips for the previous one (file://, plain path, memory://, S3 via moto)."""

from __future__ import annotations

import json
import logging

import pytest

from elastic.checkpoint import CorruptCheckpoint
from elastic.checkpoint.codec import canonical_json, sha256
from elastic.checkpoint.store import MANIFEST, VERSION, CheckpointStore, FileEntry, step_dir
from elastic.checkpoint.testing import TEST_SECRET
from test_checkpoint_store import assert_same, backend, commit_tiny, make_store, tiny_state  # noqa: F401 - backend: a fixture

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


# Each leaves the step's files as they are, so only the manifest's own fields can give it away.
@pytest.mark.parametrize("change, reason", [
    (without("world_size"), "world_size None is not a positive integer"),
    (setting("world_size", "1"), "world_size '1' is not a positive integer"),
    (setting("world_size", 0), "world_size 0 is not a positive integer"),
    (setting("version", VERSION + 1), f"version {VERSION + 1} is not one this code reads"),
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
    (size_as_text, r"file records do not parse \(record 0: size '\d+' is not a byte count\)"),
], ids=["no-world_size", "world_size-str", "world_size-0", "newer-version", "no-version", "no-created_at",
        "no-meta", "meta-list", "rng-str", "rng-list", "rng-rank-beyond-world", "rng-state-int", "files-dict",
        "files-empty", "size-str"])
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


def test_a_manifest_naming_a_file_outside_its_step_is_corrupt(backend, caplog):
    """``..`` in a record's path: the bytes there match the record, but a manifest vouches for
    its own step's files only, and ``verify`` must not read outside the run directory."""
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    store.storage.write_bytes(ESCAPE, b"outside")
    outside = FileEntry(ESCAPE, 7, sha256(b"outside")).to_dict()
    rewrite_manifest(store, 2, lambda body: body["files"].append(outside))
    with pytest.raises(CorruptCheckpoint, match=r"record 1: path '.*outside.bin' is not a normalized relative path"):
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
])
def test_commit_refuses_a_file_outside_its_step(backend, path):
    store = make_store(backend)
    commit_tiny(store, 1)
    entries = store.write_rank_files(2, 0, 1, tiny_state(2))
    with pytest.raises(ValueError, match="cannot commit step 2: .* is not a normalized relative path inside"):
        store.commit(2, entries + [FileEntry(path, 1, "0" * 64)], 1, {})
    assert not store.storage.exists(f"{step_dir(2)}/{MANIFEST}")  # nothing written
    assert store.latest_valid() == 1


def test_every_manifest_commit_writes_loads(backend):
    """What ``commit`` writes passes the same checks: here ranks with no file of their own, one
    with an RNG state in the manifest and one with none, and files in a subdirectory."""
    store = make_store(backend)
    entries = store.write_rank_files(5, 0, 3, tiny_state(5), {"rank": 0})
    store.storage.write_bytes(f"{step_dir(5)}/extra/notes.bin", b"notes")
    entries.append(FileEntry(f"{step_dir(5)}/extra/notes.bin", 5, sha256(b"notes")))
    store.commit(5, entries, 3, {"data": {"cursor": 1}}, rng={1: {"rank": 1}, 2: None})
    assert store.latest_valid() == 5
    assert [store.read_rng(5, r) for r in range(3)] == [{"rank": 0}, {"rank": 1}, None]
    state, meta = store.read_state(5)
    assert_same(state, tiny_state(5))
    assert meta == {"data": {"cursor": 1}}
