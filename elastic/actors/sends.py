"""The first-N leader's sends of the agreed update to late replicas: bounded, with reused buffers.

After the fast N have averaged their gradients, the lowest fast rank sends the averaged vector to
each late replica with a non-blocking ``isend`` and goes on to its next step. The vector it sends
must stay untouched until the send is done, so it sends a copy, and the copy lives until then.

Why a send is never polled with ``work.is_completed()``: on gloo (torch 2.13) a send's ``Work``
is marked complete only inside ``wait()``. ``ProcessGroupGloo``'s send work has no future and no
completion callback, so ``is_completed()`` stays False after the peer has long received it
(checked with two processes: False after the receive, True after ``wait()``). Keeping each copy
until its send "completes" therefore kept every copy: 1.6 MB a step on the benchmark model, with
no bound (the leaders' memory grew by ~650 MB every 15 s, 3 GB in a minute of training).
``wait(timeout)`` is no test either: a timeout inside gloo's ``waitSend`` signals an exception to
the whole transport context, which breaks every pair of the group.

So at most ``limit`` sends stay in flight. A send over the limit first waits for the oldest one.
A late replica applies the updates in order, and after a late gradient it sits out, so it is
seldom more than a few steps behind: by then it has read the oldest send, and ``wait()`` returns
at once. A replica more than ``limit`` sends behind holds the leader up until it catches up. That
is the bound on how far a straggler may lag, in memory and in steps. NCCL does report completion
(``is_completed()`` queries its CUDA event), so finished sends there are reaped without waiting.

The copies are reused once their sends are done. Why: a fresh buffer each step is fresh memory,
and on the benchmark's VM the page faults of filling it cost the leader 3.3 ms of thread CPU per
1.6 MB copy, against 0.1 ms into a reused buffer (measured in the worker), on the critical path
of the leader's next step.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

# Bytes of in-flight update copies a leader may hold before its sends start to wait for the late
# replicas, and at most this many sends. Why this much slack: a replica that stalls for a moment
# (a pause, a slow disk, a busy core) should not stall the fast N; with the benchmark's 1.6 MB
# gradient the 64 sends cover ~1.5 s of 25 ms steps in ~100 MB. The 3x straggler of the
# benchmark lags 3-4 steps at most. At least 2 copies whatever the model size: one step of lag
# must never stall the leader.
SEND_BUDGET_BYTES = 256 << 20
MAX_IN_FLIGHT = 64


def in_flight_limit(nbytes: int) -> int:
    """How many sends of ``nbytes`` a leader keeps in flight (see the module docstring)."""
    return max(2, min(MAX_IN_FLIGHT, SEND_BUDGET_BYTES // max(1, nbytes)))


def max_trail(world_size: int) -> int:
    """Steps a first-N replica may trail the fastest rank of a group of ``world_size``.

    Why per rank of the world, not per leader: a replica late in every step from s to t is
    waiting on each of those steps' updates, sent by whichever rank led the step (the lowest of
    its fast set), and leadership moves as the fast set does. Each leader lets at most
    ``MAX_IN_FLIGHT`` sends to it be in flight and blocks on the next one, so a rank that leads
    accounts for at most ``MAX_IN_FLIGHT + 1`` of the steps it trails by."""
    return (MAX_IN_FLIGHT + 1) * max(1, int(world_size))


class UpdateSends:
    """One leader's sends in flight, oldest first, and the buffers of finished ones."""

    def __init__(self, isend: Callable[..., Any], limit: int):
        """``isend(tensor, dst=, tag=)`` starts one send and returns its work (``dist.isend``)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        self._isend = isend
        self.limit = limit
        self._in_flight: deque = deque()  # (works, buffer, destinations)
        self._free: list = []

    def __len__(self) -> int:
        return len(self._in_flight)

    def send(self, vector: Any, dsts: list[int], tag: int, received: Any = ()) -> None:
        """Send a copy of ``vector`` to every rank in ``dsts``; returns without waiting for them,
        unless more than ``limit`` sends would be in flight. ``received``: the ranks that reduced
        in this step (``confirm``), whose earlier sends are done."""
        self.reap()
        self.confirm(received)
        buf = self._free.pop() if self._free else vector.new_empty(vector.shape)
        buf.copy_(vector)
        self._in_flight.append(([self._isend(buf, dst=dst, tag=tag) for dst in dsts], buf, tuple(dsts)))
        while len(self._in_flight) > self.limit:
            self._finish_oldest()

    def confirm(self, received: Any) -> None:
        """Take back the buffers of the oldest sends whose every destination is in ``received``:
        ranks that computed and reduced in the current step, so they applied every earlier
        update first (a replica runs its steps in order, receiving each update it was late for)
        and their receives of those sends are done; ``wait()`` returns at once.

        Why: on gloo ``reap`` takes back nothing (see the module docstring), so until ``limit``
        sends were in flight each step's copy went into a fresh buffer, 65 of them for the
        benchmark's model: ~100 MB of new pages, each copy's page faults 3.3 ms of the leader's
        CPU for its first 65 steps as leader, in every group generation, on cores the replicas
        share. With this a buffer comes back once its late replica computes again."""
        while self._in_flight and all(dst in received for dst in self._in_flight[0][2]):
            self._finish_oldest()

    def reap(self) -> None:
        """Take back the buffers of the oldest sends that report completion (NCCL; never gloo)."""
        while self._in_flight and all(w.is_completed() for w in self._in_flight[0][0]):
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        works, buf, _ = self._in_flight.popleft()
        for w in works:
            w.wait()  # a peer that died fails it: DistBackendError, as a broken collective
        self._free.append(buf)  # at most limit + 1 buffers ever exist: one is made only when none is free
