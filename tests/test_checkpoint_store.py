"""Checkpoint store contract (file://, plain path, memory://, S3 via moto): sharded round trip, torn
writes, corruption, retention and GC; then the background persister, the worker hook, the committer,
and a storage outage against a real S3 endpoint that goes away and comes back."""

from __future__ import annotations

import collections
import errno
import json
import logging
import multiprocessing
import os
import pickle
import random
import signal
import socket
import stat
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from elastic.checkpoint import (
    AsyncPersister,
    CheckpointCommitter,
    CheckpointStore,
    CorruptCheckpoint,
    RetryPolicy,
    StorageError,
    WorkerCheckpointer,
    restore_rng,
)
from elastic.checkpoint.codec import (
    RawRng,
    SkeletonJson,
    assign_shards,
    canonical_json,
    capture_rng,
    decode_metadata,
    decode_tensors,
    encode_tensor_buffers,
    encode_tensors,
    flatten_state,
    json_object_plus,
    rank_share,
    sha256,
    tensor_nbytes,
    unflatten_state,
    writer_count,
    writer_slot,
)
from elastic.checkpoint.storage import StorageUnavailable
from elastic.checkpoint.store import MANIFEST, FileEntry, meta_name, shard_name, step_dir
from elastic.checkpoint.testing import BACKENDS, TEST_SECRET, MotoS3, backend_url, clear_memory
from elastic.config import CheckpointConfig, ConfigError

FAST = RetryPolicy(attempts=3, base_s=0.01, max_s=0.05)
RUN = "run-1"


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    moto = request.getfixturevalue("moto_s3") if request.param == "s3" else None
    url, options = backend_url(request.param, str(tmp_path), moto)
    yield request.param, url, options
    if request.param == "memory":
        clear_memory(url)


def make_store(backend) -> CheckpointStore:
    _, url, options = backend
    return CheckpointStore(url, RUN, options, retry=FAST)


@pytest.fixture
def delete_clock(monkeypatch):
    """The store's monotonic clock, which times a failed delete's backoff, stopped; ``advance(s)``
    moves it on. Why: a test that counts retries on the real clock raced it (a loop of commits
    that took over a second on a loaded machine saw a backoff end early)."""
    from elastic.checkpoint import store as store_module

    now = [time.monotonic()]
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=time.time, monotonic=lambda: now[0]))
    return SimpleNamespace(advance=lambda s: now.__setitem__(0, now[0] + s))


# ---- a stand-in for TrainWorker: the same attributes and the same get_state/set_state ------------
class FakeWorker:
    def __init__(self, rank: int = 0, world_size: int = 1, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2, betas=(0.9, 0.99))
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.rank, self.world_size, self.completed_step = rank, world_size, 0

    def train(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 + step)  # same batch on every replica
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.completed_step = step

    def get_state(self) -> dict:
        # As TrainWorker.get_state: the model's copy keeps the state dict's module versions
        # (``_metadata``), as a checkpoint of the live state (``live_state``) does, so a state
        # read back compares equal to it.
        model = self.model.state_dict()
        copy = collections.OrderedDict((k, v.detach().cpu().clone()) for k, v in model.items())
        copy._metadata = model._metadata
        return {
            "model": copy,
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "completed_step": self.completed_step,
        }

    def set_state(self, state: dict) -> int:  # as TrainWorker.set_state
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.completed_step = int(state["completed_step"])
        return self.completed_step


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj


def assert_same(a, b, path="state"):
    """Exact equality, including container and scalar types (tuple stays tuple, int stays int)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: module metadata"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def trained_worker(steps: int = 2, rank: int = 0, world_size: int = 1) -> FakeWorker:
    worker = FakeWorker(rank, world_size)
    for step in range(1, steps + 1):
        worker.train(step)
    return worker


def write_step(store: CheckpointStore, worker: FakeWorker, step: int, world_size: int = 2,
               commit: bool = True, meta: dict | None = None) -> list:
    state = worker.get_state()
    entries = []
    for rank in range(world_size):
        entries += store.write_rank_files(step, rank, world_size, state, capture_rng())
    if commit:
        store.commit(step, entries, world_size, meta or {"data": {"epoch": 0, "cursor": step * 10}})
    return entries


# ---- round trip --------------------------------------------------------------------------------
def test_sharded_round_trip_restores_model_and_adam(backend):
    store = make_store(backend)
    store.validate()
    worker = trained_worker(steps=2)
    expected = worker.get_state()
    assert store.latest_valid() is None
    entries = write_step(store, worker, step=2, world_size=2, meta={"data": {"epoch": 1, "cursor": 7}})

    assert store.committed_steps() == [2]
    assert store.latest_valid() == 2
    state, meta = store.read_state(2)
    assert meta == {"data": {"epoch": 1, "cursor": 7}}
    assert_same(state, expected)
    assert torch.is_tensor(state["optimizer"]["state"][0]["step"])  # Adam's step stays a tensor
    assert isinstance(state["optimizer"]["param_groups"][0]["betas"], tuple)

    # The restored state is usable: a fresh replica loads it and then trains in lockstep.
    fresh = FakeWorker(seed=123)
    assert fresh.set_state(state) == 2
    worker.train(3)
    fresh.train(3)
    for p, q in zip(worker.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p, q)

    # Dedup: each tensor is written exactly once, split by bytes across the two ranks.
    paths = {e.path: e for e in entries}
    # One file per rank a step: its meta (RNG; on rank 0 the state skeleton) rides in the header.
    assert set(paths) == {f"{step_dir(2)}/shard-r0-of-2.safetensors", f"{step_dir(2)}/shard-r1-of-2.safetensors"}
    shards = [decode_tensors(store.storage.read_bytes(shard_name(2, r, 2))) for r in range(2)]
    all_tensors, _ = flatten_state(expected)
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(all_tensors)
    loads = [sum(tensor_nbytes(t) for t in s.values()) for s in shards]
    assert max(loads) - min(loads) <= max(tensor_nbytes(t) for t in all_tensors.values())
    assert store.read_rng(2, 1) is not None


def test_read_state_with_a_different_world_size(backend):
    """Three ranks wrote it; anyone can read it (resize between runs)."""
    store = make_store(backend)
    worker = trained_worker(steps=3)
    write_step(store, worker, step=3, world_size=3)
    state, _ = store.read_state()
    assert_same(state, worker.get_state())


class _HalvedBeforeVersion2(torch.nn.Module):
    """A module whose state dict changed format at version 2 (version 1 stored half the weight),
    upgrading an older one as torch's own modules do: by the version in its local metadata, None
    for a state dict from before versions were recorded."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(1.0, 5.0))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        version = local_metadata.get("version")
        if (version is None or version < 2) and prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _versioned_worker(seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _HalvedBeforeVersion2())
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None,
                           completed_step=3)


def test_a_modules_state_dict_version_survives_a_checkpoint(backend):
    """A state dict's ``_metadata`` (each module's version) was lost in the skeleton: a resume
    loaded the model with no version, the case a module reads as an old format to upgrade, and
    this one doubled its current weight at every resume, with no error."""
    from elastic.checkpoint.worker_hook import live_state

    store = make_store(backend)
    worker = _versioned_worker()
    state = live_state(worker)  # what a checkpointed step writes: the model's own state_dict()
    entries = []
    for rank in range(2):
        entries += store.write_rank_files(3, rank, 2, state, capture_rng())
    store.commit(3, entries, 2, {})

    got, _ = store.read_state(3)
    fresh = _versioned_worker(seed=1).model
    fresh.load_state_dict(got["model"])  # as TrainWorker.set_state does
    for p, q in zip(worker.model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)  # before: the second module's weight came back doubled
    assert got["model"]._metadata == worker.model.state_dict()._metadata
    assert got["model"]._metadata["1"] == {"version": 2}
    # Each rebuild has its own copy: a load that changes it does not change the next one's.
    got["model"]._metadata["1"]["version"] = 1
    assert store.read_state(3)[0]["model"]._metadata["1"] == {"version": 2}


def test_a_skeleton_without_module_metadata_still_loads(backend):
    """Checkpoints written before the metadata was kept have no ``__metadata__`` beside a dict's
    pairs: their model comes back a plain dict, as it always did, and loads."""
    from elastic.checkpoint.store import Snapshot
    from elastic.checkpoint.worker_hook import live_state

    store = make_store(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    worker = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None,
                             completed_step=2)
    tensors, skeleton = flatten_state(live_state(worker))
    model_node = dict(skeleton["__dict__"])["model"]
    assert "__metadata__" in model_node
    del model_node["__metadata__"]  # as older versions wrote it
    store.commit(2, store.write_snapshot(Snapshot(2, 0, 1, tensors, skeleton, capture_rng())), 1, {})

    got, _ = store.read_state(2)
    assert type(got["model"]) is dict and not hasattr(got["model"], "_metadata")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(got["model"])  # BatchNorm takes a missing version as its oldest format
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_module_metadata_is_kept_apart_from_user_keys_and_unusual_metadata_is_dropped():
    """The metadata sits beside the marker's pairs, where no user key goes: a user dict whose keys
    look like markers round-trips as it is. Metadata not of torch's shape is left out (as all of it
    was before), and the rest of the state still saves."""
    from elastic.checkpoint.codec import skeleton_tensor_names

    model = torch.nn.Linear(2, 2).state_dict()
    user = {"__metadata__": [["x", {"__tensor__": "model/weight"}]], "__dict__": torch.ones(1)}
    tensors, skeleton = flatten_state({"model": model, "user": user})
    assert sorted(skeleton_tensor_names(skeleton)) == sorted(tensors) == ["model/bias", "model/weight", "user/__dict__"]
    back = unflatten_state(tensors, json.loads(canonical_json(skeleton)))
    assert back["model"]._metadata == model._metadata and list(back["model"]) == ["weight", "bias"]
    assert type(back["user"]) is dict and back["user"]["__metadata__"] == user["__metadata__"]
    assert torch.equal(back["user"]["__dict__"], torch.ones(1))

    model._metadata[""]["note"] = (1, 2)  # a tuple would come back a list: not kept
    _, skeleton = flatten_state({"model": model})
    assert type(unflatten_state(tensors, skeleton)["model"]) is dict
    # Metadata that checks out but is not pairs of a prefix and plain values is a corrupt state.
    with pytest.raises(ValueError, match="module metadata"):
        unflatten_state({}, {"__dict__": [], "__metadata__": [["", {"version": [1]}]]})


def test_flatten_state_keeps_every_plain_value_and_refuses_what_json_cannot_key():
    """The walk's fast path for plain children (exact int, str, bool, None) keeps them as they
    are; everything else goes through the full checks, subclasses included."""
    import enum
    import math

    class Name(str, enum.Enum):
        LR = "lr"

    state = {"model": {"w": torch.arange(3.0)}, 7: [1, True, None, "x", 2.5, float("nan"), (3, False, torch.ones(2))],
             Name.LR: np.float32(0.5), "nested": {"ids": list(range(5)), "inf": float("-inf"), "n": np.int64(4)}}
    tensors, skeleton = flatten_state(state)
    assert sorted(tensors) == ["7/6/2", "model/w"]
    back = unflatten_state(tensors, json.loads(canonical_json(skeleton)))
    assert back[7][:5] == [1, True, None, "x", 2.5] and math.isnan(back[7][5])
    assert back[7][6][:2] == (3, False) and torch.equal(back[7][6][2], torch.ones(2))
    assert back["lr"] == 0.5 and back["nested"] == {"ids": [0, 1, 2, 3, 4], "inf": float("-inf"), "n": 4}
    for bad_key in (True, (1, 2), 1.5):
        with pytest.raises(TypeError, match="must be str or int"):
            flatten_state({"optimizer": {bad_key: 1}})
    with pytest.raises(TypeError, match="without pickle"):
        flatten_state({"x": [1, object()]})
    # numpy scalars with no Python number: .item() gives the numpy scalar back (it recursed)
    for bad in (np.longdouble(1.5), np.clongdouble(1 + 2j)):
        with pytest.raises(TypeError, match=rf"has a numpy {bad.dtype}"):
            flatten_state({"x": bad})


def test_a_member_spliced_into_a_json_object_reads_back_with_the_rest():
    text = canonical_json({"b": [1, {"c": None}], "a": "x}"})
    assert json.loads(json_object_plus(text, "rng", canonical_json({"torch": "AAA="}))) == {
        "a": "x}", "b": [1, {"c": None}], "rng": {"torch": "AAA="}}
    assert json.loads(json_object_plus(b"{ }", "k", b"[1]")) == {"k": [1]}
    for bad in (b"[1]", b'"x"', b"{"):
        with pytest.raises(ValueError, match="not a JSON object"):
            json_object_plus(bad, "k", b"1")


def test_a_skeleton_encoded_step_after_step_reads_back_as_it_is_each_step():
    """SkeletonJson reuses the text of the parts that did not change; every step still reads back
    as that step's skeleton (the step counter, a scheduled learning rate, a new optimizer entry)."""
    worker = FakeWorker()
    cache = SkeletonJson()
    texts = []
    for step in range(1, 6):
        worker.train(step)  # StepLR halves the learning rate every second step
        state = worker.get_state()
        if step == 4:
            state["optimizer"]["state"][99] = {"note": "new entry"}
        _, skeleton = flatten_state(state)
        text = cache.dumps(skeleton)
        assert json.loads(text) == json.loads(canonical_json(skeleton))
        texts.append(text)
        if step == 1:
            weight_text = cache._last[("model", "0.weight")][1]
    assert len(set(texts)) == 5
    assert cache._last[("model", "0.weight")][1] is weight_text  # a tensor's name: encoded once, reused since


def test_assign_shards_is_deterministic_and_balanced():
    sizes = {f"t{i}": (i * 37) % 101 + 1 for i in range(40)}
    a = assign_shards(sizes, 4)
    b = assign_shards(dict(reversed(list(sizes.items()))), 4)
    assert a == b
    loads = [sum(sizes[n] for n in s) for s in a]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert sorted(n for s in a for n in s) == sorted(sizes)
    assert assign_shards({"only": 5}, 3) == [["only"], [], []]  # an empty shard is fine
    # The split is remembered per names and sizes; what a caller gets is its own to change.
    a[0].append("mine")
    assert assign_shards(sizes, 4) == b
    share, _ = rank_share({n: torch.zeros(sizes[n], dtype=torch.uint8) for n in sizes}, 1, 4)
    share.append("mine")
    assert rank_share({n: torch.zeros(sizes[n], dtype=torch.uint8) for n in sizes}, 1, 4)[0] == b[1]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        assign_shards(sizes, 0)


def test_rank_without_a_share_writes_no_file_and_its_rng_goes_in_the_manifest(backend):
    """More ranks than tensors: ranks 1 and 2 have nothing to write. They write no file, the
    manifest carries their RNG state, and a commit that lacks one of them is refused."""
    store = make_store(backend)
    state = {"model": {"w": torch.arange(3.0)}, "optimizer": {"state": {}, "param_groups": []},
             "scheduler": None, "completed_step": 5}
    entries = []
    for rank in range(3):
        entries += store.write_rank_files(5, rank, 3, state, {"rank": rank})
    assert [e.path for e in entries] == [shard_name(5, 0, 3)]
    with pytest.raises(ValueError, match="shard-r2-of-3"):
        store.commit(5, entries, 3, {}, rng={1: {"rank": 1}})
    store.commit(5, entries, 3, {}, rng={1: {"rank": 1}, 2: {"rank": 2}})
    got, _ = store.read_state(5)
    assert_same(got, state)
    assert [store.read_rng(5, r) for r in range(3)] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert sorted(p for p in store.storage.list_dir(step_dir(5))) == ["manifest.json", "shard-r0-of-3.safetensors"]


def test_shard_buffers_are_a_safetensors_file_the_library_reads():
    """The shard is written from the tensors' own memory (header + buffers); joined, the bytes
    are a safetensors file that the library loads, for every dtype and layout a state holds."""
    import safetensors.torch

    weight = torch.randn(4, 4)
    tensors = {"f32": torch.randn(3, 4), "i64": torch.arange(5), "bf16": torch.randn(3).to(torch.bfloat16),
               "f16": torch.randn(3, dtype=torch.float16), "f64": torch.randn(2, dtype=torch.float64),
               "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 3), "bool": torch.tensor([True, False]),
               "transposed": torch.randn(4, 3).t(), "tied_a": weight, "tied_b": weight,
               "u16": torch.arange(3).to(torch.uint16), "u64": torch.arange(3).to(torch.uint64),
               "c64": torch.ones(2, dtype=torch.complex64)}  # not in our set: the library encodes it
    for chosen in (tensors, {k: v for k, v in tensors.items() if k != "c64"}):
        buffers = encode_tensor_buffers(chosen, {"elastic": "{}"})
        assert len(buffers) == (1 if "c64" in chosen else 1 + sum(1 for t in chosen.values() if t.numel()))
        data = b"".join(buffers)
        assert sha256(buffers) == sha256(data)
        got = safetensors.torch.load(data)
        assert decode_metadata(data) == {"elastic": "{}"}
        for name, t in chosen.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    fp8 = {"e4m3": torch.ones(3).to(torch.float8_e4m3fn), "e5m2": torch.ones(3).to(torch.float8_e5m2)}
    buffers = encode_tensor_buffers(fp8)
    assert len(buffers) == 3  # our layout: the header, then each tensor's memory
    for name, t in safetensors.torch.load(b"".join(buffers)).items():
        assert t.dtype == fp8[name].dtype and torch.equal(t.view(torch.uint8), fp8[name].view(torch.uint8))


def test_writer_slots_cover_every_shard_once_and_rotate():
    for world, writers in ((4, 1), (4, 2), (4, 4), (3, 2)):
        seen_writers = set()
        for step in range(12):
            slots = [writer_slot(r, world, writers, step) for r in range(world)]
            assert sorted(x for x in slots if x is not None) == list(range(writers))
            seen_writers |= {r for r, x in enumerate(slots) if x is not None}
            if writers == world:
                assert slots == list(range(world))  # every rank writes: rank r writes shard r
        assert seen_writers == set(range(world))  # over the steps, every rank takes its turn


@pytest.mark.parametrize("every", [2, 4, 10, 100])
def test_the_writers_rotate_over_the_checkpoints_taken_whatever_their_schedule(every):
    # Rotated by the step, a schedule sharing a factor with the world size kept the duty on some
    # ranks: every 4 steps on 4 ranks, rank 0 wrote every checkpoint (2: ranks 0 and 2).
    tensors = {f"t{i}": torch.zeros(1024, dtype=torch.uint8) for i in range(4)}
    for world, min_shard_bytes in ((4, 10**9), (4, 2048), (5, 10**9)):
        writes: dict[int, int] = {}
        for step in range(every, every * (world * 3 + 1), every):  # the steps a run of this schedule snapshots
            shares = [rank_share(tensors, r, world, min_shard_bytes, step, every) for r in range(world)]
            assert sorted(n for names, _ in shares for n in names) == sorted(tensors)  # each tensor once
            for r, (names, _) in enumerate(shares):
                writes[r] = writes.get(r, 0) + bool(names)
        assert len(set(writes.values())) == 1 and min(writes.values()) > 0, (world, writes)  # all alike


@pytest.mark.parametrize("min_shard_bytes,writers", [(0, 3), (1, 3), (10**9, 1)])
def test_min_shard_bytes_sets_how_many_ranks_write(tmp_path, min_shard_bytes, writers):
    """A small state is written by fewer ranks, each tensor still once, the duty rotating with
    the step; the step reads back the same whoever wrote it."""
    store = CheckpointStore(f"file://{tmp_path}/ck", RUN)
    worker = trained_worker(steps=2)
    state = worker.get_state()
    tensors, _ = flatten_state(state)
    total = sum(tensor_nbytes(t) for t in tensors.values())
    assert writer_count(total, 3, min_shard_bytes) == writers
    assert writer_count(total, 3, total // 2 + 1) == 2
    for step in (3, 4, 5):
        entries, rng = [], {}
        for rank in range(3):
            mine = store.write_rank_files(step, rank, 3, state, capture_rng(), min_shard_bytes=min_shard_bytes)
            if not mine:
                rng[rank] = capture_rng()
            entries += mine
        expected = range(3) if writers == 3 else [step % 3]  # one writer: rank step % 3
        assert [e.path for e in entries] == [shard_name(step, r, 3) for r in expected]
        store.commit(step, entries, 3, {}, rng=rng)
        got, _ = store.read_state(step)
        assert_same(got, state)
        assert all(store.read_rng(step, r) is not None for r in range(3))


def test_commit_refuses_missing_rank_files(backend):
    store = make_store(backend)
    worker = trained_worker(steps=1)
    entries = store.write_rank_files(1, 0, 2, worker.get_state())
    with pytest.raises(ValueError, match="shard-r1-of-2"):
        store.commit(1, entries, 2, {})
    with pytest.raises(ValueError, match="plain JSON"):
        store.commit(1, entries + store.write_rank_files(1, 1, 2, worker.get_state()), 2, {"x": object()})
    assert store.latest_valid() is None


# ---- torn writes -------------------------------------------------------------------------------
def _torn_writer(url: str, options: dict, step: int) -> None:
    """Child process: write every rank's shards for ``step``, then die before the manifest."""
    store = CheckpointStore(url, RUN, options, retry=FAST)
    worker = trained_worker(steps=step)
    state = worker.get_state()
    for rank in range(2):
        store.write_rank_files(step, rank, 2, state, capture_rng())
    os.kill(os.getpid(), signal.SIGKILL)


def test_torn_write_is_never_used_and_is_collected(backend):
    kind, url, options = backend
    store = make_store(backend)
    write_step(store, trained_worker(steps=2), step=2)
    if kind == "file":
        # A real kill: a spawned process writes every shard and dies by SIGKILL before the manifest.
        # (One backend only: a spawned interpreter costs seconds of imports.)
        proc = multiprocessing.get_context("spawn").Process(target=_torn_writer, args=(url, options, 4))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
    else:
        # The same files, written here and never committed: what a killed writer leaves behind.
        state = trained_worker(steps=4).get_state()
        for rank in range(2):
            store.write_rank_files(4, rank, 2, state)
    assert store.step_dirs() == [2, 4]
    assert len(store.storage.list_dir(step_dir(4))) == 2  # every shard is there ...
    assert store.latest_valid() == 2  # ... but without a manifest the step does not exist
    assert store.committed_steps() == [2]
    state, _ = store.read_state()
    assert state["completed_step"] == 2
    with pytest.raises(FileNotFoundError, match="not committed"):
        store.read_state(4)
    assert {i.step: i.status for i in store.list_steps()} == {2: "valid", 4: "partial"}

    # GC only collects uncommitted steps older than the newest committed one.
    assert store.gc_uncommitted().deleted == []
    write_step(store, trained_worker(steps=6), step=6)
    report = store.gc_uncommitted()
    assert report.deleted == [4] and not report.failed
    assert store.step_dirs() == [2, 6]


# ---- corruption --------------------------------------------------------------------------------
def test_corrupt_and_truncated_files_are_skipped_with_a_warning(backend, caplog, monkeypatch):
    store = make_store(backend)
    for step in (2, 4, 6):
        write_step(store, trained_worker(steps=step), step=step)
    shard6 = shard_name(6, 1, 2)
    data = bytearray(store.storage.read_bytes(shard6))
    data[len(data) // 2] ^= 0xFF  # flip one byte in the tensor payload; the size stays the same
    store.storage.write_bytes(shard6, bytes(data))
    shard4 = shard_name(4, 0, 2)  # rank 0's: its header also holds the state skeleton
    store.storage.write_bytes(shard4, store.storage.read_bytes(shard4)[:-10])  # truncated

    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        assert store.latest_valid() == 2
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "shard-r1-of-2.safetensors" in warnings and "sha256 mismatch" in warnings
    assert "shard-r0-of-2.safetensors" in warnings and "truncated" in warnings
    assert TEST_SECRET not in warnings

    with pytest.raises(CorruptCheckpoint, match="shard-r1-of-2.safetensors") as info:
        store.read_state(6)
    assert info.value.step == 6
    # It crosses from the reading rank to the controller pickled, fields and all.
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.step, again.path, again.reason, str(again)) == (6, info.value.path, info.value.reason,
                                                                  str(info.value))
    reads, real_read = [], store.storage.read_bytes

    def read(rel, *args, **kwargs):
        reads.append(rel)
        return real_read(rel, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(store.storage, "read_bytes", read)
        state, _ = store.read_state()
    assert state["completed_step"] == 2
    # Each of step 2's files read once: verified as it is read, not verified and then read again.
    step2 = [r for r in reads if r.startswith(step_dir(2))]
    assert step2 and len(step2) == len(set(step2)), step2
    statuses = {i.step: i.status for i in store.list_steps()}
    assert statuses == {2: "valid", 4: "corrupt", 6: "corrupt"}


def test_a_shard_grown_past_its_record_is_corrupt_and_not_read_past_it(backend, caplog, monkeypatch):
    store = make_store(backend)
    for step in (2, 4):
        write_step(store, trained_worker(steps=step), step=step)
    shard4 = shard_name(4, 1, 2)
    data = store.storage.read_bytes(shard4)
    store.storage.write_bytes(shard4, data + b"\0" * 10 * len(data))  # appended to
    reads = []
    real = store.storage.read_bytes
    monkeypatch.setattr(store.storage, "read_bytes",
                        lambda rel, size=None, **kw: reads.append((rel, len(out := real(rel, size, **kw)))) or out)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        assert store.latest_valid() == 2
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "shard-r1-of-2.safetensors" in warnings and f"larger than the recorded {len(data)} bytes" in warnings
    assert {n for rel, n in reads if rel == shard4} == {len(data) + 1}  # not its 11x


def test_a_meta_with_keys_that_are_not_strings_commits_a_step_that_validates(tmp_path):
    # The checksum was taken over {2: .., 10: ..} as built (sorted as ints), the reader
    # re-encoded {"10": .., "2": ..}: every such step failed its checksum and resume found none.
    store = CheckpointStore(str(tmp_path), RUN, retry=FAST)
    entries = store.write_rank_files(1, 0, 1, tiny_state(1))
    store.commit(1, entries, 1, {"per_rank": {2: "a", 10: "b"}})
    assert store.latest_valid() == 1 and store.load_manifest(1)["meta"] == {"per_rank": {"10": "b", "2": "a"}}
    with pytest.raises(ValueError, match="must be plain JSON data"):
        store.commit(2, store.write_rank_files(2, 0, 1, tiny_state(2)), 1, {"mixed": {1: "a", "b": 2}})


def test_corrupt_manifest_means_uncommitted(backend):
    store = make_store(backend)
    write_step(store, trained_worker(steps=1), step=1)
    write_step(store, trained_worker(steps=2), step=2)
    manifest = f"{step_dir(2)}/manifest.json"
    doc = json.loads(store.storage.read_bytes(manifest))
    doc["meta"]["data"]["cursor"] = 999  # edited without updating the checksum
    store.storage.write_bytes(manifest, json.dumps(doc).encode())
    assert store.committed_steps() == [1]
    assert store.latest_valid() == 1
    store.storage.write_bytes(manifest, b'{"format": "elastic-checkpoint", "ste')  # torn manifest
    assert store.latest_valid() == 1
    assert store.gc_uncommitted(older_than=3).deleted == [2]


def test_a_manifest_nested_too_deep_to_parse_is_corrupt_not_an_error_of_every_listing(backend):
    # json.loads raises RecursionError on b"[" * 5000, which the parse's except missed: resume,
    # retention, GC and the CLI's listing all stopped on it.
    store = make_store(backend)
    commit_tiny(store, 1)
    commit_tiny(store, 2)
    store.storage.write_bytes(f"{step_dir(2)}/manifest.json", b"[" * 5000)
    assert store.committed_steps() == [1] and store.latest_valid() == 1
    with pytest.raises(CorruptCheckpoint, match="RecursionError"):
        store.load_manifest(2)
    assert store.gc_uncommitted(older_than=3).deleted == [2]


def test_a_committed_state_that_is_no_training_state_is_corrupt_not_a_crash(backend):
    # Checksums vouch only for what was written: a step whose state rebuilds as something other
    # than a training state (a list, say) raised AttributeError in the fit check, and a resume
    # stopped instead of trying the older step.
    store = make_store(backend)
    commit_tiny(store, 1)
    entries = store.write_rank_files(2, 0, 1, [torch.zeros(2)])
    store.commit(2, entries, 1, {})
    with pytest.raises(CorruptCheckpoint, match="not a training state"):
        store.read_state(2)
    assert store.read_state(1)[0]["completed_step"] == 1


def test_a_shard_header_of_the_wrong_shape_is_refused_as_corrupt():
    from elastic.checkpoint.codec import decode_metadata

    def shard(header: bytes) -> bytes:
        return len(header).to_bytes(8, "little") + header

    with pytest.raises(ValueError, match="header is not an object"):
        decode_metadata(shard(b"[1, 2]"))
    with pytest.raises(ValueError, match="not an object of strings"):
        decode_metadata(shard(b'{"__metadata__": {"elastic": 5}}'))
    assert decode_metadata(shard(b'{"__metadata__": {"elastic": "{}"}}')) == {"elastic": "{}"}


def test_gc_takes_a_corrupt_manifest_away_first_and_a_missing_one_costs_no_delete(backend, monkeypatch):
    store = make_store(backend)
    write_step(store, trained_worker(steps=1), step=1, commit=False)  # torn: shards, no manifest
    write_step(store, trained_worker(steps=2), step=2)
    store.storage.write_bytes(f"{step_dir(2)}/manifest.json", b'{"format": "elastic-checkpoint", "ste')
    write_step(store, trained_worker(steps=3), step=3)
    calls = []

    def recorded(name: str):
        real = getattr(store.storage, name)

        def call(rel: str) -> None:
            calls.append((name, rel))
            real(rel)
        return call

    for name in ("delete", "delete_tree"):
        monkeypatch.setattr(store.storage, name, recorded(name))
    report = store.gc_uncommitted()
    assert report.deleted == [1, 2] and not report.failed
    # Step 1 had nothing to take away first; step 2's corrupt manifest goes before its shards, so
    # a delete that fails half-way leaves no manifest over missing files.
    assert calls == [("delete_tree", step_dir(1)), ("delete", f"{step_dir(2)}/manifest.json"),
                     ("delete_tree", step_dir(2))]
    assert store.step_dirs() == [3] and store.committed_steps() == [3]


def test_gc_waits_out_a_failed_deletes_backoff_and_the_backoff_never_overflows(tmp_path, monkeypatch):
    """A directory GC could not delete is tried again after its backoff, not on every sweep; and
    however often one keeps failing, the backoff stays a number (2.0 ** 1024 raised OverflowError,
    which then stopped every later pass)."""
    store = CheckpointStore(str(tmp_path), RUN, retry=FAST)
    for step in (1, 2):
        write_step(store, trained_worker(steps=step), step=step, commit=False)  # torn
    write_step(store, trained_worker(steps=3), step=3)
    tried = []
    real = store.storage.delete_tree

    def refused(rel: str) -> None:
        tried.append(rel)
        if rel == step_dir(1):
            raise StorageError("permission denied")
        real(rel)

    monkeypatch.setattr(store.storage, "delete_tree", refused)
    store._retry_deletes[1] = (5000, 0.0)  # it has failed 5,000 times already
    report = store.gc_uncommitted()
    assert report.deleted == [2] and list(report.failed) == [1] and not report.error
    failures, not_before = store._retry_deletes[1]
    assert failures == 5001 and 0 < not_before - time.monotonic() <= store.DELETE_BACKOFF_MAX_S
    tried.clear()
    assert not store.gc_uncommitted().failed and tried == []  # in its backoff: not tried
    store._retry_deletes[1] = (5001, time.monotonic() - 1)  # the backoff is over
    monkeypatch.setattr(store.storage, "delete_tree", real)
    assert store.gc_uncommitted().deleted == [1] and store.step_dirs() == [3]


def test_a_new_step_directory_is_made_durable_in_its_parent(tmp_path, monkeypatch):
    from elastic.checkpoint import storage as storage_module

    synced = []
    real = storage_module._fsync_dir
    monkeypatch.setattr(storage_module, "_fsync_dir", lambda d: synced.append(d) or real(d))
    store = CheckpointStore(str(tmp_path / "runs"), RUN, retry=FAST)
    commit_tiny(store, 1)
    root = str(tmp_path / "runs")
    run, step1 = f"{root}/{RUN}", f"{root}/{RUN}/{step_dir(1)}"
    # The files' directory after each write; each directory created, in its parent, once.
    assert {str(tmp_path), root, run} <= set(synced) and synced.count(run) == 1
    assert synced.count(str(tmp_path)) == 1 and synced.count(root) == 1
    synced.clear()
    commit_tiny(store, 2)
    assert synced.count(run) == 1 and str(tmp_path) not in synced and step1 not in synced


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.ENOTSUP])
def test_a_filesystem_whose_directories_take_no_fsync_still_commits(tmp_path, monkeypatch, refusal):
    # Some SMB/CIFS and FUSE mounts answer a directory's fsync with EINVAL: taken for a refusal,
    # every shard and manifest write failed, though each file was whole under its final name.
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(refusal, os.strerror(refusal))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    commit_tiny(store, 1)
    assert store.committed_steps() == [1]
    state, _ = store.read_state(1)
    assert torch.equal(state["model"]["w"], torch.full((2,), 1.0))


def write_version_1_step(store: CheckpointStore, worker: FakeWorker, step: int, world_size: int = 2) -> dict:
    """A step as version 1 wrote it: a bare safetensors shard plus a meta-rN.json per rank."""
    tensors, skeleton = flatten_state(worker.get_state())
    rngs, entries = {}, []
    for rank in range(world_size):
        rngs[rank] = capture_rng()
        share = {n: tensors[n].clone() for n in rank_share(tensors, rank, world_size)[0]}
        meta = {"format": "elastic-checkpoint-rank-meta", "version": 1, "step": step, "rank": rank,
                "world_size": world_size, "tensors": sorted(share), "rng": rngs[rank],
                **({"state": skeleton} if rank == 0 else {})}
        for rel, data in ((shard_name(step, rank, world_size), encode_tensors(share)),
                          (meta_name(step, rank), canonical_json(meta))):
            store.storage.write_bytes(rel, data)
            entries.append(FileEntry(rel, len(data), sha256(data)))
    store.commit(step, entries, world_size, {"data": {"epoch": 0, "cursor": step * 10}})
    return rngs


def test_version_1_steps_still_load(backend):
    store = make_store(backend)
    worker = trained_worker(steps=3)
    rngs = write_version_1_step(store, worker, step=3)
    assert store.latest_valid() == 3
    state, meta = store.read_state()
    assert_same(state, worker.get_state())
    assert meta["data"]["cursor"] == 30
    assert store.read_rng(3, 1) == rngs[1]


def test_a_manifest_whose_file_record_has_no_checksum_is_corrupt(backend):
    store = make_store(backend)
    write_step(store, trained_worker(steps=2), step=2)
    write_step(store, trained_worker(steps=4), step=4)
    rel = f"{step_dir(4)}/manifest.json"
    body = {k: v for k, v in json.loads(store.storage.read_bytes(rel)).items() if k != "checksum"}
    for record in body["files"]:
        del record["sha256"]
    # A manifest that checks out as a whole (its own checksum recomputed) but vouches for nothing.
    store.storage.write_bytes(rel, canonical_json({**body, "checksum": sha256(canonical_json(body))}))
    with pytest.raises(CorruptCheckpoint, match="file records do not parse"):
        store.load_manifest(4)
    assert store.committed_steps() == [2] and store.latest_valid() == 2


def test_rank_meta_rides_in_the_shard_header(backend):
    store = make_store(backend)
    rng = capture_rng()
    (entry,) = store.write_rank_files(5, 0, 1, tiny_state(5), rng)
    data = store.storage.read_bytes(entry.path)
    meta = json.loads(decode_metadata(data)["elastic"])
    assert (meta["step"], meta["rank"], meta["rng"]) == (5, 0, rng) and "state" in meta
    assert set(decode_tensors(data)) == {"model/w"}  # the header holds no tensor of its own
    with pytest.raises(ValueError, match="header"):
        decode_metadata(data[:20])  # cut inside the header


# ---- retention ---------------------------------------------------------------------------------
def tiny_state(step: int) -> dict:
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
            "scheduler": None, "completed_step": step}


def commit_tiny(store: CheckpointStore, step: int) -> None:
    entries = store.write_rank_files(step, 0, 1, tiny_state(step))
    store.commit(step, entries, 1, {})


def hand_over(committer: CheckpointCommitter, store: CheckpointStore, step: int, state: dict) -> None:
    """Both ranks of a 2-rank group write ``state`` for ``step`` and hand their files to the committer."""
    for rank in range(2):
        committer.add(step, rank, 2, store.write_rank_files(step, rank, 2, state))
    committer.set_meta(step, {"cursor": step})


def hand_over_and_wait(committer: CheckpointCommitter, store: CheckpointStore, step: int) -> None:
    """``hand_over`` one step and wait until it commits: steps handed over faster than the commit
    thread commits supersede the waiting one, which a test counting commits must not race."""
    hand_over(committer, store, step, tiny_state(step))
    deadline = time.monotonic() + 10
    while committer.latest_committed != step and time.monotonic() < deadline:
        time.sleep(0.01)
    assert committer.latest_committed == step


def stall(store: CheckpointStore, method: str) -> tuple[threading.Event, threading.Event]:
    """Make ``store.<method>`` wait inside each call until released: ``(entered, release)``, set
    when a call is waiting and to let calls go on. The real method runs once released."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(store, method)

    def stalled(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    setattr(store, method, stalled)
    return entered, release


@pytest.mark.parametrize("keep_last,keep_every,expected", [
    (3, 0, [8, 9, 10]),
    (1, 0, [10]),
    (2, 4, [4, 8, 9, 10]),
    (1, 3, [3, 6, 9, 10]),
    (20, 0, list(range(1, 11))),
])
def test_retention_keeps_exactly_what_it_promises(tmp_path, keep_last, keep_every, expected):
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    for step in range(1, 11):
        commit_tiny(store, step)
    store.write_rank_files(11, 0, 1, tiny_state(11))  # in flight: retention must not touch it
    report = store.apply_retention(keep_last, keep_every)
    assert store.committed_steps() == expected
    assert sorted(report.deleted) == sorted(set(range(1, 11)) - set(expected))
    assert store.step_dirs() == expected + [11]
    assert store.apply_retention(keep_last, keep_every).deleted == []  # idempotent


def test_retention_on_every_backend_never_deletes_the_newest(backend):
    store = make_store(backend)
    for step in (1, 2, 3):
        commit_tiny(store, step)
    store.apply_retention(keep_last=1, keep_every=0)
    assert store.committed_steps() == [3]
    assert store.step_dirs() == [3]
    state, _ = store.read_state()
    assert state["completed_step"] == 3


@pytest.mark.parametrize("keep_last, keep_every, old, corrupt, resumed", [
    (1, 0, [10], [10], None),                        # nothing to resume from: the run starts over
    (3, 100, [100, 147, 148, 149], [147, 148, 149], 100),
])
def test_retention_of_a_resumed_run_never_deletes_what_it_commits_below_newer_corrupt_steps(
        tmp_path, keep_last, keep_every, old, corrupt, resumed):
    # Resume skips newer steps whose files fail their checksums. Counted by step number, they
    # used to take keep_last's places, and each step the resumed run committed was deleted at once.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in old:
        commit_tiny(store, step)
    for step in corrupt:
        path = shard_name(step, 0, 1)
        store.storage.write_bytes(path, store.storage.read_bytes(path)[:-3])
    assert store.latest_valid() == resumed
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=keep_last, keep_every=keep_every),
                                    latest_committed=resumed, retention_interval_s=0, gc_interval_s=0)
    try:
        first = (resumed or 0) + 1
        for step in range(first, first + 4):
            committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
            committer.set_meta(step, {})
            assert committer.flush(timeout_s=10)
            assert store.latest_valid() == step
        mine = [s for s in store.committed_steps() if s not in old]
        assert mine == list(range(first, first + 4))[-keep_last:]  # retention still keeps exactly keep_last
        # A restart that goes back to `first`: the later steps are this run's past, written again next.
        committer.rewind(first)
        committer.add(first + 1, 0, 1, store.write_rank_files(first + 1, 0, 1, tiny_state(first + 1)))
        committer.set_meta(first + 1, {})
        assert committer.flush(timeout_s=10)
        assert store.latest_valid() == first + 3 and first + 1 in store.committed_steps()
    finally:
        committer.close()


def test_newer_steps_a_resumed_run_left_behind_go_once_it_commits_past_them(tmp_path):
    # Resumed from 100 below corrupt 147-149, with another every_n_steps: the run never commits
    # those numbers again, and they used to stay on storage for good.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (100, 147, 148, 149):
        commit_tiny(store, step)
    for step in (147, 148, 149):
        path = shard_name(step, 0, 1)
        store.storage.write_bytes(path, store.storage.read_bytes(path)[:-3])
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=3, every_n_steps=10),
                                    latest_committed=100, retention_interval_s=0, gc_interval_s=0)
    try:
        for step in (110, 120, 130, 140, 150):
            committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
            committer.set_meta(step, {})
            assert committer.flush(timeout_s=10)
            on_storage = store.committed_steps()
            assert [s for s in on_storage if s >= 147 and s != 150] == ([] if step == 150 else [147, 148, 149])
        assert store.committed_steps() == [130, 140, 150] and store.latest_valid() == 150
    finally:
        committer.close()


def test_a_rollback_never_names_a_restored_step_retention_deleted(tmp_path):
    # Resumed from 100 with keep_last=1: 101 and 102 commit, and retention deletes 100 and 101.
    # A rollback to 101 then said the newest committed step was 100 (the step the run started
    # from, still on the committer's list of restored steps): the failure message and the
    # result named a step no longer on storage.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    commit_tiny(store, 100)
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=1), latest_committed=100,
                                    retention_interval_s=0, gc_interval_s=0)
    try:
        for step in (101, 102):
            committer.set_meta(step, {})
            committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
            assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [102]
        committer.rewind(101)
        assert committer.latest_committed is None
    finally:
        committer.close()


def test_a_passed_step_whose_delete_was_still_to_come_at_a_rewind_goes_once_passed_again(tmp_path, monkeypatch):
    # 105 is an earlier timeline's step above the base (100). Committing 106 passes it: its
    # delete is scheduled, and fails once (a transient error). A rollback to 103 came before the
    # retry and dropped the retry, and 105 was tracked nowhere after it: the run committed 104
    # and 106 again (never 105), and 105's manifest stayed on storage for the rest of the run.
    from elastic.checkpoint.storage import StorageError

    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (100, 105):
        commit_tiny(store, step)
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=5), latest_committed=100,
                                    retention_interval_s=0, gc_interval_s=0)
    real_delete, failed = store.storage.delete, []

    def delete_fails_once_for_105(rel):
        if rel.startswith(step_dir(105)) and not failed:
            failed.append(rel)
            raise StorageError("503 Slow Down (test)")
        return real_delete(rel)

    monkeypatch.setattr(store.storage, "delete", delete_fails_once_for_105)
    try:
        def commit(step):
            committer.set_meta(step, {})
            committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
            assert committer.flush(timeout_s=10)

        commit(106)
        assert failed and 105 in store.committed_steps()  # its delete failed: waiting for a retry
        committer.rewind(103)
        for step in (104, 106):
            commit(step)
        assert store.committed_steps() == [100, 104, 106]
    finally:
        committer.close()


def test_retention_during_an_outage_never_raises_and_catches_up():
    server = MotoS3().start()
    try:
        bucket = server.create_bucket()
        store = CheckpointStore(f"s3://{bucket}", RUN, server.storage_options(), retry=FAST)
        for step in (1, 2, 3):
            commit_tiny(store, step)
        server.stop()
        report = store.apply_retention(keep_last=1)
        assert report.error and not report.deleted and TEST_SECRET not in report.error
        assert store.gc_uncommitted().error
        server.start()
        assert store.apply_retention(keep_last=1).deleted == [1, 2]
    finally:
        server.stop()


def test_bulk_retention_failure_leaves_steps_uncommitted_and_is_retried(monkeypatch, delete_clock):
    """The files' bulk delete fails after the manifests' went: those steps are merely
    uncommitted (never committed with files missing), and the next pass removes them."""
    server = MotoS3().start()
    try:
        store = CheckpointStore(f"s3://{server.create_bucket()}", RUN, server.storage_options(), retry=FAST)
        files = {}
        for step in (1, 2, 3):
            entries = store.write_rank_files(step, 0, 1, tiny_state(step))
            store.commit(step, entries, 1, {})
            files[step] = [e.path for e in entries]
        real = store.storage.delete_files
        calls = []

        def flaky(rels, d):
            calls.append(rels)
            if len(calls) == 2:
                raise StorageError("503 Slow Down")
            return real(rels, d)

        monkeypatch.setattr(store.storage, "delete_files", flaky)
        report = store.apply_retention(1, committed=[1, 2, 3], files=files)
        assert report.deleted == [] and sorted(report.failed) == [1, 2]
        assert store.committed_steps() == [3] and store.step_dirs() == [1, 2, 3]
        # Retried once their backoff (1 s after a first failure) is over, not by the pass right after.
        assert store.apply_retention(1, committed=[3], files=files).deleted == [] and len(calls) == 2
        delete_clock.advance(1.05)
        assert store.apply_retention(1, committed=[3], files=files).deleted == [1, 2]
        assert store.step_dirs() == [3]
    finally:
        server.stop()


# ---- AsyncPersister ----------------------------------------------------------------------------
class SlowWriter:
    """A write function that blocks until released, to hold the persister busy."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.written: list[int] = []

    def __call__(self, payload):
        self.started.set()
        assert self.release.wait(10)
        self.written.append(payload)
        return [f"file-{payload}"]


def test_newest_snapshot_replaces_the_waiting_one():
    writer = SlowWriter()
    persister = AsyncPersister(writer)
    persister.submit(1, 1)
    assert writer.started.wait(5)
    t0 = time.monotonic()
    for step in range(2, 51):
        persister.submit(step, step)
        assert persister.waiting_step == step  # one slot: the newest, never a queue
        assert persister.inflight_step == 1
    assert time.monotonic() - t0 < 5  # submit never waits for the write (held until released below)
    assert persister.superseded == 48
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [1, 50]
    assert persister.drain() == [(1, ["file-1"]), (50, ["file-50"])]
    assert persister.drain() == []
    assert persister.close(5)


def test_light_reports_queue_in_order_and_only_snapshots_replace_each_other():
    """A rank's reports of steps it writes no file for wait behind its own slow write, in order;
    a newer snapshot still replaces a waiting snapshot, and the queue stays bounded."""
    writer = SlowWriter()
    persister = AsyncPersister(writer, max_light=3)
    persister.submit(1, 1)
    assert writer.started.wait(5)
    for step, light in ((2, True), (3, True), (5, False), (6, True), (9, False)):
        persister.submit(step, step, light=light)
    assert persister.superseded == 1  # 5 by 9
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [1, 2, 3, 6, 9]
    writer.release.clear()
    writer.started.clear()
    persister.submit(10, 10)
    assert writer.started.wait(5)
    for step in range(11, 17):
        persister.submit(step, step, light=True)
    writer.release.set()
    assert persister.flush(5)
    assert writer.written[5:] == [10, 13, 14, 15, 16]  # at most max_light + 1 wait: 11 and 12 dropped
    assert persister.close(5)


def persister_in_an_outage(step, payload, keep=False):
    """A persister whose storage is down (``state["down"]``) once it has begun to retry
    ``payload``: ``(persister, state, written, released)``."""
    state = {"down": True}
    written, released = [], []

    def write(payload):
        if state["down"]:
            raise StorageError("down")
        written.append(payload)
        return [payload]

    persister = AsyncPersister(write, retry_min_s=0.01, retry_max_s=0.02, on_release=released.append)
    persister.submit(step, payload, keep=keep)
    deadline = time.monotonic() + 5
    while not persister.in_outage and time.monotonic() < deadline:
        time.sleep(0.005)
    return persister, state, written, released


def test_an_outage_moves_on_to_the_newest_snapshot_but_never_past_a_milestone():
    """Milestones (keep_every) wait in order through an outage and are written once storage is
    back; the outage's move to the newest snapshot skipped them (and the one being retried)."""
    persister, state, written, released = persister_in_an_outage(10, "m10", keep=True)  # retried through it
    persister.submit(11, "s11")
    persister.submit(12, "r12", light=True)
    persister.submit(20, "m20", keep=True)
    persister.submit(21, "s21")  # replaces 11
    time.sleep(0.1)  # several retries: the milestone in flight is not left for the newest
    state["down"] = False
    assert persister.flush(5)
    assert written[0] == "m10" and "m20" in written and written[-1] == "s21" and "s11" not in written
    assert sorted(released) == sorted(["m10", "s11", "r12", "m20", "s21"])  # each exactly once
    persister.close(5)


def test_an_outage_moving_on_from_a_snapshot_writes_a_waiting_milestone_before_any_newer_step():
    """A snapshot (8) retried through an outage, then milestone 10 and snapshot 12 queued: the
    move-on went to 12, and 10 was written after it. The committer, past 10 once 12 was whole,
    took 10's parts for stale: the milestone never committed (or its commit raced the sweep
    that deletes the directories of steps below a commit). Now the move goes to 10, then 12."""
    persister, state, written, released = persister_in_an_outage(8, "s8")  # retried through it
    persister.submit(9, "r9", light=True)
    persister.submit(10, "m10", keep=True)
    persister.submit(11, "s11")
    persister.submit(12, "s12")  # replaces 11
    time.sleep(0.1)  # several retries, each a chance to move on
    state["down"] = False
    assert persister.flush(5)
    assert written == ["m10", "s12"]  # 8 superseded, the report before the milestone moot
    assert sorted(released) == sorted(["s8", "r9", "m10", "s11", "s12"])  # each exactly once
    persister.close(5)


def test_milestones_waiting_are_bounded_apart_from_reports_and_the_oldest_dropped_is_said():
    writer = SlowWriter()
    released = []
    persister = AsyncPersister(writer, max_light=32, max_keep=2, on_release=released.append)
    persister.submit(1, 1)
    assert writer.started.wait(5)
    for step in (10, 20, 30):  # every snapshot a milestone (keep_every == every_n_steps)
        persister.submit(step, step, keep=True)
    assert released == [10]  # two wait at most: whole copies of the state, not 32 of them
    events = [e for e in persister.drain_events() if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in events] == [10] and "milestone step 10 dropped" in events[0]["message"]
    for step in range(40, 45):
        persister.submit(step, step, light=True)  # reports do not push milestones out
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [1, 20, 30, 40, 41, 42, 43, 44]
    persister.close(5)


def test_milestones_a_rank_writes_no_file_for_do_not_push_out_the_waiting_copies_of_its_state():
    # A milestone the rank only reports its RNG for (the duty to write rotated elsewhere) took
    # one of max_keep's two places, kept for whole copies of the state: a third such report,
    # waiting behind this rank's one slow write, dropped the oldest, which then never committed.
    writer = SlowWriter()
    released = []
    persister = AsyncPersister(writer, max_light=32, max_keep=2, on_release=released.append)
    persister.submit(8, 8, keep=True)  # its own write of a milestone, slow
    assert writer.started.wait(5)
    for step in (9, 10, 11, 12):  # keep_every == every_n_steps: the other ranks' turns
        persister.submit(step, step, keep=True, light=True)
    persister.submit(13, 13, keep=True)
    persister.submit(14, 14, keep=True)  # two heavy milestones wait: the bound's, none dropped
    assert released == [] and not [e for e in persister.drain_events() if e["event"] == "checkpoint_failed"]
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [8, 9, 10, 11, 12, 13, 14]
    persister.close(5)
    # Bounded with the reports, a light milestone is still the last of them to go: on a node
    # agent's link (max_keep 32) it was dropped before the newer reports, which nothing promises.
    writer = SlowWriter()
    persister = AsyncPersister(writer, max_light=4, max_keep=32)
    persister.submit(1, 1, keep=True)
    assert writer.started.wait(5)
    persister.submit(2, 2, keep=True, light=True)
    for step in range(3, 9):
        persister.submit(step, step, light=True)
    failed = [(e["step"], e["error"]) for e in persister.drain_events() if e["event"] == "checkpoint_failed"]
    assert failed == [(3, "dropped"), (4, "dropped")]  # the oldest reports, not milestone 2
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [1, 2, 5, 6, 7, 8]
    persister.close(5)


def test_blocking_mode_writes_inline_and_never_raises():
    calls = []
    fail = {"on": False}

    def write(payload):
        if fail["on"]:
            raise StorageUnavailable("storage is down")
        calls.append(payload)
        return [payload]

    persister = AsyncPersister(write, blocking=True)
    persister.submit(1, "a")
    assert calls == ["a"] and persister.drain() == [(1, ["a"])]  # written before submit returned
    fail["on"] = True
    persister.submit(2, "b")  # does not raise
    persister.submit(3, "c")
    fail["on"] = False
    persister.submit(4, "d")
    assert persister.drain() == [(4, ["d"])]
    events = persister.drain_events()
    assert [e["event"] for e in events] == ["storage_outage", "storage_recovered"]
    assert events[0]["step"] == 2 and events[1]["step"] == 4 and events[1]["failed_attempts"] == 2
    assert persister._thread is None  # no thread in blocking mode


def test_a_bug_in_the_write_is_reported_not_raised():
    def write(payload):
        raise TypeError("cannot serialise")

    persister = AsyncPersister(write)
    persister.submit(1, None)
    assert persister.flush(5)
    events = persister.drain_events()
    assert events[0]["event"] == "checkpoint_failed" and "cannot serialise" in events[0]["error"]
    persister.close(1)


def test_a_writer_thread_that_cannot_start_writes_inline_and_never_raises(monkeypatch, tmp_path):
    """At the process's thread limit ``Thread.start`` raises ``RuntimeError``. The submit inside a
    training step then writes inline, as blocking mode does, says so once, and the next submit
    gets its background writer back once a thread can start."""
    import elastic.checkpoint.persister as persister_module

    limit = {"at": True}

    class LimitedThread(threading.Thread):
        def start(self):
            if limit["at"]:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(persister_module, "threading",
                        SimpleNamespace(Thread=LimitedThread, Condition=threading.Condition))
    written, released = [], []

    def write(payload):
        written.append((payload, threading.current_thread().name))
        return [payload]

    persister = AsyncPersister(write, on_release=released.append)
    persister.submit(1, "a")  # does not raise
    persister.submit(2, "b", light=True)
    here = threading.current_thread().name
    assert written == [("a", here), ("b", here)]  # written before submit returned, on the caller's thread
    assert released == ["a", "b"] and persister.drain() == [(1, ["a"]), (2, ["b"])]
    events = persister.drain_events()
    assert [e["event"] for e in events] == ["checkpoint_writer_inline"]  # once for the spell, not per submit
    assert events[0]["step"] == 1 and "can't start new thread" in events[0]["message"]
    assert persister._thread is None and persister.flush(1)
    limit["at"] = False
    persister.submit(3, "c")
    assert persister.flush(5) and persister.drain() == [(3, ["c"])]
    assert written[-1] == ("c", "elastic-checkpoint write")  # the background writer again
    assert persister.drain_events() == [] and released == ["a", "b", "c"]
    assert persister.close(5)
    # The committer hands steps over under the lock its commit takes: written inline there, the
    # first commit waited on that lock forever. Its thread starts when it is made, so no submit
    # of its writes inline, and a process at its limit fails at set-up.
    limit["at"] = True
    with pytest.raises(RuntimeError, match="can't start new thread"):
        AsyncPersister(write).start()
    limit["at"] = False
    committer = CheckpointCommitter(CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST))
    assert committer._persister._thread is not None
    committer.close()


def failing_persister(error: StorageError) -> tuple[AsyncPersister, dict]:
    """A persister whose writes raise ``error`` while ``state["failing"]``, returned once its
    first snapshot (step 1) has failed three times (or 5 s passed)."""
    state = {"failing": True, "attempts": 0}

    def write(payload):
        state["attempts"] += 1
        if state["failing"]:
            raise error
        return [payload]

    persister = AsyncPersister(write, retry_min_s=0.01, retry_max_s=0.02)
    persister.submit(1, 1)
    deadline = time.monotonic() + 5
    while state["attempts"] < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    return persister, state


def test_outage_retries_then_writes_the_newest():
    persister, state = failing_persister(StorageUnavailable("down"))
    assert persister.in_outage
    persister.submit(2, 2)
    persister.submit(3, 3)
    state["failing"] = False
    assert persister.flush(5)
    assert persister.drain() == [(3, [3])]  # 1 and 2 were superseded while storage was down
    kinds = [e["event"] for e in persister.drain_events()]
    assert kinds == ["storage_outage", "storage_recovered"]
    persister.close(1)


def test_storage_that_refuses_is_retried_and_said_to_need_the_user():
    """A permission or a missing bucket (what Storage does not retry): training goes on and the
    writes are retried as in an outage, since a fixed policy lets checkpoints catch up. It used to
    read as an outage of the endpoint; the event log now says that the user has to act."""
    persister, state = failing_persister(
        StorageError("write s3://bucket/run/step-000000001 failed: PermissionError: Access Denied"))
    assert state["attempts"] >= 3 and persister.in_outage
    state["failing"] = False
    assert persister.flush(5) and persister.drain() == [(1, [1])]
    events = persister.drain_events()
    assert [e["event"] for e in events] == ["storage_outage", "storage_refused", "storage_recovered"]
    assert events[0]["refused"] is True
    assert "not a transient error: check the credentials" in events[1]["message"]
    assert "PermissionError: Access Denied" in events[1]["message"]
    persister.close(1)


def test_close_gives_up_when_storage_stays_down():
    def write(payload):
        raise StorageError("down")

    persister = AsyncPersister(write, retry_min_s=0.01, retry_max_s=0.02)
    persister.submit(1, 1)
    t0 = time.monotonic()
    assert persister.close(0.2) is False
    assert time.monotonic() - t0 < 2
    assert not persister._thread.is_alive()


# ---- worker hook + committer -------------------------------------------------------------------
def run_training(workers, hooks, committer, steps, meta_fn=lambda s: {"data": {"cursor": s}}):
    reports = []
    for step in steps:
        for worker, hook in zip(workers, hooks):
            worker.train(step)
            out = hook.after_step(worker, step)
            reports.append(out)
            add_parts(committer, worker, out)
        committer.set_meta(step, meta_fn(step))
    return reports


def add_parts(committer, worker, out: dict) -> None:
    """Hand a rank's reported parts to the committer, as the controller does."""
    for done_step, part in out["ckpt_done"]:
        committer.add(done_step, worker.rank, worker.world_size, part["entries"], rng=part.get("rng"))


def finish(workers, hooks, committer) -> list[dict]:
    """End of training: wait for the writers, hand their last reports over, wait for the commit."""
    events = []
    for worker, hook in zip(workers, hooks):
        assert hook.flush(10, worker=worker)  # as TrainWorker.flush_checkpoint
        out = hook.drain()
        events += out["ckpt_events"]
        add_parts(committer, worker, out)
    assert committer.flush(10)
    return events


@pytest.mark.parametrize("blocking,min_shard_bytes", [(False, 0), (True, 0), (False, 10**9)])
def test_worker_hook_and_committer_end_to_end(backend, blocking, min_shard_bytes):
    """``min_shard_bytes=10**9``: rank 0 writes the whole state, rank 1 only reports its RNG."""
    _, url, options = backend
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(url, options, RUN, every_n_steps=2, blocking=blocking, retry=FAST,
                                min_shard_bytes=min_shard_bytes) for _ in workers]
    store = make_store(backend)
    # The committer in the run's mode, as the controller builds it: in blocking mode it commits
    # every step in order; a background committer may let step 4 replace a waiting step 2.
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=2, keep_last=2, blocking=blocking))
    try:
        reports = run_training(workers, hooks, committer, range(1, 5))
        expected = workers[0].get_state()
        # Train on before the background writes finish: the snapshot must be a copy.
        run_training(workers, hooks, committer, [5])
        finish(workers, hooks, committer)
        assert committer.latest_committed == 4
        assert committer.lag(5) == 1
        files = [e["path"] for e in store.load_manifest(4)["files"]]
        assert files == [shard_name(4, r, 2) for r in range(2 if min_shard_bytes == 0 else 1)]
        assert store.read_rng(4, 1) is not None
        # In the background, step 2 may be superseded by step 4 before it is written: that is the point.
        assert store.committed_steps() == [2, 4] if blocking else store.committed_steps()[-1] == 4
        state, meta = store.read_state(store.latest_valid())
        assert meta == {"data": {"cursor": 4}}
        assert_same(state, expected)
        for out in reports:
            assert set(out) == {"ckpt_done", "ckpt_events"}
            json.dumps(out)  # small and JSON-friendly
        if blocking:
            assert reports[2]["ckpt_done"][0][0] == 2  # rank 0, step 2: written inline, reported by the same call
        committed = [e["step"] for e in committer.drain_events() if e["event"] == "checkpoint_committed"]
        assert committed == store.committed_steps()

        # Step 6 makes step 2 fall out of keep_last=2.
        run_training(workers, hooks, committer, [6])
        finish(workers, hooks, committer)
        assert store.committed_steps() == [4, 6]
    finally:
        for hook in hooks:
            hook.close()
        committer.close()


def test_an_outages_tries_are_at_most_5_s_apart_by_default(monkeypatch):
    # 30 s by default: the tries of a 10 s outage had backed off to 8-16 s, and the run went that
    # long again on its old checkpoint with the storage back.
    monkeypatch.delenv("ELASTIC_CKPT_RETRY_MAX_S", raising=False)
    persister = AsyncPersister(lambda payload: [])
    try:
        assert persister.retry_max_s == 5.0
        waits = [persister._backoff_s(attempt) for attempt in range(64)]
        assert max(waits) <= 5.0 and waits[0] <= persister.retry_min_s and max(waits[10:]) >= 2.5
    finally:
        persister.close()
    monkeypatch.setenv("ELASTIC_CKPT_RETRY_MAX_S", "60")
    persister = AsyncPersister(lambda payload: [])
    assert persister.retry_max_s == 60.0
    persister.close()


def test_persister_releases_every_payload_exactly_once():
    """Written, replaced while waiting, dropped from a full light queue, failed, skipped in an
    outage, refused after close: each payload comes back once, and never while being written."""
    released: list = []
    writer = SlowWriter()
    persister = AsyncPersister(writer, max_light=1, on_release=released.append)
    persister.submit(1, 1)
    assert writer.started.wait(5)
    persister.submit(2, 2)
    persister.submit(3, 3)  # replaces 2
    persister.submit(4, 4, light=True)
    persister.submit(5, 5, light=True)  # the queue holds max_light + 1: 3 (the snapshot) goes
    assert sorted(released) == [2, 3]  # 1 is still being written
    writer.release.set()
    assert persister.flush(5)
    assert writer.written == [1, 4, 5]
    persister.close(5)
    persister.submit(6, 6)  # after close: dropped, and released
    assert sorted(released) == [1, 2, 3, 4, 5, 6]

    released.clear()
    state = {"down": True}

    def write(payload):
        if payload == "bug":
            raise TypeError("cannot serialise")
        if state["down"]:
            raise StorageError("down")
        return [payload]

    persister = AsyncPersister(write, retry_min_s=0.01, retry_max_s=0.02, on_release=released.append)
    persister.submit(1, "bug")
    assert persister.flush(5) and released == ["bug"]  # a failed write lets go of its payload too
    persister.submit(2, "a")
    deadline = time.monotonic() + 5
    while not persister.in_outage and time.monotonic() < deadline:
        time.sleep(0.005)
    persister.submit(3, "b")
    state["down"] = False
    assert persister.flush(5)
    assert released == ["bug", "a", "b"]  # "a" when the outage moved on to "b", then "b" once written
    persister.close(5)

    released.clear()
    blocking = AsyncPersister(write, blocking=True, on_release=released.append)
    blocking.submit(1, "x")
    assert released == ["x"]


def test_snapshot_buffers_are_recycled_without_mixing_steps(tmp_path):
    """Every step saved in the background for a dozen steps: the hooks recycle their host
    buffers, and every committed step still holds exactly that step's state."""
    url = f"file://{tmp_path}"
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(url, {}, RUN, every_n_steps=1, retry=FAST) for _ in workers]
    store = CheckpointStore(url, RUN, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=100))
    expected = {}
    try:
        for step in range(1, 13):
            run_training(workers, hooks, committer, [step])
            expected[step] = workers[0].get_state()
            time.sleep(0.01)  # let some writes finish, so buffers come back and are reused
        finish(workers, hooks, committer)
        assert sum(hook.staging.reused for hook in hooks) > 0
        committed = store.committed_steps()
        assert committed[-1] == 12 and len(committed) >= 3
        for step in committed:
            state, _ = store.read_state(step)
            assert_same(state, expected[step], f"step {step}")
    finally:
        for hook in hooks:
            hook.close()
        committer.close()


def test_rng_is_saved_per_rank(tmp_path):
    url = f"file://{tmp_path}"
    worker = FakeWorker(rank=0, world_size=1)
    hook = WorkerCheckpointer(url, {}, RUN, every_n_steps=1, blocking=True)
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    worker.completed_step = 1
    out = hook.after_step(worker, 1)
    (step, part), = out["ckpt_done"]
    store = CheckpointStore(url, RUN)
    store.commit(step, part["entries"], 1, {})
    torch.manual_seed(0)
    restore_rng(store.read_rng(1, 0))
    assert torch.equal(torch.rand(3), expected)
    hook.close()


def test_rng_read_inside_the_step_encodes_later_to_what_it_was_then():
    """``RawRng``: its reads are private copies (draws after ``take`` change nothing it encodes),
    its blobs back from one buffer (as the agent reads them from the slot) encode the same, and
    what it encodes restores every generator, numpy's cached gaussian included."""
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    np.random.standard_normal()  # leaves a cached gaussian behind: has_gauss is state too
    raw, expected = RawRng.take(), capture_rng()
    draws = (torch.rand(2), float(np.random.standard_normal()), float(np.random.rand()), random.random())
    assert raw.encode() == expected and expected["numpy"]["has_gauss"] == 1
    joined = b"".join(memoryview(b).cast("B").tobytes() for b in raw.blobs)
    assert len(joined) == sum(raw.lengths)
    fields = json.loads(json.dumps(raw.fields))  # as it travels in the message
    assert RawRng.from_bytes(fields, joined, raw.lengths).encode() == expected
    with pytest.raises(ValueError, match="do not match"):
        RawRng.from_bytes(fields, joined + b"\0", raw.lengths)  # bytes the lengths do not account for
    with pytest.raises(ValueError, match="do not match"):
        RawRng.from_bytes(fields, joined[:sum(raw.lengths[:2])], raw.lengths[:2])  # a generator missing
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    restore_rng(json.loads(json.dumps(raw.encode())))
    assert torch.equal(torch.rand(2), draws[0])
    assert (float(np.random.standard_normal()), float(np.random.rand()), random.random()) == draws[1:]


def test_rng_of_earlier_versions_as_json_lists_still_restores():
    """Before version 3 the two Mersenne Twister states were JSON lists of ints; now base64."""
    random.seed(3)
    np.random.seed(4)
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    legacy = {"numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)},
              "python": {"version": version, "internal": list(internal), "gauss_next": gauss}}
    current = capture_rng()
    assert "keys_b64" in current["numpy"] and "internal_b64" in current["python"]
    expected = (random.random(), float(np.random.rand()))
    for saved in (legacy, json.loads(json.dumps(current))):
        random.seed(0)
        np.random.seed(0)
        restore_rng(saved)
        assert (random.random(), float(np.random.rand())) == expected


def test_cuda_rng_states_beyond_this_processs_devices_are_ignored(monkeypatch):
    # Saved where the process saw 4 GPUs, restored where it sees 1: set_rng_state_all indexed
    # devices that are not there (an IndexError, deferred to the first CUDA use).
    import base64

    set_states = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: set_states.append((bytes(state), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("indexes every saved device"))
    states = [base64.b64encode(bytes([i]) * 16).decode() for i in range(4)]
    restore_rng({"cuda": states})
    assert set_states == [(bytes([0]) * 16, 0)]


def test_committer_waits_for_every_rank_and_the_meta(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store)
    state = tiny_state(3)
    e0 = store.write_rank_files(3, 0, 2, state)
    e1 = store.write_rank_files(3, 1, 2, state)
    committer.add(3, 0, 2, e0)
    committer.set_meta(3, {"cursor": 3})
    assert committer.flush(5) and committer.latest_committed is None  # rank 1 missing
    assert committer.holds(3, 0) and not committer.holds(3, 1) and not committer.holds(4, 0)
    committer.add(3, 1, 2, [e.to_dict() for e in e1])
    assert committer.flush(5) and committer.latest_committed == 3
    assert committer.holds(3, 1) and committer.holds(2, 1)  # committed, or past needing parts
    committer.add(3, 1, 2, e1)  # a late duplicate is ignored
    assert committer.lag(10) == 7
    committer.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_a_blocking_committer_commits_every_step_in_order(tmp_path, monkeypatch, blocking):
    """Steps complete faster than a commit takes: non-blocking, a newer step replaces a waiting
    one; blocking, every step commits, in order."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    commit = store.commit

    def slow_commit(*args, **kwargs):
        time.sleep(0.05)
        return commit(*args, **kwargs)

    monkeypatch.setattr(store, "commit", slow_commit)
    committer = CheckpointCommitter(store, CheckpointConfig(blocking=blocking, keep_last=10))
    for step in range(1, 7):
        committer.set_meta(step, {"cursor": step})
        committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
    assert committer.flush(10)
    if blocking:
        assert store.committed_steps() == [1, 2, 3, 4, 5, 6]
    else:
        assert len(store.committed_steps()) < 6 and store.committed_steps()[-1] == 6
    committer.close()


def test_a_blocking_committer_far_behind_still_commits_every_step(tmp_path, monkeypatch):
    # The commit thread held up (an outage's backoff, a suspect step's wait) while 40 steps were
    # handed over: the persister kept 33 light payloads and dropped the oldest with a debug line.
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    commit, held = store.commit, threading.Event()

    def held_first(*args, **kwargs):
        held.wait(10)
        return commit(*args, **kwargs)

    monkeypatch.setattr(store, "commit", held_first)
    committer = CheckpointCommitter(store, CheckpointConfig(blocking=True, keep_last=100))
    try:
        for step in range(1, 41):
            committer.set_meta(step, {"cursor": step})
            committer.add(step, 0, 1, store.write_rank_files(step, 0, 1, tiny_state(step)))
        held.set()
        assert committer.flush(20)
        assert store.committed_steps() == list(range(1, 41))
        assert not [e for e in committer.drain_events() if e["event"] == "checkpoint_failed"]
    finally:
        committer.close()


def test_a_light_payload_the_persister_drops_is_an_event(monkeypatch):
    release, held = [], threading.Event()
    persister = AsyncPersister(lambda payload: held.wait(10), name="checkpoint commit", max_light=2,
                               on_release=release.append)
    try:
        for step in range(1, 6):
            persister.submit(step, f"p{step}", light=True)
        dropped = [e for e in persister.drain_events() if e["event"] == "checkpoint_failed"]
        assert [e["step"] for e in dropped] and all(e["error"] == "dropped" for e in dropped)
        assert [f"p{e['step']}" for e in dropped] == [p for p in release if p in {f"p{e['step']}" for e in dropped}]
    finally:
        held.set()
        persister.close(5)


@pytest.mark.parametrize("dies_in", ["thread_init", "write"])
def test_a_writer_thread_that_dies_releases_what_waits_and_says_so(dies_in):
    # The thread ended on an error its handlers did not take: what waited was never written
    # nor released (a node agent's slots never came back), and close() said all was written.
    released, started = [], threading.Event()

    def write(payload):
        started.set()
        if dies_in == "write":
            time.sleep(0.2)
            raise SystemExit("bug")  # past the writer's handlers (they take Exception)
        return []

    def init():
        if dies_in == "thread_init":
            time.sleep(0.2)
            raise RuntimeError("cannot join the writer priority class")

    persister = AsyncPersister(write, name="checkpoint write", thread_init=init, on_release=released.append)
    persister.submit(1, "p1", keep=True)
    persister.submit(2, "p2", keep=True)
    assert not persister.flush(5)
    assert set(released) == {"p1", "p2"}
    persister.submit(3, "p3")  # dropped, released at once
    assert "p3" in released and not persister.close(1)
    (event,) = [e for e in persister.drain_events() if e["event"] == "checkpoint_failed"]
    assert "its writer thread died" in event["message"]


def test_a_committer_whose_cleanup_thread_cannot_start_leaves_no_commit_thread(tmp_path, monkeypatch):
    from elastic.checkpoint import committer as committer_module

    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    real = threading.Thread

    class AtItsLimit(real):
        def start(self):
            if self.name == "elastic-checkpoint cleanup":
                raise RuntimeError("can't start new thread")
            super().start()

    before = {t.ident for t in threading.enumerate()}
    monkeypatch.setattr(committer_module.threading, "Thread", AtItsLimit)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        CheckpointCommitter(store)
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.ident not in before] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.ident not in before]


def test_committer_keeps_the_meta_of_a_step_written_long_ago(tmp_path):
    """Slow storage and fast steps: the report for step 100 arrives 200 steps later."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store)
    for step in range(1, 301):
        committer.set_meta(step, {"cursor": step})
    entries = {r: store.write_rank_files(100, r, 2, tiny_state(100)) for r in range(2)}
    committer.add(100, 0, 2, entries[0])
    committer.add(100, 1, 2, entries[1])
    assert committer.flush(5) and committer.latest_committed == 100
    assert store.read_state(100)[1] == {"cursor": 100}
    committer.close()


def test_committer_prunes_steps_a_rank_skipped(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=2))
    for step in range(1, 11):
        committer.set_meta(step, {"cursor": step})
    assert sorted(committer._metas) == [2, 4, 6, 8, 10]  # only checkpoint steps are kept
    e4 = {r: store.write_rank_files(4, r, 2, tiny_state(4)) for r in range(2)}
    e6 = {r: store.write_rank_files(6, r, 2, tiny_state(6)) for r in range(2)}
    committer.add(4, 0, 2, e4[0])
    committer.add(6, 1, 2, e6[1])  # rank 1 skipped 4 (superseded): 4 can never complete
    assert sorted(committer._metas) == [6, 8, 10] and sorted(committer._reports) == [6]
    committer.add(6, 0, 2, e6[0])
    assert committer.flush(5) and committer.latest_committed == 6
    assert sorted(committer._metas) == [8, 10] and committer._reports == {}
    committer.close()


def test_snapshot_failure_does_not_stop_training(tmp_path):
    # A snapshot that fails for a reason of the moment is an event; a state no checkpoint can
    # store ends the run instead (test_checkpoint_agent's unsaveable-state test).
    def unavailable():
        raise RuntimeError("the scheduler's state is being rebuilt")

    worker = FakeWorker()
    worker.scheduler.state_dict = unavailable
    hook = WorkerCheckpointer(f"file://{tmp_path}", {}, RUN, every_n_steps=1, blocking=True)
    out = hook.after_step(worker, 1)
    assert out["ckpt_done"] == []
    assert out["ckpt_events"][0]["event"] == "checkpoint_failed" and "rebuilt" in out["ckpt_events"][0]["error"]
    hook.close()


def test_worker_warm_up_opens_the_client_and_never_raises(caplog):
    """Before training a worker makes one cheap request, so its first checkpoint does not pay
    for the S3 client's set-up; with the endpoint down it only logs, at once."""
    server = MotoS3().start()
    try:
        url, options = f"s3://{server.create_bucket()}", server.storage_options()
        hook = WorkerCheckpointer(url, options, RUN, every_n_steps=1, blocking=True, retry=FAST)
        calls = []
        real = hook.store.storage.exists
        hook.store.storage.exists = lambda rel, retry=None: calls.append(rel) or real(rel, retry)
        hook.warm_up()
        assert calls == [""]
        server.stop()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            hook.warm_up()
        assert time.monotonic() - t0 < 10
        assert "did not answer a warm-up request" in caplog.text and TEST_SECRET not in caplog.text
        hook.close()
    finally:
        server.stop()


def test_store_validate(tmp_path):
    CheckpointStore(f"file://{tmp_path}", RUN).validate()
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        CheckpointStore("foo://bucket", RUN).validate()


# ---- a storage outage against a real S3 endpoint -----------------------------------------------
def test_s3_outage_is_survived_and_the_newest_step_commits():
    server = MotoS3().start()
    bucket = server.create_bucket()
    url, options = f"s3://{bucket}", server.storage_options()
    workers = [FakeWorker(rank=r, world_size=2) for r in range(2)]
    hooks = [WorkerCheckpointer(url, options, RUN, every_n_steps=1, retry=FAST, retry_min_s=0.02, retry_max_s=0.1)
             for _ in workers]
    store = CheckpointStore(url, RUN, options, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=2, retry_min_s=0.02, retry_max_s=0.1)
    try:
        store.validate()
        run_training(workers, hooks, committer, [1, 2])
        finish(workers, hooks, committer)
        assert committer.latest_committed == 2

        server.stop()
        reports = run_training(workers, hooks, committer, range(3, 9))
        time.sleep(0.3)
        reports += run_training(workers, hooks, committer, [9, 10])
        expected = workers[0].get_state()
        assert all(out["ckpt_done"] == [] for out in reports)  # training went on; nothing was written
        # The next retry moves each writer on to the newest snapshot.
        deadline = time.monotonic() + 10
        while not all(h.persister.inflight_step == 10 for h in hooks) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(h.persister.in_outage and h.persister.inflight_step == 10 for h in hooks)
        assert committer.latest_committed == 2

        server.start()  # the same port; moto kept the bucket
        events = finish(workers, hooks, committer)
        assert committer.latest_committed == 10
        assert store.latest_valid() == 10
        state, meta = store.read_state(10)
        assert_same(state, expected)
        assert meta == {"data": {"cursor": 10}}
        assert store.committed_steps() == [2, 10]  # keep_last=2; nothing in between was committed

        events += [e for out in reports for e in out["ckpt_events"]]
        kinds = [e["event"] for e in events]
        assert kinds.count("storage_outage") == 2 and kinds.count("storage_recovered") == 2
        assert all(e["message"] for e in events)
        assert TEST_SECRET not in json.dumps(events) + json.dumps(committer.drain_events())
    finally:
        for hook in hooks:
            hook.close()
        committer.close()
        server.stop()


def test_committer_retention_without_listing_storage_each_commit(tmp_path, monkeypatch):
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=3600)
    listings = []
    real = store.committed_steps
    monkeypatch.setattr(store, "committed_steps", lambda: listings.append(1) or real())
    state = tiny_state(1)
    for step in range(1, 7):
        hand_over(committer, store, step, state)
        assert committer.flush(5)
    assert real() == [5, 6]  # exactly keep_last, from the committer's own list
    assert len(listings) == 1  # storage listed once (steps of earlier runs), not after every commit
    store.write_rank_files(7, 0, 2, state)  # a torn write: one rank's shard, no manifest
    committer.gc_interval_s = 0  # the periodic sweep (due now) removes directories no manifest commits
    hand_over(committer, store, 8, state)
    assert committer.flush(5)
    assert store.step_dirs() == [6, 8]
    committer.close()


def test_committer_deletes_the_files_it_committed_without_finding_them(backend, monkeypatch):
    store = make_store(backend)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=3600)
    trees = []
    real_tree = store.storage.delete_tree
    monkeypatch.setattr(store.storage, "delete_tree", lambda rel: trees.append(rel) or real_tree(rel))

    def commit(step):
        hand_over(committer, store, step, tiny_state(step))
        assert committer.flush(10)

    for step in (1, 2, 3):
        commit(step)
    assert store.step_dirs() == [3]
    assert trees == []  # steps 1 and 2 went by their known files: no walk, no LIST

    store.storage.write_bytes(f"{step_dir(3)}/stray.bin", b"x")  # a file the manifest does not list
    commit(4)
    # Either way the stray goes with its directory, by one walk: on a filesystem retention finds
    # the directory not empty after the known files and removes it as a tree; on an object store
    # retention deletes the known keys in bulk, which leaves an uncommitted prefix, and the
    # sweep at flush removes that.
    assert trees == [step_dir(3)] and store.step_dirs() == [4] and store.committed_steps() == [4]
    committer.close()


def test_committer_batches_retention_and_flush_leaves_exactly_keep_last(backend, monkeypatch):
    """While training runs, retention deletes at most every ``retention_interval_s``: the steps
    in between stay. ``flush()`` runs a pass, after which exactly ``keep_last`` remain; on an
    object store the four doomed steps go in two bulk requests (manifests, then files)."""
    store = make_store(backend)
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=3600, retention_interval_s=3600)
    calls = []
    real = store.storage.delete_files
    monkeypatch.setattr(store.storage, "delete_files", lambda rels, d: calls.append(len(rels)) or real(rels, d))
    for step in range(1, 7):
        hand_over(committer, store, step, tiny_state(step))
        deadline = time.monotonic() + 10
        while committer.latest_committed != step and time.monotonic() < deadline:
            time.sleep(0.01)
    assert committer.latest_committed == 6
    assert store.committed_steps() == [1, 2, 3, 4, 5, 6]  # no pass since the first commit
    assert calls == []
    files = sum(len(store.load_manifest(s)["files"]) for s in range(1, 5))
    assert committer.flush(10)
    assert store.committed_steps() == [5, 6] and store.step_dirs() == [5, 6]
    if store.storage.is_object_store:
        assert calls == [4, files]  # the 4 manifests, then every shard of the 4 steps
    else:
        assert len(calls) == 4  # a step at a time: local deletes are cheap system calls
    deleted = [e for e in committer.drain_events() if e["event"] == "checkpoint_deleted"]
    assert [e["deleted"] for e in deleted] == [[1, 2, 3, 4]]
    committer.close()


def test_committer_reports_a_failed_delete_and_a_failed_sweep_as_events_and_retries_both(tmp_path, monkeypatch,
                                                                                          delete_clock):
    """A delete that fails is a ``checkpoint_delete_failed`` event naming the step and the error, a
    sweep that cannot list storage a ``checkpoint_cleanup_failed`` event; the commits stand, and a
    later pass deletes what the failed one left (README: these events are the ones that say so)."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, {}, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=3600, retention_interval_s=3600)
    for step in (1, 2):
        hand_over_and_wait(committer, store, step)
    assert committer.flush(10) and store.committed_steps() == [2]
    committer.drain_events()
    hand_over_and_wait(committer, store, 3)

    def refuse(*args, **kwargs):
        raise StorageError("503 Slow Down")

    with monkeypatch.context() as m:
        m.setattr(store.storage, "delete", refuse)  # a step's delete starts with its manifest
        m.setattr(store, "step_dirs", refuse)  # the sweep starts with a listing
        assert committer.flush(10)
    events = committer.drain_events()
    failed = [e for e in events if e["event"] == "checkpoint_delete_failed"]
    assert [(e["step"], e["error"]) for e in failed] == [(2, "503 Slow Down")]
    assert "could not delete step 2 (will retry)" in failed[0]["message"]
    swept = [e for e in events if e["event"] == "checkpoint_cleanup_failed"]
    assert [e["error"] for e in swept] == ["503 Slow Down"]
    assert not [e for e in events if e["event"] == "checkpoint_deleted"]
    assert store.committed_steps() == [2, 3] and committer.latest_committed == 3
    delete_clock.advance(1.05)  # a failed delete waits out its backoff (1 s after a first failure)
    assert committer.flush(10)
    assert store.committed_steps() == [3] and store.step_dirs() == [3]
    assert [e["deleted"] for e in committer.drain_events() if e["event"] == "checkpoint_deleted"] == [[2]]
    committer.close()


def test_flush_sweeps_superseded_writes_and_leaves_newer_ones(backend):
    """The end of a run (or a stop) leaves no uncommitted directory behind a committed step. One
    newer than the newest commit may still be written by a rank, and stays."""
    store = make_store(backend)
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=3600, retention_interval_s=3600)
    state = tiny_state(1)

    def commit(step):
        hand_over(committer, store, step, state)

    commit(1)
    assert committer.flush(10)  # the first commit's sweep is behind us; the next is an hour away
    store.write_rank_files(2, 0, 2, state)  # step 2: one rank's shard, superseded before it completed
    commit(3)
    deadline = time.monotonic() + 10
    while committer.latest_committed != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    store.write_rank_files(4, 0, 2, state)  # step 4: still being written
    assert store.step_dirs() == [1, 2, 3, 4]
    assert committer.flush(10)
    assert store.step_dirs() == [1, 3, 4] and store.committed_steps() == [1, 3]
    swept = [e for e in committer.drain_events() if e["event"] == "checkpoint_deleted"]
    assert [e["deleted"] for e in swept] == [[2]]
    committer.close()


def test_the_sweep_never_deletes_a_step_this_run_committed_when_its_manifest_reads_as_missing(backend,
                                                                                               monkeypatch):
    """An object store's read that answers "not found" for a manifest just listed (a lagging
    replica, a cache): the sweep took the committed step for a torn write and deleted all of
    it, a step retention keeps. Steps the committer knows committed are not the sweep's."""
    store = make_store(backend)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=3600, retention_interval_s=3600)
    for step in (1, 2, 3):
        hand_over(committer, store, step, tiny_state(step))
        deadline = time.monotonic() + 10
        while committer.latest_committed != step and time.monotonic() < deadline:
            time.sleep(0.01)
    assert committer.flush(10) and store.committed_steps() == [1, 2, 3]
    real = store.load_manifest

    def lagging(step, *args, **kwargs):
        if step == 2:
            raise FileNotFoundError(f"{step_dir(step)}/manifest.json")
        return real(step, *args, **kwargs)
    monkeypatch.setattr(store, "load_manifest", lagging)
    store.write_rank_files(4, 0, 2, tiny_state(4))  # a torn write the sweep should take
    hand_over(committer, store, 5, tiny_state(5))
    deadline = time.monotonic() + 10
    while committer.latest_committed != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert committer.flush(10)
    monkeypatch.setattr(store, "load_manifest", real)
    assert store.committed_steps() == [2, 3, 5] and store.step_dirs() == [2, 3, 5]
    swept = [e["deleted"] for e in committer.drain_events() if e["event"] == "checkpoint_deleted"]
    assert sorted(s for d in swept for s in d) == [1, 4]
    committer.close()


# ---- does a checkpoint fit the model and optimizer? ---------------------------------------------
def _trained_state(model, optimizer_fn):
    opt = optimizer_fn(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_a_state_fits_the_model_and_optimizer_it_came_from():
    from helpers import make_adam, make_model

    from elastic.checkpoint import state_mismatches

    saved = _trained_state(make_model(), make_adam)
    live_model = make_model()
    assert state_mismatches({"model": live_model.state_dict(),
                             "optimizer": make_adam(live_model.parameters()).state_dict()}, saved) == []


def test_another_model_or_optimizer_is_named_line_by_line():
    from helpers import make_adam, make_sgd

    from elastic.checkpoint import state_mismatches

    saved = _trained_state(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)),
                           make_adam)
    wider = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4), torch.nn.Linear(4, 4))
    sgd = make_sgd(wider.parameters()).state_dict()
    problems = state_mismatches({"model": wider.state_dict(), "optimizer": sgd}, saved)
    adam_only = sorted(set(saved["optimizer"]["param_groups"][0]) - set(sgd["param_groups"][0]))
    assert {"betas", "eps", "amsgrad"} <= set(adam_only)  # the names differ a little between torch versions
    assert problems == [
        "model: 2 key(s) of the model are not in the checkpoint: 3.weight, 3.bias",
        "model: 0.weight is [32, 16] in the checkpoint and [64, 16] in the model",
        "model: 0.bias is [32] in the checkpoint and [64] in the model",
        "model: 2.weight is [4, 32] in the checkpoint and [4, 64] in the model",
        "optimizer: param group 0 holds 4 parameter(s) in the checkpoint and 6 in this optimizer",
        f"optimizer: param group 0 of the checkpoint has hyperparameters this optimizer does not have: "
        f"{adam_only} (was it saved from another optimizer class?)",
    ]
    assert state_mismatches({"model": wider.state_dict(), "optimizer": sgd}, saved, limit=3)[2] == \
        "... and 4 more difference(s)"


def test_a_hyperparameter_newer_torch_added_still_fits():
    """torch's load_state_dict fills in a hyperparameter the checkpoint's torch did not have yet."""
    from helpers import make_adam, make_model

    from elastic.checkpoint import state_mismatches

    model = make_model()
    saved = _trained_state(model, make_adam)
    for group in saved["optimizer"]["param_groups"]:
        group.pop("decoupled_weight_decay", None)
        del group["amsgrad"]
    assert state_mismatches({"model": model.state_dict(), "optimizer": make_adam(model.parameters()).state_dict()},
                            saved) == []


def test_an_optimizer_or_scheduler_of_another_class_with_the_same_names_is_named():
    # AdamW's param groups have Adam's names: loading set decoupled_weight_decay back to False and
    # the AdamW trained as Adam. A LambdaLR resumed from a StepLR checkpoint loaded the model and
    # optimizer, then failed with KeyError: 'lr_lambdas' (no ConfigError, the state half-loaded).
    from helpers import make_model

    from elastic.checkpoint import state_mismatches

    model = make_model()
    saved = _trained_state(model, lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1))
    saved["scheduler"] = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1), 10).state_dict()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    lam = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1), lambda s: 1.0).state_dict()
    problems = state_mismatches({"model": model.state_dict(), "optimizer": adamw.state_dict(), "scheduler": lam},
                                saved)
    assert len(problems) == 2
    assert problems[0].startswith("optimizer: param group 0 has decoupled_weight_decay=False in the checkpoint and "
                                  "True in this optimizer") and "Adam against AdamW" in problems[0]
    assert problems[1].startswith("scheduler: the checkpoint's LR scheduler state has ") and "lr_lambdas" in problems[1]
    # The same classes fit; a scheduler added or removed between runs is no mismatch.
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1).state_dict()
    step = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1), 10).state_dict()
    assert state_mismatches({"model": model.state_dict(), "optimizer": adam, "scheduler": step}, saved) == []
    assert state_mismatches({"model": model.state_dict(), "optimizer": adam, "scheduler": None}, saved) == []


def test_a_scheduler_changed_inside_a_sequentiallr_or_chainedscheduler_is_named():
    # A SequentialLR has the same keys whatever it chains, and torch loads the chained
    # schedulers' states by position: a ConstantLR took a LinearLR's attributes silently, and a
    # checkpoint chaining three schedulers raised IndexError in the worker after the model and
    # optimizer had loaded ("list index out of range", no setting named).
    from torch.optim import lr_scheduler as lr

    from elastic.checkpoint import state_mismatches

    model = torch.nn.Linear(4, 3)

    def state(*chained, chain=lr.SequentialLR):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        schedulers = [make(opt) for make in chained]
        wrapped = chain(opt, schedulers, milestones=list(range(3, 3 * len(schedulers), 3))) \
            if chain is lr.SequentialLR else chain(schedulers)
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": wrapped.state_dict()}

    linear = lambda opt: lr.LinearLR(opt, 0.1, total_iters=3)
    constant = lambda opt: lr.ConstantLR(opt, 0.5, total_iters=3)
    cosine = lambda opt: lr.CosineAnnealingLR(opt, 10)
    saved = state(linear, cosine)
    assert state_mismatches(state(linear, cosine), saved) == []
    (problem,) = state_mismatches(state(constant, cosine), saved)
    assert problem.startswith("scheduler: the scheduler at position 0 in the checkpoint's LR scheduler state "
                              "(SequentialLR) has 'end_factor', 'start_factor' that this run's lacks and lacks factor")
    (problem,) = state_mismatches(state(linear, cosine), state(linear, constant, cosine))
    assert problem.startswith("scheduler: the checkpoint's LR scheduler state is a SequentialLR of 3 scheduler(s), "
                              "and this run's of 2")
    # ChainedScheduler keeps its schedulers' states in _schedulers too.
    chained = state(linear, cosine, chain=lr.ChainedScheduler)
    assert state_mismatches(state(linear, cosine, chain=lr.ChainedScheduler), chained) == []
    (problem,) = state_mismatches(state(linear, constant, chain=lr.ChainedScheduler), chained)
    assert "position 1" in problem and "(ChainedScheduler)" in problem and "T_max" in problem


def test_an_optimizer_with_a_subset_of_another_classes_names_is_named_by_its_state():
    # Adamax's hyperparameter names are a subset of Adam's (and RAdam's of NAdam's and Adam's),
    # so the names' check let them through: an Adamax checkpoint loaded into an Adam, whose first
    # step raised KeyError 'exp_avg_sq'; a RAdam one into a NAdam raised KeyError 'mu_product'
    # inside load_state_dict after the model had loaded; a RAdam one loaded into an Adam silently.
    from elastic.checkpoint import state_mismatches
    from elastic.checkpoint.compat import param_shapes_of

    def state(make, steps=1):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make(model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None}, param_shapes_of(opt)

    def check(live, saved):
        (live, shapes), (saved, _) = live, saved
        return state_mismatches(live, saved, param_shapes=shapes)

    adamax = state(lambda p: torch.optim.Adamax(p, lr=1e-3))
    for steps in (1, 0):  # a live Adam that has stepped, and a fresh one (a resume)
        (problem,) = check(state(lambda p: torch.optim.Adam(p, lr=1e-3), steps), adamax)
        assert problem == ("optimizer: the checkpoint's per-parameter state keeps 'exp_inf', which Adam or AdamW "
                           "does not keep, and lacks exp_avg_sq, which Adam or AdamW needs (it was saved from Adamax)")
    radam = state(lambda p: torch.optim.RAdam(p, lr=1e-3))
    (problem,) = check(state(lambda p: torch.optim.NAdam(p, lr=1e-3), 0), radam)
    assert "lacks mu_product, which NAdam needs (it was saved from RAdam)" in problem
    (problem,) = check(state(lambda p: torch.optim.Adam(p, lr=1e-3), 0), radam)
    assert problem.startswith("optimizer: the checkpoint's param groups have exactly RAdam's hyperparameters and "
                              "this optimizer is Adam or AdamW")
    # The same class fits, fresh or stepped, with the settings that add state keys or none.
    for make in (lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
                 lambda p: torch.optim.Adamax(p, lr=1e-3), lambda p: torch.optim.NAdam(p, lr=1e-3),
                 lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True)):
        for steps in (1, 0):
            assert check(state(make, steps), state(make)) == []

    class AdamWithEma(torch.optim.Adam):  # Adam's names, a state key of its own
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["ema"] = p.detach().clone()

    # Not of torch.optim (param_shapes_of gives None): its state is its own, a fresh one fits.
    ema = state(AdamWithEma)
    assert ema[1] is None and check(state(AdamWithEma, 0), ema) == []


def test_layers_of_the_same_shapes_declared_in_another_order_are_named_not_given_each_others_moments():
    # The model's state loads by name and fits; torch gives the optimizer's state by position, so
    # fc1's momentum went to fc2 and back, silently. The checkpoint keeps the parameters' names.
    from elastic.checkpoint import state_mismatches
    from elastic.checkpoint.compat import PARAM_NAMES_KEY, param_names_of

    class Before(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class After(torch.nn.Module):  # the same layers, fc2 declared first
        def __init__(self):
            super().__init__()
            self.fc2 = torch.nn.Linear(4, 4)
            self.fc1 = torch.nn.Linear(4, 4)

    def state(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                PARAM_NAMES_KEY: param_names_of(model, opt)}

    saved = state(Before())
    assert saved[PARAM_NAMES_KEY] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    problems = state_mismatches(state(After()), saved)
    assert len(problems) == 1 and problems[0].startswith(
        "optimizer: its state goes to parameters by position, and 4 position(s) hold another parameter than in "
        "the checkpoint (position 0 is 'fc1.weight' in the checkpoint and fc2.weight here; position 1 is "
        "'fc1.bias' in the checkpoint and fc2.bias here; position 2 is 'fc2.weight' in the checkpoint and "
        "fc1.weight here and 1 more): were the model's layers declared")
    assert state_mismatches(state(Before()), saved) == []
    unnamed = {k: v for k, v in saved.items() if k != PARAM_NAMES_KEY}  # written before names were kept
    assert state_mismatches(state(After()), unnamed) == [] and state_mismatches(unnamed, saved) == []


def test_an_optimizer_built_from_named_parameters_and_one_built_from_plain_ones_fit_each_other():
    # torch keeps named parameters' names in the param groups (param_names) and loads them
    # either way; they were taken for a hyperparameter of another optimizer class.
    from elastic.checkpoint import state_mismatches

    model = torch.nn.Linear(4, 3)
    named = torch.optim.SGD(list(model.named_parameters()), lr=0.1).state_dict()
    plain = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    assert "param_names" in named["param_groups"][0]
    for live, saved in ((plain, named), (named, plain)):
        assert state_mismatches({"model": model.state_dict(), "optimizer": live, "scheduler": None},
                                {"model": model.state_dict(), "optimizer": saved, "scheduler": None}) == []
    torch.optim.SGD(model.parameters(), lr=0.1).load_state_dict(named)  # as torch loads it


def test_a_dropped_scheduler_that_wrote_its_own_keys_into_the_groups_still_fits():
    # OneCycleLR writes max_lr, min_lr and its momentum bounds into every param group (CyclicLR
    # its momentum bounds, SWALR swa_lr); a run that dropped it was refused as "another optimizer
    # class", though torch loads such groups and the optimizer never reads those keys.
    from elastic.checkpoint import state_mismatches

    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cycle = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=10)
    saved = {"model": model.state_dict(), "optimizer": sgd.state_dict(), "scheduler": cycle.state_dict()}
    assert {"max_lr", "min_lr", "max_momentum", "base_momentum"} <= set(saved["optimizer"]["param_groups"][0])
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    assert state_mismatches({"model": model.state_dict(), "optimizer": plain, "scheduler": None}, saved) == []
    # Another class's names still differ outside those keys.
    adam = torch.optim.Adam(model.parameters(), lr=0.1).state_dict()
    (problem,) = state_mismatches({"model": model.state_dict(), "optimizer": adam, "scheduler": None}, saved)
    assert "momentum" in problem and "another optimizer class" in problem


def test_a_scheduler_dropped_or_saved_by_another_torch_still_fits():
    """A run that drops its scheduler reads the scheduler's initial_lr in the saved param groups;
    a scheduler's state from another torch has keys of that version (verbose, no _is_initial).
    Both were refused as another class."""
    from elastic.checkpoint import state_mismatches

    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(sgd, 10)
    saved = {"model": model.state_dict(), "optimizer": sgd.state_dict(), "scheduler": step.state_dict()}
    assert "initial_lr" in saved["optimizer"]["param_groups"][0]
    plain = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    assert state_mismatches({"model": model.state_dict(), "optimizer": plain, "scheduler": None}, saved) == []
    older = dict(step.state_dict(), verbose=False)
    del older["_is_initial"]
    live = {"model": model.state_dict(), "optimizer": sgd.state_dict(), "scheduler": step.state_dict()}
    assert state_mismatches(live, dict(saved, scheduler=older)) == []
    # Another class still differs outside those keys.
    multi = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(model.parameters(), lr=0.1), [5]).state_dict()
    (problem,) = state_mismatches(live, dict(saved, scheduler=multi))
    assert "milestones" in problem and "step_size" in problem


def test_a_sequential_schedule_into_multisteplr_resumes_past_its_hand_over():
    """MultiStepLR keeps its milestones in a Counter; restored as a dict, SequentialLR's hand-over
    to it (a closed-form step calling .elements()) raised AttributeError after a resume."""
    from torch.optim import lr_scheduler as lr

    from elastic.checkpoint.codec import SkeletonJson, canonical_json, flatten_state, unflatten_state

    def schedule():
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        return opt, lr.SequentialLR(opt, [lr.LinearLR(opt, 0.1, total_iters=3), lr.MultiStepLR(opt, [5, 8])], [3])

    opt, sched = schedule()
    opt.step()
    sched.step()  # one step into the warm-up, as a checkpoint mid-warm-up has it
    tensors, skeleton = flatten_state(sched.state_dict())
    for text in (canonical_json(skeleton), SkeletonJson().dumps(skeleton)):
        state = unflatten_state(tensors, json.loads(text))
        assert type(state["_schedulers"][1]["milestones"]) is collections.Counter
        opt2, resumed = schedule()
        resumed.load_state_dict(state)
        for _ in range(12):  # past the hand-over at step 3 and MultiStepLR's milestones after it
            opt2.step()
            resumed.step()
        assert resumed.get_last_lr() == pytest.approx([0.001])  # 0.1, decayed at both milestones


def test_a_model_compiled_in_one_run_and_not_the_other_is_named_as_that():
    from elastic.checkpoint import state_mismatches

    model = torch.nn.Linear(4, 3)
    plain = {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict()}
    compiled = dict(plain, model={f"_orig_mod.{k}": v for k, v in model.state_dict().items()})
    for live, saved in ((plain, compiled), (compiled, plain)):
        (problem,) = state_mismatches(live, saved)
        assert "torch.compile's '_orig_mod.' prefix" in problem


class _TwoLayers(torch.nn.Module):
    def __init__(self, b_first: bool = False):
        super().__init__()
        if b_first:
            self.b = torch.nn.Linear(3, 2)
        self.a = torch.nn.Linear(4, 3)
        if not b_first:
            self.b = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_optimizer_state_for_parameters_declared_in_another_order_is_named():
    """Same names and shapes, so the model's check passes; torch gives the optimizer's state to
    parameters by position, and Adam's moments of a.weight went to b.weight: the first step
    failed inside the worker on their shapes."""
    from elastic.checkpoint import state_mismatches

    torch.manual_seed(0)
    old = _TwoLayers()
    adam = torch.optim.Adam(old.parameters(), lr=1e-3)
    old(torch.randn(5, 4)).sum().backward()
    adam.step()
    saved = {"model": old.state_dict(), "optimizer": adam.state_dict()}

    def check(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        shapes = [list(p.shape) for g in opt.param_groups for p in g["params"]]
        return state_mismatches({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved,
                                param_shapes=shapes)

    assert check(_TwoLayers()) == []
    problems = check(_TwoLayers(b_first=True))
    assert problems and problems[0].startswith("optimizer: the state of parameter 0 (exp_avg) is [3, 4] in the "
                                               "checkpoint, and that parameter is [2, 3] in this model")
    assert "declared in another order" in problems[0]


def test_checkpoint_mismatch_survives_pickling_whole():
    """It travels from a worker to the controller pickled."""
    import pickle

    from elastic.checkpoint import CheckpointMismatch

    err = CheckpointMismatch(7, "s3://bucket/run", ["model: a.weight is [2] in the checkpoint and [3] in the model"])
    back = pickle.loads(pickle.dumps(err))
    assert (back.step, back.location, back.problems, str(back)) == (err.step, err.location, err.problems, str(err))
    assert "RunConfig.name" in str(back) and "step 7 in s3://bucket/run" in str(back)


def test_commits_go_on_while_a_cleanup_pass_is_slow(tmp_path, caplog):
    """Retention and GC run on a thread of their own: a pass that takes long (an S3 listing under
    load) holds no commit back, and the commits it missed are all taken in by the next pass. A
    fresh run's own commits are not mistaken for steps an earlier run left above its start."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=0, retention_interval_s=0)
    entered, release = stall(store, "apply_retention")
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.committer"):
        hand_over(committer, store, 1, tiny_state(1))
        assert entered.wait(10)  # the first pass is stuck in retention
        for step in range(2, 6):
            hand_over_and_wait(committer, store, step)
        assert store.committed_steps() == [1, 2, 3, 4, 5]
        release.set()
        assert committer.flush(10)
    assert store.committed_steps() == [4, 5]
    assert not [r for r in caplog.records if "newer than step" in r.getMessage()]
    commits = [e for e in committer.drain_events() if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in commits] == [1, 2, 3, 4, 5]
    committer.close()


def test_a_resumed_runs_commits_during_its_first_listing_are_its_own(tmp_path, caplog):
    """The cleanup thread's first pass lists storage for the steps earlier runs left. Steps this
    run commits while that listing runs show up in it above the step the run resumed from; they
    are this run's, counted by retention, never deleted as another timeline's nor warned about."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in range(1, 6):
        commit_tiny(store, step)
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=3), latest_committed=5,
                                    retention_interval_s=0, gc_interval_s=0)
    listed, release = stall(store, "committed_steps")
    try:
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.committer"):
            hand_over(committer, store, 6, tiny_state(6))
            assert listed.wait(10)  # the first pass lists, and commits go on meanwhile
            for step in (7, 8):
                hand_over_and_wait(committer, store, step)
            # Step 9's manifest is written while the listing waits, and the commit thread takes
            # it in only after the first pass is through: the listing sees 9 before the pass
            # knows it as this run's (what a loaded machine once did, by chance).
            written, passed = threading.Event(), threading.Event()
            real_commit, real_retention = store.commit, store.apply_retention

            def commit(step, *args, **kwargs):
                out = real_commit(step, *args, **kwargs)
                if step == 9:
                    written.set()
                    assert passed.wait(10)
                return out

            def apply_retention(*args, **kwargs):
                try:
                    return real_retention(*args, **kwargs)
                finally:
                    passed.set()

            store.commit, store.apply_retention = commit, apply_retention
            hand_over(committer, store, 9, tiny_state(9))
            assert written.wait(10)
            release.set()
            assert committer.flush(10)
        assert CheckpointStore.committed_steps(store) == [7, 8, 9]
        assert not [r for r in caplog.records if "newer than step" in r.getMessage()]
    finally:
        release.set()
        committer.close()


def test_flush_waits_for_a_stuck_cleanup_pass_no_longer_than_its_timeout(tmp_path):
    """A recovery flushes with a timeout: a retention pass stuck on storage (a listing the store
    keeps retrying) must not hold it past that. flush() answers that every step is committed, the
    event log says the cleanup is late, and the pass still finishes on its own afterwards."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0, retention_interval_s=0)
    entered, release = stall(store, "apply_retention")
    try:
        hand_over_and_wait(committer, store, 1)
        assert entered.wait(10)
        hand_over_and_wait(committer, store, 2)
        t0 = time.monotonic()
        assert committer.flush(timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        assert "checkpoint_cleanup_late" in [e["event"] for e in committer.drain_events()]
        assert store.committed_steps() == [1, 2]  # the pass has not deleted anything yet
        release.set()
        assert committer.flush(timeout_s=10)  # this one waits for a pass that starts after it asks
        assert store.committed_steps() == [2]
    finally:
        release.set()
        committer.close()


def commit_6_after_a_rewind_to_5(committer: CheckpointCommitter, store: CheckpointStore) -> None:
    """Steps 1-5 commit; step 6's commit is under way when a recovery's flush gives up on it and
    the run goes back to 5; then step 6's manifest lands (left behind)."""
    for step in range(1, 6):
        hand_over_and_wait(committer, store, step)
    entered, release = stall(store, "commit")
    hand_over(committer, store, 6, tiny_state(6))
    assert entered.wait(10)
    assert not committer.flush(timeout_s=0.2)  # the recovery's flush gives up on step 6
    committer.rewind(5)
    release.set()  # and now step 6's manifest lands


def test_a_manifest_that_lands_after_a_rewind_past_it_never_costs_the_step_training_went_back_to(backend):
    """A recovery flushes with a timeout, restores the newest committed step and rewinds to it,
    while the commit of a later step may still be on its way to storage. When that manifest
    landed, it used to count as committed: with keep_last=1 retention deleted the step training
    went back to, the new timeline's reports of that step number were dropped as stale, and its
    shards, written again, no longer matched the old manifest: nothing valid was left."""
    store = make_store(backend)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0, retention_interval_s=0)
    try:
        commit_6_after_a_rewind_to_5(committer, store)
        assert committer.flush(timeout_s=10)
        assert committer.latest_committed == 5
        assert 5 in store.committed_steps() and store.latest_valid() in (5, 6)
        assert "checkpoint_left_behind" in [e["event"] for e in committer.drain_events()]
        # The new timeline's step 6 (other bytes) commits over it, and step 5 goes as keep_last says.
        hand_over(committer, store, 6, tiny_state(60))
        assert committer.flush(timeout_s=10)
        assert committer.latest_committed == 6
        assert store.committed_steps() == [6] and store.latest_valid() == 6
        state, _ = store.read_state()
        assert state["completed_step"] == 60
    finally:
        committer.close()


def test_a_restore_of_a_step_a_rewind_left_behind_counts_it_as_the_newest_committed(tmp_path):
    """Step 6's manifest lands after a recovery went back to 5 (left behind); a second recovery
    restores 6, which checks out, before any cleanup pass took it in. The rewind to 6 looked for
    it among the steps passes had taken in only: it went above the base, and was deleted as
    passed once the run committed 7 (keep_last=2 kept one step). And the newest committed step
    stayed 5 (the lag, the failure message) until the next commit."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=0, retention_interval_s=0)
    try:
        commit_6_after_a_rewind_to_5(committer, store)  # the first recovery's
        deadline = time.monotonic() + 10
        while "checkpoint_left_behind" not in [e["event"] for e in committer.drain_events()]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        committer.rewind(6, restored=True)  # the second recovery restored it
        assert committer.latest_committed == 6
        hand_over_and_wait(committer, store, 7)
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [6, 7]
    finally:
        committer.close()


@pytest.mark.parametrize("pass_between", [False, True], ids=["not_taken_in", "taken_in_by_a_pass"])
def test_a_rollback_to_a_step_never_committed_says_the_newest_committed_below_it(tmp_path, pass_between):
    # every_n_steps=10: 10 and 20 committed, then a first-N rollback to 15 (a replica's state).
    # The newest committed step became 15, which has no manifest: the failure message's
    # "fit() again resumes from step 15", lag() and result's checkpoint said so.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=5, gc_interval_s=0, retention_interval_s=0)
    try:
        for step in (10, 20):
            hand_over_and_wait(committer, store, step)
        if pass_between:
            assert committer.flush(timeout_s=10)
        committer.rewind(15)
        assert committer.latest_committed == 10
        hand_over_and_wait(committer, store, 20)  # the new timeline's step 20, committed over the old
        assert committer.latest_committed == 20 and committer.flush(timeout_s=10)
        assert store.committed_steps() == [10, 20]
        committer.rewind(17)  # a second rollback: 15, the step the first went back to, was never written
        assert committer.latest_committed == 10
        committer.rewind(20, restored=True)  # a restore of 20, then one of 10 (20 found corrupt, say)
        committer.rewind(10, restored=True)
        hand_over_and_wait(committer, store, 30)  # 20 trained again but not written (every_n_steps)
        committer.rewind(25)  # a rollback past 20, which this timeline has not committed
        assert committer.latest_committed == 10
        committer.rewind(5)  # below every committed step: none
        assert committer.latest_committed is None
    finally:
        committer.close()


@pytest.mark.parametrize("pass_between", [False, True], ids=["left_behind", "taken_in_by_a_pass"])
def test_a_rollback_to_a_step_a_rewind_left_behind_does_not_take_its_old_manifest(tmp_path, pass_between):
    """As above, but the run goes back to step 6 by a rollback (a first-N replica's state), not
    a restore: it goes on from state step 6's manifest on storage does not hold, whose files the
    new timeline has written again. Taken as the new timeline's committed step, it kept the one
    place keep_last=1 gives, and retention deleted step 5, the last good one. It stays above the
    base, and goes once the run commits past it; after a pass had taken it in (above the base)
    it used to fall out of both lists, and stayed for the rest of the run."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0, retention_interval_s=0)
    try:
        commit_6_after_a_rewind_to_5(committer, store)
        deadline = time.monotonic() + 10
        while "checkpoint_left_behind" not in [e["event"] for e in committer.drain_events()]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if pass_between:
            assert committer.flush(timeout_s=10)
        for rank in range(2):  # the new timeline writes step 6's files again; its commit is to come
            store.write_rank_files(6, rank, 2, tiny_state(60))
        committer.rewind(6)  # a rollback to a replica that holds the new timeline's step 6
        assert committer.flush(timeout_s=10) and committer.latest_committed == 5
        assert 5 in store.committed_steps() and store.latest_valid() == 5
        hand_over_and_wait(committer, store, 7)
        assert committer.flush(timeout_s=10) and store.committed_steps() == [7]
    finally:
        committer.close()


def land_30_after_a_restore_of_20(committer: CheckpointCommitter, store: CheckpointStore) -> None:
    """Step 20 commits; step 30's commit is under way when a recovery's flush gives up on it, the
    recovery restores 20 and goes back to it; then step 30's manifest lands (left behind)."""
    hand_over_and_wait(committer, store, 20)
    entered, release = stall(store, "commit")
    hand_over(committer, store, 30, tiny_state(30))
    assert entered.wait(10)
    assert not committer.flush(timeout_s=0.2)
    committer.rewind(20, restored=True)
    release.set()
    deadline = time.monotonic() + 10
    while "checkpoint_left_behind" not in [e["event"] for e in committer.drain_events()]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("commits_after", [True, False], ids=["commits_one_step_under_it", "ends_on_the_restored_step"])
def test_a_step_left_behind_newer_than_the_last_commit_is_gone_when_the_run_ends(tmp_path, commits_after):
    # Step 30 lands after the run went back to 20, and the run ends (a stop) on 25, or on 20
    # itself, before committing past 30. Passes delete a left-behind step only once the run
    # commits past it: 30 stayed the newest manifest on storage, the result said 25, and fit()
    # again resumed from 30, on the history training had thrown away.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0)
    try:
        hand_over_and_wait(committer, store, 10)
        land_30_after_a_restore_of_20(committer, store)
        if commits_after:
            hand_over_and_wait(committer, store, 25)  # the run's final step, forced (every_n_steps)
        assert committer.flush(timeout_s=10)
        assert 30 in store.committed_steps()  # still: the run may yet commit over it or past it
    finally:
        committer.close()
    assert committer.latest_committed == (25 if commits_after else 20)
    assert store.committed_steps()[-1] == committer.latest_committed
    assert store.latest_valid() == committer.latest_committed
    assert [e["deleted"] for e in committer.drain_events() if e["event"] == "checkpoint_deleted"] == [[30]]


def test_the_run_end_leaves_an_earlier_runs_newer_step_alone(tmp_path):
    # 40 is an earlier run's step the resume skipped (its files are corrupt); it is above the
    # step this run started from, as 30 (left behind) is, but not this run's to delete.
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (10, 40):
        commit_tiny(store, step)
    path = shard_name(40, 0, 1)
    store.storage.write_bytes(path, store.storage.read_bytes(path)[:-3])
    committer = CheckpointCommitter(store, keep_last=3, latest_committed=10, gc_interval_s=0, retention_interval_s=0)
    try:
        land_30_after_a_restore_of_20(committer, store)
        hand_over_and_wait(committer, store, 25)
        assert committer.flush(timeout_s=10)
    finally:
        committer.close()
    assert store.committed_steps() == [10, 20, 25, 40] and store.latest_valid() == 25


def test_a_left_behind_step_that_cannot_be_deleted_at_the_end_is_reported(tmp_path, caplog):
    # The run must end all the same, and say that fit() again resumes from 30, not from 20.
    from elastic.checkpoint.storage import StorageError

    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0)
    real_delete = store.storage.delete

    def refuse_30(rel):
        if rel.startswith(step_dir(30)):
            raise StorageError("403 AccessDenied (test)")
        return real_delete(rel)

    try:
        land_30_after_a_restore_of_20(committer, store)
        assert committer.flush(timeout_s=10)
        store.storage.delete = refuse_30
    finally:
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.committer"):
            committer.close()
    assert store.committed_steps() == [20, 30]
    failed = [e for e in committer.drain_events() if e["event"] == "checkpoint_delete_failed"]
    assert [e["step"] for e in failed] == [30] and "AccessDenied" in failed[0]["error"]
    assert any("resumes from step 30" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_restore_past_a_commit_still_on_its_way_leaves_the_newest_committed_step_below_it(tmp_path):
    """A restore loads step 7 (an earlier timeline's, on storage) while this run's commit of step
    6 is still on its way (a flush that timed out). Raised to 7 at once, the newest committed
    step let the sweep take step 6's directory, whose manifest was not there yet, for a torn
    write and delete it; the manifest then landed naming deleted files."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0)
    entered, release = None, threading.Event()
    try:
        for step in range(1, 6):
            hand_over_and_wait(committer, store, step)
        entered, release = stall(store, "commit")
        hand_over(committer, store, 6, tiny_state(6))
        assert entered.wait(10)
        committer.rewind(7, restored=True)
        assert committer.latest_committed == 5
        committer._cleanup_pass(force=True)  # a sweep while step 6's manifest is on its way
        release.set()
        assert committer.flush(timeout_s=10) and committer.latest_committed == 6
        assert store.latest_valid() == 6
    finally:
        release.set()
        committer.close()


def test_the_committer_takes_parts_of_steps_not_committed_past_and_of_awaited_milestones(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1, keep_last=2, keep_every=8))
    try:
        committer.set_meta(8, {"cursor": 8})
        committer.add(8, 0, 2, store.write_rank_files(8, 0, 2, tiny_state(8)))  # rank 1's part still to come
        for step in range(9, 13):
            hand_over_and_wait(committer, store, step)
        assert [committer.takes_parts(s) for s in (8, 11, 12, 13)] == [True, False, False, True]
    finally:
        committer.close()


def test_a_commit_handed_over_before_a_rewind_past_it_is_not_written():
    store = CheckpointStore("memory://rewind-drop/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0)
    try:
        hand_over_and_wait(committer, store, 1)
        entered, release = stall(store, "commit")
        hand_over(committer, store, 2, tiny_state(2))
        assert entered.wait(10)
        hand_over(committer, store, 3, tiny_state(3))  # waits behind step 2
        committer.rewind(1)
        release.set()
        assert committer.flush(timeout_s=10)
        assert committer.latest_committed == 1
        assert store.committed_steps() == [1, 2]  # 2 was being written; 3 was never
    finally:
        committer.close()
        clear_memory("memory://rewind-drop/ckpt")


def test_a_rewind_does_not_wait_for_a_cleanup_pass_stuck_on_storage(tmp_path):
    """flush() leaves a stuck pass to finish in the background so a recovery goes on; the
    rewind that follows it used to wait for that pass's lock (minutes against S3 that does not
    answer). The pass, or the next one, applies the rewind before anything else it does."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0, retention_interval_s=0)
    entered, release = stall(store, "apply_retention")
    unstick = threading.Timer(30, release.set)  # old code: rewind waits for this
    try:
        hand_over_and_wait(committer, store, 1)
        assert entered.wait(10)
        hand_over_and_wait(committer, store, 2)
        assert committer.flush(timeout_s=0.2)
        unstick.start()
        t0 = time.monotonic()
        committer.rewind(1)
        assert time.monotonic() - t0 < 10
        release.set()
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [1, 2]  # 2 is above the step training went back to
        hand_over_and_wait(committer, store, 2)  # written again
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [2]
    finally:
        unstick.cancel()
        release.set()
        committer.close()


def refuse_manifest_reads(store: CheckpointStore, step: int, monkeypatch) -> None:
    """Storage answers step ``step``'s manifest read with a permanent refusal, as S3 does for an
    object a lifecycle rule archived to Glacier (403 InvalidObjectState). Through monkeypatch:
    fsspec caches filesystem instances, so a patched one is every later test's too. Local
    storage reads through ``storage._read_local``, the others through ``fs.cat_file``."""
    import elastic.checkpoint.storage as storage_module

    local = store.storage.protocol == "file"
    fs, _ = store.storage._filesystem()
    real = storage_module._read_local if local else fs.cat_file

    def read(path, *args, **kwargs):
        if f"{step_dir(step)}/manifest.json" in path:
            raise PermissionError("InvalidObjectState: The operation is not valid for the object's storage class")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(*((storage_module, "_read_local") if local else (fs, "cat_file")), read)


def test_an_older_step_whose_manifest_storage_refuses_is_skipped_and_left_alone(tmp_path, caplog, monkeypatch):
    """One archived old step stopped every resume: the listing raised on its manifest."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (5, 10, 15):
        commit_tiny(store, step)
    refuse_manifest_reads(store, 5, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        assert store.committed_steps() == [10, 15]
    assert any("step 5" in r.message and "cannot be read" in r.message for r in caplog.records)
    report = store.gc_uncommitted(older_than=15)
    assert report.error is None and report.deleted == [] and store.step_dirs() == [5, 10, 15]
    assert store.read_state()[0]["completed_step"] == 15


def test_a_newest_step_whose_manifest_storage_refuses_stops_the_listing(monkeypatch):
    """Refused on the newest step, resuming from an older one would train over it."""
    store = CheckpointStore("memory://refused-newest/ckpt", RUN, retry=FAST)
    try:
        for step in (5, 10):
            commit_tiny(store, step)
        refuse_manifest_reads(store, 10, monkeypatch)
        with pytest.raises(StorageError, match="newer than every readable committed step"):
            store.committed_steps()
    finally:
        clear_memory("memory://refused-newest/ckpt")


def delete_during_first_shard_read(store: CheckpointStore, step: int, then=None) -> list:
    """The first read of ``step``'s shard first runs retention's delete of that step (manifest,
    then files) and ``then`` (if given): a listing racing the committer of a live run, made
    deterministic. Returns the list of steps whose reads the hook saw."""
    real, seen = store.storage.read_bytes, []

    def read_bytes(rel, size=None, **kwargs):
        if rel == shard_name(step, 0, 1) and not seen:
            seen.append(step)
            report = store.apply_retention(keep_last=1, committed=[step, step + 1])
            assert report.deleted == [step], report
            if then is not None:
                then()
        return real(rel, size=size, **kwargs)

    store.storage.read_bytes = read_bytes
    return seen


def test_a_step_retention_deletes_while_it_is_listed_is_left_out_not_reported_corrupt(tmp_path):
    """`elastic checkpoints --run` on a live run showed a step retention deleted between its
    manifest read and its shard read in red as corrupt ("file is missing")."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (5, 6):
        commit_tiny(store, step)
    seen = delete_during_first_shard_read(store, 5)
    infos = store.list_steps()
    assert seen == [5]
    assert [(i.step, i.status) for i in infos] == [(6, "valid")]
    # A file missing under a manifest that is still there is corruption, as before.
    store.storage.delete(shard_name(6, 0, 1))
    [info] = store.list_steps()
    assert (info.step, info.status) == (6, "corrupt") and "file is missing" in info.problem


def test_a_step_written_again_while_it_is_listed_is_verified_from_its_new_manifest(tmp_path):
    """Training that went back writes a step again: the listing verifies what is there now
    instead of reporting the old manifest's checksums against the new files."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (5, 6):
        commit_tiny(store, step)

    def write_5_again():
        store.commit(5, store.write_rank_files(5, 0, 1, tiny_state(55)), 1, {})

    seen = delete_during_first_shard_read(store, 5, then=write_5_again)
    assert {i.step: i.status for i in store.list_steps()} == {5: "valid", 6: "valid"}
    assert seen == [5] and store.read_state(5)[0]["completed_step"] == 55


def test_a_step_storage_refuses_is_unreadable_and_the_listing_goes_on(tmp_path, monkeypatch):
    """A refused manifest (archived to Glacier, AccessDenied on one key) ended the whole listing
    with a StorageError; `committed_steps` already skipped such a step."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (5, 10, 15):
        commit_tiny(store, step)
    refuse_manifest_reads(store, 5, monkeypatch)
    import elastic.checkpoint.storage as storage_module
    refused_manifest = storage_module._read_local

    def read_local(path, limit):  # and one shard of step 10 (read by verify only)
        if shard_name(10, 0, 1) in path:
            raise PermissionError(f"AccessDenied: {path}")
        return refused_manifest(path, limit)

    monkeypatch.setattr(storage_module, "_read_local", read_local)
    for verify in (True, False):
        infos = {i.step: i for i in store.list_steps(verify=verify)}
        good = "valid" if verify else "committed"
        assert {s: i.status for s, i in infos.items()} == {5: "unreadable", 10: "unreadable" if verify else good,
                                                           15: good}
        assert "InvalidObjectState" in infos[5].problem and "manifest.json" in infos[5].problem
        assert infos[5].size_bytes > 0 and infos[5].num_files == 2  # the directory listing still counts
    assert "AccessDenied" in {i.step: i for i in store.list_steps()}[10].problem

    # An outage is not one unreadable step: every step would be; the listing still fails.
    def down(path, limit):
        raise ConnectionError("endpoint down")

    monkeypatch.setattr(storage_module, "_read_local", down)
    with pytest.raises(StorageUnavailable):
        store.list_steps(verify=False)


def test_a_cleanup_pass_from_before_a_rewind_deletes_no_step_of_the_new_timeline(tmp_path):
    """A pass reads the committed steps before a rewind and deletes after it: by its old
    picture of storage. A previous run committed 1..9 and this one resumed from 8 (9 skipped
    as corrupt, say); committing 10 passes 9, which is scheduled for deletion, and the pass
    stalls. A recovery then goes back to 8 and the new timeline commits 9: the stale pass used
    to delete that 9, the newest committed step of the run."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in range(1, 10):
        store.commit(step, [e for r in range(2) for e in store.write_rank_files(step, r, 2, tiny_state(step))], 2, {},
                     rng={1: None})  # rank 1 has no share of the tiny state: its RNG goes to the manifest
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=3600, retention_interval_s=0,
                                    latest_committed=8)
    entered, release = stall(store, "apply_retention")
    try:
        hand_over_and_wait(committer, store, 10)
        assert entered.wait(10)
        committer.rewind(8)
        hand_over_and_wait(committer, store, 9)  # the commit thread does not wait for the pass
        release.set()
        assert committer.flush(timeout_s=10)
        assert committer.latest_committed == 9
        assert 9 in store.committed_steps()
        store.verify(9)
    finally:
        release.set()
        committer.close()


def test_a_rewind_a_running_pass_could_not_apply_is_applied_before_the_new_timelines_commits(tmp_path):
    """A pass began (its first listing stalls, as on a loaded memory:// host), a recovery went
    back to step 3 meanwhile (the pass held the cleanup lock: the rewind waited for the next
    pass), and the new timeline committed 4, 5 and 6 again. The pass took those commits in; the
    next applied the rewind to them as if they were the timeline left, and scheduled the new 4
    and 5 for deletion as passed: the run ended with steps 2, 3 and 6 (seen in the suite), and
    would have lost 6 at the next commit."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=3600, retention_interval_s=0)
    entered, release = stall(store, "committed_steps")
    try:
        hand_over_and_wait(committer, store, 1)
        assert entered.wait(10)  # the first pass, listing storage
        for step in range(2, 6):
            hand_over_and_wait(committer, store, step)  # the commit thread does not wait for the pass
        committer.rewind(3)
        for step in range(4, 7):
            hand_over_and_wait(committer, store, step)  # the new timeline's 4, 5 and 6
        release.set()
        assert committer.flush(timeout_s=10)
        hand_over_and_wait(committer, store, 7)
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [5, 6, 7]
        assert [store.read_state(s)[0]["model"]["w"][0].item() for s in (5, 6, 7)] == [5.0, 6.0, 7.0]
    finally:
        release.set()
        committer.close()


def test_a_sweep_from_before_a_rewind_leaves_the_directory_the_new_timeline_writes(tmp_path):
    """The sweep's old picture: step 9 an uncommitted directory below the newest commit (10).
    After a rewind to 8 the new timeline writes 9 there; the stale sweep used to delete its
    shards, and 9 then committed a manifest naming files that were gone."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0)
    for step in range(1, 9):
        hand_over_and_wait(committer, store, step)
    assert committer.flush(timeout_s=10)
    store.write_rank_files(9, 0, 2, tiny_state(9))  # the old timeline's 9: superseded, never committed
    entered, release = stall(store, "apply_retention")
    try:
        hand_over_and_wait(committer, store, 10)
        assert entered.wait(10)
        committer.rewind(8)
        files = [store.write_rank_files(9, r, 2, tiny_state(109)) for r in range(2)]
        committer.add(9, 0, 2, files[0])
        release.set()
        assert committer.flush(timeout_s=10)
        written = sorted(e.path.rsplit("/", 1)[-1] for e in files[0] + files[1])
        assert written and store.storage.list_dir(step_dir(9)) == written
        committer.add(9, 1, 2, files[1])
        committer.set_meta(9, {"cursor": 9})
        assert committer.flush(timeout_s=10) and committer.latest_committed == 9
        store.verify(9)
    finally:
        release.set()
        committer.close()


def test_a_delete_still_under_way_at_a_rewind_never_leaves_a_step_committed_without_its_files(tmp_path):
    """A delete call the rewind's wait (FENCE_WAIT_S) did not see end may still remove the
    directory of a step the new timeline writes again. That step's commit waits for the
    delete and checks its files: with one gone it is not committed (an event says why),
    and the next step commits, instead of a manifest that fails on resume. A delete that
    outlasts the commit's wait (SUSPECT_WAIT_S, 0.2 s here) is the commit's storage error,
    retried: checked then, the files were still there, and the step committed over a delete
    about to remove them."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0,
                                    retry_min_s=0.05, retry_max_s=0.2)
    committer.FENCE_WAIT_S, committer.SUSPECT_WAIT_S = 0.1, 0.2
    for step in range(1, 9):
        hand_over_and_wait(committer, store, step)
    assert committer.flush(timeout_s=10)
    store.write_rank_files(9, 0, 2, tiny_state(9))  # the old timeline's 9: superseded, never committed
    entered, release = threading.Event(), threading.Event()
    real = store.storage.delete_tree

    def stalled(rel):
        if rel == step_dir(9):
            entered.set()
            assert release.wait(30)
        return real(rel)

    store.storage.delete_tree = stalled
    try:
        hand_over_and_wait(committer, store, 10)  # the sweep starts deleting 9
        assert entered.wait(10)
        t0 = time.monotonic()
        committer.rewind(8)
        assert time.monotonic() - t0 < 10  # FENCE_WAIT_S (0.1 s), not the stalled delete (30 s)
        hand_over(committer, store, 9, tiny_state(109))  # its commit waits for the delete, and again
        time.sleep(1.0)
        assert committer.latest_committed == 8
        release.set()  # the old delete removes the new 9's shards
        assert committer.flush(timeout_s=10) and committer.latest_committed == 8
        assert [e for e in committer.drain_events() if e["event"] == "checkpoint_not_committed"][0]["step"] == 9
        hand_over_and_wait(committer, store, 10)
        for step in store.committed_steps():
            store.verify(step)
        assert 9 not in store.committed_steps()
    finally:
        release.set()
        committer.close()


def test_missing_file_finds_a_file_gone_or_of_another_size_in_the_step_or_below_it(backend):
    store = make_store(backend)
    entries = store.write_rank_files(5, 0, 1, tiny_state(5))
    store.storage.write_bytes(f"{step_dir(5)}/extra/notes.bin", b"notes")
    entries.append(FileEntry(f"{step_dir(5)}/extra/notes.bin", 5, sha256(b"notes")))
    assert store.missing_file(5, entries) is None
    store.storage.write_bytes(entries[0].path, b"torn")
    assert store.missing_file(5, entries).endswith(entries[0].path)
    store.storage.delete(f"{step_dir(5)}/extra/notes.bin")
    assert store.missing_file(5, entries[1:]).endswith("extra/notes.bin")


def test_a_delete_that_keeps_failing_is_retried_with_backoff_and_warned_of_once(tmp_path, caplog, delete_clock):
    """A bucket whose policy forbids deletes: every retention pass (once a second while
    training runs) retried every step that had failed and logged each, so the requests and
    log lines grew with the run. Then each step got its own backoff, which bounded one step's
    retries but not their number: every step past keep_last joined the list. Now two refusals
    in a row hold every delete for 1, 2, 4 ... s, and then one probe is tried; once one
    succeeds, the pass deletes the rest."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    calls = []
    real_delete = store.storage.delete

    def refuse(rel):
        calls.append(rel)
        raise StorageError(f"delete {rel}: PermissionError: AccessDenied")

    store.storage.delete = refuse
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=3600, retention_interval_s=0)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
            for step in range(1, 21):
                hand_over_and_wait(committer, store, step)
                assert committer.flush(timeout_s=10)
        assert calls == [f"{step_dir(s)}/{MANIFEST}" for s in (1, 2)]  # then the hold: 17 steps, 2 requests
        assert len([r for r in caplog.records if "could not delete" in r.message]) == 1
        calls.clear()
        assert committer.flush(timeout_s=10) and calls == []
        delete_clock.advance(1.05)  # the hold (1 s after two refusals) is over: one probe, a step never tried
        assert committer.flush(timeout_s=10) and calls == [f"{step_dir(3)}/{MANIFEST}"]
        delete_clock.advance(1.05)  # refused again: the hold is now 2 s
        assert committer.flush(timeout_s=10) and len(calls) == 1
        delete_clock.advance(1.0)
        assert committer.flush(timeout_s=10) and len(calls) == 2
        store.storage.delete = real_delete  # deletes allowed again (the policy was fixed)
        delete_clock.advance(4.05)  # hold and every step's own backoff over: the probe, then the rest
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [18, 19, 20] and store.step_dirs() == [18, 19, 20]
        deleted = [e["deleted"] for e in committer.drain_events() if e["event"] == "checkpoint_deleted"]
        assert sorted(s for d in deleted for s in d) == list(range(1, 18))
    finally:
        committer.close()


def test_one_step_that_storage_refuses_to_delete_holds_back_no_other(tmp_path, delete_clock):
    """A refusal of one step's objects (a legal hold on them) is not the storage refusing deletes:
    the steps after it are deleted as they pass keep_last, and the probes after a hold ask about
    the step tried least often, not the locked one each time. The sweep of uncommitted
    directories keeps to the same hold."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in range(1, 7):
        write_step(store, trained_worker(steps=1), step=step)
    real_delete, tried = store.storage.delete, []

    def locked(rel):
        tried.append(rel)
        if rel.startswith(step_dir(1)):
            raise StorageError(f"delete {rel}: PermissionError: AccessDenied (object lock)")
        real_delete(rel)

    store.storage.delete = locked
    report = store.apply_retention(keep_last=2, committed=[1, 2, 3, 4, 5, 6])
    assert list(report.failed) == [1] and report.deleted == [2, 3, 4]
    assert store.committed_steps() == [1, 5, 6]
    # Step 1 refused twice in a row (after its own backoffs, with nothing else to delete) puts
    # a hold on deletes; the probe after it is step 5, which passed keep_last meanwhile and was
    # never tried, not step 1 again.
    delete_clock.advance(1.05)
    assert list(store.apply_retention(keep_last=2, committed=[1, 5, 6]).failed) == [1]
    delete_clock.advance(2.05)
    assert list(store.apply_retention(keep_last=2, committed=[1, 5, 6]).failed) == [1]
    write_step(store, trained_worker(steps=1), step=7)
    tried.clear()
    assert store.apply_retention(keep_last=2, committed=[1, 5, 6, 7]).deleted == [] and tried == []  # held
    delete_clock.advance(4.05)  # the hold and step 1's own backoff (4 s after its third refusal) are over
    report = store.apply_retention(keep_last=2, committed=[1, 5, 6, 7])
    assert report.deleted == [5] and list(report.failed) == [1]
    assert tried == [f"{step_dir(s)}/{MANIFEST}" for s in (5, 1)] and store.committed_steps() == [1, 6, 7]

    # Storage that refuses every delete: the sweep stops at the second refusal, and tries nothing
    # while the hold lasts.
    store, tried = CheckpointStore(f"file://{tmp_path}/sweep", RUN, retry=FAST), []
    for step in (8, 9, 10):
        write_step(store, trained_worker(steps=1), step=step, commit=False)  # torn
    write_step(store, trained_worker(steps=1), step=11)
    real_tree = store.storage.delete_tree

    def refuse_all(rel):
        tried.append(rel)
        raise StorageError(f"delete {rel}: PermissionError: AccessDenied")

    store.storage.delete_tree = refuse_all
    tried.clear()
    swept = store.gc_uncommitted()
    assert sorted(swept.failed) == [8, 9] and tried == [step_dir(8), step_dir(9)]
    tried.clear()
    assert not store.gc_uncommitted().failed and tried == []
    store.storage.delete_tree = real_tree
    delete_clock.advance(2.05)  # the hold and steps 8 and 9's own backoffs are over: step 10 (never tried) first
    assert store.gc_uncommitted().deleted == [10, 8, 9]
    assert store.step_dirs() == [11]


def test_a_commit_that_failed_but_landed_is_counted_by_retention_once_superseded(tmp_path):
    """A manifest PUT can land while its reply is lost: the commit fails, and a newer step
    supersedes it during the backoff. The step is then on storage, committed and valid, but it
    was in no list of this run's: retention never deleted it (GC leaves valid manifests alone)
    until the next run listed storage, past keep_last."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0, retention_interval_s=0,
                                    retry_min_s=1.0, retry_max_s=1.0)
    real_commit, failed = store.commit, threading.Event()

    def commit(step, *args, **kwargs):
        out = real_commit(step, *args, **kwargs)
        if step == 2:
            failed.set()
            raise StorageUnavailable("the reply was lost")
        return out

    store.commit = commit
    try:
        hand_over_and_wait(committer, store, 1)
        hand_over(committer, store, 2, tiny_state(2))
        assert failed.wait(10)
        hand_over_and_wait(committer, store, 3)  # the persister moves on to it after the backoff
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [3]
    finally:
        committer.close()


def test_a_failed_commit_is_not_confirmed_by_another_timelines_manifest(tmp_path):
    """Step 2's manifest on storage is an earlier timeline's (it checks out by itself); this run
    writes step 2's files again and its commit fails without landing. Taken for this commit's,
    step 2 (its files no longer those its manifest names: corrupt on resume) took a keep_last
    place, and retention deleted step 1, a good one. Now only a manifest naming this commit's
    files confirms it; the other goes with what a rewind leaves on storage."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    # The earlier timeline's step 2 (rank 1 has no share of so small a state: its RNG goes in the manifest).
    entries = [e for rank in range(2) for e in store.write_rank_files(2, rank, 2, tiny_state(99))]
    store.commit(2, entries, 2, {"cursor": 2}, rng={1: None})
    committer = CheckpointCommitter(store, keep_last=2, gc_interval_s=0, retention_interval_s=0,
                                    retry_min_s=1.0, retry_max_s=1.0)
    real_commit, failed = store.commit, threading.Event()

    def commit(step, *args, **kwargs):
        if step == 2:
            failed.set()
            raise StorageUnavailable("down (test)")  # did not land
        return real_commit(step, *args, **kwargs)

    store.commit = commit
    try:
        hand_over_and_wait(committer, store, 1)
        hand_over(committer, store, 2, tiny_state(2))  # rewrites step 2's files
        assert failed.wait(10)
        hand_over_and_wait(committer, store, 3)
        deadline = time.monotonic() + 10
        while store.committed_steps() != [1, 3] and time.monotonic() < deadline:
            assert committer.flush(timeout_s=10)
            time.sleep(0.05)
        assert store.committed_steps() == [1, 3]
    finally:
        committer.close()


def test_a_failed_commit_a_rewind_goes_back_past_while_its_manifest_is_read_takes_no_keep_last_place(tmp_path):
    """Step 2's commit landed but failed (its reply lost), and step 3 superseded it. A cleanup
    pass reads 2's manifest to see whether it landed; a recovery goes back to step 1 meanwhile,
    and the read fails. Put back for another read, step 2 escaped the rewind. The new timeline
    wrote step 2's files again and went on to 3 and 4 (its step 2 superseded, as in background
    mode): the read then found the old manifest naming the files it had named, and counted step
    2 as committed, though its files were no longer those (corrupt on resume). It took a
    keep_last place, and retention deleted step 1, a good one."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=0, retention_interval_s=0,
                                    retry_min_s=1.0, retry_max_s=1.0)
    real_commit, real_read, failed, rewound = store.commit, store.load_manifest, threading.Event(), []
    step_3_in = threading.Event()

    def commit(step, *args, **kwargs):
        out = real_commit(step, *args, **kwargs)
        if step == 2:  # every try: its retries until step 3 supersedes it, however late that comes
            failed.set()
            raise StorageUnavailable("the reply was lost")
        return out

    def load_manifest(step, *args, **kwargs):
        if step == 2 and not rewound:  # the pass's read of the failed commit
            assert step_3_in.wait(10)
            recovery = threading.Thread(target=committer.rewind, args=(1,))
            recovery.start()
            recovery.join(10)
            rewound.append(not recovery.is_alive())
            raise StorageUnavailable("read failed (test)")
        return real_read(step, *args, **kwargs)

    store.commit, store.load_manifest = commit, load_manifest
    try:
        hand_over_and_wait(committer, store, 1)
        hand_over(committer, store, 2, tiny_state(2))
        assert failed.wait(10)
        hand_over_and_wait(committer, store, 3)
        step_3_in.set()
        assert committer.flush(timeout_s=10) and rewound == [True]
        for rank in range(2):  # the new timeline's step 2, superseded before its commit
            store.write_rank_files(2, rank, 2, tiny_state(20))
        for step in (3, 4):
            hand_over_and_wait(committer, store, step)
            assert committer.flush(timeout_s=10)
        assert committer.flush(timeout_s=10)
        assert store.committed_steps() == [1, 3, 4]
        assert [store.read_state(s)[0]["model"]["w"][0].item() for s in (1, 3, 4)] == [1.0, 3.0, 4.0]
    finally:
        committer.close()


def test_no_step_is_deleted_while_a_restore_holds_the_steps(tmp_path):
    # A restore lists the committed steps, then reads the newest for seconds, while later steps
    # still commit: with keep_last=1 retention deleted the one being read, the read found a
    # file missing, and the run started over from step 0.
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, gc_interval_s=0)
    hand_over_and_wait(committer, store, 1)
    assert committer.flush(5) and store.committed_steps() == [1]
    with committer.holding_steps():
        hand_over_and_wait(committer, store, 2)
        assert committer.flush(5)
        assert store.committed_steps() == [1, 2]  # step 1, being read, stays
        state, _ = store.read_state(1)
        assert torch.equal(state["model"]["w"], torch.full((2,), 1.0))
    assert committer.flush(5) and store.committed_steps() == [2]  # released: retention as promised
    committer.close()


def test_a_milestone_whose_parts_come_after_a_newer_steps_is_still_committed(tmp_path):
    """Ranks that pool their parts report each step from whichever rank finished it last, and Ray
    does not order two senders' calls: step 3's parts came before milestone 2's. Step 3's report
    pruned step 2's meta, its commit made step 2 stale, and milestone 2 never existed (its files
    swept as uncommitted). A milestone that never completes goes once a newer one is handed over."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, keep_every=2, gc_interval_s=0, retention_interval_s=0)
    written = {step: [store.write_rank_files(step, rank, 2, tiny_state(step)) for rank in range(2)]
               for step in (2, 3, 4, 5, 6)}
    try:
        for step in (2, 3):
            committer.set_meta(step, {"cursor": step})
        for step in (3, 2):  # step 3's parts first
            for rank in range(2):
                committer.add(step, rank, 2, written[step][rank])
        assert committer.flush(10) and store.committed_steps() == [2, 3]
        # Milestone 4 never completes (rank 1's part never comes); milestone 6 is handed over.
        for step in (4, 5, 6):
            committer.set_meta(step, {"cursor": step})
            for rank in range(2 if step != 4 else 1):
                committer.add(step, rank, 2, written[step][rank])
        assert committer.flush(10)
        assert store.committed_steps() == [2, 6]  # 3 and 5 replaced in turn (keep_last=1)
        assert 4 not in store.step_dirs()  # swept as any incomplete step
        assert committer.holds(4, 0) and committer.holds(4, 1)  # past needing its parts
    finally:
        committer.close()


def test_a_milestones_own_report_does_not_let_go_of_older_steps_still_in_the_pool(tmp_path):
    """Each rank reports its part of a milestone on its own (never pooled), while its parts of
    the steps before it may still wait in the group's pool for a slower rank's. Rank 1's report
    of milestone 4 came first: taken for a sign that rank 1 skipped steps 2 and 3, it let go of
    their metas, and their pooled parts, when they came, committed nothing."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, keep_every=4, gc_interval_s=0, retention_interval_s=0)
    written = {step: [store.write_rank_files(step, rank, 2, tiny_state(step)) for rank in range(2)]
               for step in (2, 3, 4)}
    try:
        for step in (2, 3, 4):
            committer.set_meta(step, {"cursor": step})
        committer.add(4, 1, 2, written[4][1])  # rank 1's milestone, on its own
        for step in (2, 3):  # the pool's reports, each with both ranks' parts
            for rank in range(2):
                committer.add(step, rank, 2, written[step][rank])
        assert committer.flush(10) and committer.latest_committed == 3
        committer.add(4, 0, 2, written[4][0])
        assert committer.flush(10) and committer.latest_committed == 4
    finally:
        committer.close()


def test_a_late_milestone_over_a_step_an_earlier_timeline_left_is_not_deleted_as_passed(tmp_path):
    """Step 2 on storage is a timeline's this run left (above the step it started from, 1). This
    run writes milestone 2 again, and its parts come in after step 3's: the cleanup after step 3's
    commit deleted step 2's directory as passed, with this run's new shards in it, and milestone
    2's manifest then named files that were gone."""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    for step, state in ((1, tiny_state(1)), (2, tiny_state(99))):  # the earlier timeline's 2
        entries = [e for rank in range(2) for e in store.write_rank_files(step, rank, 2, state)]
        store.commit(step, entries, 2, {"cursor": step}, rng={1: None})
    committer = CheckpointCommitter(store, keep_last=1, keep_every=2, latest_committed=1, gc_interval_s=0,
                                    retention_interval_s=0)
    try:
        written = {step: [store.write_rank_files(step, rank, 2, tiny_state(step)) for rank in range(2)]
                   for step in (2, 3)}
        for step in (2, 3):
            committer.set_meta(step, {"cursor": step})
        for rank in range(2):
            committer.add(3, rank, 2, written[3][rank])
        assert committer.flush(10) and committer.latest_committed == 3  # a cleanup pass ran after it
        for rank in range(2):
            committer.add(2, rank, 2, written[2][rank])
        assert committer.flush(10)
        state, _ = store.read_state(2)  # whole, and this run's
        assert torch.equal(state["model"]["w"], torch.full((2,), 2.0))
        assert store.committed_steps() == [2, 3]
    finally:
        committer.close()


def test_a_late_milestone_whose_commit_is_retried_is_not_taken_for_an_earlier_timelines(tmp_path, caplog):
    """As above, and milestone 2's first commit fails (storage down) while step 3 is committed:
    a cleanup pass then found the earlier timeline's manifest of step 2 and took the step for one
    a rewind left (another timeline's files), to be deleted once passed, while its commit was
    still being retried. (The sweep's pending set keeps it until that commit lands, which then
    makes it this run's: what shows is the log's false word.)"""
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    for step, state in ((1, tiny_state(1)), (2, tiny_state(99))):
        entries = [e for rank in range(2) for e in store.write_rank_files(step, rank, 2, state)]
        store.commit(step, entries, 2, {"cursor": step}, rng={1: None})
    committer = CheckpointCommitter(store, keep_last=1, keep_every=2, latest_committed=1, gc_interval_s=0,
                                    retention_interval_s=0, retry_min_s=0.05, retry_max_s=0.05)
    real_commit, failed, looked = store.commit, threading.Event(), threading.Event()

    def commit(step, *args, **kwargs):
        if step == 2 and not failed.is_set():
            failed.set()
            raise StorageUnavailable("down (test)")
        if step == 2:
            assert looked.wait(10)  # the retry waits for the test's cleanup pass
        return real_commit(step, *args, **kwargs)

    store.commit = commit
    try:
        written = {step: [store.write_rank_files(step, rank, 2, tiny_state(step)) for rank in range(2)]
                   for step in (2, 3)}
        for step in (2, 3):
            committer.set_meta(step, {"cursor": step})
        for step in (3, 2):
            for rank in range(2):
                committer.add(step, rank, 2, written[step][rank])
            if step == 3:
                assert committer.flush(10) and committer.latest_committed == 3
        assert failed.wait(10)
        with caplog.at_level(logging.INFO, logger="elastic.checkpoint.committer"):
            committer._cleanup(force=True)  # while the milestone's commit is retried
        assert "names other files" not in caplog.text
        looked.set()
        for _ in range(3):
            assert committer.flush(10)
        state, _ = store.read_state(2)
        assert torch.equal(state["model"]["w"], torch.full((2,), 2.0))
        assert store.committed_steps() == [2, 3]
    finally:
        looked.set()
        committer.close()


def test_a_step_kept_by_keep_every_is_never_replaced_before_its_commit(tmp_path, monkeypatch):
    # Complete steps waiting for their manifest are replaced by newer ones; a milestone replaced
    # stayed on storage without a manifest, the sweep deleted it, and it never existed.
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=1, keep_every=2, gc_interval_s=0)
    real = store.commit

    def slow_first(step, *args, **kwargs):
        if step == 1:
            time.sleep(0.5)  # steps 2 and 3 are handed over while step 1's manifest is written
        return real(step, *args, **kwargs)

    monkeypatch.setattr(store, "commit", slow_first)
    for step in (1, 2, 3):
        hand_over(committer, store, step, tiny_state(step))
    assert committer.flush(10)
    assert store.committed_steps() == [2, 3]  # the milestone, and the newest
    committer.close()


def test_a_commit_a_rewind_left_behind_does_not_end_an_outage(tmp_path, monkeypatch):
    # It returns with no request made: taken as a success, "storage is back" came with storage down.
    from elastic.checkpoint.storage import StorageUnavailable

    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    committer = CheckpointCommitter(store, keep_last=3, gc_interval_s=3600, retry_min_s=0.05, retry_max_s=0.1)

    def down(*args, **kwargs):
        raise StorageUnavailable("endpoint down")

    monkeypatch.setattr(store, "commit", down)
    hand_over(committer, store, 2, tiny_state(2))
    deadline = time.monotonic() + 5
    while not committer.in_outage and time.monotonic() < deadline:
        time.sleep(0.01)
    assert committer.in_outage
    committer.rewind(1)  # step 2 is left behind: its next attempt returns without a request
    time.sleep(0.5)
    assert committer.in_outage
    assert not [e for e in committer.drain_events() if e["event"] == "storage_recovered"]
    committer.close()


def test_a_ranks_writer_never_replaces_a_snapshot_keep_every_keeps(tmp_path, monkeypatch):
    # Only the newest snapshot waits for a busy writer: a keep_every step replaced there was never
    # written, so never whole, never committed, and the milestone never existed.
    url = f"file://{tmp_path}"
    worker = FakeWorker(rank=0, world_size=1)
    hook = WorkerCheckpointer(url, {}, RUN, every_n_steps=1, retry=FAST, keep_every=2)
    store = CheckpointStore(url, RUN, retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(keep_last=1, keep_every=2))
    real = hook.store.write_snapshot

    def slow_first(snapshot):
        if snapshot.step == 1:
            time.sleep(0.5)  # steps 2 and 3 are snapshotted while step 1 is written
        return real(snapshot)

    monkeypatch.setattr(hook.store, "write_snapshot", slow_first)
    try:
        run_training([worker], [hook], committer, [1, 2, 3])
        finish([worker], [hook], committer)
        assert store.committed_steps() == [2, 3]
    finally:
        hook.close()
        committer.close()


def test_a_step_above_the_base_that_training_went_back_to_is_counted_by_retention(tmp_path):
    # A restore that took a step of a timeline the run had left (above its base) rewound to it:
    # it was dropped from the steps above the base and never counted, so retention never
    # deleted it, for the rest of the run.
    store = CheckpointStore(f"file://{tmp_path}", RUN, retry=FAST)
    for step in range(1, 6):
        commit_tiny(store, step)
    committer = CheckpointCommitter(store, keep_last=1, latest_committed=3, gc_interval_s=3600)
    hand_over_and_wait(committer, store, 4)
    assert committer.flush(5) and store.committed_steps() == [4, 5]  # 5: above the base, left for now
    committer.rewind(5, restored=True)  # training went back to step 5 (a restore took it)
    hand_over_and_wait(committer, store, 6)
    assert committer.flush(5) and store.committed_steps() == [6]
    committer.close()


# ---- the rank's link to its node's checkpoint agent -----------------------------------------
def _agent_impostor() -> tuple[socket.socket, str]:
    """A listening socket where a node agent would be (an abstract name, as the agent's)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    address = f"\0elastic-test-agent-{os.getpid()}-{random.getrandbits(64):x}"
    server.bind(address)
    server.listen(1)
    return server, address


def test_a_rank_refuses_an_agent_socket_held_by_another_user(monkeypatch):
    """The agent's address is an abstract socket name, which any user of the node can bind:
    the rank checks who holds it (SO_PEERCRED), as the agent checks its ranks, and refuses a
    link to another user's process with an OSError, on which the rank writes in its own
    process. Another user is stood in for by this process's uid seen as another one."""
    from elastic.checkpoint.worker_hook import AgentCheckpointer

    server, address = _agent_impostor()
    try:
        hook = AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"))  # the same user: linked
        conn, _ = server.accept()
        hook.sock.close()
        conn.close()
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        with pytest.raises(OSError, match=f"held by user {real}, not this rank's user {real + 1}"):
            AgentCheckpointer(address, 1, lambda: pytest.fail("fell back"))
        conn, _ = server.accept()  # it connected, then hung up: nothing was sent to the impostor
        conn.settimeout(5)
        assert conn.recv(4096) == b""
        conn.close()
    finally:
        server.close()


# ---- local storage: step directories that are links ------------------------------------------
def _files_under(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


def test_a_file_of_a_step_directorys_name_is_no_step(backend):
    # Read as the newest step, its manifest's read failed as no directory: a storage error that
    # stopped every resume ("cannot tell where to resume") and every cleanup pass.
    store = make_store(backend)
    commit_tiny(store, 1)
    store.storage.write_bytes(step_dir(2), b"stray")
    assert store.step_dirs() == [1] and store.committed_steps() == [1]
    state, _ = store.read_state()
    assert state["completed_step"] == 1
    assert store.gc_uncommitted().deleted == [] and store.storage.read_bytes(step_dir(2)) == b"stray"


def test_a_step_directory_that_is_a_symlink_is_no_step_and_nothing_is_deleted_through_it(tmp_path, caplog):
    """A run directory in a directory others can write (``/tmp/ckpt``): a step "directory"
    another user made a link to their own files was listed as a step of the run, its target's
    manifest vouched for it, and retention and GC deleted the target's files through it."""
    store = CheckpointStore(f"file://{tmp_path}/ckpt", RUN, retry=FAST)
    for step in (1, 5):
        commit_tiny(store, step)
    # Behind step 3: a whole committed step (manifest and shard) elsewhere; behind step 2, a
    # corrupt manifest and a shard (GC's business, were it the run's).
    commit_tiny(CheckpointStore(f"file://{tmp_path}/other", RUN, retry=FAST), 3)
    victim3, victim2 = tmp_path / "other" / RUN / step_dir(3), tmp_path / "victim2"
    victim2.mkdir()
    (victim2 / "manifest.json").write_bytes(b"not a manifest")
    (victim2 / "shard-r0-of-1.safetensors").write_bytes(b"their bytes")
    run = tmp_path / "ckpt" / RUN
    os.symlink(victim3, run / step_dir(3))
    os.symlink(victim2, run / step_dir(2))
    before = {v: _files_under(v) for v in (victim2, victim3)}

    assert store.step_dirs() == [1, 5] and store.committed_steps() == [1, 5]
    assert [i.step for i in store.list_steps()] == [1, 5]
    assert store.gc_uncommitted().error is None
    assert store.apply_retention(keep_last=1).deleted == [1]
    # A caller that knows step 3 as committed (the committer wrote it, then the directory was
    # swapped for a link): the delete is refused, and retried later as any failed delete.
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.store"):
        report = store.apply_retention(keep_last=1, committed=[3, 5], files={3: [shard_name(3, 0, 1)]})
    assert report.deleted == [] and "is a symbolic link" in report.failed[3]
    with pytest.raises(StorageError, match="is a symbolic link"):
        store.storage.delete_tree(step_dir(2))
    with pytest.raises(StorageError, match="is a symbolic link"):
        store.storage.write_bytes(shard_name(3, 0, 1), b"ours")

    assert {v: _files_under(v) for v in (victim2, victim3)} == before  # untouched
    assert os.path.islink(run / step_dir(3)) and os.path.islink(run / step_dir(2))
    assert store.committed_steps() == [5] and store.read_state()[0]["completed_step"] == 5
