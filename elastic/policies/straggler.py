"""Straggler policy: score each rank's speed and name a persistent straggler for eviction.

A rank's score is the (lower) median of its recent local step times divided by the median over the other
ranks.
A rank whose score stays above ``straggler_factor`` for ``window`` consecutive steps is persistent.
A rank still busy after the others finished (first-N mode does not wait for it) is scored by how
long it has been late so far, so it does not look healthy just because it has not reported. The
policy only decides; the controller evicts the rank and puts a hot spare in its place.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict, deque

from elastic.policies.decisions import Continue, Decision, EvictStraggler


class StragglerPolicy:
    def __init__(self, factor: float, window: int, evict: bool, warmup_steps: int = 0):
        if factor <= 1.0:
            raise ValueError("straggler factor must be > 1")
        self.factor = factor
        self.window = window
        self.evict = evict
        self._times: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))
        self._over: dict[int, int] = defaultdict(int)
        self._busy_for: dict[int, float] = {}
        self._fresh: dict[int, int] = defaultdict(int)  # timings observed since the last decision
        # Early steps after a (re)start are noisy (allocators, caches, a spare warming up) and on
        # a crowded machine vary by more than 2x; they would name healthy ranks as stragglers.
        self.warmup_steps = warmup_steps
        self._steps = 0
        # Each rank's own first step after a (re)start is cold too (a promoted spare's first
        # kernels, allocations, autotuning), and in first-N the run's warm-up can be over before
        # a new rank's first step is: the fast N run ahead. Its first timing is left out and,
        # until it has one, its late stretch counts as a pause (``decide``). None with no warm-up.
        self._cold_steps = 1 if warmup_steps > 0 else 0
        self._seen: dict[int, int] = defaultdict(int)  # timings each rank reported since the reset
        # A rank's warm-up step times after its cold first step: no score is made of them, but
        # they are what a late rank with no counted step time has to show that its steps are
        # healthy (``decide``). Its cold step is not among them: a replica slow from its second
        # step had its fast cold step there, and their median called it healthy (a first try,
        # reverted in fc98c46, kept it and the lower median; it was never evicted).
        self._early: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))
        # Late ranks held one short of the window in their current late stretch (``decide``).
        # The step time that ends such a stretch is the pause again: it joins the rank's times
        # but is no fresh evidence, and while it is the rank's newest it is no evidence of the
        # rank's own speed either (``_paused``). Why: counted at the next decision on top of the
        # held count, or judged the rank's speed while it was still late on a later window
        # (first-N: the fast N ran on), one pause reached the window and evicted a healthy
        # replica whose only counted timing it was. Only one: the next step time counts, held
        # or not, so a rank slow for good (late again and again) is still judged by its times.
        self._held: set[int] = set()
        self._paused: set[int] = set()
        # Each held rank's count from before its current late stretch: given back when the step
        # time that ends the stretch is taken as the pause (``observe``). Why: the held count
        # is the pause's, and the pause's time stays in the rank's times after it stops being
        # the newest; kept, the count made the pause count twice. A healthy replica that paused
        # once, sat out under the late backoff, then ran one 2.2x step (a crowded host) was
        # evicted at window 3 ("over the threshold for 3 steps"): the held 2, plus 1 for a lower
        # median that the pause's time and that one step made slow.
        self._before_hold: dict[int, int] = {}

    def reset(self) -> None:
        """The group was rebuilt: old timings describe another ring. Start a new warm-up."""
        self._times.clear()
        self._over.clear()
        self._busy_for.clear()
        self._fresh.clear()
        self._seen.clear()
        self._early.clear()
        self._held.clear()
        self._paused.clear()
        self._before_hold.clear()
        self._steps = 0

    def observe(self, rank: int, local_time_s: float) -> None:
        self._seen[rank] += 1
        self._busy_for.pop(rank, None)  # it finished: no longer late
        ends_hold = rank in self._held
        self._held.discard(rank)
        before_hold = self._before_hold.pop(rank, None)
        if self._seen[rank] <= self._cold_steps:
            return
        if self._steps < self.warmup_steps:
            self._early[rank].append(local_time_s)
            return
        self._times[rank].append(local_time_s)
        if ends_hold and rank not in self._paused:  # the held stretch's own time (``__init__``)
            self._paused.add(rank)
            if before_hold is not None:
                self._over[rank] = before_hold
        else:
            self._paused.discard(rank)
            self._fresh[rank] += 1

    def observe_pending(self, rank: int, elapsed_s: float) -> None:
        """``rank`` has been late for ``elapsed_s`` and has not finished (0: it is not late)."""
        if elapsed_s <= 0:
            self._busy_for.pop(rank, None)
        elif self._steps >= self.warmup_steps:
            self._busy_for[rank] = elapsed_s

    def forget(self, rank: int) -> None:
        """A rank got a new actor: its history no longer describes it."""
        self._times.pop(rank, None)
        self._over.pop(rank, None)
        self._busy_for.pop(rank, None)
        self._fresh.pop(rank, None)
        self._seen.pop(rank, None)
        self._early.pop(rank, None)
        self._held.discard(rank)
        self._paused.discard(rank)
        self._before_hold.pop(rank, None)

    def scores(self) -> dict[int, float]:
        """Each rank's median step time over the median of the other ranks' medians.

        Why the others' median and not everyone's: with two ranks the median of both is their
        mean, so a rank could never score 2 or more however slow it was (1 ms against 300 ms
        scored 1.99), and the default threshold of 2 could never evict the slow rank of a
        two-rank group. Without itself in the median a rank's score is its slowdown against its
        peers at any group size; with many ranks the two medians barely differ."""
        # Over copies: the controller's status thread (``elastic status``, metrics) scores while
        # the training thread observes. ``list(d.items())`` runs in C under the GIL, so the copy
        # is whole; iterating the dict itself in Python code could meet a key added meanwhile
        # ("dictionary changed size during iteration"), and ``median`` copies a deque in C too.
        # A rank's own median is the lower one: with an even window (2, say) the median of two
        # timings is their mean, and one slow step then scored a healthy rank over the threshold
        # for as long as it stayed in the window, which at window=2 was enough to evict it. The
        # lower median needs more than half of the window slow, as an odd window's does.
        return self._scores()[0]

    def _scores(self) -> tuple[dict[int, float], dict[int, float]]:
        """``scores()``, and each late rank's score from its own step times alone (its late
        stretch left out): what ``decide`` tells a pause from a slow rank by. A rank with no
        counted step time is judged there by its warm-up step times (``_early``), by their upper
        median: half of them slow (of two, one) is enough to be counted in full."""
        timed = {r: statistics.median_low(t) for r, t in list(self._times.items()) if t}
        # What each rank's own steps say: its counted times but those that ended a held pause
        # (``_paused``), else its warm-up's.
        early = {r: statistics.median_high(t) for r, t in list(self._early.items()) if t}
        judged = {**early, **timed}
        for r in set(self._paused):  # a median again only for these (decide runs every window)
            before = list(self._times.get(r, ()))[:-1]
            if before:
                judged[r] = statistics.median_low(before)
            elif r in early:
                judged[r] = early[r]
            else:
                judged.pop(r, None)
        medians = dict(timed)
        for r, busy in list(self._busy_for.items()):
            medians[r] = max(medians.get(r, 0.0), busy)
        if len(medians) < 2:
            return {r: 1.0 for r in medians}, {r: 1.0 for r in timed}
        ordered = sorted(medians.values())
        out, own = {}, {}
        for r, m in medians.items():
            others = _median_without(ordered, bisect.bisect_left(ordered, m))
            out[r] = m / others if others > 0 else 1.0
            if r in judged:
                own[r] = judged[r] / others if others > 0 else 1.0
        return out, own

    def decide(self, spares_ready: int, steps: int = 1) -> Decision:
        """Decide after ``steps`` more steps (the controller asks once per dispatch window).

        A rank over the threshold now counts as over it for those steps, but for at most half a
        policy window per decision: one noisy dispatch window (on a crowded machine a healthy
        rank can look 2x slow for a dozen steps) is never enough to evict; with a window of 2 or
        more it takes at least two consecutive decisions, and at least ``window`` steps (a window
        of 1 evicts on one decision over the threshold).

        Only a rank with new evidence since the last decision counts: a timing observed, or a
        step it is still busy with. Why: a late first-N replica sits out the next steps and
        reports no timing for them, and its one slow timing (a GC pause) would otherwise be
        counted again at every decision until it was evicted on that one sample. Without new
        evidence its count stays as it was.

        A late stretch alone never makes a rank persistent when its own step times are healthy:
        its count stops one short of the window until a step time of its own says it is slow.
        Why: counted at every decision it stayed late, one pause of a healthy replica (a GC, a
        page-fault storm: 0.3 s against 30 ms steps, one step a decision) reached the window and
        evicted it, where the same pause as a step time in data parallel never can (the lower
        median over the window). A rank still in its first, cold step since the reset (a
        promoted spare: see ``_cold_steps``) is held the same way: a healthy spare's slow start
        evicted it, and kept spares off its node for ``straggler_node_avoid_s``. One with no step
        time counted yet is judged by its warm-up step times after the cold one: a first-N
        replica that computed healthy warm-up steps and then sat out under the late backoff is
        held on its first pause after the warm-up (it was evicted ~0.2 s into a GC pause). One
        with none of those either, or slow ones, is counted in full, so a replica 200x slow from
        the start is evicted at its next late stretch after its first step (a rank that never
        finishes one is ``step_timeout_s``'s). The step time that ends a held stretch joins the
        rank's times but is no fresh evidence, nor its own speed while it is its newest
        (``_held``, ``_paused``): it is the same pause. The count held for it is given back
        (``_before_hold``): the pause's time still counts among the rank's times later on.
        """
        self._steps += steps
        scores, own = self._scores()
        counted = min(steps, max(1, (self.window + 1) // 2))
        for rank, score in scores.items():
            if not self._fresh.get(rank) and rank not in self._busy_for:
                continue
            if score <= self.factor:
                self._over[rank] = 0
                self._held.discard(rank)
                self._before_hold.pop(rank, None)
                continue
            over = self._over[rank] + counted
            if rank in self._busy_for and (own.get(rank, math.inf) <= self.factor
                                           or self._seen.get(rank, 0) < max(1, self._cold_steps)):
                # Late, with healthy steps of its own, with none yet since the reset, or in its
                # cold first step: a pause so far. (With no warm-up, a rank late before its first
                # step since a rebuild was counted in full: nothing of its own said it was slow.)
                over = min(over, self.window - 1)
                if rank not in self._held and own.get(rank, math.inf) <= self.factor:
                    # Held as a pause: its own steps say it is healthy, so the count is given
                    # back when the pause's time comes in (``observe``). One held with no step
                    # time of its own yet (cold, or none since a rebuild) keeps it: nothing says
                    # the stretch was a pause, and a rank slow from its first step is evicted
                    # at its next late stretch.
                    self._before_hold[rank] = self._over[rank]
                self._held.add(rank)
            elif rank in self._busy_for:
                # Counted in full in a stretch it was held in before: its own steps say it is
                # slow now, and what it counted since is no pause's, to give back.
                self._before_hold.pop(rank, None)
            self._over[rank] = over
        self._fresh.clear()
        if not self.evict:
            return Continue()
        # Only a rank over the threshold now: one whose evidence is gone (no timing since the last
        # reset, and no longer late) keeps its count, but nothing says it is slow now; nor does
        # a count frozen while the rank sat out and its peers slowed down to its pace.
        candidates = [r for r, n in self._over.items() if n >= self.window and scores.get(r, 0.0) > self.factor]
        if not candidates:
            return Continue()
        worst = max(candidates, key=scores.__getitem__)
        if spares_ready < 1:
            return Continue(f"rank {worst} is a persistent straggler (score {scores[worst]:.2f}) but no spare is "
                            "ready; it is evicted once one is", straggler=worst)
        if worst in self._busy_for and worst not in self._times:
            # Scored by its late stretch alone: it has no step time counted to compare.
            evidence = f"late for {self._busy_for[worst]:.2f}s, {scores[worst]:.2f}x the other ranks' median step time"
        else:
            evidence = f"step time {scores[worst]:.2f}x the other ranks' median"
        return EvictStraggler(f"rank {worst} {evidence}, over the threshold ({self.factor:g}x) for "
                              f"{self._over[worst]} steps (window {self.window})", worst)


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted ``ordered`` without its ``i``-th element, read off by index (no
    copy and no sort per rank: the policy scores every rank every dispatch window)."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th of the remaining elements
        return ordered[k if k < i else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
