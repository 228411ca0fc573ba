"""Staging buffers: the host memory a rank's in-process writer copies its snapshots into,
reused once a snapshot is written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic.checkpoint.staging import StagingBuffers
from elastic.checkpoint.store import Snapshot
from elastic.checkpoint.worker_hook import live_state


def test_staging_buffers_reuse_only_memory_that_was_released():
    staging = StagingBuffers()
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = staging.copy(src)
    assert torch.equal(a, src) and a.data_ptr() != src.data_ptr() and a.is_contiguous()
    b = staging.copy(src.t())  # another shape; a strided source still gives a contiguous copy
    assert torch.equal(b, src.t()) and b.is_contiguous()
    c = staging.copy(src)  # a is still out (its snapshot may be being written): fresh memory
    assert c.data_ptr() != a.data_ptr() and staging.reused == 0
    staging.release([a])
    staging.release([a])  # twice, as a bug might: still only one snapshot may get it
    staging.release([torch.zeros(3, 4)])  # not handed out by this: ignored
    src.add_(100)
    d = staging.copy(src)
    assert d.data_ptr() == a.data_ptr() and torch.equal(d, src) and staging.reused == 1
    e = staging.copy(src)
    assert e.data_ptr() not in (a.data_ptr(), c.data_ptr())
    # A snapshot of three tensors of one shape comes back: the next one gets all three.
    staging.release([c, d, e])
    again = [staging.copy(src) for _ in range(4)]
    assert {t.data_ptr() for t in again[:3]} == {c.data_ptr(), d.data_ptr(), e.data_ptr()}
    assert staging.reused == 4 and all(torch.equal(t, src) for t in again)  # the fourth was fresh
    # Bounded: two snapshots of three coming back leave three waiting, not six.
    staging.release(again[:3])
    staging.release([again[3], *(staging.copy(src) for _ in range(2))])
    for _ in range(4):
        staging.copy(src)
    assert staging.reused == 4 + 2 + 3
    empty = staging.copy(torch.zeros(0, 4))
    assert empty.shape == (0, 4)
    staging.release([empty])


def test_a_state_of_repeated_shapes_is_copied_into_recycled_buffers_once_they_come_back():
    """As in the persister, up to three snapshots are out at once (one written, one waiting, one
    being taken): from the fourth on, every copy goes into a buffer the oldest gave back, though
    the state holds many tensors of each shape (4 equal layers; Adam's moments have their
    parameter's shape), and no buffer serves two snapshots that are out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters())
    worker = SimpleNamespace(model=model, optimizer=optimizer, scheduler=None, completed_step=0)
    staging = StagingBuffers()
    out: list[Snapshot] = []
    for step in range(1, 8):
        model(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        worker.completed_step = step
        out.append(Snapshot.of_state(live_state(worker), step, 0, 1, copy=staging.copy))
        copies = len(out[-1].tensors)
        assert copies == 8 * 4  # 4 weights and 4 biases, and of each its two moments and its step counter
        assert staging.reused == copies * max(0, step - 3)
        assert all(torch.equal(out[-1].tensors[f"model/{k}"], v) for k, v in model.state_dict().items())
        held = [t.data_ptr() for snap in out for t in snap.tensors.values()]
        assert len(set(held)) == len(held)
        if len(out) == 3:
            staging.release(out.pop(0).tensors.values())


def test_buffers_of_a_shape_no_snapshot_gives_back_any_more_are_let_go():
    # A buffer that grows by one each checkpoint left a buffer of every old shape for good.
    staging = StagingBuffers()
    for i in range(50):
        staging.release([staging.copy(torch.zeros(i + 10)), staging.copy(torch.ones(3))])
    waiting = {key[0]: len(buffers) for key, buffers in staging._free.items()}
    assert set(waiting) == {(3,), *((i + 10,) for i in range(50 - StagingBuffers.FORGET_AFTER, 50))}
    assert staging.reused == 49  # the steady shape is still reused every time
    staging.release([])  # a release of nothing is no release
    assert (59,) in {key[0] for key in staging._free}


def test_pinned_buffers_let_go_are_given_back_by_torchs_host_allocator(monkeypatch):
    # Dropped from the pool, pinned buffers stayed pinned in torch's caching host allocator.
    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True), raising=False)
    staging, kept = StagingBuffers(), []
    for i in range(StagingBuffers.FORGET_AFTER + 1):  # as copies from a GPU (pinned) of a growing tensor
        t = torch.zeros(i + 1)
        kept.append(t)
        staging._out[t.data_ptr()] = ((i + 1,), t.dtype, True)
        staging.release([t])
    assert emptied == [True]  # once: the first shape let go


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_from_a_gpu_are_whole_after_settle():
    # The copies from a GPU are queued (one wait for all of them, not one each); settle() waits.
    staging = StagingBuffers()
    sources = [torch.randn(512, 512, device="cuda") for _ in range(8)] + [torch.ones(3)]
    copies = [staging.copy(t) for t in sources]
    staging.settle()
    assert all(c.device.type == "cpu" and torch.equal(c, t.cpu()) for c, t in zip(copies, sources))
    assert all(c.is_pinned() for c in copies[:-1])
    staging.settle()  # nothing queued: no wait
