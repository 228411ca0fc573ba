"""Snapshot slots in memory a rank shares with its node's checkpoint agent (one Linux memfd).

The rank copies its share of the state into a free slot inside the step; the agent writes the
shard straight from that memory and hands the slot back. Layout of the memfd: the shard layout
as JSON (``codec.shard_layout``) on the first pages, then ``nslots`` slots, each the shard's
safetensors data section (tensors back to back, in file order) followed by room for the rank's
meta JSON of that step (RNG, and with the first share the state skeleton).

Why a memfd and not ``multiprocessing.shared_memory``: a memfd has no name to leak or to
collide (it goes with the last process that maps it, a killed rank included), it is not bound
by the size of ``/dev/shm`` (64 MB in a default container), and it travels to the agent over
the Unix socket they already share (``SCM_RIGHTS``).
"""

from __future__ import annotations

import json
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


class SlotRing:
    """``nslots`` snapshot slots of one shard layout. ``create`` on the rank, ``attach`` on the agent."""

    def __init__(self, fd: int, desc: dict, layout: list[dict] | None = None):
        self.desc = dict(desc)
        self.nslots = int(desc["nslots"])
        self.slot_bytes = int(desc["slot_bytes"])
        self.data_bytes = int(desc["data_bytes"])
        self.meta_capacity = int(desc["meta_capacity"])
        self.slots_offset = int(desc["slots_offset"])
        self._mm = mmap.mmap(fd, int(desc["size"]))
        os.close(fd)  # the mapping keeps the memory
        self._export: int | None = None  # a descriptor for the agent, until it is sent
        if layout is None:
            n = int(desc["layout_len"])
            layout = json.loads(self._mm[:n])
        self.layout = layout
        self._views: dict[int, list] = {}
        self._pinned: bool | None = None  # page-locked for CUDA (``pin``)
        self._unpin: tuple | None = None

    @classmethod
    def create(cls, layout: list[dict], nslots: int, meta_capacity: int) -> "SlotRing":
        """A new memfd for ``nslots`` snapshots of tensors laid out as ``layout``."""
        text = json.dumps(layout, separators=(",", ":")).encode()
        data_bytes = sum(e["nbytes"] for e in layout)
        slots_offset = _round_up(len(text))
        slot_bytes = _round_up(data_bytes + meta_capacity)
        desc = {"nslots": nslots, "slot_bytes": slot_bytes, "data_bytes": data_bytes,
                "meta_capacity": slot_bytes - data_bytes, "slots_offset": slots_offset,
                "layout_len": len(text), "size": slots_offset + nslots * slot_bytes}
        fd = os.memfd_create("elastic-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, desc["size"])
            ring = cls(os.dup(fd), desc, layout)
        except BaseException:
            os.close(fd)
            raise
        ring._export = fd
        ring._mm[:len(text)] = text
        return ring

    def take_fd(self) -> int:
        """The memfd, for the agent: the caller sends it and closes it (once)."""
        fd, self._export = self._export, None
        if fd is None:
            raise ValueError("this ring's descriptor was already taken")
        return fd

    @classmethod
    def attach(cls, fd: int, desc: dict) -> "SlotRing":
        """The agent's mapping of a ring a rank created (``fd`` received over the socket)."""
        return cls(fd, desc)

    def _start(self, slot: int) -> int:
        if not 0 <= slot < self.nslots:
            raise ValueError(f"slot {slot} is outside a ring of {self.nslots}")
        return self.slots_offset + slot * self.slot_bytes

    def data(self, slot: int) -> memoryview:
        """The slot's tensors, as the data section of the shard file."""
        start = self._start(slot)
        return memoryview(self._mm)[start:start + self.data_bytes]

    def meta(self, slot: int, length: int) -> bytes:
        if not 0 <= length <= self.meta_capacity:
            raise ValueError(f"meta of {length} bytes in a slot with room for {self.meta_capacity}")
        start = self._start(slot) + self.data_bytes
        return self._mm[start:start + length]

    def put_meta(self, slot: int, data: bytes) -> None:
        if len(data) > self.meta_capacity:
            raise ValueError(f"meta of {len(data)} bytes in a slot with room for {self.meta_capacity}")
        start = self._start(slot) + self.data_bytes
        self._mm[start:start + len(data)] = data

    def copy_in(self, slot: int, tensors: dict[str, Any]) -> None:
        """Copy ``tensors`` (the layout's names) into ``slot``, from any device; synchronous."""
        views = self._views.get(slot)
        if views is None:
            start = self._start(slot)
            views = []
            for e in self.layout:
                dtype = getattr(torch, TORCH_DTYPES[e["dtype"]])
                count = math.prod(e["shape"])
                views.append(torch.frombuffer(self._mm, dtype=dtype, count=count, offset=start + e["offset"])
                             .view(e["shape"]) if count else None)
            self._views[slot] = views
        dst, src = [], []
        for e, view in zip(self.layout, views):
            if view is not None:
                dst.append(view)
                src.append(tensors[e["name"]].detach())
        if dst and all(t.device.type == "cpu" for t in src):
            torch._foreach_copy_(dst, src)  # one call, one trip through the dispatcher
            return
        if any(t.device.type == "cuda" for t in src):
            self.pin()
        for d, t in zip(dst, src):  # from a GPU: each a synchronous device-to-host copy
            d.copy_(t)

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
