"""Host memory for snapshots: buffers a rank copies its share into, reused once written."""

from __future__ import annotations

import threading

from elastic._lazy import LazyModule
from elastic.checkpoint.codec import host_copy

torch = LazyModule("torch")


class StagingBuffers:
    """Host buffers that snapshots copy into, reused once the persister lets go of a snapshot.

    Why: a fresh host copy of every tensor each step pays for new memory, and the copy is inside
    the step. On CPU the allocator hands big blocks back to the kernel and page-faults them in
    again (glibc always does above 32 MB). Measured in one process, with the two newest copies
    alive as in the persister: 1.6 MB took 0.79 ms fresh against 0.14 ms into a reused buffer,
    64 MB 48 ms against 10.7 ms. (On the benchmark's small state the snapshot's in-step time
    did not move measurably: ~0.95 ms a rank, most of it flattening the state dicts and reading
    the RNG; its copies took 0.22 ms.) For tensors on a GPU the buffers are pinned, which is
    what lets a device-to-host copy run at full speed; pinning fresh memory every step would
    cost more than the copy. torch.distributed.checkpoint's stager caches its staging copies for the same
    reasons, but it reuses one copy per tensor, which the next snapshot would overwrite while the
    previous one may still be written. Here a buffer only returns when ``release`` says its
    snapshot is written or dropped (``AsyncPersister``'s ``on_release``), so a buffer is never
    handed out twice. Memory: the snapshots in flight (one being written, one waiting, one being
    taken) hold buffers, as fresh copies would; between checkpoints, of each (shape, dtype) as
    many buffers wait for reuse as one snapshot has given back at most. So when every step is
    saved, step t's buffers come back while step t+1 is written and serve all of step t+2's
    copies, and what waits is never more than one snapshot's worth of each shape. Why not one
    per shape: a snapshot holds many tensors of one shape (Adam's two moments have their
    parameter's; a transformer's blocks repeat theirs). 4 x Linear(64, 64) with Adam, each
    snapshot released before the next: keeping one per shape reused 57 of 640 copies over 20
    steps, the rest were fresh (on a GPU, pinned) memory; keeping this many reuses 608, all
    but the first snapshot's.
    """

    # A shape no release gave back in this many is let go (its buffers and its count). Why: a
    # tensor whose shape changes (a buffer that grows, an embedding resized) left a buffer of each
    # old shape for good, pinned memory on a GPU, growing with every checkpoint. Not after one
    # release: with ``min_shard_bytes`` the ranks that write take turns, and a rank's shapes come
    # back every few steps.
    FORGET_AFTER = 16

    def __init__(self):
        self._free: dict[tuple, list] = {}  # (shape, dtype, pinned) -> buffers ready for reuse
        self._keep: dict[tuple, int] = {}  # (shape, dtype, pinned) -> the most one release gave back
        self._seen: dict[tuple, int] = {}  # (shape, dtype, pinned) -> the release that last gave one back
        self._releases = 0
        self._out: dict[int, tuple] = {}  # data_ptr -> key of every buffer handed out, not yet back
        self._lock = threading.Lock()
        self.reused = 0  # copies made into a recycled buffer
        self._queued: set = set()  # GPUs with copies queued since the last settle()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A private, contiguous CPU copy of ``t``, like ``host_copy``, in a recycled buffer when one fits.

        From a GPU the copy is only queued: call ``settle()`` before the copies are read. Why: a
        synchronous device-to-host copy waits for its stream each time, thousands of waits a step
        for a model under Adam, inside the step; one wait for all of a snapshot's copies does."""
        t = t.detach()
        if t.numel() == 0 or t.layout != torch.strided:
            return host_copy(t)
        key = (tuple(t.shape), t.dtype, t.device.type == "cuda")
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
            self.reused += buf is not None
        if buf is None:
            buf = torch.empty(key[0], dtype=t.dtype, device="cpu", pin_memory=key[2])
        if key[2]:
            buf.copy_(t, non_blocking=True)  # into pinned memory: queued on t's device's current stream
            self._queued.add(t.device)
        else:
            buf.copy_(t)
        with self._lock:
            self._out[buf.data_ptr()] = key
        return buf

    def settle(self) -> None:
        """Wait for the device-to-host copies queued since the last call: every copy ``copy``
        returned is whole after this. A stream's ``synchronize()`` returns once all work queued on
        it is done, and each copy went on its source device's current stream of this thread."""
        while self._queued:
            torch.cuda.current_stream(self._queued.pop()).synchronize()

    def release(self, tensors) -> None:
        """Take back the buffers of one snapshot that is written or dropped. Anything this did
        not hand out, or already took back, is ignored: a second release of a snapshot before
        the next ``copy`` frees nothing. Each snapshot must still be released once only (as
        ``AsyncPersister`` calls ``on_release`` once a payload): a second release after a ``copy``
        that reused one of its buffers frees that buffer while the new snapshot holds it, and a
        later copy writes over it.

        Why not ignore that one too: a buffer is known by its address, and handed out again it is
        the very tensor the first snapshot held, so a late release of the first cannot be told
        from the new snapshot's own. Telling them apart takes a new tensor object each time a
        buffer is handed out (``detach``: about 1.5 us a tensor, more than this pool's own
        bookkeeping of a copy, for every tensor of every snapshot) or a token carried through
        the persister's payload to here."""
        with self._lock:
            back: dict[tuple, list] = {}
            for t in tensors:
                key = self._out.pop(t.data_ptr(), None)  # empty tensors are never handed out
                if key is not None:
                    back.setdefault(key, []).append(t)
            if not back:
                return
            self._releases += 1
            for key, buffers in back.items():
                keep = self._keep[key] = max(self._keep.get(key, 0), len(buffers))
                free = self._free.setdefault(key, [])
                free.extend(buffers[:max(0, keep - len(free))])
                self._seen[key] = self._releases
            forgotten = [k for k, last in self._seen.items() if last <= self._releases - self.FORGET_AFTER]
            for key in forgotten:
                del self._seen[key], self._keep[key]
                self._free.pop(key, None)
        # Pinned buffers go back to torch's caching host allocator, which keeps them pinned until
        # asked: let it give back those no buffer holds (CUDA builds only have the call).
        if any(key[2] for key in forgotten) and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
