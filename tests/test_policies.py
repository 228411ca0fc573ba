"""Policies alone: no Ray, no actors. Each decision and its reason for every situation."""

from __future__ import annotations

import pytest

from elastic.config import FailureConfig
from elastic.data import SampleLedger, ShardPlan, epoch_order, epoch_order_array, order_digest
from elastic.policies import (
    Continue,
    EvictStraggler,
    Fail,
    FailurePolicy,
    FailureView,
    ReplaceWithSpares,
    RestartFromCheckpoint,
    Shrink,
    StragglerPolicy,
    WaitForCapacity,
)


def view(lost=(1,), active=4, ready=0, pending=0, failures=1, waited=False):
    return FailureView(tuple(lost), "actor_died", active, ready, pending, failures, waited)


# Each row: the decision, and what its reason says (the controller logs it as the why of a recovery).
@pytest.mark.parametrize("cfg, v, expected, says", [
    (FailureConfig(), view(ready=1), ReplaceWithSpares, "1 hot spare(s) ready for rank(s) [1]"),
    (FailureConfig(), view(lost=(1, 2), ready=2), ReplaceWithSpares, "2 hot spare(s) ready for rank(s) [1, 2]"),
    (FailureConfig(), view(lost=(1, 2), ready=1), WaitForCapacity,
     "only 1 spare(s) ready for 2 lost rank(s); waiting up to"),
    (FailureConfig(), view(ready=0), WaitForCapacity, "only 0 spare(s) ready for 1 lost rank(s); waiting up to"),
    (FailureConfig(capacity_timeout_s=5), view(ready=0), WaitForCapacity, "waiting up to 5s for capacity"),
    (FailureConfig(), view(ready=0, waited=True), Fail, "no capacity came within capacity_timeout_s="),
    (FailureConfig(when_no_spare="fail"), view(), Fail, "only 0 spare(s) ready for 1 lost rank(s); FailureConfig says fail"),
    (FailureConfig(when_no_spare="restart"), view(), RestartFromCheckpoint,
     "restarting every rank from the last committed checkpoint"),
    (FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=3), view(), Shrink,
     "shrinking to 3 worker(s) (min_workers=3)"),
    (FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=4), view(), Fail,
     "shrinking would leave 3 < min_workers=4"),
    (FailureConfig(when_no_spare="shrink", allow_shrink=True), view(), Fail,  # min_workers defaults to all
     "shrinking would leave 3 < min_workers=4"),
    (FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=1), view(ready=0), Shrink,
     "FailureConfig.on_failure='shrink'; shrinking to 3 worker(s) (min_workers=1)"),
    (FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=1), view(ready=3), ReplaceWithSpares,
     "3 hot spare(s) ready for rank(s) [1] keep the run's size instead of a shrink"),
    (FailureConfig(on_failure="restart"), view(ready=3), RestartFromCheckpoint,
     "FailureConfig.on_failure='restart'; restarting every rank"),
    (FailureConfig(max_failures=1), view(ready=1, failures=2), Fail, "failure 2 exceeds FailureConfig.max_failures=1"),
    # on_failure="wait" waits for spares, and uses them once they are there (or already were)
    (FailureConfig(on_failure="wait"), view(ready=0), WaitForCapacity, "FailureConfig.on_failure='wait'; waiting up to"),
    (FailureConfig(on_failure="wait"), view(ready=1), ReplaceWithSpares,
     "FailureConfig.on_failure='wait'; 1 hot spare(s) ready for rank(s) [1]"),
    (FailureConfig(on_failure="wait"), view(ready=1, waited=True), ReplaceWithSpares,
     "FailureConfig.on_failure='wait'; 1 hot spare(s) ready for rank(s) [1]"),
    (FailureConfig(on_failure="wait"), view(ready=0, waited=True), Fail,
     "FailureConfig.on_failure='wait'; no capacity came within"),
    (FailureConfig(), view(lost=(1, 2), ready=2, waited=True), ReplaceWithSpares, "2 hot spare(s) ready for rank(s) [1, 2]"),
    # "fail" fails even with a spare ready for the lost rank
    (FailureConfig(on_failure="fail"), view(ready=1), Fail, "FailureConfig.on_failure='fail'; FailureConfig says fail"),
])
def test_failure_policy(cfg, v, expected, says):
    # Only the decision's type was checked: a ReplaceWithSpares for no rank, or a wait with
    # another timeout than capacity_timeout_s, passed, and so did any reason that was not empty.
    decision = FailurePolicy(cfg, num_workers=4).decide(v)
    assert type(decision) is expected
    assert says in decision.reason, decision.reason
    if isinstance(decision, (ReplaceWithSpares, WaitForCapacity, Shrink)):
        assert decision.ranks == v.lost_ranks  # the lost ranks, all of them, in order
    if isinstance(decision, WaitForCapacity):
        assert decision.timeout_s == cfg.capacity_timeout_s
        assert f"waiting up to {cfg.capacity_timeout_s:g}s" in decision.reason
    if isinstance(decision, Shrink):  # no Shrink row has a ready spare: every survivor trains on
        assert decision.size == v.num_active - len(v.lost_ranks) and decision.replace == ()


@pytest.mark.parametrize("cfg", [FailureConfig(), FailureConfig(on_failure="restart"), FailureConfig(on_failure="fail"),
                                 FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=1),
                                 FailureConfig(on_failure="wait"), FailureConfig(when_no_spare="fail")])
def test_a_group_that_broke_with_every_rank_alive_forms_again_with_its_members_whatever_on_failure_says(cfg):
    # A dropped link: nothing lost. "restart" rebuilt every rank from the checkpoint, "fail" ended
    # the run. The failure still counts (max_failures bounds a link that keeps dropping).
    decision = FailurePolicy(cfg, num_workers=4).decide(
        FailureView((), "collective", 4, spares_ready=0, spares_pending=0, failures_so_far=1))
    assert isinstance(decision, ReplaceWithSpares) and decision.ranks == ()
    assert "no rank lost (collective)" in decision.reason
    over = FailurePolicy(cfg, num_workers=4).decide(
        FailureView((), "collective", 4, spares_ready=0, spares_pending=0, failures_so_far=cfg.max_failures + 1))
    assert isinstance(over, Fail) and "max_failures" in over.reason


def test_failure_policy_reasons_name_the_limit():
    d = FailurePolicy(FailureConfig(max_failures=0), 4).decide(view(ready=1))
    assert "max_failures=0" in d.reason
    d = FailurePolicy(FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=4), 4).decide(view())
    assert "min_workers=4" in d.reason


SHRINK = FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=2)


def test_shrink_goes_to_the_largest_size_the_global_batch_divides_over():
    policy = FailurePolicy(SHRINK, 4, global_batch=64)
    d = policy.decide(view(lost=(1,), active=4))  # 3 survivors: 64 does not divide over 3
    assert isinstance(d, Shrink) and d.size == 2 and d.ranks == (1,)
    assert "shrinking to 2" in d.reason and "1 survivor(s) stand by" in d.reason
    d = FailurePolicy(SHRINK, 4, global_batch=63).decide(view(lost=(1,), active=4))
    assert isinstance(d, Shrink) and d.size == 3 and "stand by" not in d.reason
    assert FailurePolicy(SHRINK, 4).shrink_size(3) == 3  # no global batch given: any size


def test_shrink_with_no_usable_size_fails_naming_the_batch_or_uses_ready_spares():
    policy = FailurePolicy(SHRINK, 4, global_batch=64)
    d = policy.decide(view(lost=(1, 2), active=3))  # one survivor, below min_workers
    assert isinstance(d, Fail) and "min_workers=2" in d.reason
    d = FailurePolicy(SHRINK, 5, global_batch=5).decide(view(lost=(4,), active=5))  # 4, 3, 2: none divides 5
    assert isinstance(d, Fail) and "global batch 5 divides over no size" in d.reason
    # Survivors an earlier shrink stood by are hot spares: they heal what shrinking cannot.
    # They are used before any shrink, with on_failure="replace" and with "shrink" alike: a
    # second shrink would leave them idle, holding their bundles, for the rest of the run.
    assert isinstance(policy.decide(view(lost=(1,), active=2, ready=1)), ReplaceWithSpares)
    first = FailurePolicy(FailureConfig(on_failure="shrink", allow_shrink=True, min_workers=1), 8, global_batch=64)
    d = first.decide(view(lost=(1,), active=4, ready=3))
    assert isinstance(d, ReplaceWithSpares) and d.ranks == (1,) and "instead of a shrink" in d.reason
    d = first.decide(view(lost=(0, 1), active=4, ready=1))  # too few spares for both: shrink to 2
    assert isinstance(d, Shrink) and d.size == 2 and d.replace == ()  # 3 does not divide 64: no spare used


def test_a_shrink_counts_the_ready_spares_toward_the_new_size():
    # Fewer ready spares than lost ranks: the spares take lost ranks first, and the run shrinks
    # by the rest. Both ranks on one node lost, one spare: it goes on as 1, not failing below
    # min_workers; 6 ranks that lose 2 with 1 spare go on as 5 (60 divides), the spare not idle.
    one = FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=1)
    d = FailurePolicy(one, 2, global_batch=64).decide(view(lost=(0, 1), active=2, ready=1))
    assert isinstance(d, Shrink) and d.size == 1 and d.ranks == (0, 1) and d.replace == (0,)
    assert "1 hot spare(s) take rank(s) [0]" in d.reason
    d = FailurePolicy(one, 6, global_batch=60).decide(view(lost=(2, 4), active=6, ready=1))
    assert isinstance(d, Shrink) and d.size == 5 and d.replace == (2,) and "stand by" not in d.reason
    d = FailurePolicy(one, 4, global_batch=64).decide(view(lost=(2, 3), active=4, ready=1))
    assert isinstance(d, Shrink) and d.size == 2 and d.replace == ()  # 3 does not divide 64
    d = FailurePolicy(SHRINK, 2, global_batch=64).decide(view(lost=(0, 1), active=2, ready=1))
    assert isinstance(d, Fail) and "shrinking would leave 1 < min_workers=2" in d.reason


def test_straggler_scores_and_persistence():
    p = StragglerPolicy(factor=2.0, window=3, evict=True)
    for _ in range(2):
        for r in range(4):
            p.observe(r, 0.3 if r == 2 else 0.1)
        assert isinstance(p.decide(spares_ready=1), Continue)
    assert p.scores()[2] == pytest.approx(3.0)
    for r in range(4):
        p.observe(r, 0.3 if r == 2 else 0.1)
    d = p.decide(spares_ready=1)
    assert isinstance(d, EvictStraggler) and d.rank == 2 and "3.00x" in d.reason


def test_straggler_not_evicted_without_spare_or_when_off():
    p = StragglerPolicy(factor=2.0, window=1, evict=True)
    for r in range(3):
        p.observe(r, 1.0 if r == 0 else 0.1)
    held = p.decide(spares_ready=0)
    assert isinstance(held, Continue) and held.straggler == 0 and "no spare is ready" in held.reason
    assert isinstance(p.decide(spares_ready=1), EvictStraggler)
    off = StragglerPolicy(factor=2.0, window=1, evict=False)
    for r in range(3):
        off.observe(r, 1.0 if r == 0 else 0.1)
    assert isinstance(off.decide(spares_ready=1), Continue)


def test_one_slow_step_is_not_persistent():
    p = StragglerPolicy(factor=2.0, window=3, evict=True)
    for step in range(6):
        for r in range(4):
            p.observe(r, 0.5 if (r == 1 and step == 2) else 0.1)
        assert isinstance(p.decide(spares_ready=1), Continue)


@pytest.mark.parametrize("window", [2, 3, 4])
def test_one_slow_step_is_not_persistent_at_any_window(window):
    # At window=2 the median of a rank's two timings was their mean: one step 10x slow scored
    # 5.5 at two decisions in a row, and the healthy rank was evicted.
    p = StragglerPolicy(factor=2.0, window=window, evict=True)
    for step in range(12):
        for r in range(4):
            p.observe(r, 1.0 if (r == 1 and step == 5) else 0.1)
        assert isinstance(p.decide(spares_ready=1), Continue), step


def test_a_count_kept_while_the_rank_sat_out_does_not_evict_it_once_its_peers_are_as_slow():
    # Rank 3 became persistent with no spare ready, then sat out (first-N) and reported nothing,
    # its count frozen; meanwhile its peers slowed to 1.2x below its pace. A spare then came up and
    # it was evicted as "1.20x the other ranks' median (threshold 2x)".
    p = StragglerPolicy(factor=2.0, window=2, evict=True)
    for _ in range(2):
        for r in range(4):
            p.observe(r, 0.5 if r == 3 else 0.1)
        decision = p.decide(spares_ready=0)
    assert isinstance(decision, Continue) and decision.straggler == 3
    for r in range(3):
        for _ in range(2):
            p.observe(r, 0.42)  # the others slow down; rank 3 reports nothing
    assert p.scores()[3] < 2.0
    decision = p.decide(spares_ready=1)
    assert isinstance(decision, Continue) and decision.straggler is None


def test_pending_time_counts_for_a_busy_rank():
    p = StragglerPolicy(factor=2.0, window=2, evict=True)
    for r in range(4):
        p.observe(r, 0.1)
    p.observe_pending(3, 1.0)  # busy for 1 s with a step the others did in 0.1 s
    assert p.scores()[3] == pytest.approx(10.0)
    for _ in range(5):  # late, with healthy steps of its own: a pause so far, however long
        assert isinstance(p.decide(1), Continue)
    p.observe(3, 1.0)
    p.observe(3, 1.0)  # its own steps say it is slow now
    # The count held for the late stretch is given back with the stretch's time (that time is in
    # the rank's times now): its slow steps count from here, as a data-parallel rank's would.
    assert isinstance(p.decide(1), Continue)
    p.observe(3, 1.0)
    assert isinstance(p.decide(1), EvictStraggler)
    p.forget(3)
    assert 3 not in p.scores()
    # A spare promoted to rank 3 starts with no count: the evicted actor's count (at the window)
    # would have evicted it on its first slow step. Even a slow one needs a window of its own.
    for r in range(3):
        p.observe(r, 0.1)
    p.observe(3, 1.0)
    assert isinstance(p.decide(1), Continue)
    for r in range(3):
        p.observe(r, 0.1)
    p.observe(3, 1.0)
    d = p.decide(1)
    assert isinstance(d, EvictStraggler) and d.rank == 3 and "for 2 steps" in d.reason


def test_with_an_odd_number_of_ranks_each_is_scored_against_the_mean_of_the_other_two():
    # Without itself, a rank of three has two peers: their median is their mean (the even-count
    # branch of _median_without), never checked by value. Each rank's own time is left out:
    # rank 0 against (0.2 + 0.6) / 2, rank 1 against (0.1 + 0.6) / 2, rank 2 against (0.1 + 0.2) / 2.
    p = StragglerPolicy(factor=2.0, window=3, evict=True)
    for r, t in enumerate((0.1, 0.2, 0.6)):
        p.observe(r, t)
    assert p.scores() == pytest.approx({0: 0.1 / 0.4, 1: 0.2 / 0.35, 2: 0.6 / 0.15})
    # Two ranks of the same time: each is left out once, the other one stays in its peers.
    tied = StragglerPolicy(factor=2.0, window=3, evict=True)
    for r, t in enumerate((0.1, 0.1, 0.4)):
        tied.observe(r, t)
    assert tied.scores() == pytest.approx({0: 0.1 / 0.25, 1: 0.1 / 0.25, 2: 0.4 / 0.1})


def test_straggler_factor_must_exceed_one():
    with pytest.raises(ValueError, match="straggler factor must be > 1"):
        StragglerPolicy(factor=1.0, window=3, evict=True)


def test_shard_plan_is_deterministic_and_requeues_first():
    a, b = ShardPlan(100, seed=7), ShardPlan(100, seed=7)
    assert a.take(4, 5) == b.take(4, 5)
    assert epoch_order(100, 7, 0) != epoch_order(100, 7, 1)
    epoch, shards = a.take(2, 5)
    a.requeue(shards[1], epoch)
    _, nxt = a.take(1, 5)
    assert nxt[0] == shards[1]


def test_seeds_2_63_apart_give_different_orders_and_the_usual_seeds_keep_theirs():
    # The key was masked to 63 bits: seeds 2**63 apart (RunConfig.seed takes [-2**63, 2**64))
    # trained on the same order in every epoch.
    import numpy as np

    for a, b in ((0, 2**63), (-1, 2**63 - 1), (5, 5 + 2**63), (-2**63, 0)):
        for epoch in (0, 3):
            assert epoch_order(50, a, epoch) != epoch_order(50, b, epoch), (a, b, epoch)
    # Seeds below ~9.2e12 keep the order they had: checkpoints made before resume in place.
    for seed, epoch in ((0, 0), (7, 2), (2**40, 1)):
        before = np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(50).tolist()
        assert epoch_order(50, seed, epoch) == before


def test_the_plan_fingerprints_the_order_of_the_epoch_a_checkpoint_is_in():
    # A checkpoint's epoch may trail the plan's (which runs a window ahead) by one at an epoch's end.
    p = ShardPlan(10, seed=0)
    for _ in range(3):
        p.take(2, 2)  # 10 samples, 4 a step: the third step starts epoch 1
    assert p.position.epoch == 1
    assert p.digest(1) == order_digest(epoch_order_array(10, 0, 1))
    assert p.digest(0) == order_digest(epoch_order_array(10, 0, 0)) != p.digest(1)
    assert order_digest(epoch_order_array(10, 1, 0)) != p.digest(0)  # another seed
    assert ShardPlan(10, seed=0).digest(0) == p.digest(0)  # the same in every process


def test_shard_plan_epoch_rollover_drops_tail():
    p = ShardPlan(10, seed=0)
    seen = [p.take(2, 2) for _ in range(3)]
    assert [e for e, _ in seen] == [0, 0, 1]
    first_epoch = [i for _, s in seen[:2] for sh in s for i in sh]
    assert len(set(first_epoch)) == 8


def test_ledger_keeps_the_newest_rows_in_whole_steps():
    ledger = SampleLedger(keep_indices=60)  # 10 steps of 2 ranks x 3 samples
    for step in range(1, 101):  # rank 1's 3 samples dropped in every odd step
        ledger.record(step, 0, 0, [step, step + 1, step + 2], used=True)
        ledger.record(step, 0, 1, [0, 1, 2], used=step % 2 == 0)
    steps = [e.step for e in ledger.entries]
    assert set(range(91, 101)) <= set(steps) and len(steps) <= 2 * 11  # the bound, plus a tenth
    assert all(steps.count(s) == 2 for s in set(steps))  # whole steps only
    assert ledger.for_step(100) and not ledger.for_step(50)
    ledger.truncate(95)  # a rollback: steps 96-100 will be trained again
    assert max(e.step for e in ledger.entries) == 95
    ledger.record(96, 0, 1, [0, 1, 2], used=False)
    ledger.truncate(0)  # back to the start (no checkpoint)
    assert ledger.entries == []
    big = SampleLedger(keep_indices=5)
    big.record(1, 0, 0, list(range(100)), used=True)
    big.record(2, 0, 0, list(range(100)), used=True)
    assert [e.step for e in big.entries] == [2]  # over the bound, the newest step stays whole
    with pytest.raises(ValueError, match="keep_indices"):
        SampleLedger(keep_indices=0)


def test_warmup_steps_are_ignored_and_reset_restarts_warmup():
    p = StragglerPolicy(factor=2.0, window=1, evict=True, warmup_steps=2)
    for _ in range(2):
        for r in range(3):
            p.observe(r, 1.0 if r == 0 else 0.1)  # a noisy start
        assert isinstance(p.decide(1), Continue)
    assert p.scores() == {}
    for r in range(3):
        p.observe(r, 1.0 if r == 0 else 0.1)
    assert isinstance(p.decide(1), EvictStraggler)
    p.reset()
    p.observe(0, 1.0)
    assert p.scores() == {}


def test_decide_over_a_window_counts_its_steps():
    # Decisions come once per dispatch window: 3 steps over the threshold count as 3.
    p = StragglerPolicy(factor=2.0, window=6, evict=True)
    for decision in range(2):
        for r in range(4):
            p.observe(r, 0.3 if r == 1 else 0.1)
        if decision == 0:
            assert isinstance(p.decide(spares_ready=1, steps=3), Continue)
    d = p.decide(spares_ready=1, steps=3)
    assert isinstance(d, EvictStraggler) and d.rank == 1


def test_one_slow_timing_counts_once_however_many_decisions_the_rank_sits_out():
    # A first-N replica late once sits out the next steps and reports no timing for them; its one
    # slow timing (a GC pause) used to count again at every decision until it was evicted on it.
    # The first timing after the warm-up, so that it is the rank's whole record.
    p = StragglerPolicy(factor=2.0, window=5, evict=True, warmup_steps=5)
    for step in range(1, 30):
        for r in range(4):
            if r == 3 and 6 < step <= 10:
                continue  # sitting out: no timing
            p.observe(r, 0.6 if (r == 3 and step == 6) else 0.2)
        assert isinstance(p.decide(spares_ready=1, steps=1), Continue), step
    # A rank slow every time it computes, sitting out in between, is still evicted.
    slow = StragglerPolicy(factor=2.0, window=5, evict=True)
    decisions = []
    for step in range(1, 60):
        for r in range(4):
            if r != 3 or step % 5 == 0:
                slow.observe(r, 0.6 if r == 3 else 0.2)
        decisions.append(slow.decide(spares_ready=1, steps=1))
    assert any(isinstance(d, EvictStraggler) and d.rank == 3 for d in decisions)


def test_pending_time_cleared_when_rank_catches_up():
    p = StragglerPolicy(factor=2.0, window=1, evict=True)
    for r in range(4):
        p.observe(r, 0.1)
    p.observe_pending(2, 1.0)
    assert p.scores()[2] > 2
    p.observe_pending(2, 0.0)
    assert p.scores()[2] == 1.0
    assert isinstance(p.decide(spares_ready=1), Continue)


def test_a_straggler_known_only_by_how_late_it_was_is_not_named_once_it_caught_up():
    # A first-N replica late from the start reports no timing of its own (it sat out); once it
    # caught up, nothing scores it, and a decision used to fail on KeyError.
    p = StragglerPolicy(factor=2.0, window=2, evict=True)
    for spares in (0, 0):
        for r in (0, 1):
            p.observe(r, 1.0)
        p.observe_pending(2, 5.0)
        decision = p.decide(spares_ready=spares)
    # Late with no step time of its own: a pause so far, however long (held one short of the window).
    assert isinstance(decision, Continue) and decision.straggler is None and p.scores()[2] == 5.0
    p.observe_pending(2, 0.0)
    assert 2 not in p.scores()
    for spares in (0, 1):
        decision = p.decide(spares_ready=spares)
        assert isinstance(decision, Continue) and decision.straggler is None
    p.observe(2, 5.0)  # its step ends, slow: the count it kept makes it persistent at its next late stretch
    p.observe_pending(2, 5.0)
    assert isinstance(p.decide(spares_ready=1), EvictStraggler)


@pytest.mark.parametrize("steps_per_decision", [1, 4, 16])
def test_one_pause_of_a_healthy_first_n_replica_is_not_persistent_and_a_slow_one_still_is(steps_per_decision):
    # A healthy replica pauses once (GC, page faults) for 2 s against 30 ms steps. Counted at
    # every decision it stayed late, the one pause reached the window and evicted it ("32x the
    # others' median for 5 steps"); the same pause as a step time in data parallel never can.
    p = StragglerPolicy(factor=2.0, window=5, evict=True)
    decisions = []
    for decision in range(60):
        for r in range(3):
            for _ in range(steps_per_decision):
                if r < 2 or not 10 <= decision < 40:
                    p.observe(r, 0.03)
        if 10 <= decision < 40:  # late with one window while the others go on
            p.observe_pending(2, (decision - 9) * 0.03 * steps_per_decision)
        if decision == 40:
            p.observe_pending(2, 0.0)
            p.observe(2, 2.0)  # that window's timing: one slow step
        decisions.append(p.decide(spares_ready=1, steps=steps_per_decision))
    assert not any(isinstance(d, EvictStraggler) for d in decisions)
    # Slow for good (3x): late window after late window, then evicted.
    for decision in range(60):
        for r in range(2):
            for _ in range(steps_per_decision):
                p.observe(r, 0.03)
        if decision % 3 == 2:
            p.observe_pending(2, 0.0)
            for _ in range(steps_per_decision):
                p.observe(2, 0.09)
        else:
            p.observe_pending(2, 0.03 * steps_per_decision * (decision % 3 + 1))
        if isinstance(p.decide(spares_ready=1, steps=steps_per_decision), EvictStraggler):
            break
    else:
        raise AssertionError("a replica 3x slow for good was never evicted")


def test_one_noisy_window_is_not_persistent():
    # A whole 16-step dispatch window over the threshold is one decision: not enough to evict.
    p = StragglerPolicy(factor=2.0, window=5, evict=True)
    for expected in (Continue, EvictStraggler):
        for r in range(4):
            p.observe(r, 0.3 if r == 1 else 0.1)
        assert isinstance(p.decide(spares_ready=1, steps=16), expected)


def test_the_slow_rank_of_a_two_rank_group_scores_its_slowdown_and_is_evicted():
    # Against the median of both ranks (their mean) it scored 1.99 however slow: never over 2.
    p = StragglerPolicy(factor=2.0, window=2, evict=True)
    for _ in range(2):
        p.observe(0, 0.001)
        p.observe(1, 0.3)
    assert p.scores() == pytest.approx({0: 0.001 / 0.3, 1: 300.0})
    assert isinstance(p.decide(spares_ready=1), Continue)  # one decision counts half a window
    p.observe(1, 0.3)
    d = p.decide(spares_ready=1)
    assert isinstance(d, EvictStraggler) and d.rank == 1
    lone = StragglerPolicy(factor=2.0, window=1, evict=True)
    lone.observe(0, 5.0)
    assert lone.scores() == {0: 1.0}  # no peer to be slower than


def test_the_sampler_keeps_an_epoch_order_of_millions_of_samples_small():
    import tracemalloc

    n = 5_000_000
    tracemalloc.start()
    try:
        plan = ShardPlan(n, seed=3)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 30e6  # 4 bytes an index (20 MB); a list of Python ints was ~180 MB
    epoch, shards = plan.take(2, 4)
    assert [i for s in shards for i in s] == epoch_order(n, 3, 0)[:8]
    assert all(type(i) is int for s in shards for i in s)  # plain ints: JSON, the ledger, the workers


def test_scores_read_from_another_thread_while_ranks_are_observed():
    # The controller's status thread scores ranks while its training thread observes them; before
    # scores() copied the dicts, this raised "dictionary changed size during iteration".
    import sys
    import threading
    import time

    policy = StragglerPolicy(2.0, 5, evict=False)
    stop, errors = threading.Event(), []

    def observe():
        while not stop.is_set():
            for r in range(64):
                policy.observe(r, 0.01 * (r + 1))
                policy.observe_pending(r, 0.5)
            for r in range(64):
                policy.forget(r)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread = threading.Thread(target=observe)
    thread.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not errors:
            try:
                policy.scores()
            except RuntimeError as exc:
                errors.append(exc)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []


def test_a_promoted_spares_cold_first_step_is_a_pause_and_a_rank_slow_from_the_start_is_still_evicted():
    # First-N after a rebuild: the fast four finish the run's warm-up in one 16-step window while
    # the new rank 4 is still in its first step (cold: first kernels, allocations). Its late
    # stretch alone used to evict it ("33.33x ... for 5 steps") and keep spares off its node.
    p = StragglerPolicy(factor=2.0, window=5, evict=True, warmup_steps=5)
    for decision, late in enumerate((None, 0.5, 1.0, 1.5)):
        for r in range(4):
            for _ in range(16):
                p.observe(r, 0.03)
        if late is not None:
            p.observe_pending(4, late)
        assert isinstance(p.decide(spares_ready=1, steps=16), Continue), decision
    p.observe(4, 1.6)  # its cold first step ends: not counted
    assert 4 not in p.scores()
    for _ in range(5):
        for r in range(5):
            p.observe(r, 0.03)
        assert isinstance(p.decide(spares_ready=1, steps=1), Continue)
    # A replica slow from its very first step: held while in it, evicted on its next late stretch.
    slow = StragglerPolicy(factor=2.0, window=5, evict=True, warmup_steps=5)
    for r in range(5):
        slow.observe(r, 0.03)  # the run's first step, in the warm-up
    for decision, late in enumerate((0.6, 1.2)):
        for r in range(4):
            for _ in range(16):
                slow.observe(r, 0.03)
        slow.observe_pending(4, late)
        assert isinstance(slow.decide(spares_ready=1, steps=16), Continue), decision
    slow.reset()  # a rebuild: every rank's next step is its first again
    for late in (None, 0.6):  # the first window is the run's warm-up
        for r in range(4):
            for _ in range(16):
                slow.observe(r, 0.03)
        if late is not None:
            slow.observe_pending(4, late)
        assert isinstance(slow.decide(spares_ready=1, steps=16), Continue)
    slow.observe(4, 2.0)  # its first step since the rebuild ends (cold: not counted) ...
    slow.observe_pending(4, 0.6)  # ... and it is late again
    d = slow.decide(spares_ready=1, steps=16)
    assert isinstance(d, EvictStraggler) and d.rank == 4
    assert "late for 0.60s" in d.reason and "window 5" in d.reason


def test_a_replica_that_computed_only_healthy_warm_up_steps_is_held_on_its_first_pause():
    # Rank 2 computed its cold first step and a healthy warm-up step, then sat out under the late
    # backoff. After the warm-up it pauses (GC) in a step: with no counted timing its late stretch
    # counted in full, and it was evicted about 0.2 s into the pause.
    p = StragglerPolicy(factor=2.0, window=5, evict=True, warmup_steps=5)
    for step in range(5):
        for r in range(3):
            if r < 2 or step < 2:
                p.observe(r, 0.03)
        p.decide(spares_ready=1)
    for late in (0.03, 0.06, 0.09, 0.12, 0.15, 0.18, 0.21, 0.24, 0.3):
        for r in range(2):
            p.observe(r, 0.03)
        p.observe_pending(2, late)
        assert isinstance(p.decide(spares_ready=1), Continue), late
    # The pause ends: its step time, the rank's only counted one, is that pause again. Counted on
    # top of the count held during the stretch, it evicted the replica ("11.00x ... for 5 steps").
    p.observe_pending(2, 0.0)
    p.observe(2, 0.33)
    for step in range(3):
        for r in range(2):
            p.observe(r, 0.03)
        if step:
            p.observe(2, 0.03)  # healthy again
        assert isinstance(p.decide(spares_ready=1), Continue), step
    assert p._over[2] == 0


@pytest.mark.parametrize("steps_per_decision", [1, 16])
def test_the_step_time_that_ends_a_held_pause_does_not_count_the_pause_twice(steps_per_decision):
    # A late rank whose own step times are healthy is held one short of the window. Its pause's
    # timing was then counted on top of the held count: with no other counted timing since the
    # reset (it sat out under the backoff) that was the window, and it was evicted.
    p = StragglerPolicy(factor=2.0, window=5, evict=True, warmup_steps=2)
    for _ in range(2):  # the warm-up: rank 2's cold step and one healthy step
        for r in range(3):
            p.observe(r, 0.03)
        p.decide(spares_ready=1)
    for late in range(2, 8):
        for r in range(2):
            for _ in range(steps_per_decision):
                p.observe(r, 0.03)
        p.observe_pending(2, 0.03 * steps_per_decision * late)
        assert isinstance(p.decide(spares_ready=1, steps=steps_per_decision), Continue), late
    assert p._over[2] == 4  # held one short of the window
    p.observe(2, 0.03 * steps_per_decision * 8)  # the paused step's time ...
    p.observe_pending(2, 0.001)  # ... and (first-N) late on its next window, the fast N having run on
    for r in range(2):
        for _ in range(steps_per_decision):
            p.observe(r, 0.03)
    assert isinstance(p.decide(spares_ready=1, steps=steps_per_decision), Continue)
    p.observe_pending(2, 0.0)
    for r in range(2):
        for _ in range(steps_per_decision):
            p.observe(r, 0.03)
    assert isinstance(p.decide(spares_ready=1, steps=steps_per_decision), Continue)
    # Slow for good: its next step times are slow, and late again it is evicted.
    for late in range(1, 6):
        for r in range(2):
            for _ in range(steps_per_decision):
                p.observe(r, 0.03)
        p.observe(2, 0.09)
        p.observe_pending(2, 0.09 * late)
        d = p.decide(spares_ready=1, steps=steps_per_decision)
        if isinstance(d, EvictStraggler):
            assert d.rank == 2 and "step time" in d.reason
            break
    else:
        raise AssertionError("a replica slow after its pause was never evicted")


@pytest.mark.parametrize("window, steps, slow_steps", [(3, 1, 1), (2, 1, 1), (5, 8, 2)])
def test_a_held_pause_does_not_count_again_once_its_time_is_no_longer_the_newest(window, steps, slow_steps):
    # A healthy replica pauses once (0.3 s against 30 ms steps) and is held one short of the
    # window. Its pause's time ends the stretch, it sits out under the late backoff, and then runs
    # a slightly slow step or two (2.2x: a crowded host). The held count stayed, and the pause's
    # time, no longer the newest, made the lower median slow with those steps: held count plus
    # one decision reached the window, and a healthy replica was evicted for one pause.
    def fast_ranks():
        for r in range(2):
            for _ in range(steps):
                p.observe(r, 0.03)

    for pause in (True, False):  # without the pause, the same slow steps never evicted
        p = StragglerPolicy(factor=2.0, window=window, evict=True, warmup_steps=2)
        for _ in range(4):
            for r in range(3):
                for _ in range(steps):
                    p.observe(r, 0.03)
            p.decide(1, steps=steps)
        decisions = []
        if pause:
            for late in range(1, 11):
                fast_ranks()
                p.observe_pending(2, 0.03 * late)
                decisions.append(p.decide(1, steps=steps))
            p.observe_pending(2, 0.3)
            p.observe(2, 0.33)  # the pause's step time
            p.observe_pending(2, 0.0)
            fast_ranks()
            decisions.append(p.decide(1, steps=steps))
        for _ in range(4):  # it sits out
            fast_ranks()
            decisions.append(p.decide(1, steps=steps))
        fast_ranks()
        p.observe_pending(2, 0.036)
        for _ in range(slow_steps):
            p.observe(2, 0.066)
        p.observe_pending(2, 0.0)
        decisions.append(p.decide(1, steps=steps))
        assert not any(isinstance(d, EvictStraggler) for d in decisions), (pause, decisions)


def test_a_stretch_counted_in_full_after_a_hold_keeps_its_count_when_its_time_comes_in():
    # Rank 2 is late with healthy-looking steps (0.05 s against 0.03 s): held. Its peers then
    # speed up (0.02 s): its own steps now say it is slow, and it is counted in full. Its count
    # from before the hold was given back all the same when its time came in: the evidence of
    # its slowness thrown away, and its eviction five decisions later.
    p = StragglerPolicy(factor=2.0, window=5, evict=True)
    for r in range(3):
        for _ in range(5):
            p.observe(r, 0.05 if r == 2 else 0.03)
    p.observe_pending(2, 0.1)
    p.decide(1)
    assert p._over[2] == 1  # held
    for late in (0.2, 0.3, 0.4):
        for r in range(2):
            for _ in range(5):
                p.observe(r, 0.02)
        p.observe_pending(2, late)
        p.decide(1)
    assert p._over[2] == 4
    p.observe_pending(2, 0.0)
    p.observe(2, 0.45)
    assert p._over[2] == 4


def test_a_replica_slow_from_its_second_step_is_not_called_healthy_by_its_fast_cold_step():
    # The first try at the case above (30cde00, reverted) judged such a rank by the lower median
    # of all its early timings, its fast cold first step among them: a replica slow from its
    # second step (1 s against 0.05 s) was held below the window while it sat out, and never
    # evicted (test_persistent_straggler_evicted_for_spare). The cold step is left out, and one
    # slow warm-up step is enough to count a late stretch in full.
    p = StragglerPolicy(factor=3.0, window=2, evict=True, warmup_steps=5)
    for r in range(3):
        p.observe(r, 0.01)  # the cold first step: fast for every rank
    p.decide(spares_ready=1)
    p.observe(0, 0.05)
    p.observe(2, 0.05)
    p.observe(1, 1.0)  # its second step, in the warm-up: slow
    p.decide(spares_ready=1)
    decisions = []
    for late in (0.2, 0.4, 0.6, 0.8, 1.0):
        for r in (0, 2):
            p.observe(r, 0.05)
        p.observe_pending(1, late)
        decisions.append(p.decide(spares_ready=1))
    evicted = [d for d in decisions if isinstance(d, EvictStraggler)]
    assert evicted and evicted[0].rank == 1, decisions
    assert "late for" in evicted[0].reason


def test_without_a_warm_up_a_late_stretch_before_a_ranks_first_step_since_a_rebuild_is_a_pause():
    # warmup_steps=0: after a rebuild, a healthy rank pauses (GC) in its first step. With no step
    # time of its own since the reset, its late stretch alone evicted it on the third decision.
    p = StragglerPolicy(factor=2.0, window=3, evict=True, warmup_steps=0)
    for _ in range(10):
        for r in range(3):
            p.observe(r, 0.03)
        p.decide(spares_ready=1)
    p.reset()
    for late in (0.3, 0.6, 0.9, 1.2):
        for r in range(2):
            p.observe(r, 0.03)
        p.observe_pending(2, late)
        assert isinstance(p.decide(spares_ready=1), Continue), late
    p.observe(2, 1.25)  # its first step ends, slow: counted (no warm-up), and late again after it
    p.observe_pending(2, 0.3)
    for r in range(2):
        p.observe(r, 0.03)
    d = p.decide(spares_ready=1)
    assert isinstance(d, EvictStraggler) and d.rank == 2


def test_without_a_warm_up_every_timing_counts_from_the_first():
    p = StragglerPolicy(factor=2.0, window=1, evict=True, warmup_steps=0)
    for r in range(3):
        p.observe(r, 1.0 if r == 0 else 0.1)
    assert isinstance(p.decide(spares_ready=1), EvictStraggler)


@pytest.mark.parametrize("fallback, expected", [("shrink", Shrink), ("restart", RestartFromCheckpoint),
                                                ("fail", Fail)])
def test_spares_still_building_are_waited_for_before_when_no_spare_falls_back(fallback, expected):
    # Failure 1 took the spare and a refill is building when failure 2 comes: the run halved
    # for good (nothing grows a shrunk run back), restarted or failed seconds before it was ready.
    cfg = FailureConfig(when_no_spare=fallback, allow_shrink=True, min_workers=2, capacity_timeout_s=7)
    policy = FailurePolicy(cfg, num_workers=4, global_batch=64)
    d = policy.decide(view(ready=0, pending=1))
    assert isinstance(d, WaitForCapacity) and d.timeout_s == 7
    assert "1 building" in d.reason and f"when_no_spare={fallback!r}" in d.reason
    assert isinstance(policy.decide(view(ready=0, pending=1, waited=True)), expected)  # not ready in time
    assert isinstance(policy.decide(view(lost=(1, 2), ready=0, pending=1)), expected)  # too few building
    assert isinstance(policy.decide(view(ready=1, pending=1)), ReplaceWithSpares)
