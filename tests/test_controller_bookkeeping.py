"""The controller's bookkeeping around recoveries, without Ray: a real ``Controller`` over stand-in
groups and ranks (``rayless_controller``), for the counts and sets that decide what it does next."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest

import elastic
from elastic import controller as controller_module
from elastic.actors.protocol import StepResult, StopRequested
from elastic.actors.worker_group import Member
from elastic.controller import Failure
from elastic.data import DataPosition


class Answers:
    """A stand-in rank's actor handle: each remote call returns its value (ray.get is patched to
    pass plain values through)."""

    def __init__(self, progress=(0, 0)):
        self._progress = progress
        self.progress = self
        self.fast_sets = NoFastSets()

    def remote(self, *args):
        return self._progress


class NoFastSets:
    """``fast_sets`` of a stand-in rank that recorded none."""

    def remote(self, first, last):
        return {}


class StandInGroup:
    """What the controller uses of a WorkerGroup: ranks, spares, spare requests."""

    def __init__(self, scaling=None, spec=None, namespace=None, ranks=2, ready_spares=0):
        self.members = [Member(Answers(), f"rank-{i}", info={"node_id": "n"}, rank=i) for i in range(ranks)]
        self.spares = [Member(Answers(), f"spare-{i}", spare=True) for i in range(ready_spares)]
        self.newly_ready = list(self.spares)
        self.building: list[Member] = []
        self.building_spares: list[Member] = []
        self.dataset_size = None  # as a WorkerGroup before its ranks are built (or that none reported)
        self.interrupted = None

    @property
    def pending_spares(self):
        return len(self.building)

    def request_spare(self, background=False, avoid_nodes=()):
        self.building.append(Member(Answers(), f"spare-{10 + len(self.building)}", spare=True))
        return []

    def collect_spares(self, block=False, timeout_s=None, enough=None, placed_only=False):
        if block:  # what the wait for capacity asked for is built
            self.spares += self.building
            self.newly_ready += self.building
            self.building = []
        return len(self.spares)

    def take_spare_notes(self):
        return []

    def take_newly_ready(self):
        ready, self.newly_ready = self.newly_ready, []
        return ready

    def watch_spares(self, timeout_s, wait=False):
        return []

    def promote_spare(self, rank, avoid_nodes=()):
        spare = self.spares.pop(0)
        spare.rank, spare.spare = rank, False
        self.members[rank] = spare
        return spare

    def remove_ranks(self, ranks, stand_by=()):
        gone = set(ranks)
        self.members = [m for m in self.members if m.rank not in gone]
        for rank, m in enumerate(self.members):
            m.rank = rank

    def start(self, num_active):
        pass

    def shutdown(self):
        pass


@pytest.fixture
def plain_values(monkeypatch):
    """ray.get and ray.wait over the stand-ins' plain values."""
    monkeypatch.setattr(controller_module.ray, "get", lambda x, **kw: x)
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, **kw: (list(refs), []))


def test_a_spare_built_by_a_wait_for_capacity_ends_the_streak_of_failed_spare_starts(rayless_controller):
    # The last SPARE_START_ATTEMPTS refills failed, so the pool stopped asking for more. A wait for
    # capacity then builds one: it is taken in, said to be ready, and the pool asks again once it is
    # promoted. It was taken in by the wait, not _collect_spares, which missed it: the streak
    # stayed, no event said so, and the pool stayed empty for the rest of the run.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1))
    c.group = StandInGroup()
    c._spare_failures_in_row = controller_module.SPARE_START_ATTEMPTS
    c.failures = 1
    c._decide_and_apply((1,), "actor_died")
    decisions = [e.details["decision"] for e in c.events if e.kind == "decision"]
    assert decisions == ["WaitForCapacity", "ReplaceWithSpares"]
    assert c.group.members[1].name == "spare-10"
    assert c._spare_failures_in_row == 0
    assert [e.details.get("spare") for e in c.events if e.kind == "spares"] == ["spare-10"]
    c._refill_spares()
    assert c.group.pending_spares == 1  # the pool refills


class CapacityOnTheSecondLook(StandInGroup):
    """What a wait for capacity asked for is built during its second slice of waiting."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []  # the timeout of each blocking wait

    def collect_spares(self, block=False, timeout_s=None, enough=None, placed_only=False):
        if block:
            self.waits.append(timeout_s)
            if len(self.waits) == 1:
                return len(self.spares)  # the slice ran out with the spare still building
        return super().collect_spares(block, timeout_s, enough, placed_only)


class CommitDuringTheWait:
    """A committer whose step 7 commits once the wait for capacity has begun."""

    def __init__(self, group):
        self.group, self.told = group, False

    def drain_events(self):
        if not self.group.waits or self.told:
            return []
        self.told = True
        return [{"event": "checkpoint_committed", "step": 7, "persist_s": 0.5, "message": "step 7 committed"}]

    def lag(self, step):
        return 0


class Recorded:
    """A metrics stand-in that records the calls it gets."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_a_wait_for_capacity_takes_in_the_commits_that_come_while_it_waits(rayless_controller):
    # The survivors' last parts commit while the recovery waits (minutes) for a spare. The commit
    # was read only after the wait: the event log said nothing of it, and the checkpoint-lag
    # gauge held the lag from before the failure, for the whole wait.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1),
                           failure=elastic.FailureConfig(capacity_timeout_s=600))
    c.group = CapacityOnTheSecondLook()
    c.committer, c.metrics = CommitDuringTheWait(c.group), Recorded()
    c._spare_failures_in_row = controller_module.SPARE_START_ATTEMPTS  # no spare: the policy waits
    c.failures = 1
    c._decide_and_apply((1,), "actor_died")
    kinds = [e.details.get("decision", e.kind) for e in c.events if e.kind in ("decision", "checkpoint_commit")]
    assert kinds == ["WaitForCapacity", "checkpoint_commit", "ReplaceWithSpares"]  # decided once, told at once
    assert len(c.group.waits) == 2 and max(c.group.waits) <= c.CAPACITY_LOOK_UP_S
    assert ("on_checkpoint", (0.5,), {"lag": 0}) in c.metrics.calls


def test_spares_of_the_start_and_ranks_standing_by_are_no_newly_ready_spares(rayless_controller):
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1))
    c.group = StandInGroup(ready_spares=1)
    c._note_ready_spares(log=False)  # as after group.start
    c.group.spares.append(Member(Answers(), "rank-1", spare=True))  # a rank standing by after a shrink
    c._spare_failures_in_row = 2
    c._collect_spares()
    assert c._spare_failures_in_row == 2 and not [e for e in c.events if e.kind == "spares"]


def _restart_with_stand_ins(c, monkeypatch, begun, restored_step, group_cls=None, configure=None):
    """``c._restart_all()`` with stand-in groups; ``restored_step`` None: nothing committed."""
    c.worker_group_cls = group_cls or (lambda scaling, spec, namespace: StandInGroup(ranks=2, ready_spares=1))
    c.group, c.store, c.committer, c.dataset_size = StandInGroup(), object(), None, 64
    monkeypatch.setattr(c, "_begun_by_survivors", lambda: begun)
    monkeypatch.setattr(c, "_configure_checkpoints", configure or (lambda members: None))
    monkeypatch.setattr(c, "_check_storage_shared", lambda: None)  # storage is a stand-in here
    monkeypatch.setattr(controller_module.ray, "get", lambda x, **kw: x)  # the stand-ins' plain values
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, **kw: (list(refs), []))

    def restore_latest(fast=None):  # every rank loads the newest committed step
        if restored_step is None:
            return None
        c.step = restored_step
        return DataPosition(cursor=restored_step * 8)
    monkeypatch.setattr(c, "_restore_latest", restore_latest)
    c._restart_all()


def test_a_restore_holds_retention_until_the_committer_has_rewound(rayless_controller, monkeypatch, tmp_path):
    # keep_last=1: step 5 is committed, and a restore reads it while the old group's parts of
    # step 6 land and commit it. The hold ended with the read, so the first cleanup pass after
    # it, still with the old timeline's picture (6 the newest), deleted step 5, the step the
    # run goes on from, before the rewind moved 6 above it.
    from elastic.checkpoint import CheckpointCommitter, CheckpointStore
    from elastic.config import CheckpointConfig
    from test_checkpoint_store import FAST, FakeWorker, write_step

    store = CheckpointStore(f"file://{tmp_path}", "held", retry=FAST)
    committer = CheckpointCommitter(store, CheckpointConfig(every_n_steps=1, keep_last=1))
    worker = FakeWorker(rank=0, world_size=1)

    def commit(step):
        committer.set_meta(step, {"data": {"epoch": 0, "cursor": step * 8}})
        committer.add(step, 0, 1, write_step(store, worker, step, world_size=1, commit=False))
        assert committer.flush(10) and committer.latest_committed == step

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=1))
    c.group, c.store, c.committer, c.dataset_size = StandInGroup(ranks=1), store, committer, 64
    try:
        commit(5)

        def restore_latest(fast=None):
            with committer.holding_steps():  # as _restore_latest_once lists and reads step 5
                commit(6)
            committer.flush(10)  # a pass after the read, before the rewind
            c.step = 5
            return DataPosition(cursor=40)
        monkeypatch.setattr(c, "_restore_latest", restore_latest)
        c._restore_members_from_checkpoint()
        assert committer.flush(10)
        assert 5 in store.committed_steps() and committer.latest_committed == 5
    finally:
        committer.close()


def test_a_restart_forgets_the_ranks_killed_as_hung_so_the_new_ones_of_those_names_are_watched(
        rayless_controller, monkeypatch):
    # _hung is kept by actor name, and a restart's new group names its ranks rank-0, rank-1, ...
    # again: the old rank-1 killed as hung left the new rank-1 never killed when it hung.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           failure=elastic.FailureConfig(step_timeout_s=1))
    c._hung = {"rank-1"}
    c.step = 6
    _restart_with_stand_ins(c, monkeypatch, begun=7, restored_step=5)
    assert c._hung == set() and c.step == 5 and c.recomputed == 2
    killed = []
    monkeypatch.setattr(c, "_kill_hung", lambda stuck, why, gone=(): killed.append(sorted(stuck.values())))
    unfinished(monkeypatch)
    c._lagging = {"window": (1, time.time() - 10, 1)}  # the new rank 1, late for 10 s
    c._check_late_hung()
    assert killed == [[1]]


def unfinished(monkeypatch) -> None:
    """The stand-in late windows (names, not refs) are still running: ``ray.wait`` on them
    finds none done (``_check_late_hung`` spares a window that finished meanwhile)."""
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, num_returns=1, timeout=None: ([], list(refs)))


def test_a_late_rank_has_step_timeout_s_a_step_of_its_oldest_window_from_when_it_started_on_it(
        rayless_controller, monkeypatch):
    # When the fast N finish a window of k steps, a slow replica may have all k still to run:
    # k healthy steps, not a hang. One step_timeout_s for the whole window killed it as hung.
    # Its later windows do not add to the budget: each window the fast N finish adds one, faster
    # than a hung rank's time runs, and it was never found.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           failure=elastic.FailureConfig(step_timeout_s=1))
    c.group = StandInGroup(ranks=3)
    killed = []
    monkeypatch.setattr(c, "_kill_hung", lambda stuck, why, gone=(): killed.append(sorted(stuck.values())))
    unfinished(monkeypatch)
    now = time.time()
    c._lagging = {"w1": (2, now - 3, 4)}  # late 3 s on a window of 4 steps
    c._check_late_hung()
    assert killed == []
    c._lagging = {"w1": (2, now - 5, 4), **{f"w{i}": (2, now - 5 + 0.1 * i, 4) for i in range(2, 40)}}
    c._check_late_hung()
    assert killed == [[2] * 39]  # 5 s on its oldest window of 4 steps: hung, whatever came after
    killed.clear()
    c._late_done_at[2] = now - 2  # it handed a window back 2 s ago: on this one since then
    c._check_late_hung()
    assert killed == []
    assert c._late_clocks() == {2: (now - 2, 4)} and c._late_clocks(exclude=2) == {}


def test_a_restart_to_a_step_past_the_controllers_recomputes_nothing(rayless_controller, monkeypatch):
    # Ranks report their checkpoint parts mid-window, so the newest committed step can be past
    # the controller's: restoring it recomputes no step (it was counted as -1).
    c = rayless_controller()
    c.step = 10
    _restart_with_stand_ins(c, monkeypatch, begun=10, restored_step=11)
    assert c.step == 11 and c.recomputed == 0


def test_a_first_n_sync_gives_up_the_lost_fast_replicas_parts_of_later_steps(rayless_controller, plain_values,
                                                                            monkeypatch):
    # A fast replica lost at step 12 had written its parts of 11 and 12 (its node's agent lives
    # on); the late survivor holds step 10, the run's, so nothing rolled back and nothing gave
    # those parts up. Steps 11 and 12 are trained again from 10, differently: the old part beside
    # a survivor's new one completed a step whose manifest mixed the two histories.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=1, num_backups=1, aggregation="first_n"),
                           global_batch_size=8)
    rewinds = []

    class Committer:
        latest_committed = 8

        def rewind(self, step, restored=False):
            rewinds.append((step, restored))

    c.group, c.committer = StandInGroup(ranks=2), Committer()
    c.group.members[1].actor = Answers(progress=(10, 10))  # the late survivor
    c._stateless = {"rank-0"}  # the spare in the lost fast replica's place
    c.step, c.generation = 10, 4
    sent = []
    monkeypatch.setattr(c, "_send_state", lambda source, behind, why: sent.append((source.rank, [m.rank for m in behind])))
    c._sync_state()
    assert sent == [(1, [0])]
    assert rewinds == [(10, False)] and (4, 10) in c._given_up_parts
    assert c._given_up(4, 11) and not c._given_up(5, 11) and not c._given_up(4, 10)
    # A rollback (every fast replica lost past the late one's step) gives them up once: twice,
    # the agents' settle waited out a slow write twice, and the event log said so twice.
    rewinds.clear()
    c._given_up_parts.clear()
    Committer.flush = lambda self, timeout_s=None: True
    c.step, c.dataset_size = 12, 64
    c._positions = {10: DataPosition().to_dict()}
    c._stateless = {"rank-0"}
    c._sync_state()
    assert c.step == 10 and rewinds == [(10, False)] and c._given_up_parts == [(4, 10)]


def test_a_sync_from_a_checkpoint_past_the_controllers_step_recomputes_nothing(rayless_controller, plain_values,
                                                                               monkeypatch):
    # The only rank died after its step 11 committed, while the controller was at step 10; the
    # spare that replaced it holds nothing, so every rank loads step 11.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=1, num_backups=1))

    class Committed:
        latest_committed = 11

        def flush(self, timeout_s=None):
            return True

        def rewind(self, step, restored=False):
            pass

        def holding_steps(self):
            return contextlib.nullcontext()
    c.group, c.committer, c.store, c.dataset_size = StandInGroup(ranks=1), Committed(), object(), 64
    c._stateless = {"rank-0"}
    c.step = 10

    def restore_latest(fast=None):
        c.step = 11
        return DataPosition(cursor=88)
    monkeypatch.setattr(c, "_restore_latest", restore_latest)
    c._sync_state()
    assert c.step == 11 and c.recomputed == 0


def test_a_rank_lost_during_a_restart_from_the_checkpoint_is_healed_by_the_recovery_loop(
        rayless_controller, monkeypatch):
    # A restart builds and restores a whole new group: a rank of it lost on the way (a flapping
    # node, which is what chose the restart) is a failure while healing, like one in a rebuild.
    # It escaped the loop as a raw RayActorError and the run ended.
    import ray

    from elastic.controller import Failure
    from elastic.policies import RestartFromCheckpoint

    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart"))
    c.group = StandInGroup()
    monkeypatch.setattr(c.failure_policy, "decide", lambda view: RestartFromCheckpoint("restart (test)"))
    restarts = []

    def restart_all():
        restarts.append(len(restarts) + 1)
        if len(restarts) == 1:
            raise ray.exceptions.RayActorError()  # rank 1 of the new group died during the restore
    monkeypatch.setattr(c, "_restart_all", restart_all)
    monkeypatch.setattr(c, "_settle_survivors", lambda dead: set())
    monkeypatch.setattr(c, "_probe_dead", lambda: {1})
    monkeypatch.setattr(c, "_sync_state", lambda: None)
    monkeypatch.setattr(c, "_form_group", lambda why: None)
    monkeypatch.setattr(c, "_refill_spares", lambda: None)
    c._recover(Failure({0}, "node_lost"))
    assert restarts == [1, 2] and c.failures == 2
    assert [r["ranks"] for r in c.recoveries] == [[0, 1]]
    assert any(e.kind == "failure" and "while healing" in e.message for e in c.events)


def test_status_shows_a_late_ranks_time_on_the_window_it_is_on_as_the_policy_reads_it(rayless_controller):
    # Shown from when its oldest window still out went late: a replica that handed back the
    # window before 3 s ago, on a backlog that went late 10 s ago, showed a 10 s step time.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=8)
    c.group = StandInGroup(ranks=3)
    now = time.time()
    c._lagging = {"w1": (2, now - 10, 1), "w2": (2, now - 5, 1)}
    c._late_done_at = {2: now - 3}  # it finished the window before the oldest still out
    row = c.rank_rows(spares=False)[2]
    assert row["state"] == "late" and 2.9 < row["step_time_s"] < 6, row


def test_status_during_a_rebuild_shows_no_survivors_heartbeat_age_and_the_lost_rank_as_lost(rayless_controller):
    # Nobody asks the survivors for heartbeats while the group is rebuilt (a wait for capacity
    # can take minutes): every survivor's age grew, and `elastic status` showed it red, "about to
    # be counted lost", like the lost rank, which itself showed the run's "recovering".
    from elastic.controller import State

    c = rayless_controller()
    c.group = StandInGroup(ranks=2)
    c._last_beat = {0: time.time() - 100, 1: time.time() - 100}
    c.transition(State.RECOVERING, "actor_died of rank(s) [1] in step 3")
    c._unhealed = (1,)
    survivor, lost = c.rank_rows(spares=False)
    assert survivor["heartbeat_age_s"] is None and survivor["state"] == "recovering"
    assert lost["heartbeat_age_s"] > 99 and lost["state"] == "lost"


def test_a_stops_flush_in_a_wait_and_the_one_before_a_users_error_keep_the_heartbeats_asked(
        rayless_controller, monkeypatch):
    # Only the run's own end asked the ranks while it flushed: a stop during a wait (placement,
    # capacity, storage) and the commit before a user's error flush for up to heartbeat_timeout_s
    # a rank, and every rank's heartbeat age grew on the gauge meanwhile.
    from elastic.controller import WorkerError

    c = rayless_controller()
    c.group, c.committer = StandInGroup(ranks=2), object()
    beating, flushed_while = [], []

    @contextlib.contextmanager
    def beating_at_the_end():
        beating.append(True)
        try:
            yield
        finally:
            beating.pop()

    monkeypatch.setattr(c, "_beating_at_the_end", beating_at_the_end)
    monkeypatch.setattr(c, "_commit_what_ranks_wrote", lambda *a, **kw: flushed_while.append(bool(beating)))
    monkeypatch.setattr(c, "_newest_live_member", lambda: None)
    c._commit_before_user_error(WorkerError(0, "the user's loss_fn raised (test)"))
    c._stop_reason = "asked by the test"
    c._stop_in_wait("stopped while placing (test)")
    assert flushed_while == [True, True] and c.state.value == "stopped"


def test_the_ends_heartbeats_publish_no_rank_released_while_they_were_asked(rayless_controller, plain_values):
    # The end's heartbeat thread listed the ranks, then a late replica (the highest rank) was
    # released meanwhile (_finish_late): published after the new group's on_group forgot it, its
    # old number aged on the gauge until the run ended, a rank that no longer exists.
    class Beats:
        def __init__(self):
            self.ages = []

        def on_heartbeats(self, ages):  # a function, read under RunMetrics' lock (test_metrics)
            self.ages.append(dict(ages() if callable(ages) else ages))

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1))
    c.group, c.metrics = StandInGroup(ranks=3), Beats()
    for m in c.group.members:  # a plain value stands for the answer's ref
        m.actor.heartbeat = SimpleNamespace(remote=lambda r=m.rank: f"beat of rank {r}")

    def release_rank_2():  # as _finish_late lets it go while the heartbeats are out
        c.group.remove_ranks([2])
        return "beat of rank 2"

    c.group.members[2].actor.heartbeat = SimpleNamespace(remote=release_rank_2)
    c._ask_heartbeats_once(0.1)
    assert list(c.metrics.ages[-1]) == [0, 1]


def test_a_decision_tried_again_after_a_ray_error_waits_out_what_is_left_of_its_wait_for_capacity(
        rayless_controller, monkeypatch):
    # The retry of a decision refused on a Ray error (REBUILD_RETRIES) started the wait for
    # capacity afresh: an error late in each wait stretched it to 4 x capacity_timeout_s.
    import ray

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1),
                           failure=elastic.FailureConfig(capacity_timeout_s=1.0))
    c.group = StandInGroup()
    deadlines = []

    def wait_for_spares(needed, deadline):  # no spare comes; the first wait ends in a GCS error
        deadlines.append(deadline)
        if len(deadlines) == 1:
            raise ray.exceptions.RaySystemError("the GCS refused the call (test)")
        time.sleep(max(0.0, deadline - time.time()))

    monkeypatch.setattr(c, "_wait_for_spares", wait_for_spares)
    monkeypatch.setattr(c, "_settle_survivors", lambda dead: set())
    monkeypatch.setattr(c, "_probe_dead", lambda: set())  # nobody else lost: the same decision again
    with pytest.raises(controller_module.TrainingFailed, match="no capacity came within capacity_timeout_s=1s"):
        c._recover(Failure({1}, "actor_died"))
    assert len(deadlines) >= 2 and len(set(deadlines)) == 1  # one wait, tried again within it
    assert c.failures == 1 and [e for e in c.events if "deciding again (1 of 3)" in e.message]


def test_a_shrink_with_a_spare_for_one_of_two_lost_ranks_promotes_it_then_drops_the_other(rayless_controller):
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1), global_batch_size=12,
                           failure=elastic.FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=1))
    c.group = StandInGroup(ranks=3, ready_spares=1)
    c.failures = 1
    c._decide_and_apply((1, 2), "node_lost")
    assert [m.name for m in c.group.members] == ["rank-0", "spare-0"] and not c.group.spares
    assert c.global_batch_size // c._split == 6 and "spare-0" in c._stateless
    assert [e.kind for e in c.events if e.kind in ("replace", "shrink")] == ["replace", "shrink"]


def test_the_dashboard_sees_the_group_and_pool_change_during_a_recovery(rayless_controller):
    class Published:
        def __init__(self):
            self.membership = []

        def on_membership(self, world_size, spares, building):
            self.membership.append((world_size, spares, building))

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1))
    c.metrics, c.group, c.failures = Published(), StandInGroup(), 1
    c._unhealed = (1,)  # as _recover sets it before deciding
    c._decide_and_apply((1,), "actor_died")  # waits for a spare, then promotes it
    assert c.metrics.membership[0] == (1, 0, 1)  # rank 1 out, its spare building
    c._unhealed = ()
    c.transition(controller_module.State.RUNNING, "rebuilt (test)")
    assert c.metrics.membership[-1] == (2, 0, 0)


class Published:
    """A stand-in for RunMetrics that keeps what the group and pool were published as."""

    def __init__(self):
        self.membership = []

    def on_membership(self, world_size, spares, building):
        self.membership.append((world_size, spares, building))

    def __getattr__(self, name):  # the other gauges: not looked at here
        return lambda *args, **kwargs: None


def test_a_recovery_publishes_the_lost_rank_out_and_the_spare_taken_before_the_state_sync(
        rayless_controller, monkeypatch):
    # Published only at the transitions: the lost rank still in at RECOVERING (_unhealed was set
    # after it), and nothing again until RUNNING, so for the whole rebuild (the state sync, the
    # rendezvous: seconds to minutes) the dashboard showed the group whole and the spare ready.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1))
    c.metrics, c.group = Published(), StandInGroup(ready_spares=1)
    at_sync = []
    monkeypatch.setattr(c, "_settle_survivors", lambda dead: set())
    monkeypatch.setattr(c, "_sync_state", lambda: at_sync.append(c.metrics.membership[-1]))
    monkeypatch.setattr(c, "_form_group", lambda why: None)
    monkeypatch.setattr(c, "_refill_spares", lambda: None)
    c._recover(Failure({1}, "actor_died"))
    assert (1, 1, 0) in c.metrics.membership  # rank 1 out, its spare still in the pool
    assert at_sync == [(2, 0, 0)]  # the spare took rank 1 and left the pool


def test_a_promoted_spare_and_renumbered_survivors_do_not_show_their_predecessors_heartbeat_or_step_time(
        rayless_controller):
    # Reset only at the rendezvous after the state sync: until then `elastic status` showed the
    # spare with the dead rank's growing heartbeat age ("looks hung") and its step time, and a
    # second failure during the sync published the predecessor's age for the spare.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1), global_batch_size=12,
                           failure=elastic.FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=1))
    c.group = StandInGroup(ranks=3, ready_spares=1)
    c.step, c.failures = 7, 1
    long_ago = time.time() - 100
    c._last_beat = {0: time.time(), 1: long_ago, 2: long_ago}
    c._step_time_of = {0: 0.1, 1: 9.0, 2: 9.0}
    c._rank_done = {0: 7, 1: 3, 2: 3}
    c._decide_and_apply((1,), "actor_died")
    spare = c.rank_rows(spares=False)[1]
    assert spare["name"] == "spare-0" and spare["heartbeat_age_s"] < 5
    assert spare["step_time_s"] is None and spare["step"] == 7
    # Rank 2 lost too, and no spare left: the group shrinks to 2, and ranks are renumbered.
    c._decide_and_apply((0,), "actor_died")
    rows = c.rank_rows(spares=False)
    assert [r["name"] for r in rows] == ["spare-0", "rank-2"]
    assert all(r["heartbeat_age_s"] < 5 and r["step_time_s"] is None and r["step"] == 7 for r in rows)
    assert set(c._last_beat) == {0, 1}


def test_a_stop_asked_for_before_a_restart_ends_the_run_with_the_survivors(rayless_controller):
    # Seen only inside the new group's start: the survivors, holding every step past the last
    # commit, were killed first, and the run handed back no weights.
    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart"))
    shut = []
    c.group = StandInGroup()
    c.group.shutdown = lambda: shut.append(True)
    c.store, c.committer = SimpleNamespace(), SimpleNamespace(flush=lambda timeout_s: shut.append("flush"))
    c.request_stop("ray job stop (test)")
    with pytest.raises(StopRequested, match="deciding to restart every rank from the checkpoint"):
        c._restart_all()
    assert shut == [] and c._restarting is None
    c.committer = None


def test_a_rank_lost_while_every_rank_restarts_starts_them_all_again(rayless_controller, monkeypatch):
    # WorkerGroup.start names its members only once all are built: a rank lost meanwhile left a
    # group with no members, and the recovery loop could not name a lost rank.
    import ray

    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart", max_failures=3))
    starts = []

    class FlakyStart(StandInGroup):
        def start(self, num_active):
            starts.append(num_active)
            if len(starts) == 1:
                raise ray.exceptions.RayActorError()
    c.failures = 1
    _restart_with_stand_ins(c, monkeypatch, begun=4, restored_step=3,
                            group_cls=lambda scaling, spec, namespace: FlakyStart(ranks=2))
    assert starts == [2, 2] and c.failures == 2 and c.step == 3
    assert any(e.kind == "failure" and "starting them all again" in e.message for e in c.events)


def test_a_ranks_own_error_while_every_rank_restarts_is_raised_not_counted_as_a_rank_lost(rayless_controller,
                                                                                         monkeypatch):
    # Any Ray error of the new group's start counted as a rank lost: the rank's own code raising
    # (a RayTaskError) restarted every rank again until max_failures was used up, and the run
    # ended saying ranks were lost. The start tells the two apart (_lost_while_starting).
    import ray

    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart", max_failures=3))
    starts = []

    class OwnError(StandInGroup):
        def start(self, num_active):
            starts.append(num_active)
            raise ray.exceptions.RayTaskError("info", "Traceback ...", ValueError("the rank's own error (test)"))
    c.failures = 1
    with pytest.raises(ray.exceptions.RayTaskError):
        _restart_with_stand_ins(c, monkeypatch, begun=4, restored_step=3,
                                group_cls=lambda scaling, spec, namespace: OwnError(ranks=2))
    assert starts == [2] and c.failures == 1
    assert not any(e.kind == "failure" for e in c.events)


def test_a_member_unavailable_in_a_recoverys_call_is_killed_and_healed_as_lost(rayless_controller, monkeypatch):
    # ActorUnavailableError (a network blip) was raised with the member alive and left alone: its
    # heartbeat answered the recovery's probe again, no rank was found lost, and the run ended
    # ("rebuild failed without a lost rank"), where a step's gather heals the same error.
    import ray

    c = rayless_controller()
    c.group = StandInGroup()
    killed = []
    monkeypatch.setattr(controller_module.ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    errors = [ray.exceptions.ActorUnavailableError("the raylet is restarting (test)", None)]

    def unavailable(ref, timeout=None):
        raise errors[0]

    monkeypatch.setattr(controller_module.ray, "get", unavailable)
    member = c.group.members[1]
    c.state = controller_module.State.RUNNING  # outside a recovery (the start, the end): nothing would heal it
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        c._answer(member, "ref", 5.0, "for its progress")
    assert killed == [] and not c._hung
    c.state = controller_module.State.RECOVERING
    # Another actor's unavailability passed on through an argument (the state sync's source):
    # Ray raises a RayTaskError that is an ActorUnavailableError too. Not this member's.
    errors[0] = ray.exceptions.RayTaskError("set_state", "Traceback ...", errors[0]).as_instanceof_cause()
    assert isinstance(errors[0], ray.exceptions.ActorUnavailableError)
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        c._answer(member, "ref", 5.0, "to take the state")
    assert killed == [] and not c._hung
    errors[0] = ray.exceptions.ActorUnavailableError("the raylet is restarting (test)", None)
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        c._answer(member, "ref", 5.0, "for its progress")
    assert killed == [member.actor] and member.name in c._hung
    assert [e.details["rank"] for e in c.events if e.kind == "rank_lost"] == [1]


def test_a_runtime_environment_that_cannot_be_set_up_twice_ends_the_start(rayless_controller):
    # Read as a rank lost, it started again max_failures times, each start running pip (minutes)
    # to fail the same way. Once more, in case it passes (a node that could not fetch yet).
    import ray

    c = rayless_controller(failure=elastic.FailureConfig(max_failures=3))
    starts = []

    def start_once():
        starts.append(1)
        raise ray.exceptions.RuntimeEnvSetupError("ERROR: No matching distribution found for torchvisionn")

    c._start_once = start_once
    c._lost_while_starting = lambda exc: "a rank"
    c._abandon_start = lambda: None  # no group here to take down
    with pytest.raises(controller_module.TrainingFailed, match=r"runtime environment could not be set up while the "
                                                               r"run started, twice .*No matching distribution found"):
        c._start()
    assert starts == [1, 1] and c.failures == 1


def test_a_rank_lost_before_a_restart_is_done_restarts_it_again_whatever_the_policy_says(rayless_controller,
                                                                                         monkeypatch):
    # A rank of the restart's new group died in its storage check or restore (the flapping node
    # that chose the restart). The next pass's decision (a spare for it) went to the state sync,
    # which found no holder (the new ranks hold nothing) and, with nothing committed, ended the
    # run, where the restart goes back to step 0.
    import ray

    from elastic.policies import ReplaceWithSpares

    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart", max_failures=3))
    c.step = 9
    configured = []

    def configure(members):
        configured.append(len(configured))
        if len(configured) == 1:
            raise ray.exceptions.RayActorError()
    with pytest.raises(ray.exceptions.RayActorError):
        _restart_with_stand_ins(c, monkeypatch, begun=10, restored_step=None, configure=configure)
    monkeypatch.setattr(c.failure_policy, "decide", lambda view: ReplaceWithSpares("a spare for it (test)"))
    c._decide_and_apply((1,), "failure_during_recovery")
    assert len(configured) == 2 and c.step == 0 and c.recomputed == 10 and c._restarting is None
    decision = [e.message for e in c.events if e.kind == "decision"][-1]
    assert decision.startswith("RestartFromCheckpoint: rank(s) [1] lost while every rank restarted")


class Reaper:
    """A stand-in rank's actor handle that records the pids it is asked to reap."""

    def __init__(self):
        self.reaped: list[int] = []
        self.reap = self

    def remote(self, pid):
        self.reaped.append(pid)


@pytest.mark.parametrize("gone", [(), (0,)])
def test_a_hung_rank_is_reaped_by_a_live_peer_on_its_node_not_a_lost_one(rayless_controller, monkeypatch, gone):
    # A survivor killed as hung while the group settles after a loss: the lost rank on its node
    # (still a member until the decision) was asked to reap it, a call a dead actor never runs,
    # so a stopped process held its peers for Ray's kill timeout.
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3))
    c.group = StandInGroup(ranks=3)
    for m in c.group.members:
        m.actor, m.info = Reaper(), {"node_id": "n", "pid": 100 + m.rank}
    monkeypatch.setattr(controller_module.ray, "kill", lambda actor, no_restart=True: None)
    c._kill_hung({"ref": 2}, "did not leave (test)", gone=gone)
    reaper = 1 if gone else 0
    assert [m.actor.reaped for m in c.group.members] == [[102] if m.rank == reaper else [] for m in c.group.members]
    assert c._hung == {"rank-2"}


class FastSets:
    """A stand-in rank's actor whose ``fast_sets`` answers from its record of the fast sets
    (a spare that took the state holds none), or raises (a rank that died)."""

    def __init__(self, record=None, dead=False):
        self.record, self.dead = record or {}, dead
        self.fast_sets = self
        # No step results kept from a broken call (TrainWorker.unreported_results).
        self.unreported_results = SimpleNamespace(remote=lambda first, last, generation: self._answer([]))

    def _answer(self, value):
        if self.dead:
            raise controller_module.ray.exceptions.RayActorError()
        return value

    def remote(self, first, last):
        return self._answer({s: r for s, r in self.record.items() if first <= s <= last})


def test_steps_kept_from_a_holder_that_computed_none_of_them_take_their_fast_sets_from_the_other_members(
        rayless_controller, plain_values):
    # First-N, 2 of 3: a spare that took the state in a failed recovery pass holds the newest step
    # in the next one, and knows no fast set of the steps it keeps; every replica's shard of them
    # was booked as used (0 dropped). The surviving late rank's record has them; a dead one is skipped.
    from elastic.data import ShardPlan

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=16)
    c.plan, c._split = ShardPlan(64, seed=0), c.global_batch_size // 8
    for step in (1, 2):
        c._shards_for(step, 3)
    c.group = StandInGroup(ranks=3)
    spare = Member(FastSets(), "spare-0", rank=0)
    c.group.members = [spare, Member(FastSets(dead=True), "rank-1", rank=1),
                       Member(FastSets({1: [0, 2], 2: [0, 2]}), "rank-2", rank=2)]
    c._keep_steps_held_by(spare, 2, "completed on a survivor before the rebuild")
    assert c.step == 2
    assert [(h.ranks, h.dropped) for h in c.history[-2:]] == [([0, 2], 8), ([0, 2], 8)]
    assert [e.used for e in c.ledger.entries if e.step == 1] == [True, False, True]


@pytest.mark.parametrize("sums", [(7, 8), (7, 7)])
def test_the_checksums_of_a_kept_steps_results_are_compared(rayless_controller, sums):
    # Step 10 (a checksum step) broke before its results came back through a gather; the ranks
    # still had them, and the step was booked from them (_keep_completed_steps), but their
    # checksums were never compared: two replicas diverged at step 10 were told only at step 20
    # or the run's end.
    from elastic.controller import ReplicaDivergence
    from elastic.data import ShardPlan

    c = rayless_controller(global_batch_size=8)
    c.plan, c._split, c.group = ShardPlan(64, seed=0), 1, StandInGroup(ranks=2)
    c._shards_for(10, 2)
    results = {10: {r: StepResult(r, 10, 0.5, 0.01, 0.01, 4, 10, {"checksum": s}) for r, s in enumerate(sums)}}
    with pytest.raises(ReplicaDivergence, match="after step 10") if sums[0] != sums[1] else contextlib.nullcontext():
        c._keep_completed_steps([10], "completed on a survivor before the rebuild", results=results)
    if sums[0] == sums[1]:
        assert [e.details["step"] for e in c.events if e.kind == "checksum"] == [10]


def test_with_requeueing_a_stops_checkpoint_holds_its_steps_data_position_not_a_handed_out_steps(
        rayless_controller):
    # First-N 2 of 3 with requeueing: step 2 is handed out (it takes step 1's requeued drops), a
    # rank dies in it, and a stop seen then ends the run on step 1. Its final checkpoint held
    # the plan's place after step 2 (cursor 40, nothing requeued): a resume skipped step 2's
    # samples and step 1's drops for the rest of the epoch.
    from elastic.data import ShardPlan

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=16)
    c.requeue_dropped = True
    metas = {}
    c.committer = SimpleNamespace(set_meta=lambda step, meta, force=False: metas.__setitem__(step, meta))
    c.plan, c._split, c.dataset_size, c.group = ShardPlan(64, seed=0), 2, 64, StandInGroup(ranks=3)
    c._shards_for(1, 3)
    c._book_step(1, used=[0, 1], loss=0.0, step_time_s=0.1)
    after_1 = c.plan.position.to_dict()
    assert after_1["cursor"] == 24 and len(after_1["requeued"]) == 8  # rank 2's shard of step 1
    c._shards_for(2, 3)  # handed out, then lost in the failure: kept for the replay
    assert c.plan.position.to_dict() != after_1
    c.step = 1
    c._force_meta(1)  # the final checkpoint of the stop (_finish_checkpoints)
    assert metas[1]["data_position"] == after_1
    c._set_meta_after_results(1)  # a kept step's meta (_keep_completed_steps) reads the same place
    assert metas[1]["data_position"] == after_1


def test_a_stop_that_comes_while_an_eviction_waits_for_late_windows_holds_it_back(rayless_controller):
    # _too_late_to_evict saw no stop yet; the eviction then went on past its waits, and its
    # rebuild could outlast the driver's stop_timeout_s, whose kill took the stop's commit.
    from elastic.controller import State, evictions_carried_out
    from elastic.policies.decisions import EvictStraggler

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, num_spares=1,
                                                         aggregation="first_n"), global_batch_size=16)
    c.group = StandInGroup(ranks=3, ready_spares=1)
    evicted = []
    c.group.evict = evicted.append
    c.transition(State.RUNNING, "training")
    c._wait_late = lambda exclude=None: (c.request_stop("elastic stop"), {})[1]  # the stop comes in the wait
    c._evict(EvictStraggler("rank 2 is 3x the median", 2))
    assert evicted == [] and c.group.members[2].name == "rank-2" and c.state is State.RUNNING
    decisions = [e.message for e in c.events if e.kind == "decision"]
    assert decisions[-1].startswith("Continue: rank 2 is a persistent straggler, but the run is stopping")
    assert evictions_carried_out([asdict(e) for e in c.events]) == []


@pytest.mark.parametrize("how", ["failure_during_recovery", "hang"])
def test_an_eviction_the_recovery_loop_finishes_is_counted_as_a_straggler_recovery(rayless_controller, plain_values,
                                                                                   monkeypatch, how):
    # The rebuild after the victim was killed ran into a failure (the promoted spare lost in the
    # state sync, a survivor that never left): _evict handed it to _recover, which counted that
    # recovery under its own kind, and returned. The eviction, carried out (evictions_carried_out
    # finds it in the events), was missing from elastic_recoveries_total{kind="straggler"}.
    import ray

    from elastic.controller import State, evictions_carried_out
    from elastic.policies.decisions import EvictStraggler

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1), global_batch_size=12)
    c.group, c.metrics = StandInGroup(ranks=3, ready_spares=1), Recorded()
    killed = []
    c.group.evict = killed.append
    c.transition(State.RUNNING, "training")
    c._wait_late = lambda exclude=None: {}
    syncs = []

    def sync():  # the eviction's state sync (the first) loses the spare that took rank 2
        syncs.append(c.group.members[2].name)
        if how == "failure_during_recovery" and len(syncs) == 1:
            raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(c, "_sync_state", sync)
    monkeypatch.setattr(c, "_ask_to_leave",
                        lambda survivors: ([], {"leave-of-rank-0": 0} if how == "hang" else {}, 0.0))
    monkeypatch.setattr(c, "_kill_hung", lambda stuck, why, gone=(): None)
    monkeypatch.setattr(c, "_probe_dead", lambda: {2})
    monkeypatch.setattr(c, "_settle_survivors", lambda dead: set())
    monkeypatch.setattr(c, "_form_group", lambda why: None)
    monkeypatch.setattr(c, "_refill_spares", lambda: None)
    c._evict(EvictStraggler("rank 2 is 3x the median", 2))
    assert [m.name for m in killed] == ["rank-2"] and c.state is State.RUNNING
    recoveries = [args[0] for name, args, _ in c.metrics.calls if name == "on_recovery"]
    assert recoveries == [how, "straggler"]  # the recovery under its kind, the eviction once
    assert len(evictions_carried_out([asdict(e) for e in c.events])) == 1


def test_an_eviction_held_back_while_the_spare_refill_has_stopped_says_no_spare_is_coming(rayless_controller):
    # After SPARE_START_ATTEMPTS failed spare starts in a row the refill asks for no more, but
    # the held-back straggler was still told "it is evicted once one is ready": it never was.
    from elastic.controller import State
    from elastic.policies.decisions import Continue, EvictStraggler

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1), global_batch_size=12)
    c.group, c.metrics = StandInGroup(ranks=3), Recorded()
    c.transition(State.RUNNING, "training")
    # The policy's word, while spares are still asked for: as it was.
    c._note_held_back(Continue("rank 2 is a persistent straggler (score 3.00) but no spare is ready; it is "
                               "evicted once one is", straggler=2))
    c._spare_failures_in_row = controller_module.SPARE_START_ATTEMPTS
    c._refill_spares()  # says in a spares event that it starts no more
    assert not c.group.building
    c._note_held_back(Continue("rank 2 is a persistent straggler (score 3.00) but no spare is ready; it is "
                               "evicted once one is", straggler=2))
    c._evict(EvictStraggler("rank 1 is 3x the median", 1))  # found no spare at its first look
    assert c.state is State.RUNNING and not [n for n, _, _ in c.metrics.calls if n == "on_recovery"]  # no victim
    said = [e.message for e in c.events if e.kind == "decision" and e.details.get("decision") == "Continue"]
    stopped = f"; the spare refill has stopped after {controller_module.SPARE_START_ATTEMPTS} failed starts: " \
              "see the spares event"
    assert said[0].endswith("it is evicted once one is")
    assert said[1].startswith("Continue: rank 2 is a persistent straggler") and said[1].endswith(stopped)
    assert said[2].startswith("Continue: rank 1 is a persistent straggler, but no live spare") and \
        said[2].endswith(stopped)
    assert len(said) == 3


def test_an_eviction_given_up_publishes_each_ranks_real_heartbeat_age(rayless_controller):
    # Given up after its waits (here: the run is stopping), the eviction published the group
    # again as if it had formed, every rank's heartbeat age 0: rank 2, silent for the whole
    # wait for the late windows, looked freshly heard from.
    from elastic.controller import State
    from elastic.policies.decisions import EvictStraggler

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3, num_backups=1), global_batch_size=12)
    c.group, c.metrics = StandInGroup(ranks=3, ready_spares=1), Recorded()
    c.transition(State.RUNNING, "training")
    c._last_beat = {0: time.time(), 1: time.time(), 2: time.time() - 100}
    c._wait_late = lambda exclude=None: (c.request_stop("elastic stop"), {})[1]  # the stop comes in the wait
    c._evict(EvictStraggler("rank 2 is 3x the median", 2))
    assert c.state is State.RUNNING
    names = [name for name, _, _ in c.metrics.calls]
    assert names.index("on_heartbeats") > names.index("on_group")
    [(ages,)] = [args for name, args, _ in c.metrics.calls if name == "on_heartbeats"]
    assert ages[0] < 5 and ages[1] < 5 and ages[2] > 99


def test_an_evictions_wait_for_late_windows_ends_when_a_stop_comes(rayless_controller, monkeypatch):
    # One ray.wait of step_timeout_s (120 s): a stop that came a second in waited it out, and
    # the stop's end came after the driver's stop_timeout_s had killed the run.
    import time as real_time

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=16)
    c._lagging = {"window-of-rank-1": (1, 0.0, 1)}
    clock = [0.0]

    def wait(refs, num_returns=1, timeout=None):  # the window never finishes; a wait takes its timeout
        clock[0] += timeout
        if clock[0] >= 1.0:
            c.request_stop("elastic stop")
        return [], list(refs)

    monkeypatch.setattr(controller_module.ray, "wait", wait)
    monkeypatch.setattr(controller_module, "time", SimpleNamespace(
        monotonic=lambda: clock[0], time=real_time.time, perf_counter=real_time.perf_counter))
    assert c._wait_late(exclude=2) == {1: None}  # still busy: left alone
    assert clock[0] <= 1.5


def test_a_batch_schedule_sizes_each_steps_shards_from_its_step_on_and_replays_them_as_planned(rayless_controller):
    # Trainer.batch_schedule={3: 16, 5: 32} over global_batch_size=8 and two ranks: steps 1-2
    # take 4 samples a rank, 3-4 take 8, 5 on take 16; a replayed step reuses its own shards.
    from elastic.data import ShardPlan

    c = rayless_controller(global_batch_size=8, batch_schedule={3: 16, 5: 32})
    c.plan, c._split, c.group = ShardPlan(256, seed=0), 2, StandInGroup(ranks=2)
    sizes = [[len(shard) for shard in c._shards_for(step, 2)[1]] for step in range(1, 7)]
    assert sizes == [[4, 4], [4, 4], [8, 8], [8, 8], [16, 16], [16, 16]]
    first = c._shards_for(4, 2)
    assert c._shards_for(4, 2) == first
    assert c._checkpoint_meta(5, c.plan.position.to_dict())["global_batch_size"] == 32


def test_a_resume_whose_batch_sizes_differ_from_the_checkpoints_says_so(rayless_controller):
    # Sample-exact either way, but a run resumed without its schedule went on at another size
    # with nothing said.
    c = rayless_controller(global_batch_size=8, batch_schedule={5: 16})
    c.dataset_size = 256
    position = {"epoch": 0, "cursor": 64, "requeued": []}
    assert c._resumable_position(7, {"data_position": position, "global_batch_size": 16}).cursor == 64
    assert c._resumable_position(3, {"data_position": position, "global_batch_size": 8}).cursor == 64
    assert not [e for e in c.events if e.kind == "batch_size_changed"]
    assert c._resumable_position(7, {"data_position": position, "global_batch_size": 32}).cursor == 64
    [event] = [e for e in c.events if e.kind == "batch_size_changed"]
    assert (event.details["saved"], event.details["now"]) == (32, 16)
    assert "step 7 trained at a global batch of 32" in event.message


def test_a_resume_without_the_checkpoints_later_batch_sizes_says_so(rayless_controller):
    # Only the checkpointed step's size was compared: a run with batch_schedule={2000: 512}
    # stopped at 1500 and resumed without the schedule trained at 256 from step 2000 on, silently.
    position = {"epoch": 0, "cursor": 64, "requeued": []}
    from elastic.data import ShardPlan

    scheduled = rayless_controller(global_batch_size=256, batch_schedule={2000: 512})
    scheduled.group, scheduled.plan, scheduled.dataset_size = StandInGroup(), ShardPlan(4096, seed=0), 4096
    meta = scheduled._checkpoint_meta(1500, position) | {"data_position": position}
    assert meta["batch_schedule"] == [[1, 256], [2000, 512]]
    scheduled._resumable_position(1500, meta)  # resumed with its schedule: nothing to say
    assert not [e for e in scheduled.events if e.kind == "batch_size_changed"]
    c = rayless_controller(global_batch_size=256)
    c.dataset_size = 4096
    c._resumable_position(1500, meta)
    [event] = [e for e in c.events if e.kind == "batch_size_changed"]
    assert (event.details["at"], event.details["saved"], event.details["now"]) == (2000, 512, 256)
    # A checkpoint written before the schedule was recorded: only its step's size, as before.
    c._resumable_position(1500, {k: v for k, v in meta.items() if k != "batch_schedule"})
    assert len([e for e in c.events if e.kind == "batch_size_changed"]) == 1


def test_a_batch_schedules_epochs_end_where_the_next_steps_batch_no_longer_fits():
    from elastic.data import BatchSchedule

    schedule = BatchSchedule(16, {4: 32, 10: 64})
    assert [schedule.size_at(s) for s in (1, 3, 4, 9, 10, 99)] == [16, 16, 32, 32, 64, 64]
    # Epoch 0: 16 x 3 then 32 (20 left, under the next 32); epoch 1: 32 x 3 (4 left)
    assert schedule.steps_for_epochs(100, 1) == 4 and schedule.steps_for_epochs(100, 2) == 7
    assert BatchSchedule(16).steps_for_epochs(100, 2) == 12  # 6 a epoch, as ShardPlan cuts them
    assert schedule.largest == 64 and schedule.sizes == [16, 32, 64]
    assert [schedule.first_step_of(size) for size in (16, 32, 64)] == [1, 4, 10]
    # Past the last change the count is arithmetic (a million epochs walked step by step hung the
    # controller): the same as walking every step, for schedules that grow, shrink or change mid-epoch.
    import random

    def walked(schedule, num_samples, epochs):
        step = 0
        for _ in range(epochs):
            left = num_samples
            while left >= schedule.size_at(step + 1):
                step += 1
                left -= schedule.size_at(step)
        return step

    rng = random.Random(0)
    for _ in range(200):
        changes = {rng.randint(1, 40): rng.choice([8, 16, 24, 32, 64]) for _ in range(rng.randint(1, 4))}
        schedule, num_samples = BatchSchedule(rng.choice([8, 16, 32]), changes), rng.randint(64, 300)
        for epochs in (1, 2, 5, 13):
            assert schedule.steps_for_epochs(num_samples, epochs) == walked(schedule, num_samples, epochs), changes
    assert schedule.steps_for_epochs(10**9, 10**6) > 0  # returns at once


class Call:
    """A stand-in actor method: ``.remote(*args)`` returns ``fn(*args)`` (ray.get passes it through)."""

    def __init__(self, fn):
        self.remote = fn


def test_first_n_steps_a_checkpoint_proves_take_their_fast_sets_from_the_members_before_the_restore(
        rayless_controller, plain_values):
    # First-N, 2 of 3, steps 11-12 committed mid-window and their results never came back: every
    # rank then loads step 12 (no survivor holds the state). The ranks that load it know no fast
    # set, so each replica's shard of 11 and 12 was booked as used; the old members' records say
    # which two made each step. A member that died is skipped.
    from elastic.data import ShardPlan

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=16)
    c.plan, c._split, c.dataset_size = ShardPlan(64, seed=0), c.global_batch_size // 8, 64
    c.step = 10
    for step in (11, 12):
        c._shards_for(step, 3)
    meta = {"data_position": DataPosition(cursor=12 * 24).to_dict()}
    record = {11: [1, 2], 12: [0, 2]}

    def rank(i, knows=True):
        fast_sets = FastSets(record if knows else None, dead=(i == 1))
        return Member(SimpleNamespace(
            fast_sets=fast_sets, unreported_results=fast_sets.unreported_results,
            restore_checkpoint=Call(lambda url, options, name, step: meta),
            get_state=Call(lambda: "state"), set_state=Call(lambda state: 12)), f"rank-{i}", rank=i)
    c.group = StandInGroup(ranks=3)
    c.group.members = [rank(0, knows=False), rank(1), rank(2)]
    c.store = SimpleNamespace(committed_steps=lambda refused=None: [12], url="memory://x", storage_options={}, location="memory://x")
    # The failure being healed carried rank 2's result of step 11 (it returned it before the
    # failure was seen): step 11 is booked with its loss; no rank had step 12's.
    c._arrived = Failure({1}, "actor_died", results={2: [StepResult(2, 11, 0.25, 0.02, 0.02, 8, 11, {"fast": [1, 2]})]})
    c._restore_members_from_checkpoint()
    assert c.step == 12 and c.restored_from == 12
    assert [(h.step, h.ranks, h.dropped) for h in c.history] == [(11, [1, 2], 8), (12, [0, 2], 8)]
    assert c.history[0].loss == 0.25 and c.history[0].step_time_s == 0.02 and math.isnan(c.history[1].loss)
    assert c.history[0].loss_known and not c.history[1].loss_known
    assert c.status()["loss"] == 0.25  # the newest known loss, as result.metrics["loss"]


class Configures:
    """A stand-in actor whose ``configure_checkpoint`` returns its name as the ref."""

    def __init__(self, name):
        self.configure_checkpoint = self
        self.name = name

    def remote(self, *args):
        return self.name


def test_a_spare_that_dies_while_checkpoint_writers_are_set_up_is_dropped_not_the_run(rayless_controller,
                                                                                     monkeypatch):
    # A restart from the checkpoint (or a start) sets up the writers of ranks and ready spares
    # in one call: a spare dying in it failed the whole rebuild ("rebuild failed without a lost
    # rank"), though a spare is not needed to train. It is dropped from the pool instead; a rank
    # that fails still fails the call, for the recovery to find it lost.
    import ray

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1))
    c.group = StandInGroup(ranks=2, ready_spares=1)
    for m in c.group.members + c.group.spares:
        m.actor = Configures(m.name)
    c.store = SimpleNamespace(url="memory://x", storage_options={})
    dead = {"spare-0"}

    def get(ref, **kw):
        if ref in dead:
            raise ray.exceptions.RayActorError()
        return ref

    monkeypatch.setattr(controller_module.ray, "get", get)
    dropped = []

    def watch_spares(timeout_s, wait=False):
        gone = [m for m in c.group.spares if m.name in dead]
        c.group.spares = [m for m in c.group.spares if m.name not in dead]
        dropped.extend(m.name for m in gone)
        return [(m, "died") for m in gone]

    c.group.watch_spares = watch_spares
    c._configure_checkpoints(c._all_actors())
    assert c._configured == {"rank-0", "rank-1"} and dropped == ["spare-0"]
    assert [e.details["spare"] for e in c.events if e.kind == "spare_lost"] == ["spare-0"]
    c._configured.clear()
    dead.add("rank-1")
    with pytest.raises(ray.exceptions.RayActorError):
        c._configure_checkpoints(c.group.members)


def test_a_state_no_checkpoint_can_hold_ends_the_start_with_that_error_not_a_storage_refusal(
        rayless_controller, monkeypatch):
    # A rank's writer set-up found the state unsaveable (UnsaveableState, a ConfigError): it is the
    # run's state, not a node's storage credentials, so it is raised as it is, without the
    # refusal's advice about AWS variables on the nodes.
    import ray

    from elastic.checkpoint import UnsaveableState
    from elastic.config import ConfigError

    c = rayless_controller()
    c.group = StandInGroup(ranks=2)
    for m in c.group.members:
        m.actor = Configures(m.name)
    c.store = SimpleNamespace(url="memory://x", storage_options={})
    causes = {"rank-0": UnsaveableState("optimizer/param_groups/0/dtype has a dtype"),
              "rank-1": ConfigError("Access Denied")}

    def get(ref, **kw):
        raise ray.exceptions.RayTaskError("configure_checkpoint", "traceback", causes[ref])

    monkeypatch.setattr(controller_module.ray, "get", get)
    with pytest.raises(UnsaveableState, match="the training state cannot be checkpointed: optimizer") as info:
        c._configure_checkpoints(c.group.members)
    assert "AWS" not in str(info.value)
    del causes["rank-0"]  # a storage refusal still names the node and the credentials' advice
    c.group.members = c.group.members[1:]
    with pytest.raises(ConfigError, match="rank-1 on node .*Access Denied.*driver's own check passed"):
        c._configure_checkpoints(c.group.members)


def test_the_ends_flush_reads_every_rank_then_commits_then_raises_an_unsaveable_state(rayless_controller,
                                                                                    monkeypatch):
    # The end's flush snapshots the last step when every_n_steps skipped it. A rank whose snapshot
    # finds the state unsaveable ends the run as in a step (it was Ray's RayTaskError, which the
    # driver showed as a TrainingFailed with the controller's traceback), after the other ranks'
    # reports are read and the complete steps committed. With lost_ok, a rank busy past
    # heartbeat_timeout_s is skipped, not the end of the commit: its GetTimeoutError was re-raised.
    import ray

    from elastic.checkpoint import UnsaveableState

    c = rayless_controller()
    c.group = StandInGroup(ranks=3)
    for m in c.group.members:
        m.actor = SimpleNamespace(flush_checkpoint=SimpleNamespace(remote=lambda final, r=m.rank: r))
    flushed, merged = [], []
    c.committer = SimpleNamespace(flush=lambda timeout_s: flushed.append(timeout_s) or True, drain_events=lambda: [], halted=None)
    c._merge_ckpt = lambda rank, report: merged.append((rank, report))
    answers = {0: UnsaveableState("x has a set", 7), 1: {"ckpt_done": []}, 2: ray.exceptions.GetTimeoutError()}

    def get(rank, **kw):
        answer = answers[rank]
        if isinstance(answer, UnsaveableState):
            raise ray.exceptions.RayTaskError("flush_checkpoint", "traceback", answer)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(controller_module.ray, "get", get)
    with pytest.raises(UnsaveableState, match=r"x has a set \(found in step 7's snapshot"):
        c._commit_what_ranks_wrote(7, 5, "final checkpoint", lost_ok=True)
    assert merged == [(1, {"ckpt_done": []})] and flushed == [5]
    skipped = [e for e in c.events if e.kind == "checkpoint_failed"]
    assert [e.details["rank"] for e in skipped] == [2] and "did not finish its writes" in skipped[0].message


def test_a_users_error_commits_what_the_ranks_wrote_before_the_run_ends_with_it(rayless_controller):
    # The ranks are alive after a user's error (WorkerError, UnsaveableState): the steps their
    # background writers still held are committed first, as a stop's are. A failure of that
    # commit is logged; the run still ends with the user's error.
    from elastic.checkpoint import UnsaveableState
    from elastic.controller import WorkerError

    for error in (WorkerError(1, "ValueError: a batch this loss cannot take"), UnsaveableState("x has a set", 3)):
        c = rayless_controller()
        c.group = StandInGroup(ranks=2)
        c.committer = SimpleNamespace(close=lambda: None)
        calls = []

        def fail(error=error):
            raise error

        c._schedule = fail
        c._commit_what_ranks_wrote = lambda final, timeout_s, what, lost_ok=False: calls.append((final, what, lost_ok))
        with pytest.raises(type(error)):
            c.run_for(steps=5)
        assert calls == [(None, f"checkpoints of the steps before the {type(error).__name__}", True)]

        def storage_gone(*args, **kwargs):
            raise RuntimeError("the storage went away")

        c._commit_what_ranks_wrote = storage_gone
        with pytest.raises(type(error)):
            c.run_for(steps=5)
        failed = [e.message for e in c.events if e.kind == "checkpoint_failed"]
        assert failed == [f"the steps before the {type(error).__name__} could not be committed: RuntimeError: "
                          "the storage went away"]


def test_a_checkpoint_read_that_does_not_return_is_logged_and_a_stop_breaks_in(rayless_controller, monkeypatch):
    # The rank reading the checkpoint is stuck in the read (a hung mount), its heartbeat still
    # answering: the restore waited in one ray.get with no end, and a stop could not break in.
    from elastic.actors.protocol import StopRequested

    c = rayless_controller()
    c.store = SimpleNamespace(location="file:///ckpt")
    waits = []

    def never_ready(refs, **kw):
        waits.append(kw["timeout"])
        if len(waits) == 3:
            c.request_stop("a stop from the test")
        return [], list(refs)

    monkeypatch.setattr(controller_module.ray, "wait", never_ready)
    monkeypatch.setattr(c, "RESTORE_NOTE_S", 0.0)
    with pytest.raises(StopRequested, match="reading checkpoint step 7"):
        c._await_restore("ref", 7)
    assert len(waits) == 3 and all(0 < t <= 1.0 for t in waits)
    notes = [e for e in c.events if e.kind == "checkpoint" and "still reading checkpoint step 7" in e.message]
    assert len(notes) == 2 and notes[0].details["step"] == 7
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(controller_module.ray, "get", lambda ref, **kw: {"step": 7})
    assert c._await_restore("ref", 7) == {"step": 7}


def test_snapshots_a_rank_dropped_count_after_it_is_gone(rayless_controller):
    # The run's checkpoint_snapshots_dropped came only from the end's drain of the ranks then in
    # the group: a rank lost or replaced before it, and a restart's new rank of the same name
    # (which took the old name's entry), were not counted.
    c = rayless_controller()
    c.group = StandInGroup(ranks=2)
    c.committer = SimpleNamespace()

    def dropped(rank, n):
        c._log_storage_event({"event": "checkpoint_snapshots_dropped", "step": 5, "dropped": n,
                              "message": f"{n} snapshot(s) dropped"}, rank)

    dropped(1, 3)
    dropped(1, 2)
    c.group.members[1] = Member(Answers(), "rank-1", rank=1)  # lost and replaced: a new actor, same name
    dropped(1, 4)
    c._snapshot_drops[c._actor_key(1)] = 6  # the new one's total at the end's drain (events undercount)
    c._snapshot_drops[c._actor_key(0)] = 1  # dropped one, never said (within the minute)
    assert c._snapshots_dropped() == 5 + 6 + 1


def test_a_shrink_counts_its_lost_ranks_out_of_the_world_size_once(rayless_controller):
    # remove_ranks took the lost ranks out of the group while _unhealed still named them, so a
    # status() read during the rest of the recovery subtracted them twice (4 ranks, 3 lost: -2).
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=4), global_batch_size=12,
                           failure=elastic.FailureConfig(when_no_spare="shrink", allow_shrink=True, min_workers=1))
    c.group = StandInGroup(ranks=4)
    c.failures = 1
    c._unhealed = (1, 2, 3)  # as the recovery loop sets it before the decision is carried out
    c._decide_and_apply((1, 2, 3), "node_lost")
    assert len(c.group.members) == 1 and c._world_size == 1


def test_a_late_replicas_own_error_during_an_eviction_is_the_users(rayless_controller):
    # First-N: rank 2 is evicted while rank 1 is late, and rank 1's loss_fn raised in its late
    # window. _evict ignored what _wait_late returned: the error vanished, the run went on.
    import ray

    from elastic.actors.protocol import CollectiveError
    from elastic.controller import WorkerError
    from elastic.policies.decisions import EvictStraggler

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, num_spares=1,
                                                         aggregation="first_n"), global_batch_size=8)
    c.group = StandInGroup(ranks=3, ready_spares=1)
    user = ray.exceptions.RayTaskError("train_steps", "Traceback ...", ValueError("a bad sample (test)"))
    c._wait_late = lambda exclude=None: {1: user}
    with pytest.raises(WorkerError, match="worker rank 1 raised"):
        c._evict(EvictStraggler(rank=2, reason="slow (test)"))
    broken = ray.exceptions.RayTaskError("train_steps", "Traceback ...", CollectiveError("peer gone (test)"))
    c._raise_user_errors({1: broken, 0: None})  # a broken group or a busy rank is no user error
    # A late window whose snapshot found the state unsaveable: that error, as in a step
    from elastic.checkpoint import UnsaveableState

    unsaveable = ray.exceptions.RayTaskError("train_steps", "Traceback ...", UnsaveableState("x has a set", 9))
    with pytest.raises(UnsaveableState, match=r"found in step 9's snapshot"):
        c._raise_user_errors({1: unsaveable})


def test_a_rollback_whose_old_checkpoint_writes_do_not_settle_says_so_and_goes_on(
        rayless_controller, tmp_path):
    """A rollback waits (``SETTLE_TIMEOUT_S``) for the nodes' agents to finish the writes of the
    state it goes back from; writes still under way after that are a
    ``checkpoint_writes_unsettled`` event naming them (rank, step), and the rollback goes on."""
    from elastic.checkpoint import CheckpointCommitter, CheckpointStore
    from elastic.config import CheckpointConfig

    c = rayless_controller(name="unsettled")
    c.committer = CheckpointCommitter(CheckpointStore(f"file://{tmp_path}", "unsettled"),
                                      CheckpointConfig(every_n_steps=1))
    asked = []

    class StuckAgents:
        def settle(self, generation, timeout_s, through=None):
            asked.append((generation, timeout_s, through))
            return [(1, 7), (0, 8)]

    c._agents, c.generation, c._worker_progress = StuckAgents(), 3, 9
    try:
        c._rewind(5)
    finally:
        c.committer.close()
    assert asked == [(3, c.SETTLE_TIMEOUT_S, 5)]  # a rollback: generation 3's steps up to 5 are still its history
    assert c._given_up_parts == [(3, 5)] and c._worker_progress == 5
    unsettled = [e for e in c.events if e.kind == "checkpoint_writes_unsettled"]
    assert len(unsettled) == 1 and unsettled[0].details["stuck"] == [[1, 7], [0, 8]]
    assert "(rank, step): [(1, 7), (0, 8)]" in unsettled[0].message
    # Settled: nothing said.
    c._agents = SimpleNamespace(settle=lambda generation, timeout_s, through=None: [])
    c.committer = CheckpointCommitter(CheckpointStore(f"file://{tmp_path}", "unsettled"),
                                      CheckpointConfig(every_n_steps=1))
    try:
        c._rewind(None)
    finally:
        c.committer.close()
    assert c._worker_progress == 0
    assert len([e for e in c.events if e.kind == "checkpoint_writes_unsettled"]) == 1


def test_a_restart_the_cluster_left_cannot_place_ends_as_a_training_failure_naming_the_checkpoint(rayless_controller):
    # The PlacementTimeout of a restart's new group left the recovery loop as it was: a generic
    # error whose advice (fewer workers...) said nothing of the restart or of the checkpoint.
    from elastic.actors.worker_group import PlacementTimeout
    from elastic.controller import TrainingFailed

    c = rayless_controller(name="restart-unplaced")
    c.step, c.store = 7, SimpleNamespace(location="file:///ckpt")
    c.committer = SimpleNamespace(latest_committed=6, flush=lambda timeout_s: True)

    def start(n):
        raise PlacementTimeout("2 rank bundle(s) could not be placed within 1s (ScalingConfig.placement_timeout_s)")

    c.group = SimpleNamespace(members=[], shutdown=lambda: None, start=start)
    c._new_group = lambda: None
    c._begun_by_survivors = lambda: 7
    c._unhealed = (1,)
    with pytest.raises(TrainingFailed, match=r"training stopped at step 7: the restart could not be placed: 2 rank "
                                             r"bundle.*latest committed checkpoint: step 6 at file:///ckpt"):
        c._restart_all()
    assert c._unhealed == ()


class Beats:
    """A stand-in rank's actor handle whose heartbeat says which phase its step is in, and since when."""

    def __init__(self, phase, since):
        self.heartbeat = SimpleNamespace(remote=lambda: {"phase": phase, "phase_since": since, "time": 1000.0})


@pytest.mark.parametrize("phases, blamed", [
    # A fast rank hung in its forward; the other fast ones wait in the collective, the resting
    # (or late) replica for the fast set's update: only the hung one is killed. The resting one
    # was killed too, as stuck in its own code.
    ({0: "allreduce", 1: "compute", 2: "allreduce", 3: "late"}, [1]),
    ({0: "allreduce", 1: "compute", 2: "arrive", 3: "late"}, [1]),
    # Every rank waits on a peer: the one that entered its collective last, not the late
    # replica that entered its wait after it.
    ({0: "allreduce", 1: "backward+allreduce", 2: "allreduce", 3: "late"}, [2]),
    # Data parallel, as before: a rank that never reached its collective.
    ({0: "backward+allreduce", 1: "compute"}, [1]),
])
def test_culprits_of_a_stalled_step_are_the_ranks_stuck_in_their_own_code(rayless_controller, plain_values,
                                                                          phases, blamed):
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=len(phases) - 1, num_backups=1))
    c.group = StandInGroup(ranks=len(phases))
    for r, phase in phases.items():
        c.group.members[r].actor = Beats(phase, since=100.0 + r + (10 if phase == "late" else 0))
    pending = {f"ref-{r}": r for r in phases}
    assert sorted(c._culprits(pending).values()) == blamed


def test_a_rank_whose_heartbeat_says_it_died_is_no_hung_culprit(rayless_controller, monkeypatch):
    # Its heartbeat raised ActorDiedError: it was taken for silent, killed as hung, and the
    # failure's kind read "hang". Dead, its pending calls fail on their own as a death. Nobody
    # else is blamed: its peers wait in their collective for it, and a first version of this
    # fix killed the one that entered it last as hung beside it.
    import ray

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3))
    c.group = StandInGroup(ranks=3)
    phases = {0: "allreduce", 1: "dead", 2: "allreduce"}
    for r, phase in phases.items():
        c.group.members[r].actor = Beats(phase, since=100.0 + r)

    def get(x, **kw):
        if x["phase"] == "dead":
            raise ray.exceptions.ActorDiedError()
        return x

    killed = []
    monkeypatch.setattr(controller_module.ray, "get", get)
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(controller_module.ray, "kill", lambda actor, no_restart: killed.append(actor))
    pending = {f"ref-{r}": r for r in phases}
    assert c._culprits(pending) == {}
    assert c._culprits({"ref-1": 1}) == {}
    # Killed all the same (an unavailable actor may live, and its calls would never fail), not as hung.
    assert killed == [c.group.members[1].actor] * 2 and not c._hung


def test_a_late_replicas_user_error_is_not_hidden_by_its_next_window_failing_as_stale(rayless_controller,
                                                                                      monkeypatch):
    # Rank 2 is late with two windows; its loss_fn raised in the first, so it left its group and
    # the second failed as StaleStep (a CollectiveError). The second outcome replaced the first:
    # the end of the run let the replica go as one that lost its group, and finished.
    import ray

    from elastic.actors.protocol import StaleStep
    from elastic.controller import WorkerError

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=2, num_backups=1, aggregation="first_n"),
                           global_batch_size=8)
    c.group = StandInGroup(ranks=3)
    outcomes = {"w1": ray.exceptions.RayTaskError("train_steps", "Traceback ...", ValueError("a bad sample (test)")),
                "w2": ray.exceptions.RayTaskError("train_steps", "Traceback ...", StaleStep("left its group (test)"))}
    c._lagging = {"w1": (2, time.time(), 1), "w2": (2, time.time(), 1)}  # in the order they went late
    monkeypatch.setattr(controller_module.ray, "wait", lambda refs, **kw: (list(refs), []))

    def get(ref, **kw):
        raise outcomes[ref]

    monkeypatch.setattr(controller_module.ray, "get", get)
    assert c._wait_late() == {2: outcomes["w1"]}
    c._lagging = {"w1": (2, time.time(), 1), "w2": (2, time.time(), 1)}
    with pytest.raises(WorkerError, match="worker rank 2 raised"):
        c._finish_late()


def test_at_the_collective_timeout_a_rank_still_in_its_own_code_is_blamed_only_past_the_step_timeout():
    # A peer died; a survivor still in a long forward (a step_fn's micro-batches) has not reached
    # the broken collective, and fails at it on its own. Blamed at collective_timeout_s, every
    # survivor still computing was killed as hung beside the dead peer, and nothing held the state.
    def beat(phase, for_s, clock=1000.0):  # a heartbeat's answer, on the rank's own clock
        return {"phase": phase, "phase_since": clock - for_s, "time": clock}

    blamed = controller_module._blamed
    refs = {"r0": 0, "r1": 1, "r2": 2}
    info = {0: beat("compute", 70.0), 1: beat("compute", 200.0, clock=5e6), 2: beat("allreduce", 65.0)}
    assert blamed(refs, info) == {"r0": 0, "r1": 1}  # the step timeout's rule
    assert blamed(refs, info, own_for_s=120.0) == {"r1": 1}  # in its forward for 200 s (its clock): hung
    info[1] = beat("compute", 80.0, clock=-3e6)  # a node's clock far off the controller's counts for nothing
    assert blamed(refs, info, own_for_s=120.0) == {}  # still computing: nobody (not rank 2 either)
    assert blamed(refs, {0: info[0], 2: info[2]}, own_for_s=120.0) == {"r1": 1}  # silent: blamed
    # Every rank in its collective: the last to enter, unless it has been in it for less than the
    # group's timeout, where it raises on its own (a peer gone with its node on gloo). Blamed, the
    # survivor that had been computing at the first check was killed at the next instead.
    waiting = {r: beat("allreduce", 30.0 - r) for r in refs.values()}
    assert blamed(refs, waiting, own_for_s=120.0) == {"r2": 2}
    assert blamed(refs, waiting, own_for_s=120.0, waiting_for_s=60.0) == {}
    waiting = {0: beat("allreduce", 63.0), 1: beat("allreduce", 62.0), 2: beat("allreduce", 61.0)}
    assert blamed(refs, waiting, own_for_s=120.0, waiting_for_s=60.0) == {"r2": 2}
    # The last to enter is the one in it the shortest time on its own clock: by the latest
    # phase_since, a node whose clock runs ahead (rank 0's here) had its healthy rank killed.
    waiting[0] = beat("allreduce", 63.0, clock=1e6)
    assert blamed(refs, waiting, own_for_s=120.0, waiting_for_s=60.0) == {"r2": 2}


class Ray:
    """``ray.wait``, ``ray.get`` and ``ray.kill`` over stand-in refs (strings): ``outcomes`` holds
    a ref's value, or the error ``ray.get`` raises for it; a ref not in it is still running. A
    rank killed has its step call fail as dead. ``leave_back``: the leaves come back in the
    ``leave_back``-th wait on them (``waits`` holds those waits' timeouts), never if None."""

    def __init__(self, monkeypatch, outcomes, leave_back=None):
        self.outcomes, self.leave_back = outcomes, leave_back
        self.waits: list[float] = []
        self.killed: list[str] = []
        for name in ("wait", "get", "kill"):
            monkeypatch.setattr(controller_module.ray, name, getattr(self, name))

    def wait(self, refs, num_returns=1, timeout=None, **kw):
        if any(r.startswith("leave") for r in refs):
            self.waits.append(timeout)
            if len(self.waits) == self.leave_back:
                self.outcomes.update({r: None for r in refs})
        ready = [r for r in refs if r in self.outcomes]
        if len(ready) < num_returns and timeout:
            time.sleep(min(timeout, 0.01))  # the gather's clocks go on
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def get(self, ref, timeout=None):
        value = self.outcomes[ref]
        if isinstance(value, BaseException):
            raise value
        return value

    def kill(self, actor, no_restart=True):
        self.killed.append(actor.name)
        self.outcomes[f"step-{actor.name}"] = controller_module.ray.exceptions.ActorDiedError()


class Rank:
    """A stand-in rank's actor handle: its calls' refs are named after it (see ``Ray``)."""

    def __init__(self, name):
        self.name = name
        self.heartbeat = Call(lambda: f"beat-{name}")
        self.leave = Call(lambda: f"leave-{name}")


def ranks_on(c, nodes):
    """``c.group``: a stand-in group whose rank i is on ``nodes[i]``."""
    c.group = StandInGroup(ranks=len(nodes))
    for m, node in zip(c.group.members, nodes):
        m.actor, m.info = Rank(m.name), {"node_id": node}


def beat(phase, for_s):
    """A heartbeat's answer: in ``phase`` for ``for_s`` seconds, on the rank's own clock."""
    return {"phase": phase, "phase_since": 1000.0 - for_s, "time": 1000.0, "completed_step": 3}


def rank_0_dies_beside(c, monkeypatch, nodes, answering):
    """Rank i on ``nodes[i]`` (Ray knows each node alive, its raylet at an address of its own);
    rank 0's step died, the others returned theirs, and of them only ``answering`` answer their
    heartbeats. Returns the stand-in ``Ray``."""
    ranks_on(c, nodes)
    outcomes = {"step-rank-0": controller_module.ray.exceptions.ActorDiedError()}
    outcomes.update({f"step-rank-{r}": f"rank {r}'s results" for r in range(1, len(nodes))})
    outcomes.update({f"beat-rank-{r}": beat("idle", 0.1) for r in answering})
    fake = Ray(monkeypatch, outcomes)
    addresses = {node: f"10.0.0.{9 - i}" for i, node in enumerate(dict.fromkeys(nodes))}
    monkeypatch.setattr(controller_module.ray, "nodes", lambda: [
        {"NodeID": node, "Alive": True, "NodeManagerAddress": address, "NodeManagerPort": 1234}
        for node, address in addresses.items()])
    return fake


def test_a_raylet_whose_connect_only_timed_out_loses_no_healthy_rank_with_the_one_that_died(rayless_controller,
                                                                                          monkeypatch):
    # Rank 0 died alone; rank 1, on the same node, is healthy. The probe of their raylet lost
    # its SYN (a 1 s connect timed out), and the timeout was taken for the node's death: rank 1
    # was killed with rank 0 as a node lost. Now the node is only suspect: rank 1 answers its
    # heartbeats, the raylet answers when asked again, and only rank 0 is lost.
    from elastic.actors import worker_group

    c = rayless_controller(failure=elastic.FailureConfig(node_settle_s=0.3))
    ranks_on(c, ["n", "n"])
    fake = Ray(monkeypatch, {"step-rank-0": controller_module.ray.exceptions.ActorDiedError(),
                             "step-rank-1": "rank 1's results", "beat-rank-1": beat("idle", 0.1)})
    monkeypatch.setattr(controller_module.ray, "nodes", lambda: [
        {"NodeID": "n", "Alive": True, "NodeManagerAddress": "10.0.0.9", "NodeManagerPort": 1234}])
    connects = []

    def connect(address, timeout=None):  # the first SYN is lost, the next one answered
        connects.append(address)
        if len(connects) == 1:
            raise TimeoutError("timed out")
        return contextlib.nullcontext()

    monkeypatch.setattr(worker_group.socket, "create_connection", connect)
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1"], [0, 1])
    assert failure.value.dead == {0} and failure.value.kind == "actor_died"
    assert fake.killed == ["rank-0"] and len(connects) >= 2  # asked again, not written off
    assert not [e for e in c.events if e.kind == "node_lost"]


def test_a_node_whose_raylet_times_out_throughout_the_settle_and_whose_ranks_are_silent_is_lost(rayless_controller,
                                                                                               monkeypatch):
    # A host crashed: it drops packets, so its raylet's connect times out (no refusal) until the
    # GCS marks it dead ~15 s later. Taken as suspect only, its silent rank 1 stayed in the group
    # and was found only when its leave() ran out, a group timeout later. A raylet that never
    # answered in the settle, with ranks that never answered either, is the node gone.
    from elastic.actors import worker_group

    c = rayless_controller(failure=elastic.FailureConfig(node_settle_s=0.3))
    fake = rank_0_dies_beside(c, monkeypatch, ["n", "n", "m"], answering=[2])  # rank 1 never answers

    def connect(address, timeout=None):  # the crashed host answers nothing
        if address[0] == "10.0.0.9":
            raise TimeoutError("timed out")
        return contextlib.nullcontext()

    monkeypatch.setattr(worker_group.socket, "create_connection", connect)
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1", "step-rank-2"], [0, 1, 2])
    assert failure.value.dead == {0, 1} and failure.value.kind == "node_lost"
    assert fake.killed == ["rank-0", "rank-1"]
    assert [e.details["ranks"] for e in c.events if e.kind == "node_lost"] == [[1]]


def test_a_rank_killed_for_missed_heartbeats_on_a_node_found_down_is_a_node_lost_not_a_hang(rayless_controller,
                                                                                          monkeypatch):
    # A host crashed: its rank's heartbeat stopped, and the rank was killed as hung (missed
    # heartbeats) before the GCS marked the node dead. The node is down for certain when the
    # gather looks, but the hang was checked first: the node lost was told as a hang in the
    # recoveries, the failures metric and the events.
    c = rayless_controller(failure=elastic.FailureConfig(heartbeat_interval_s=0.01, heartbeat_timeout_s=0.05,
                                                         node_settle_s=0.05))
    ranks_on(c, ["a", "b"])
    Ray(monkeypatch, {"step-rank-0": "rank 0's results"})  # rank 1 answers nothing
    monkeypatch.setattr(controller_module.ray, "nodes", lambda: [{"NodeID": "b", "Alive": False}])
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1"], [0, 1])
    assert "rank-1" in c._hung  # killed for its missed heartbeats, as before
    assert failure.value.dead == {1} and failure.value.kind == "node_lost"


def test_a_raylet_that_answered_once_in_the_settle_keeps_its_silent_rank_when_the_last_probe_times_out(
        rayless_controller, monkeypatch):
    # Rank 0 died alone; rank 1, on the same node, is healthy but silent through the settle (on
    # NCCL its communicators are aborted on its one control thread, which takes seconds). The
    # raylet answered mid-settle, but only the last probe counted: that one lost its SYN, and
    # rank 1 was killed with rank 0 as a node lost.
    from elastic.actors import worker_group

    c = rayless_controller(failure=elastic.FailureConfig(node_settle_s=0.3))
    ranks_on(c, ["n", "n"])
    fake = Ray(monkeypatch, {"step-rank-0": controller_module.ray.exceptions.ActorDiedError(),
                             "step-rank-1": "rank 1's results"})  # rank 1 never answers its heartbeat
    monkeypatch.setattr(controller_module.ray, "nodes", lambda: [
        {"NodeID": "n", "Alive": True, "NodeManagerAddress": "10.0.0.9", "NodeManagerPort": 1234}])
    connects = []

    def connect(address, timeout=None):  # timed out, answered, then timed out every time after
        connects.append(address)
        if len(connects) != 2:
            raise TimeoutError("timed out")
        return contextlib.nullcontext()

    monkeypatch.setattr(worker_group.socket, "create_connection", connect)
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1"], [0, 1])
    assert len(connects) >= 3  # the last probe timed out again
    assert failure.value.dead == {0} and failure.value.kind == "actor_died"
    assert fake.killed == ["rank-0"]


def test_a_rank_that_answers_keeps_its_node_up_though_its_raylet_times_out_throughout(rayless_controller,
                                                                                    monkeypatch):
    # Rank 0 died; rank 1 on its node answers its heartbeat, rank 2 there is silent (its NCCL
    # abort holds its control thread), and every connect to the raylet times out. The node was
    # taken as lost for its silent rank: rank 2 killed and the death told as a node lost, though
    # rank 1's answer shows the host up.
    from elastic.actors import worker_group

    c = rayless_controller(failure=elastic.FailureConfig(node_settle_s=0.3))
    fake = rank_0_dies_beside(c, monkeypatch, ["n", "n", "n"], answering=[1])  # rank 2 never answers

    def connect(address, timeout=None):
        raise TimeoutError("timed out")

    monkeypatch.setattr(worker_group.socket, "create_connection", connect)
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1", "step-rank-2"], [0, 1, 2])
    assert failure.value.dead == {0} and failure.value.kind == "actor_died"
    assert fake.killed == ["rank-0"]


@pytest.mark.parametrize("answers_at, kind", [(None, "node_lost"), (2, "hang")])
def test_a_rank_killed_for_missed_heartbeats_alone_on_a_node_whose_raylet_never_answers_is_a_node_lost(
        rayless_controller, monkeypatch, answers_at, kind):
    # A host crashed: it drops packets, so its raylet's connect times out (no refusal), and the
    # GCS marks it dead only ~15 s later. Its one rank was killed for missed heartbeats; with no
    # other rank on that node, the settle never ran, the node was never asked again, and the
    # node lost was told as a hang. A raylet that answers once in the settle is up: a hang.
    from elastic.actors import worker_group

    c = rayless_controller(failure=elastic.FailureConfig(heartbeat_interval_s=0.01, heartbeat_timeout_s=0.05,
                                                         node_settle_s=0.3))
    ranks_on(c, ["a", "b"])
    Ray(monkeypatch, {"step-rank-0": "rank 0's results"})  # rank 1 answers nothing
    monkeypatch.setattr(controller_module.ray, "nodes", lambda: [
        {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.8", "NodeManagerPort": 1234},
        {"NodeID": "b", "Alive": True, "NodeManagerAddress": "10.0.0.9", "NodeManagerPort": 1234}])
    connects = []

    def connect(address, timeout=None):
        connects.append(address)
        if address[0] == "10.0.0.9" and len(connects) != answers_at:
            raise TimeoutError("timed out")
        return contextlib.nullcontext()

    monkeypatch.setattr(worker_group.socket, "create_connection", connect)
    with pytest.raises(Failure) as failure:
        c._gather(["step-rank-0", "step-rank-1"], [0, 1])
    assert "rank-1" in c._hung  # killed for its missed heartbeats, as before
    assert failure.value.dead == {1} and failure.value.kind == kind
    assert len(connects) >= 2 and answers_at in (None, len(connects))  # asked again, until it answered


def test_a_first_n_survivor_that_does_not_leave_is_told_the_wait_it_had_and_the_settings_behind_it(
        rayless_controller, monkeypatch):
    # First-N's group timeout is step_timeout_s when that is longer: the survivor waited 130 s,
    # and the event said "within collective_timeout_s=60".
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=1, num_backups=1, aggregation="first_n"),
                           failure=elastic.FailureConfig(collective_timeout_s=60, step_timeout_s=120))
    ranks_on(c, ["a", "b"])
    c.group.evict = lambda m: None
    fake = Ray(monkeypatch, {"leave-rank-0": None})  # rank 1 is silent and never leaves
    assert c._settle_survivors(set()) == {1}
    assert fake.waits == [130.0]
    hang = [e.message for e in c.events if e.kind == "hang"]
    assert hang == ["rank 1 did not leave the broken group within 130s (step_timeout_s=120, first-N's group "
                    "timeout, + a margin of 10s); killing it so its peers unblock"]


@pytest.mark.parametrize("answer, back, waits, killed", [
    # In its collective for 5 s: gloo's timeout runs from when the collective was issued (after
    # the step's compute), not from the leave. It raises 55 s on and leaves: not killed at the
    # first deadline, as it was (with every other survivor, and no one left holding the state).
    (beat("allreduce", 5.0), 2, [70.0, 65.0], []),
    (beat("backward+allreduce", 5.0), None, [70.0, 65.0], ["rank-0"]),  # still not back at the bound
    (beat("compute", 5.0), 2, [70.0, 70.0], []),  # still computing: at most one more timeout and margin
    (None, 2, [70.0], ["rank-0"]),  # silent
    (beat("allreduce", 75.0), 2, [70.0], ["rank-0"]),  # in its collective past the group's timeout
    (beat("compute", 130.0), 2, [70.0], ["rank-0"]),  # in its own code past step_timeout_s
])
def test_a_survivor_whose_heartbeat_shows_it_still_in_its_collective_is_given_until_it_raises_there(
        rayless_controller, monkeypatch, answer, back, waits, killed):
    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=3),
                           failure=elastic.FailureConfig(collective_timeout_s=60, step_timeout_s=120))
    ranks_on(c, ["a", "a", "b"])
    c.group.evict = lambda m: None
    outcomes = {"leave-rank-1": None} if answer is None else {"leave-rank-1": None, "beat-rank-0": answer}
    fake = Ray(monkeypatch, outcomes, leave_back=back)
    assert c._settle_survivors({2}) == ({0} if killed else set())
    assert fake.waits == waits and fake.killed == killed
    if killed and len(waits) > 1:
        hang = [e.message for e in c.events if e.kind == "hang"]
        assert "within 70s (collective_timeout_s=60, + a margin of 10s; extended by 65s" in hang[0]


def test_a_late_part_of_a_fenced_generation_does_not_raise_the_progress_past_the_rollback(rayless_controller):
    # First-N rolled back to step 15 (every fast replica lost). A lost fast replica's node agent
    # then pushed its part of step 15, taken when the replica had finished step 19: the progress
    # went to 19, and the checkpoint lag read 4 steps too many until training passed 19 again.
    class Committer:
        def rewind(self, step, restored=False):
            pass

        def add(self, step, rank, world_size, entries, taken_at=None, rng=None):
            pass

    c = rayless_controller(scaling=elastic.ScalingConfig(num_workers=1, num_backups=1, aggregation="first_n"))
    c.committer, c.generation, c.step = Committer(), 3, 15
    c._rewind(15)
    c._add_part(15, 1, 2, {"generation": 3, "progress": 19, "entries": []})
    assert c._progress_step() == 15
    c._add_part(16, 0, 2, {"generation": 4, "progress": 17, "entries": []})  # the new generation's count
    assert c._progress_step() == 17


def test_a_restart_that_finds_no_checkpoint_forgets_an_earlier_resumes_restore(rayless_controller, monkeypatch):
    # The run resumed from step 5; a restart later found nothing committed and went back to
    # step 0, but restored_from stayed 5: steps up to 5 skipped their checkpoints, and result()
    # named a restore this timeline no longer comes from.
    c = rayless_controller(failure=elastic.FailureConfig(on_failure="restart"))
    c.step, c.restored_from = 9, 5
    _restart_with_stand_ins(c, monkeypatch, begun=10, restored_step=None)
    assert c.step == 0 and c.restored_from is None
