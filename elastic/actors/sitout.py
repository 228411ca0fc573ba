"""First-N's sit-out schedule: which replicas skip computing a step's gradient, kept the same in
every rank of the group.

A replica whose gradient came late ``k`` times in a row sits out the next
``min(FIRST_SIT_OUT * 2**(k-1), late_backoff_steps)`` steps (``ScalingConfig.late_backoff_steps``;
0 turns it off). It still takes part in each of them: it receives the agreed update and applies
it, so it stays identical, but it computes no gradient that would only be dropped.

Why back off at all: the rule that lets a late rank skip a gradient sure to be dropped (N had
arrived before it started, see ``TrainWorker._first_n_step``) rarely fires, because a late rank
starts its next step last (it waits for the update first). Counted on the straggler benchmark's
workload (5 replicas, 300 steps, 2 cores): with no straggler a late gradient was computed and
dropped in every one of the 300 steps, a fifth of all the CPU the replicas spent; with a 3x
straggler, in 90-101 of them. With a cap of 8: 85-123 and 36-39. In alternating runs, training
after an eviction (five healthy replicas again) went from ~5,050 to ~6,100 samples/s; with the
3x straggler it moved within the noise.

Exponential backoff, as for a retry: each late gradient in a row doubles the steps sat out, up to
the cap, and one gradient in time ends it, so a rank that recovers is back in the fast set within
the cap. The first sit-out is ``FIRST_SIT_OUT`` (4) steps, not 1: with no straggler the late rank
of a step is nearly a coin toss among the replicas, so streaks stay short, and with 1 step first,
103-122 of 300 steps still computed a gradient that was dropped; starting at 4 (then 8, the cap),
45-49. Four alternating rounds each (5 replicas against 4 plain DDP ranks, 2 cores): first-N with
no straggler at 0.79/1.01/0.88/1.02 of plain against 0.76/0.78/0.72/0.75, and with the 3x
straggler 0.78/0.89/0.88/0.80 against 0.72/0.83/0.65/0.83. The cost: a backup that was late once
is no backup for 4 steps.

Why every rank keeps the whole schedule, not each replica its own streak: the schedule is a
function of the fast sets alone, which every rank reads each step, so every rank knows who sits
out of the next step before it starts. When that leaves exactly N replicas to compute (b = 1 and
one replica resting: most steps, with a persistent straggler or after one late gradient), those
N are the fast set by definition, and the step needs no agreement at all: no arrival on the
store, no wait for the N-th arrival to publish the set, the N reduce in the subgroup cached for
that set, bucket by bucket during their backward as DDP does (elastic/actors/grads.py). The step
then costs what a data-parallel one does, and it means the same as before: a replica that sits
out was no backup for that step either way, and the step waited for the slowest of the N
computing ones either way.

What counts as late here is "was eligible and is not in the fast set": a replica that skipped its
gradient because N had already arrived counts as late too (it was, and it is likely to be
again). Every rank of a group generation starts with an empty schedule at the rendezvous, and
records every step in order (a late replica lags, but it runs each step in turn), so all of them
hold the same schedule at the same step.
"""

from __future__ import annotations

FIRST_SIT_OUT = 4  # steps a first-N replica sits out after its first late gradient in a row


class SitOutSchedule:
    """Who computes a first-N step's gradient (see the module docstring). ``backoff_max``:
    ``ScalingConfig.late_backoff_steps``; 0 means nobody ever sits out."""

    def __init__(self, world_size: int, backoff_max: int) -> None:
        self.world_size = world_size
        self.backoff_max = backoff_max
        self.streak = [0] * world_size  # late gradients in a row, per rank
        self._rests_through = [0] * world_size  # the last step each rank sits out

    def eligible(self, step: int) -> tuple[int, ...]:
        """The ranks that may compute ``step``'s gradient, in rank order."""
        return tuple(r for r, last in enumerate(self._rests_through) if last < step)

    def record(self, step: int, fast: tuple[int, ...]) -> None:
        """``step`` is agreed, ``fast`` its fast set: a replica that could compute it and is not
        in the fast set rests the next steps. (Who could is ``eligible(step)`` still: only this
        changes the schedule.)"""
        for r in self.eligible(step):
            if r in fast:
                self.streak[r] = 0
            else:
                self.streak[r] += 1
                self._rests_through[r] = step + self.rest(self.streak[r])

    def rest(self, streak: int) -> int:
        """Steps a replica sits out after its ``streak``-th late gradient in a row."""
        return min(FIRST_SIT_OUT << min(streak - 1, 16), self.backoff_max)
