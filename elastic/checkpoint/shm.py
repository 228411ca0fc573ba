"""Snapshot slots in memory a rank shares with its node's checkpoint agent (Linux memfds).

The rank copies its share of the state into a free slot inside the step; the agent writes the
shard straight from that memory and hands the slot back. A slot holds one snapshot: the shard's
safetensors data section (tensors back to back, in file order, as a registered layout says),
then the rank's meta JSON of that step (with the first share the state skeleton), then its RNG
as read (``codec.RawRng``'s blobs, which the agent encodes into the meta). A
layout (``codec.shard_layout``) travels once, in a memfd of its own; slots are plain bytes, so a
rank whose share changes with the step (fewer writers than ranks) needs no more memory.

Why memfds and not ``multiprocessing.shared_memory``: a memfd has no name to leak or to collide
(it goes with the last process that maps it, a killed rank included), it is not bound by the size
of ``/dev/shm`` (64 MB in a default container), and it travels to the agent over the Unix socket
they already share (``SCM_RIGHTS``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from typing import Any

from elastic._lazy import LazyModule
from elastic.checkpoint.codec import TORCH_DTYPES

torch = LazyModule("torch")
logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def supported() -> bool:
    """Whether this platform has memfds (Linux)."""
    return hasattr(os, "memfd_create")


def memfd_with(data: bytes) -> int:
    """A new memfd holding ``data`` (a layout, to send once); the caller sends and closes it."""
    fd = os.memfd_create("elastic-checkpoint-layout", os.MFD_CLOEXEC)
    try:
        os.pwrite(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_memfd(fd: int, length: int) -> bytes:
    """The first ``length`` bytes of a received memfd, which is closed."""
    try:
        return os.pread(fd, length, 0)
    finally:
        os.close(fd)


class SlotRing:
    """``nslots`` slots of ``slot_bytes`` each in one memfd: ``create`` on the rank; the agent
    maps the descriptor it receives with the ring's ``desc``."""

    def __init__(self, fd: int, desc: dict):
        self.desc = {k: int(desc[k]) for k in ("nslots", "slot_bytes", "size")}
        self.nslots, self.slot_bytes = self.desc["nslots"], self.desc["slot_bytes"]
        # The slots must cover the mapping exactly: ``_span`` checks a slot's bounds only, and a
        # memoryview slice past a shorter mapping is cut short without a word, so a shard would
        # be written truncated, with a matching sha256 and size, and fail only at the resume.
        if self.nslots < 1 or self.slot_bytes < 1 or self.desc["size"] != self.nslots * self.slot_bytes:
            raise ValueError(f"a ring's description does not add up: {self.desc}")
        self._mm = mmap.mmap(fd, self.desc["size"])
        os.close(fd)  # the mapping keeps the memory
        self._export: int | None = None  # a descriptor for the agent, until it is sent
        self._views: dict[tuple[int, Any], list] = {}  # (slot, layout id) -> tensors over the slot
        self._pinned: bool | None = None  # page-locked for CUDA (``pin``)
        self._unpin: tuple | None = None

    @classmethod
    def create(cls, nslots: int, slot_bytes: int) -> "SlotRing":
        """A new memfd for ``nslots`` snapshots of up to ``slot_bytes`` (rounded up to pages)."""
        slot_bytes = _round_up(slot_bytes)
        desc = {"nslots": nslots, "slot_bytes": slot_bytes, "size": nslots * slot_bytes}
        # Two descriptors: ``fd`` goes to the agent (``take_fd``), ``mapped`` is this side's,
        # closed by ``__init__`` once mapped. ``__init__`` leaves it open when it raises (the
        # agent's ``_handle`` closes a received one then), so a failed mapping (ENOMEM, the
        # vm.max_map_count limit) closes both here.
        fd = os.memfd_create("elastic-checkpoint", os.MFD_CLOEXEC)
        mapped = None
        try:
            os.ftruncate(fd, desc["size"])
            mapped = os.dup(fd)
            ring = cls(mapped, desc)
        except BaseException:
            for d in (fd, mapped):
                if d is not None:
                    os.close(d)
            raise
        ring._export = fd
        return ring

    def take_fd(self) -> int:
        """The memfd, for the agent: the caller sends it and closes it (once)."""
        fd, self._export = self._export, None
        if fd is None:
            raise ValueError("this ring's descriptor was already taken")
        return fd

    def _span(self, slot: int, offset: int, length: int) -> tuple[int, int]:
        if not 0 <= slot < self.nslots:
            raise ValueError(f"slot {slot} is outside a ring of {self.nslots}")
        if offset < 0 or length < 0 or offset + length > self.slot_bytes:
            raise ValueError(f"{length} bytes at {offset} do not fit a slot of {self.slot_bytes}")
        start = slot * self.slot_bytes + offset
        return start, start + length

    def data(self, slot: int, nbytes: int) -> memoryview:
        """The slot's first ``nbytes``: the data section of the shard file."""
        start, end = self._span(slot, 0, nbytes)
        return memoryview(self._mm)[start:end]

    def read(self, slot: int, offset: int, length: int) -> bytes:
        """A copy of ``length`` bytes at ``offset``: the meta, the RNG's blobs."""
        start, end = self._span(slot, offset, length)
        return self._mm[start:end]

    def put(self, slot: int, offset: int, data: Any) -> int:
        """Copy ``data`` (bytes or a buffer) into ``slot`` at ``offset``; returns its byte count."""
        data = memoryview(data).cast("B")
        start, end = self._span(slot, offset, data.nbytes)
        self._mm[start:end] = data
        return data.nbytes

    def copy_in(self, slot: int, layout_id: Any, layout: list[dict], tensors: dict[str, Any]) -> None:
        """Copy ``tensors`` (the layout's names) into ``slot``, from any device; whole on return."""
        views = self._views.get((slot, layout_id))
        if views is None:
            start, _ = self._span(slot, 0, sum(e["nbytes"] for e in layout))
            views = []
            for e in layout:
                dtype = getattr(torch, TORCH_DTYPES[e["dtype"]])
                count = math.prod(e["shape"])
                views.append(torch.frombuffer(self._mm, dtype=dtype, count=count, offset=start + e["offset"])
                             .view(e["shape"]) if count else None)
            self._views[(slot, layout_id)] = views
        dst, src = [], []
        for e, view in zip(layout, views):
            if view is not None:
                dst.append(view)
                src.append(tensors[e["name"]].detach())
        if dst and all(t.device.type == "cpu" for t in src):
            torch._foreach_copy_(dst, src)  # one call, one trip through the dispatcher
            return
        devices = {t.device for t in src if t.device.type == "cuda"}
        if devices:
            self.pin()
        # From a GPU: every copy queued without waiting, then one wait per device. Why: a
        # synchronous device-to-host copy waits for its stream each time, thousands of waits a
        # step for a model under Adam, inside the step. Why it is whole on return: each copy goes
        # on its source device's current stream of this thread, whose synchronize() returns once
        # everything queued on it is done (into pageable memory, when pinning was refused, CUDA
        # copies synchronously anyway).
        for d, t in zip(dst, src):
            d.copy_(t, non_blocking=t.device.type == "cuda")
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def forget(self, layout_id: Any) -> None:
        """Drop the views over the slots made for ``layout_id``, a layout the rank let go of
        (``AgentCheckpointer._forget_layouts``). Why: the views stayed until the ring was closed,
        so a tensor whose shape changed each checkpoint added a list of them per slot each time,
        for as long as the ring lasted (thousands of checkpoints when the state grows slowly)."""
        for key in [k for k in self._views if k[1] == layout_id]:
            del self._views[key]

    def pin(self, cudart: Any = None) -> bool:
        """Page-lock this memory for CUDA (``cudaHostRegister``), once: a device-to-host copy
        into pageable memory goes through a driver bounce buffer at a fraction of the speed,
        inside the step. (The in-process writer pins its staging buffers for the same reason.)
        False where CUDA refuses; the copies then still work, slower."""
        if self._pinned is not None:
            return self._pinned
        cudart = cudart or torch.cuda.cudart()
        base = torch.frombuffer(self._mm, dtype=torch.uint8)
        try:
            code = cudart.cudaHostRegister(base.data_ptr(), base.numel(), 0)  # a cudaError; 0 is success
            self._pinned = int(code) == 0
        except Exception as exc:  # noqa: BLE001 - an old or odd runtime: unpinned copies still work
            code, self._pinned = exc, False
        if self._pinned:
            self._unpin = (cudart, base)
        else:
            logger.warning("could not page-lock checkpoint snapshot memory for CUDA (%s); device-to-host "
                           "copies into it are slower", code)
        return self._pinned

    def close(self) -> None:
        if self._export is not None:
            os.close(self._export)
            self._export = None
        self._views.clear()
        if self._unpin is not None:
            cudart, base = self._unpin
            self._unpin = None
            try:
                cudart.cudaHostUnregister(base.data_ptr())
            except Exception:  # noqa: BLE001 - the process is going down with its context
                pass
            del base
        try:
            self._mm.close()
        except BufferError:  # a view of it is still alive somewhere; the GC unmaps it then
            pass
