"""Worker pieces: DDP's bucket layout as the worker builds it (in a real two-process gloo group),
first-N's helpers, and how a batch is fetched from the dataset."""

from __future__ import annotations

import os
import random
import threading
import time
import zlib

import pytest
import torch
import torch.distributed as dist

from elastic.actors.worker import ddp_bucket_kwargs
from helpers import join_pair, port_box, run_pair, spawned


def _buckets_reduced(rank: int, init_file: str, caps: list, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        counts = []
        for cap in caps:  # one process pair for every cap: spawning (and importing torch) is the slow part
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                        torch.nn.ReLU(), torch.nn.Linear(512, 10))
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True,
                                                            **ddp_bucket_kwargs("gloo", cap))
            for _ in range(3):  # DDP rebuilds its buckets after the first iteration
                ddp(torch.randn(4, 256)).sum().backward()
            counts.append(ddp._get_ddp_logging_data()["num_buckets_reduced"])
            del ddp
        if rank == 0:
            out.put(counts)
    finally:
        dist.destroy_process_group()


def buckets_reduced(tmp_path, caps: list) -> list[int]:
    with spawned(_buckets_reduced, [(r, str(tmp_path / "init"), caps) for r in range(2)]) as (procs, out):
        counts = out.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    return counts


@pytest.fixture(autouse=True)
def _memory_storage_stays_this_processs():
    """A TrainWorker built in this process (``local_worker``, outside a spawned one) marks it a
    process of a run (``memory.join_run``): memory:// then went to a cluster host in every later
    test of this pytest process (another module's memory:// checkpoints failed with the host)."""
    from elastic.checkpoint import memory

    was = memory._in_run
    yield
    memory._in_run = was


def local_worker(model_fn, optimizer_fn=None, dataset_fn=None, loss=None, **spec):
    """A real TrainWorker (no Ray) in this process, on one thread; the helpers' SGD, dataset and
    loss unless given."""
    from helpers import loss_fn, make_dataset, make_sgd

    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    return TrainWorker(TrainingSpec(model_fn, optimizer_fn or make_sgd, dataset_fn or make_dataset, loss or loss_fn,
                                    **spec))


def in_spawned_process(target, *args):
    """Run ``target(*args, out)`` in a fresh spawned process (its own torch.distributed state) and
    return what it put on ``out``."""
    with spawned(target, [args]) as ([proc], out):
        found = out.get(timeout=120)
        proc.join(timeout=60)
    assert proc.exitcode == 0
    return found


def _leave_after_losing_the_peer(rank: int, box, mark: str, out) -> None:
    """A real TrainWorker (no Ray) in a two-rank DDP group; rank 1 SIGKILLs itself in step 2,
    writing the time to ``mark`` first."""
    from helpers import loss_fn, make_dataset, make_model, make_sgd

    from elastic.actors.protocol import CollectiveError, TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(TrainingSpec(make_model, make_sgd, make_dataset, loss_fn))
    join_pair(worker, rank, 2, box, 1, 20.0)
    if rank == 1:
        worker.inject_kill(at_step=2, mark=mark)
    try:
        worker.train_steps(1, [[0, 1], [2, 3]], 1)
        out.put(("no failure", None))
    except CollectiveError:
        out.put((worker.teardown_leaks, dist.is_initialized()))


def test_a_collective_failure_frees_the_ddp_wrapper_before_its_group(tmp_path):
    # leave() must free the DDP wrapper while it still holds the group itself, so that the
    # reducer never drops the group's last reference with the GIL held (a deadlock with gloo's
    # worker threads, elastic/actors/worker.py: TrainWorker.leave). The failed step's frames
    # held the wrapper until Ray dropped the exception; now they are cleared first.
    box, mark, t0 = port_box(), str(tmp_path / "killed_at"), time.time()
    with spawned(_leave_after_losing_the_peer, [(r, box, mark) for r in range(2)]) as (procs, out):
        leaks, still_in_group = out.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
    assert procs[1].exitcode == -9  # rank 1 died in its step, as injected
    assert procs[0].exitcode == 0
    assert (leaks, still_in_group) == (0, False)
    assert t0 < float(open(mark).read()) < time.time()  # the kill's time, for the recovery benchmark


def _join_that_fails_after_the_group_formed(out) -> None:
    """A real TrainWorker (no Ray) whose join fails once the process group is up (DDP's
    constructor refuses, as a peer lost during its first broadcast would make it)."""
    from helpers import loss_fn, make_dataset, make_model, make_sgd

    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(TrainingSpec(make_model, make_sgd, make_dataset, loss_fn))

    def refuses(*args, **kwargs):
        raise RuntimeError("DDP refused (test)")
    torch.nn.parallel.DistributedDataParallel = refuses
    try:
        port = worker.host_rendezvous(60.0)  # bound by the store: no port found free, then taken
        worker.join(0, 1, "127.0.0.1", port, 1, 20.0)
        out.put("joined")
    except RuntimeError as exc:
        # While the exception lives (Ray keeps a failed call's a while): rank 0's store is closed,
        # not held by join's own frame in the traceback, so peers fail at once.
        import socket

        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            store_open = True
        except OSError:
            store_open = False
        out.put((str(exc), dist.is_initialized(), store_open))


class MaskedModel(torch.nn.Module):
    """A small net with a large persistent buffer (a 1024 x 1024 causal mask, 8 MB as float64)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.register_buffer("mask", torch.tril(torch.ones(1024, 1024)))

    def forward(self, x):
        return self.net(x)


class Fp32Moments(torch.optim.Optimizer):
    """An optimizer keeping fp32 state for low-precision parameters (as Kahan-summation ones do)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                m = state.setdefault("m", torch.zeros(p.shape, dtype=torch.float32))
                m.mul_(0.9).add_(torch.full(p.shape, 1 / 3))  # a third: not exact in bf16
                p.sub_((group["lr"] * m).to(p.dtype))


def bf16_model():
    return torch.nn.Linear(4, 4).bfloat16()


def test_a_peers_fp32_optimizer_state_keeps_its_dtype_on_low_precision_parameters():
    # torch's load_state_dict casts floating state to its parameter's dtype: a spare or survivor
    # took a peer's fp32 moments as bf16 (the others kept fp32), and the replicas diverged.
    sender, receiver = local_worker(bf16_model, Fp32Moments), local_worker(bf16_model, Fp32Moments)
    for _ in range(3):
        sender.optimizer.step()
    receiver.set_state(sender.get_state())
    for p_sent, p_got in zip(sender.optimizer.param_groups[0]["params"], receiver.optimizer.param_groups[0]["params"]):
        sent, got = sender.optimizer.state[p_sent]["m"], receiver.optimizer.state[p_got]["m"]
        assert got.dtype == torch.float32 and torch.equal(got, sent)
        got.add_(1)  # its own memory, writable
    assert not torch.equal(receiver.optimizer.state[p_got]["m"], sender.optimizer.state[p_sent]["m"])


def test_a_resume_into_another_precision_takes_the_moments_in_the_new_one():
    # Saved in fp32 and resumed with the model in bf16: the moments follow the parameters (torch's
    # cast), or Adam's next step met fp32 moments beside bf16 parameters and failed.
    from helpers import make_adam

    def bf16_linear():
        return torch.nn.Linear(4, 4).bfloat16()

    sender, receiver = local_worker(lambda: torch.nn.Linear(4, 4), make_adam), local_worker(bf16_linear, make_adam)
    sender.model(torch.randn(2, 4)).pow(2).sum().backward()
    sender.optimizer.step()
    receiver.set_state(sender.get_state())  # as a checkpoint holds it: the model and its moments in fp32
    for p in receiver.model.parameters():
        assert receiver.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
    receiver.model(torch.randn(2, 4).bfloat16()).float().pow(2).sum().backward()
    receiver.optimizer.step()  # fp32 moments beside bf16 parameters failed here


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.k(self.q(x))


def adam_over_parameters_in_reverse(params):
    """Another process's order of the same group (a group built from a set of parameters)."""
    return torch.optim.Adam(list(params)[::-1], lr=0.1)


def test_a_peers_optimizer_state_goes_to_its_parameters_by_name_whatever_their_order():
    # Given by position, the moments of same-shaped layers were swapped on the receiver.
    from helpers import make_adam

    sender, receiver = local_worker(TwoLayers, make_adam), local_worker(TwoLayers, adam_over_parameters_in_reverse)
    assert sender.optimizer_param_names == receiver.optimizer_param_names[::-1]
    sender.model(torch.randn(2, 4)).pow(2).sum().backward()
    sender.optimizer.step()
    receiver.set_state(sender.get_state())
    mine = dict(receiver.model.named_parameters())
    for name, p in sender.model.named_parameters():
        assert torch.equal(receiver.optimizer.state[mine[name]]["exp_avg"], sender.optimizer.state[p]["exp_avg"]), name


def test_a_checkpoint_of_groups_built_from_sets_resumes_and_its_writers_name_the_moments_alike(tmp_path):
    # A group built from a set lists its parameters in each process's own order. The resume's
    # check by position refused every such checkpoint (a ConfigError at every fit() again and at
    # every restore mid-run); and two ranks writing their shares of one step, each in its own
    # order, named another parameter's moments by the same position: the step mixed them.
    from helpers import make_adam

    from elastic.checkpoint import CheckpointMismatch, CheckpointStore
    from elastic.checkpoint.store import Snapshot
    from elastic.checkpoint.worker_hook import live_state
    from elastic.data import DataPosition

    first, second = local_worker(TwoLayers, make_adam), local_worker(TwoLayers, adam_over_parameters_in_reverse)
    first.model(torch.randn(2, 4)).pow(2).sum().backward()
    first.optimizer.step()
    first.completed_step = 1
    second.set_state(first.get_state())  # the same state, each in its own order
    store = CheckpointStore(f"file://{tmp_path}", "set-groups")
    entries = []
    for rank, worker in enumerate((first, second)):  # each writes its share of step 1
        entries += store.write_snapshot(Snapshot.of_state(live_state(worker), 1, rank, 2, {}))
    store.commit(1, entries, 2, {"data_position": DataPosition().to_dict()})
    for reader in (local_worker(TwoLayers, adam_over_parameters_in_reverse), local_worker(TwoLayers, make_adam)):
        reader.restore_checkpoint(f"file://{tmp_path}", {}, "set-groups", 1)
        mine = dict(reader.model.named_parameters())
        for name, p in first.model.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(reader.optimizer.state[mine[name]][moment], first.optimizer.state[p][moment]), name
    # A step written before that order (each writer in its own, unmarked) is not given by name,
    # which would put the second writer's moments on the other same-shaped layer: refused, as before.
    entries = []
    for rank, worker in enumerate((first, second)):
        entries += store.write_snapshot(Snapshot.of_state(live_state(worker, canonical=False), 2, rank, 2, {}))
    store.commit(2, entries, 2, {"data_position": DataPosition().to_dict()})
    with pytest.raises(CheckpointMismatch, match="hold another parameter than in the checkpoint"):
        local_worker(TwoLayers, adam_over_parameters_in_reverse).restore_checkpoint(
            f"file://{tmp_path}", {}, "set-groups", 2)


def test_optimizer_state_is_given_by_name_only_within_the_same_groups():
    from elastic.checkpoint.compat import state_by_name

    saved = {"state": {0: "a", 1: "b", 2: "c"}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}
    assert state_by_name(saved, ["x", "y", "z"], ["y", "x", "z"], [2, 1])["state"] == {0: "b", 1: "a", 2: "c"}
    assert state_by_name(saved, ["x", "y", "z"], ["z", "x", "y"], [2, 1]) is saved  # z would change group
    assert state_by_name(saved, None, ["x", "y", "z"], [2, 1]) is saved  # a state without names
    assert state_by_name(saved, ["x", "y", "z"], ["x", "", "z"], [2, 1]) is saved  # a parameter the model lacks
    # An entry keyed by no parameter (a custom optimizer's own counter) is kept, as torch keeps it.
    counted = {**saved, "state": {**saved["state"], "calls": 7}}
    assert state_by_name(counted, ["x", "y", "z"], ["y", "x", "z"], [2, 1])["state"] == {0: "b", 1: "a", 2: "c", "calls": 7}


def _leave_when_the_abort_raises(out) -> None:
    from helpers import make_model

    worker = local_worker(make_model)
    join_pair(worker, 0, 1, None, 1, 20.0)  # a group of one
    worker.backend = "nccl"  # its leave aborts the communicators first

    def refuses():
        raise RuntimeError("ProcessGroupNCCL abort failed (test)")

    dist.distributed_c10d._abort_process_group = refuses
    worker.leave()
    out.put(dist.is_initialized())


def test_a_leave_whose_nccl_abort_raises_still_destroys_the_group():
    # One try held both: the abort's error skipped the destroy, and every later join of the
    # rank failed ("initialize the default process group twice"), read as a collective failure.
    assert in_spawned_process(_leave_when_the_abort_raises) is False


def _first_n_send_budget(rank: int, box, out) -> None:
    """Two real TrainWorkers (no Ray) joining a first-N group (N = 1 of 2) of MaskedModel: what
    a leader keeps in flight to a late replica, a step's gradient and buffers together."""
    worker = local_worker(MaskedModel)
    join_pair(worker, rank, 2, box, 1, 20.0, use_ddp=False, subgroup_size=1)
    grads = worker._fn_grads.flat
    out.put((rank, (worker._fn_sends.limit, worker._fn_buffer_sends.limit,
                    grads.numel() * grads.element_size(), worker._buffers.flat.numel() * 8)))
    worker.leave()


def test_a_leaders_copies_in_flight_stay_within_the_send_budget_with_the_buffers():
    # The buffer copies took the gradient's limit (64 sends of a few bytes) while each was the
    # whole buffer vector: up to 64 copies of 8 MB here, twice the 256 MB the budget allows.
    from elastic.actors.sends import SEND_BUDGET_BYTES

    grad_limit, buffer_limit, grad_bytes, buffer_bytes = run_pair(_first_n_send_budget, port_box())[0]
    assert grad_limit == buffer_limit
    assert grad_limit * (grad_bytes + buffer_bytes) <= SEND_BUDGET_BYTES
    assert grad_limit == SEND_BUDGET_BYTES // (grad_bytes + buffer_bytes)


class PerProcessInitModel(torch.nn.Module):
    """A model_fn that is not deterministic under the run's seed: its weights and a buffer come
    from the process id (as an init by time, pid or an uninitialised torch.empty would)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(os.getpid())
        self.net = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.net.weight.copy_(torch.randn(2, 4, generator=g))
        self.register_buffer("running", torch.randn(3, generator=g))

    def forward(self, x):
        return self.net(x)


def _first_n_start_state(rank: int, box, out) -> None:
    """Two real TrainWorkers (no Ray) of PerProcessInitModel join a first-N group (N = 1 of 2):
    the parameters and buffers each holds after the join."""
    worker = local_worker(PerProcessInitModel)
    before = [t.tolist() for t in worker.model.state_dict().values()]
    join_pair(worker, rank, 2, box, 1, 20.0, use_ddp=False, subgroup_size=1)
    out.put((rank, (before, [t.tolist() for t in worker.model.state_dict().values()])))
    worker.leave()


def test_first_n_replicas_start_from_rank_0s_parameters_and_buffers():
    # DDP's constructor broadcasts rank 0's module state; first-N had nothing like it, so a model_fn
    # that is not deterministic under the seed gave each replica its own weights from step 0.
    states = run_pair(_first_n_start_state, port_box())
    (before0, after0), (before1, after1) = states[0], states[1]
    assert before0 != before1  # the two processes built different models
    assert after0 == after1 == before0


def _caches_after_a_join(rank: int, use_ddp: bool, box, torch_before_2_13: bool, out) -> None:
    """Two real TrainWorkers join (DDP, or first-N with N = 1 of 2), each holding a non-persistent
    cache of its own length (a survivor's grown one on rank 0, a fresh spare's on rank 1), a
    non-persistent table of the same layout on both but other values, and (rank 0 only) a cache
    registered by an earlier forward, which the fresh rank 1 does not have. ``torch_before_2_13``:
    DDP is built as on a torch without ``forward_sync_buffers`` (``broadcast_buffers=False``)."""
    if torch_before_2_13:
        import elastic.actors.worker as worker_module

        worker_module.ddp_no_forward_buffer_sync = lambda ddp_init: {"broadcast_buffers": False}
    worker = local_worker(PerProcessInitModel)
    worker.model.register_buffer("cache", torch.full((64 if rank == 0 else 16,), float(rank + 1)), persistent=False)
    worker.model.register_buffer("table", torch.full((8,), float(rank + 1)), persistent=False)
    if rank == 0:
        worker.model.register_buffer("mask", torch.ones(4), persistent=False)
    join_pair(worker, rank, 2, box, 1, 20.0, use_ddp=use_ddp, subgroup_size=0 if use_ddp else 1)
    out.put((rank, (worker.model.cache.tolist(), worker.model.table.tolist(),
                    [t.tolist() for t in worker.model.state_dict().values()])))
    worker.leave()


def _states_sent_at_a_join(rank: int, box, out) -> None:
    """Two real TrainWorkers join with DDP built as on a torch before 2.13; puts, for each
    parameter and buffer, how many times it was broadcast at the join (DDP's constructor and
    elastic's own), in the order of the calls."""
    import torch.distributed.utils as torch_dist_utils

    import elastic.actors.worker as worker_module

    worker_module.ddp_no_forward_buffer_sync = lambda ddp_init: {"broadcast_buffers": False}
    calls, real = [], torch_dist_utils._sync_params_and_buffers

    def counted(pg, states, *args):
        calls.append({t.data_ptr() for t in states})
        return real(pg, states, *args)

    torch_dist_utils._sync_params_and_buffers = counted
    worker = local_worker(PerProcessInitModel)
    join_pair(worker, rank, 2, box, 1, 20.0, use_ddp=True, subgroup_size=0)
    params = [p.data_ptr() for p in worker.model.parameters()]
    buffers = [b.data_ptr() for b in worker.model.buffers()]
    out.put((rank, ([sum(p in c for c in calls) for p in params], [sum(b in c for c in calls) for b in buffers],
                    [sorted(c) == sorted(params) for c in calls])))
    worker.leave()


def test_a_join_on_torch_before_2_13_sends_the_parameters_once_and_the_buffers_after_ddps_check():
    # On those versions DDP's constructor sends no buffer: elastic sends them. Sent with the
    # parameters, before the constructor, the parameters went twice at every join, and before
    # DDP's check that the ranks' parameters agree. Now: DDP's parameters, then the buffers alone.
    for rank, (params, buffers, params_only) in run_pair(_states_sent_at_a_join, port_box()).items():
        assert params == [1] * len(params) and buffers == [1] * len(buffers), rank
        assert params_only[0] and not params_only[-1], rank  # DDP's call first (its check, then its parameters)


@pytest.mark.parametrize("use_ddp, torch_before_2_13", [(True, False), (True, True), (False, False)],
                         ids=["ddp", "ddp_torch_before_2_13", "first_n"])
def test_a_join_leaves_only_the_non_persistent_buffers_of_other_layouts_alone(use_ddp, torch_before_2_13):
    # Rank 0's module state is broadcast at a join, buffers and all: caches of other lengths on
    # the two sides aborted the receiving process in gloo, or overwrote part of the survivors'.
    # A non-persistent buffer of one layout everywhere (random features drawn at build) is made
    # rank 0's, as DDP makes it; a first fix left every non-persistent buffer out. Before torch
    # 2.13 DDP's constructor broadcast no buffer at all (broadcast_buffers=False stops that too):
    # the table stayed each rank's own, and the persistent buffers until the first step's end.
    states = run_pair(_caches_after_a_join, use_ddp, port_box(), torch_before_2_13)
    (cache0, table0, state0), (cache1, table1, state1) = states[0], states[1]
    assert cache0 == [1.0] * 64 and cache1 == [2.0] * 16  # each its own
    assert table0 == table1 == [1.0] * 8  # rank 0's
    assert state0 == state1  # the model's state is rank 0's on both


def test_a_join_that_fails_after_the_group_formed_leaves_it():
    # The group stayed up after a failed join: its sockets and rank 0's store open, so peers
    # blocked on this rank waited out collective_timeout_s instead of failing at once.
    assert in_spawned_process(_join_that_fails_after_the_group_formed) == \
        ("DDP refused (test)", False, False)


def test_a_first_n_abandon_never_lands_on_a_group_being_left_or_joined():
    # Checked, then set after the main thread had left and joined the next generation (whose join
    # clears the flag): every step of the new group then failed as abandoned.
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    worker = SimpleNamespace(generation=3, rank=0, _group_lock=threading.Lock(), _fn_store=None,
                             _fn_abandoned=False, current_step=None, completed_step=0)
    worker._fn_store = SimpleNamespace()  # stands in for the group's store (never reached here)
    with worker._group_lock:  # the training thread is leaving or joining
        assert TrainWorker.abandon_first_n(worker, 3) is False
    assert worker._fn_abandoned is False
    assert TrainWorker.abandon_first_n(worker, 2) is False and worker._fn_abandoned is False  # an older group's


def test_a_first_n_abandon_of_the_current_group_sets_the_flag_and_marks_the_current_step():
    # The lock free and the generation the controller gave up: the flag is set, the lock given
    # back, and (in a thread of its own) the current step's agreement key is marked on a real
    # TCPStore, under the prefix a process group uses.
    from datetime import timedelta
    from types import SimpleNamespace

    from elastic.actors.worker import ABANDONED, TrainWorker, _fast_key

    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("default_pg/0/", master)
    worker = SimpleNamespace(generation=3, rank=1, _group_lock=threading.Lock(), _fn_store=store,
                             _fn_abandoned=False, current_step=None, completed_step=6)
    assert TrainWorker.abandon_first_n(worker, 3) is True
    assert worker._fn_abandoned is True
    assert worker._group_lock.acquire(blocking=False)  # released on the way out
    worker._group_lock.release()
    # No step under way: the next one (7) is the step a waiting rank would block in. get() waits
    # for the marking thread.
    assert store.get(_fast_key(7)) == ABANDONED
    # In a step: that step's key, and a fast set already published stays as it was.
    store.set(_fast_key(9), "3")
    worker.current_step = 9
    assert TrainWorker.abandon_first_n(worker, 3) is True
    worker.current_step = 10
    assert TrainWorker.abandon_first_n(worker, 3) is True
    for t in threading.enumerate():  # the marking threads have done their compare_set
        if t.name == "elastic-abandon-first-n":
            t.join(10)
    assert store.get(_fast_key(10)) == ABANDONED
    assert store.get(_fast_key(9)) == b"3"
    assert not store.check([_fast_key(8)])  # only the current step's key is marked


class SlowToRead(torch.utils.data.Dataset):
    """A dataset whose samples take 50 ms each to read (a slow disk, a crowded decoder)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import time

        time.sleep(0.05)
        return torch.ones(16), i % 4


def _local_time_of_a_step_with_slow_data(out) -> None:
    from helpers import loss_fn, make_model, make_sgd

    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(TrainingSpec(make_model, make_sgd, SlowToRead, loss_fn))
    out.put(worker._train_step(1, [0, 1, 2, 3]).extra["local_time_s"])


def test_a_ranks_local_time_counts_reading_its_batch():
    # The local time the straggler policy scores began after the batch was read, so a rank slow
    # at reading its data (4 samples x 50 ms here) looked as fast as its peers.
    assert in_spawned_process(_local_time_of_a_step_with_slow_data) >= 0.2


_WATCHED: dict = {}  # the spawned process's worker, for PhaseWatchingData and the optimizer's hook


class PhaseWatchingData(torch.utils.data.Dataset):
    """``make_dataset``'s samples, each read noting the worker's phase and since when."""

    def __init__(self):
        from helpers import make_dataset

        self.data = make_dataset()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        w = _WATCHED["worker"]
        _WATCHED["seen"].append(("fetch", w.phase, w.phase_since))
        return self.data[i]


def _phases_of_a_step(rank: int, use_ddp: bool, box, out) -> None:
    """A real TrainWorker (no Ray): DDP in a group of one, or first-N with N = 1 of 2; what phase
    it reports while it reads its batch and while its optimizer steps."""
    from helpers import loss_fn, make_model, make_sgd

    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(TrainingSpec(make_model, make_sgd, PhaseWatchingData, loss_fn))
    _WATCHED.update(worker=worker, seen=[])
    if use_ddp:
        join_pair(worker, 0, 1, None, 1, 20.0)
    else:
        join_pair(worker, rank, 2, box, 1, 20.0, use_ddp=False, subgroup_size=1)
    worker.optimizer.register_step_pre_hook(
        lambda *_: _WATCHED["seen"].append(("optimizer", worker.phase, worker.phase_since)))
    worker.phase, worker.phase_since = "failed", 0.0  # a survivor's, from before its rebuild
    t0 = time.time()
    worker.train_steps(1, [[4 * rank, 4 * rank + 1], [8 + 4 * rank, 9 + 4 * rank]], 1)
    out.put((rank, (t0, _WATCHED["seen"])))
    # Both done before either leaves: first-N's leader does not wait for its send to the late
    # rank, and leaving first reset the connection under the late rank's receive.
    dist.barrier()
    worker.leave()


@pytest.mark.parametrize("use_ddp", [True, False], ids=["ddp", "first_n"])
def test_a_rank_reads_its_batch_and_steps_its_optimizer_in_its_own_codes_phase(use_ddp):
    # The batch's fetch ran under the phase of the last call ("idle", a survivor's "failed", a
    # promoted spare's "idle" since it was built) and the update, the snapshot and the checksum
    # under the collective's: at a peer's death a rank reading a cold dataset read as in its own
    # code for hours and was killed at the collective timeout, and one stuck in its optimizer
    # read as waiting on peers, so a healthy rank that entered the next collective last was.
    from elastic.controller import _waits_on_peers

    if use_ddp:
        runs = {0: in_spawned_process(_phases_of_a_step, 0, True, None)[1]}
    else:
        runs = run_pair(_phases_of_a_step, False, port_box())
    for rank, (t0, seen) in runs.items():
        fetches = [(phase, since) for what, phase, since in seen if what == "fetch"]
        updates = [phase for what, phase, _ in seen if what == "optimizer"]
        # Both steps' samples, or (first-N) at least the first's: a late replica may sit out the next.
        assert len(fetches) in (2, 4) and len(updates) == 2, (rank, seen)
        assert all(phase == "compute" and since >= t0 for phase, since in fetches), (rank, seen)
        assert updates == ["update", "update"] and not _waits_on_peers("update"), (rank, seen)


def _accumulating_step_fn(model, batch):
    """Two micro-batches, the second's backward all-reducing again (no ``no_sync``), noting the
    worker's phase after each forward and each backward, and whether the phase was entered
    after that backward began."""
    x, y = batch
    w, seen = _WATCHED["worker"], _WATCHED["seen"]
    for part in (slice(0, 2), slice(2, 4)):
        loss = torch.nn.functional.cross_entropy(model(x[part]), y[part]) / 2
        seen.append(("forward", w.phase, True))
        began = time.time()
        loss.backward()
        seen.append(("backward", w.phase, w.phase_since >= began))
    return loss


def _phases_around_a_step_fns_backward(out) -> None:
    """A real TrainWorker (no Ray) with a step_fn, DDP in a gloo group of one; the phases its
    step_fn saw (``_accumulating_step_fn``) and the optimizer's."""
    from helpers import loss_fn, make_dataset, make_model, make_sgd

    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(TrainingSpec(make_model, make_sgd, make_dataset, loss_fn, step_fn=_accumulating_step_fn))
    _WATCHED.update(worker=worker, seen=[])
    join_pair(worker, 0, 1, None, 1, 20.0)
    worker.optimizer.register_step_pre_hook(lambda *_: _WATCHED["seen"].append(("optimizer", worker.phase, True)))
    worker.train_steps(1, [[0, 1, 2, 3], [4, 5, 6, 7]], 1)
    out.put(_WATCHED["seen"])
    worker.leave()


def test_a_step_fn_back_in_its_own_code_after_its_backward_is_in_the_compute_phase():
    # Under a step_fn the phase went to "backward+allreduce" at the step's first bucket and
    # stayed there until the update: a rank hung in its own code after its backward (a logging
    # call, the next micro-batch's forward) read as waiting on its peers, and the controller
    # (_blamed) killed a healthy rank first.
    seen = in_spawned_process(_phases_around_a_step_fns_backward)
    expected = [("forward", "compute", True), ("backward", "compute", True)] * 2 + [("optimizer", "update", True)]
    assert seen == expected * 2, seen


def test_a_step_fns_later_forward_takes_the_phase_back_to_its_own_code():
    # On NCCL the backward's end leaves the phase at the collective (the host cannot tell when
    # its all-reduces end): the next micro-batch's forward is the rank's own code again.
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    def rank(phase, step_clock):
        r = SimpleNamespace(phase=phase, phase_since=0.0, _step_clock=step_clock, _ddp_forwarded=False)
        r._enter = lambda phase: TrainWorker._enter(r, phase)
        return r

    after_backward = rank("backward+allreduce", (3, 0.0))
    TrainWorker._note_ddp_forward(after_backward)
    assert after_backward.phase == "compute" and after_backward.phase_since > 0 and after_backward._ddp_forwarded
    first = rank("compute", (3, 0.0))  # the step's first forward keeps the step's start (its fetch)
    TrainWorker._note_ddp_forward(first)
    assert (first.phase, first.phase_since) == ("compute", 0.0)
    outside = rank("idle", None)  # not in a step_fn
    TrainWorker._note_ddp_forward(outside)
    assert outside.phase == "idle"


def test_bucket_arguments_by_backend():
    assert ddp_bucket_kwargs("gloo", None) == {"bucket_cap_mb": 25}
    assert ddp_bucket_kwargs("nccl", None) == {}  # torch's default: a small first bucket to overlap
    assert ddp_bucket_kwargs("nccl", 50) == {"bucket_cap_mb": 50}


def test_gloo_model_under_the_cap_is_one_all_reduce(tmp_path):
    # 1.6 MB of gradients: one bucket, the first included; the user's cap still applies (a tensor
    # over it stands alone)
    assert buckets_reduced(tmp_path, [None, 0.5]) == [1, 2]


def test_rank_0_holds_its_rendezvous_port_from_the_moment_it_names_it():
    # The port used to be one rank 0 found free and let go; another socket could take it before
    # rank 0's store bound it, and the group failed to form with every rank alive. Now the port
    # named is the store's own, listening already: a peer reaches it, no other socket gets it.
    import socket
    from datetime import timedelta
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    rank0 = SimpleNamespace()
    port = TrainWorker.host_rendezvous(rank0, 10.0)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", port))
    peer = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    peer.set("k", "v")
    assert rank0._hosted_store.get("k") == b"v"
    hosted = rank0._hosted_store
    assert TrainWorker._rendezvous_store(hosted, 0, 2, "10.0.0.9", port, 10.0) is hosted  # join takes it
    assert TrainWorker._rendezvous_store(hosted, 1, 2, "127.0.0.1", port, 10.0).get("k") == b"v"


def test_abandoning_first_n_releases_a_waiting_rank_and_keeps_published_steps():
    # A real TCPStore under the prefix a process group uses; the waiter blocks like a rank that
    # arrived and waits for the N-th arrival.
    import threading
    from datetime import timedelta

    from elastic.actors.worker import ABANDONED, _mark_abandoned

    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("default_pg/0/", master)
    store.set("fn/4/fast", "3")  # step 4's fast set was published before the failure
    got = {}
    waiter = threading.Thread(target=lambda: got.update(value=store.clone().get("fn/3/fast")))
    waiter.start()
    for step in range(3, 6):
        _mark_abandoned(store, step, rank=0)
    waiter.join(5)
    assert got == {"value": ABANDONED}
    assert store.get("fn/4/fast") == b"3"
    assert store.get("fn/5/fast") == ABANDONED


def test_first_n_agreement_keys_are_forgotten_a_horizon_behind_so_the_store_stays_bounded():
    # A real TCPStore under the prefix a process group uses, driven as a long first-N run drives
    # it: each step's arrivals add to its count key, the N-th publishes the fast set, and one
    # late replica forgets the step a horizon behind.
    from datetime import timedelta

    from elastic.actors.sends import max_trail
    from elastic.actors.worker import _count_key, _fast_key, agreement_horizon, forget_agreement

    assert agreement_horizon(4) == 4096
    assert agreement_horizon(64) == 2 * max_trail(64)  # wide groups trail further
    horizon = agreement_horizon(3)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("default_pg/0/", master)
    before = master.num_keys()
    steps = horizon + 300
    for step in range(1, steps + 1):
        store.add(_count_key(step), 1 + (1 << 8))
        store.compare_set(_fast_key(step), "", "3")
        forget_agreement(store, step - horizon)
    # The newest horizon of steps keeps its keys (a replica that far behind may still read them).
    assert master.num_keys() - before == 2 * horizon
    assert store.check([_fast_key(steps - horizon + 1), _count_key(steps - horizon + 1)])
    assert not store.check([_fast_key(steps - horizon)]) and not store.check([_count_key(300)])
    forget_agreement(store, steps + 5)  # keys that never were: no error
    forget_agreement(store, -3)


def test_a_late_first_n_replica_sits_out_four_steps_then_twice_as_long_each_time_up_to_the_cap():
    from elastic.actors.sitout import SitOutSchedule

    def rests_after_late_gradients(cap: int, lates: int) -> list[int]:
        """Rank 2 of 3 late each time it may compute: the steps it rests after each."""
        s, step, rests = SitOutSchedule(3, cap), 1, []
        while len(rests) < lates:
            eligible = s.eligible(step)
            if 2 in eligible:
                s.record(step, (0, 1))
                rests.append(sum(1 for t in range(step + 1, step + 100) if 2 not in s.eligible(t)))
                step += rests[-1]
            step += 1
        return rests

    assert rests_after_late_gradients(8, 6) == [4, 8, 8, 8, 8, 8]
    assert rests_after_late_gradients(32, 5) == [4, 8, 16, 32, 32]
    assert rests_after_late_gradients(2, 1) == [2]  # the cap bounds the first sit-out too
    assert rests_after_late_gradients(0, 3) == [0, 0, 0]  # late_backoff_steps=0: never sits out
    s = SitOutSchedule(3, 8)
    s.record(1, (0, 1))
    assert s.streak == [0, 0, 1] and s.eligible(2) == (0, 1) and s.eligible(6) == (0, 1, 2)
    s.record(6, (1, 2))  # one gradient in time ends the backoff; rank 0 is late now
    assert s.streak == [1, 0, 0] and s.eligible(7) == (1, 2)


def test_every_rank_knows_the_steps_only_n_may_compute_from_the_fast_sets_alone():
    # Five replicas, N = 4: each rank records the same fast sets, so each holds the same
    # schedule. A step with exactly N eligible is agreed without the store (its fast set is the
    # eligible set); a rank that rests is in none of them.
    from elastic.actors.sitout import SitOutSchedule

    schedules = [SitOutSchedule(5, 8) for _ in range(5)]
    rng = random.Random(0)
    known_steps = 0
    for step in range(1, 200):
        eligible = schedules[0].eligible(step)
        assert all(s.eligible(step) == eligible for s in schedules)
        assert len(eligible) >= 4
        if len(eligible) == 4:
            fast = eligible
            known_steps += 1
        else:
            fast = tuple(sorted(rng.sample(eligible, 4)))  # who arrives first: anyone eligible
        for s in schedules:
            s.record(step, fast)
    assert known_steps > 100  # a late replica rests 4 steps at least: most steps need no agreement


def test_a_batch_is_fetched_the_way_dataloader_fetches_it():
    from torch.utils.data import Subset, TensorDataset, default_collate

    from elastic.actors.worker import fetch_samples

    class Batched(torch.utils.data.Dataset):
        """A dataset with torch's batched-fetch protocol, counting how it is asked."""

        def __init__(self):
            self.data = torch.arange(20.0).reshape(10, 2)
            self.calls = []

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            self.calls.append(("item", i))
            return self.data[i]

        def __getitems__(self, indices):
            self.calls.append(("items", list(indices)))
            return [self.data[i] for i in indices]

    ds = Batched()
    got = default_collate(fetch_samples(ds, [3, 1, 7]))
    assert ds.calls == [("items", [3, 1, 7])]  # one call for the batch, in the shard's order
    assert torch.equal(got, ds.data[[3, 1, 7]])
    ds.calls.clear()
    sub = Subset(ds, [9, 8, 7, 6])  # torch's Subset passes the batch on, remapped
    assert torch.equal(default_collate(fetch_samples(sub, [0, 2])), ds.data[[9, 7]])
    assert ds.calls == [("items", [9, 7])]
    plain = TensorDataset(torch.arange(5), torch.arange(5) * 10)  # no __getitems__: one item at a time
    x, y = default_collate(fetch_samples(plain, [4, 0]))
    assert x.tolist() == [4, 0] and y.tolist() == [40, 0]

    class Short(Batched):
        def __getitems__(self, indices):
            return [self.data[i] for i in indices[:-1]]

    with pytest.raises(ValueError, match="returned 1 samples for 2 indices"):
        fetch_samples(Short(), [0, 1])


def test_the_replica_checksum_covers_buffers_and_any_dtype():
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    w = SimpleNamespace(model=model)
    before = TrainWorker.param_checksum(w)
    model[1].running_mean[0] += 1e-3  # statistics only: no parameter moves
    assert TrainWorker.param_checksum(w) != before
    model.to(torch.bfloat16)  # numpy has no bfloat16: the bytes are read as bytes
    before = TrainWorker.param_checksum(w)
    assert isinstance(before, int) and TrainWorker.param_checksum(w) == before
    with torch.no_grad():
        model[0].weight[0, 0] = model[0].weight[0, 0].item() + 1.0  # exact in bfloat16
    assert TrainWorker.param_checksum(w) != before
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    before = TrainWorker.param_checksum(w)
    model.cache += 1  # a cache is not state
    assert TrainWorker.param_checksum(w) == before


def test_ddp_is_told_not_to_broadcast_buffers_each_forward_in_the_words_of_its_version():
    from elastic.actors.worker import ddp_no_forward_buffer_sync

    def new(self, module, forward_sync_buffers=None, broadcast_buffers=None): ...

    def old(self, module, broadcast_buffers=True): ...

    assert ddp_no_forward_buffer_sync(new) == {"forward_sync_buffers": False}  # torch >= 2.13
    assert ddp_no_forward_buffer_sync(old) == {"broadcast_buffers": False}


def test_a_metric_driven_scheduler_is_refused_when_the_worker_builds():
    from elastic.actors.protocol import TrainingSpec
    from elastic.actors.worker import TrainWorker
    from helpers import loss_fn, make_dataset, make_model, make_sgd

    spec = TrainingSpec(model_fn=make_model, optimizer_fn=make_sgd, dataset_fn=make_dataset, loss_fn=loss_fn,
                        scheduler_fn=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match="ReduceLROnPlateau, which steps on a metric"):
        TrainWorker._build(TrainWorker.__new__(TrainWorker), spec, "rank-0")
    spec.scheduler_fn = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    worker = TrainWorker.__new__(TrainWorker)
    TrainWorker._build(worker, spec, "rank-0")  # a step-based one is fine
    assert worker.scheduler is not None


def test_torch_distributed_errors_are_told_from_the_users_by_class():
    from elastic.actors.protocol import CollectiveError
    from elastic.actors.worker import _group_failures_as_collective

    def raised(exc):
        try:
            with _group_failures_as_collective("rank 1 could not join generation 2"):
                raise exc
        except Exception as out:
            return out

    assert isinstance(raised(dist.DistNetworkError("peer gone")), CollectiveError)
    assert isinstance(raised(dist.DistStoreError("store timeout")), CollectiveError)
    assert isinstance(raised(dist.DistBackendError("gloo")), CollectiveError)
    user = RuntimeError("Modules with uninitialized parameters")
    assert raised(user) is user


def test_a_first_n_step_abandoned_before_it_began_is_no_work_thrown_away():
    # It was marked begun before the abandon flag was checked: the controller counted it as a
    # step recomputed, one too many per recovery.
    from types import SimpleNamespace

    from elastic.actors.worker import FirstNAbandoned, TrainWorker

    rank = SimpleNamespace(_fn_abandoned=True, rank=1, generation=3, completed_step=7, started_step=7,
                           current_step=None)
    rank._check_abandoned = lambda step: TrainWorker._check_abandoned(rank, step)
    with pytest.raises(FirstNAbandoned, match="step 8 abandoned"):
        TrainWorker._first_n_step(rank, 8, [0, 1])
    assert TrainWorker.progress(rank) == (7, 7) and rank.current_step == 8  # marked for abandon_first_n


def test_a_step_blocked_on_a_store_that_closed_is_a_collective_failure():
    # A first-N rank blocked in the store's get when rank 0 left the group (its store closed with
    # it): torch's words named no marker, the step's failure read as the user's, and the run ended.
    from elastic.actors.worker import _looks_collective

    for words in ("failed to recv, got 0 bytes", "Failed to recv, got 0 bytes. Connection was likely closed."):
        assert _looks_collective(dist.DistNetworkError(words))
    assert _looks_collective(dist.DistStoreError("wait timeout after 5000ms"))
    assert not _looks_collective(RuntimeError("Modules with uninitialized parameters"))
    batch = dist.DistNetworkError("failed to recv")
    batch.elastic_data_error = True  # raised reading a batch: the user's dataset, never the group
    assert not _looks_collective(batch)


def _users_loss_fn(words):
    raise RuntimeError(words)


def test_the_users_own_error_with_a_collectives_words_is_the_users():
    # loss_fn raising "timed out" (a feature service) or "aborted" read as a broken group: it
    # formed again with every rank alive and replayed the error until max_failures.
    import os

    from elastic.actors.worker import _looks_collective

    for words in ("feature service request timed out", "training aborted: loss is NaN"):
        with pytest.raises(RuntimeError) as raised:
            _users_loss_fn(words)
        assert not _looks_collective(raised.value)
    # Raised in torch's frames (a gloo error out of the DDP reducer in backward): still a collective's.
    inside_torch = os.path.join(os.path.dirname(torch.__file__), "distributed", "fake_c10d.py")
    with pytest.raises(RuntimeError) as raised:
        exec(compile("raise RuntimeError('[../gloo/transport/tcp/pair.cc:534] Connection closed by peer')",
                     inside_torch, "exec"))
    assert _looks_collective(raised.value)
    assert _looks_collective(RuntimeError("Connection reset by peer"))  # never raised: the words decide

    def users_step_fn(wait):  # a step_fn's own collective: torch's C++ raises in the user's frame, at the call
        wait()

    def gloo_wait():
        raise RuntimeError("Connection closed by peer")

    c_call = type("Work", (), {"wait": staticmethod(lambda: os.stat("\0"))})  # a C function raising
    with pytest.raises(ValueError) as raised:
        users_step_fn(c_call.wait)
    assert raised.value.__traceback__ is not None
    frame = raised.value.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    assert frame.tb_frame.f_code.co_name == "<lambda>"  # the C call's caller, not a raise statement
    from elastic.actors.worker import _raised_outside_libraries

    assert not _raised_outside_libraries(raised.value)
    with pytest.raises(RuntimeError) as raised:
        users_step_fn(gloo_wait)
    assert _raised_outside_libraries(raised.value)  # a raise statement of the user's


# The DDP reducer's error for a parameter without a gradient, in torch 2.13's words (reducer.cpp):
# what it says with the constructor's find_unused_parameters off, then on, and what it adds with
# TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL) for a model whose ``peer_proj`` got none.
_UNFINISHED_REDUCTION = ("Expected to have finished reduction in the prior iteration before starting a new one. "
                         "This error indicates that your module has parameters that were not used in producing "
                         "loss. {}\nIf you already have done the above, then the distributed data parallel module "
                         "wasn't able to locate the output tensors in the return value of your module's `forward` "
                         "function.{}")
_WITH_UNUSED_OFF = ("You can enable unused parameter detection by passing the keyword argument "
                    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \nmaking "
                    "sure all `forward` function outputs participate in calculating loss. ")
_WITH_UNUSED_ON = ("Since `find_unused_parameters=True` is enabled, this likely  means that not all `forward` "
                   "outputs participate in computing loss. You can fix this by making sure all `forward` function "
                   "outputs participate in calculating loss. ")
_NAMED = ("\nParameters which did not receive grad for rank 1: peer_proj.bias, peer_proj.weight\n"
          "Parameter indices which did not receive grad for rank 1: 2 3")


def _failed_guarded_step(text, find_unused_parameters=False, aborted=None):
    """What ``TrainWorker._run_guarded`` raises for a DDP step whose error, with ``text``, came
    out of torch's frames (as the reducer's does), on a rank of a group of one."""
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    rank = SimpleNamespace(rank=1, world_size=1, generation=3, _aborted_generation=aborted, ddp=object(),
                           current_step=5, spec=SimpleNamespace(find_unused_parameters=find_unused_parameters),
                           phase="compute", leave=lambda: None)
    rank._enter = lambda phase: setattr(rank, "phase", phase)
    inside_torch = os.path.join(os.path.dirname(torch.__file__), "nn", "parallel", "distributed.py")
    with pytest.raises(Exception) as raised:
        TrainWorker._run_guarded(rank, lambda: exec(compile(f"raise RuntimeError({text!r})", inside_torch, "exec")))
    return raised.value


def test_ddps_unused_parameter_error_is_told_what_to_change_with_find_unused_parameters_set_or_not():
    # With ScalingConfig(find_unused_parameters=True) already set, the error still said to set it
    # (DDP's words then are that not every forward output took part in the loss).
    from elastic.actors.protocol import CollectiveError

    off = _failed_guarded_step(_UNFINISHED_REDUCTION.format(_WITH_UNUSED_OFF, ""), find_unused_parameters=False)
    assert type(off) is RuntimeError and "set ScalingConfig(find_unused_parameters=True)." in str(off)
    on = _failed_guarded_step(_UNFINISHED_REDUCTION.format(_WITH_UNUSED_ON, ""), find_unused_parameters=True)
    assert type(on) is RuntimeError and not isinstance(on, CollectiveError)
    assert "set ScalingConfig(find_unused_parameters=True)" not in str(on)
    assert "find_unused_parameters=True) is already set" in str(on)
    assert "Every output of the model's forward must take part in the loss" in str(on)


def test_ddps_error_naming_a_parameter_with_a_collectives_word_is_the_users():
    # With TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL the reducer's error names the parameters without a
    # gradient: "peer_proj.weight" holds "peer", the step's failure read as a broken group, and
    # the group was rebuilt and the step replayed into it until max_failures.
    from elastic.actors.protocol import CollectiveError
    from elastic.actors.worker import _looks_collective

    for unused, hint in ((False, _WITH_UNUSED_OFF), (True, _WITH_UNUSED_ON)):
        text = _UNFINISHED_REDUCTION.format(hint, _NAMED)
        assert not _looks_collective(RuntimeError(text))
        failure = _failed_guarded_step(text, find_unused_parameters=unused)
        assert type(failure) is RuntimeError and "peer_proj.weight" in str(failure)
        assert ("is already set" if unused else "set ScalingConfig(find_unused_parameters=True).") in str(failure)
    twice = ("Expected to mark a variable ready only once. This error is caused by one of the following reasons: "
             "...\nParameter at index 2 with name peer_proj.weight has been marked as ready twice.")
    assert not _looks_collective(RuntimeError(twice))
    # After an NCCL abort of the step's generation it is the abort's doing all the same.
    aborted = _failed_guarded_step(_UNFINISHED_REDUCTION.format(_WITH_UNUSED_OFF, _NAMED), aborted=3)
    assert isinstance(aborted, CollectiveError)


# The reducer's error for a gradient marked ready twice, in torch 2.13's words (reducer.cpp),
# named by TORCH_DISTRIBUTED_DEBUG=INFO; reason 3 is added only with find_unused_parameters on.
_MARKED_TWICE = ("Expected to mark a variable ready only once. This error is caused by one of the following "
                 "reasons: 1) Use of a module parameter outside the `forward` function. Please make sure model "
                 "parameters are not shared across multiple concurrent forward-backward passes. or try to use "
                 "_set_static_graph() as a workaround if this module graph does not change during training loop."
                 "2) Reused parameters in multiple reentrant backward passes. For example, if you use multiple "
                 "`checkpoint` functions to wrap the same part of your model, it would result in the same set of "
                 "parameters been used by different reentrant backward passes multiple times, and hence marking a "
                 "variable ready multiple times. DDP does not support such use cases in default. You can try to "
                 "use _set_static_graph() as a workaround if your module graph does not change over iterations."
                 "\nParameter at index 2 with name lora_A.weight has been marked as ready twice. This means that "
                 "multiple autograd engine  hooks have fired for this particular parameter during this iteration."
                 "{}")
_REASON_3 = ("\n3) Incorrect unused parameter detection. The return value of the `forward` function is inspected "
             "by the distributed data parallel wrapper to figure out if any of the module's parameters went "
             "unused. For unused parameters, DDP would not expect gradients from then. However, if an unused "
             "parameter becomes part of the autograd graph at a later point in time (e.g., in a reentrant "
             "backward when using `checkpoint`), the gradient will show up unexpectedly. If all parameters in "
             "the model participate in the backward pass, you can disable unused parameter detection by passing "
             "the keyword argument `find_unused_parameters=False` to `torch.nn.parallel.DistributedDataParallel`. "
             "If unused parameters in the model do not change over iterations, You can try to use "
             "_set_static_graph() as a workaround if this module graph does not change during training loop.")


def test_ddps_marked_twice_error_is_told_about_checkpointing_not_the_losss_outputs():
    # With find_unused_parameters=True the error names `find_unused_parameters=False` (its reason
    # 3), and read by that word it was told "already set: every output of the forward must take
    # part in the loss", the opposite of its causes (reentrant checkpointing, as in LoRA with
    # gradient checkpointing).
    from elastic.actors.protocol import CollectiveError

    on = _failed_guarded_step(_MARKED_TWICE.format(_REASON_3), find_unused_parameters=True)
    assert type(on) is RuntimeError and not isinstance(on, CollectiveError) and "lora_A.weight" in str(on)
    assert "must take part in the loss" not in str(on) and "is already set" not in str(on)
    assert "ScalingConfig(find_unused_parameters=False)" in str(on) and "use_reentrant=False" in str(on)
    # Off, the error does not name the setting; its fix (_set_static_graph()) is the wrapper's.
    off = _failed_guarded_step(_MARKED_TWICE.format(""), find_unused_parameters=False)
    assert type(off) is RuntimeError and "use_reentrant=False" in str(off)
    assert "ScalingConfig(find_unused_parameters=" not in str(off)


def test_a_failed_steps_buffer_restore_does_not_replace_its_collective_error():
    # A sticky CUDA error fails the copy back of the buffers too: raised, it replaced the step's
    # CollectiveError, and a group to heal read as the user's error.
    from types import SimpleNamespace

    from elastic.actors.worker import CollectiveError, TrainWorker

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def failed_step(step, indices):
        raise CollectiveError("gloo: connection closed by peer")

    rank = SimpleNamespace(ddp=object(), _fn_store=None, generation=3, world_size=2, rank=0, completed_step=4,
                           scaler=None, _buffers=SimpleNamespace(save=lambda: None, restore=broken))
    rank._run_guarded = lambda fn: fn()
    with pytest.raises(CollectiveError):
        TrainWorker._guarded_step(rank, failed_step, 5, [0], 3)


def test_a_batch_keeps_its_container_types_on_the_way_to_the_device():
    import collections
    from collections import UserDict, namedtuple

    from elastic.actors.worker import _to_device

    Pair = namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1)]), "enc": UserDict({"ids": torch.arange(3)}),
             "od": collections.OrderedDict(a=torch.ones(1)), "t": (torch.ones(1), 3)}
    out = _to_device(batch, torch.device("meta"))  # a device other than the CPU, without a GPU
    assert type(out["pair"]) is Pair and out["pair"].x.device.type == "meta"
    assert out["pair"].y[0].device.type == "meta"
    assert type(out["enc"]) is UserDict and out["enc"]["ids"].device.type == "meta"
    assert type(out["od"]) is collections.OrderedDict and out["od"]["a"].device.type == "meta"
    assert out["t"][0].device.type == "meta" and out["t"][1] == 3


class _WithExtraState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_extra_state(self):
        return {"scale": 0.5}  # not a tensor, as TransformerEngine's and some quantised layers'

    def set_extra_state(self, state):
        self.scale = state["scale"]


def test_a_model_with_non_tensor_extra_state_is_checksummed_and_handed_over():
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    model = _WithExtraState()
    w = SimpleNamespace(model=model)
    # The extra state is left out (it is no tensor); the parameters are still checked.
    expected = 0
    for t in (model.lin.weight, model.lin.bias):
        expected = zlib.crc32(t.detach().numpy().tobytes(), expected)
    assert TrainWorker.param_checksum(w) == expected
    state = TrainWorker.model_state(w)
    assert state["_extra_state"] == {"scale": 0.5} and state["lin.weight"].device.type == "cpu"
    _WithExtraState().load_state_dict(state)


class _Versioned(torch.nn.Module):
    """A module at version 2 that upgrades a state dict of an older version (none: the oldest)."""
    _version = 2

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version") is None or local_metadata["version"] < 2:
            state_dict[prefix + "lin.weight"] = state_dict[prefix + "lin.weight"] * 2  # the old format's scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_peers_model_state_keeps_the_modules_versions():
    # model_state() (a peer's catch-up, the Result's weights) was a plain dict: loaded with no
    # version, a module that upgrades old state dicts changed its current weights.
    import pickle
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    source = _Versioned()
    state = pickle.loads(pickle.dumps(TrainWorker.model_state(SimpleNamespace(model=source))))  # as Ray sends it
    assert state._metadata[""]["version"] == 2
    peer = _Versioned()
    peer.load_state_dict(state)
    assert torch.equal(peer.lin.weight, source.lin.weight)
    # A copy of the state dict's metadata, not the dict itself (a model whose state_dict() hands
    # out one it keeps would have it changed by whoever changes the copy).
    live = source.state_dict()
    source.state_dict = lambda: live
    copied = TrainWorker.model_state(SimpleNamespace(model=source))
    assert copied._metadata == live._metadata and copied._metadata is not live._metadata
    assert copied._metadata[""] is not live._metadata[""]


def test_set_state_leaves_adams_step_counters_where_torch_keeps_them():
    # torch's load_state_dict moves moments to each parameter's device but keeps plain Adam's
    # step on the CPU; moving the whole state first put it on the GPU (two syncs per parameter a step).
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None, "completed_step": 1}
    calls = []
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict = lambda sd: calls.append(sd)
    TrainWorker.set_state(SimpleNamespace(model=model, optimizer=fresh, scheduler=None, scaler=None,
                                          device=torch.device("meta"), _fast_log={}, _unreported=(-1, [])), state)
    assert all(s["step"].device.type == "cpu" for s in calls[0]["state"].values())


def test_abort_collectives_acts_only_on_an_nccl_group_of_the_generation_asked():
    from types import SimpleNamespace

    from elastic.actors.worker import NCCL_ERROR_ENV, TrainWorker

    def rank(backend="nccl", generation=1):
        return SimpleNamespace(backend=backend, generation=generation, rank=0, _group_lock=threading.Lock(),
                               _aborted_generation=None)

    assert NCCL_ERROR_ENV["TORCH_NCCL_BLOCKING_WAIT"] == "1"  # so an aborted collective raises in wait()
    assert TrainWorker.abort_collectives(rank("gloo"), 1) is False
    # NCCL, but no group formed (or an older generation asked): nothing to abort
    assert TrainWorker.abort_collectives(rank(), 1) is False
    assert TrainWorker.abort_collectives(rank(generation=2), 1) is False


def test_an_nccl_abort_is_flagged_and_never_lands_on_a_group_being_left_or_joined(monkeypatch):
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    aborted = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: aborted.append(True))
    worker = SimpleNamespace(backend="nccl", generation=3, rank=0, _group_lock=threading.Lock(),
                             _aborted_generation=None)
    with worker._group_lock:  # the training thread is leaving or joining
        assert TrainWorker.abort_collectives(worker, 3) is False
    assert aborted == [] and worker._aborted_generation is None
    assert TrainWorker.abort_collectives(worker, 3) is True
    assert aborted == [True] and worker._aborted_generation == 3


def test_a_step_of_an_aborted_nccl_generation_makes_no_update_and_fails_as_a_collective(monkeypatch):
    # DDP waits on its all-reduce's future, which on NCCL completes once the kernel is queued: an
    # abort freeing a hung kernel let the optimizer step on partly reduced gradients, and the
    # step was reported done. And after the abort any dist call raises a ValueError (the group
    # registry is gone), which read as the user's error and ended the run.
    from types import SimpleNamespace

    from elastic.actors.protocol import CollectiveError
    from elastic.actors.worker import TrainWorker

    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        query=lambda: synced.append(device) or True))
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    worker = SimpleNamespace(backend="nccl", generation=3, rank=0, device="cuda:0", _aborted_generation=3,
                             _collective_timeout_s=30.0, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), scheduler=None,
                             spec=SimpleNamespace(max_grad_norm=None), scaler=None, completed_step=4, current_step=5,
                             _kill_after_update=False, _kill_at=None, _enter=lambda phase: None)
    worker._check_not_aborted = lambda: TrainWorker._check_not_aborted(worker)
    with pytest.raises(CollectiveError, match="generation 3 were aborted"):
        TrainWorker._apply_update(worker, 5)
    assert synced == ["cuda:0"] and torch.equal(model.weight, before) and worker.completed_step == 4
    worker._aborted_generation = 2  # an older generation's abort: this one's step goes on
    TrainWorker._apply_update(worker, 5)
    assert worker.completed_step == 5 and not torch.equal(model.weight, before)

    worker.__dict__.update(world_size=2, ddp=None, _enter=lambda phase: None, leave=lambda: None,
                           _aborted_generation=3)

    def registry_gone():
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")

    with pytest.raises(CollectiveError, match="Default process group has not been initialized"):
        TrainWorker._run_guarded(worker, registry_gone)


def test_an_nccl_step_whose_collective_never_ends_fails_at_the_groups_timeout(monkeypatch):
    # The stream's synchronize() has no timeout: a kernel hung on a dead peer that no abort
    # reached held the rank there until it was killed as hung, its state lost with it.
    import time
    from types import SimpleNamespace

    from elastic.actors.protocol import CollectiveError
    from elastic.actors.worker import TrainWorker, wait_for_stream

    polls = []
    hung = SimpleNamespace(query=lambda: polls.append(time.monotonic()) and False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: hung)
    worker = SimpleNamespace(backend="nccl", generation=3, rank=1, device="cuda:0", _aborted_generation=None,
                             _collective_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank 1: the collectives of group generation 3 did not finish "
                                              r"within the group's timeout \(0.3 s\)"):
        TrainWorker._check_not_aborted(worker)
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert len(polls) >= 10  # polled (sleeps of at most 1 ms), not one sleep to the deadline

    done_after = iter([False] * 5 + [True])
    assert wait_for_stream(SimpleNamespace(query=lambda: next(done_after)), 5.0) is True
    assert wait_for_stream(SimpleNamespace(query=lambda: True), 0.0) is True


def test_a_gpu_ranks_local_time_is_the_devices_not_the_hosts_kernel_launches():
    # The host only queues a GPU's kernels: its time to the first contact was the data fetch and
    # the launches, the same on a throttled GPU as on a healthy one, so a slow GPU scored like the
    # others and was never evicted. On a GPU the span comes from CUDA events (stand-ins here).
    import time

    from elastic.actors.worker import LocalClock

    made = []

    class Event:  # torch.cuda.Event(enable_timing=True)'s surface
        def __init__(self):
            self.recorded, self.done = False, iter([False, False, True])
            made.append(self)

        def record(self):
            self.recorded = True

        def query(self):  # the device reaches it after two polls
            return next(self.done)

        def elapsed_time(self, end):  # milliseconds, as CUDA's
            assert self is made[0] and end is made[1] and self.recorded and end.recorded
            return 900.0

    clock = LocalClock(torch.device("cuda"), event=Event)
    t_step = time.perf_counter() - 0.05  # the batch fetched on the host: its 50 ms count too
    clock.begin(t_step)
    clock.contact()
    clock.contact()  # only the first contact counts
    assert len(made) == 2 and 0.95 <= clock.seconds() < 1.0
    # On CPU the host's clock, as before; a GPU clock asks for CUDA events only when used.
    cpu = LocalClock(torch.device("cpu"))
    cpu.begin(time.perf_counter() - 0.2)
    cpu.contact()
    assert 0.2 <= cpu.seconds() < 1.0 and cpu._event is None
    assert LocalClock(torch.device("cuda"))._event is not None


def test_a_gpu_clock_whose_contact_never_completes_falls_back_to_the_hosts_time():
    import time

    from elastic.actors.worker import LocalClock

    class Hung:
        def record(self):
            pass

        def query(self):
            return False

    clock = LocalClock(torch.device("cuda"), timeout_s=lambda: 0.05, event=Hung)
    clock.begin(time.perf_counter())
    clock.contact()
    t0 = time.perf_counter()
    assert clock.seconds() >= 0.05 and time.perf_counter() - t0 < 5.0


def test_a_rank_that_takes_an_older_state_forgets_the_fast_sets_of_the_history_given_up():
    # A restore or a rollback to step 5: the fast sets this rank logged for 6-8 are of the old
    # history, and the controller must not read them for the new one's steps 6-8.
    from types import SimpleNamespace

    from elastic.actors.worker import TrainWorker

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from elastic.actors.worker import StepResult

    finished = [StepResult(0, s, 0.5, 0.01, 0.01, 4, s, {}) for s in (7, 8)]  # a broken call's, kept
    rank = SimpleNamespace(model=model, optimizer=optimizer, scheduler=None, scaler=None, completed_step=8,
                           started_step=8, _fast_log={s: (0, 1) for s in range(1, 9)}, _unreported=(3, finished))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": None, "completed_step": 5}
    assert TrainWorker.set_state(rank, state) == 5
    assert TrainWorker.fast_sets(rank, 1, 8) == {s: [0, 1] for s in range(1, 6)}
    assert rank._unreported == (3, [])  # its finished steps' results went with that history too
    state["completed_step"] = 7  # forward (a rank behind catching up): what it knows stays
    assert TrainWorker.set_state(rank, state) == 7 and sorted(rank._fast_log) == [1, 2, 3, 4, 5]
    rank._unreported = (3, finished[:1])
    assert TrainWorker.set_state(rank, state) == 7 and rank._unreported == (3, finished[:1])


class _FrozenBackbone(torch.nn.Module):
    """A backbone model_fn froze (no gradients, eval mode: BatchNorm statistics fixed) and a head."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


def frozen_backbone_model():
    model = _FrozenBackbone()
    model.backbone.requires_grad_(False)
    model.backbone.eval()
    return model


def pretrained_style_model():
    from helpers import make_model

    return make_model().eval()  # as from_pretrained returns a model


def _train_modes_over_steps(kind: str, out) -> None:
    worker = local_worker(frozen_backbone_model if kind == "frozen" else pretrained_style_model)
    join_pair(worker, 0, 1, None, 1, 20.0)  # a group of one
    modes = lambda: sorted({name or "root": m.training for name, m in worker.model.named_modules()}.items())
    built = modes()
    worker.train_steps(1, [list(range(8))], 1)
    worker.train_steps(2, [list(range(8, 16))], 1)
    stats = None
    after = modes()
    if kind == "frozen":
        bn = worker.model.backbone[1]
        stats = (float(bn.running_mean.abs().sum()), float(bn.running_var.sum()), int(bn.num_batches_tracked))
    out.put((built, after, stats))
    worker.leave()


@pytest.mark.parametrize("kind", ["frozen", "pretrained"])
def test_modules_model_fn_left_in_eval_mode_stay_there_and_a_wholly_eval_model_trains(kind):
    # Every step called model.train(): a backbone model_fn froze in eval mode had its BatchNorm
    # normalise with batch statistics and update its running ones (dropout on too), silently.
    built, after, stats = in_spawned_process(_train_modes_over_steps, kind)
    assert after == built  # after two steps
    if kind == "frozen":
        assert dict(built) == {"root": True, "backbone": False, "backbone.0": False, "backbone.1": False,
                               "head": True}
        assert stats == (0.0, 32.0, 0)  # BatchNorm1d's initial statistics, untouched
    else:
        assert all(training for _, training in built)  # switched to train mode once, at build


def _user_code_checks(tmp, out) -> None:
    from helpers import make_model, make_sgd

    from elastic.checkpoint import UnsaveableState

    def refusal(model_fn=make_model, **kw) -> str | None:
        """Why a worker of these parts refuses to build, or None."""
        try:
            local_worker(model_fn, **kw)
        except ValueError as exc:
            return str(exc)
        return None

    def two_groups(params):  # reads its argument twice, as weight-decay splits do
        return torch.optim.SGD([{"params": [p for p in params if p.ndim >= 2]},
                                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=0.1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    def with_a_dtype(params):  # a param group holding a torch.dtype: no checkpoint can store it
        opt = make_sgd(params)
        opt.param_groups[0]["compute_dtype"] = torch.float32
        return opt

    def by_name(params):  # no weight decay on biases, by their names
        return torch.optim.AdamW([{"params": [p for n, p in params.named if not n.endswith("bias")]},
                                  {"params": [p for n, p in params.named if n.endswith("bias")], "weight_decay": 0.0}],
                                 lr=0.1)

    def names_of(worker) -> list[list[str]]:
        """Each param group's parameters, by the model's names for them."""
        name = {id(p): n for n, p in worker.model.named_parameters()}
        return [[name[id(p)] for p in g["params"]] for g in worker.optimizer.param_groups]

    named = local_worker(make_model, lambda params: torch.optim.SGD(params.named, lr=0.1))
    named.configure_checkpoint(f"file://{tmp}/named", {}, "run", 1, True)  # its names are saveable
    sparse_model = lambda: torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    found = {
        "groups": [len(g["params"]) for g in local_worker(make_model, two_groups).optimizer.param_groups],
        "by_name": names_of(local_worker(make_model, by_name)),
        "torch_named": named.optimizer.param_groups[0]["param_names"],
        "left_out": refusal(optimizer_fn=lambda p: torch.optim.SGD([x for x in p if x.ndim >= 2], lr=0.1)),
        "closure": refusal(optimizer_fn=lambda p: torch.optim.LBFGS(p)),
        "iterable": refusal(dataset_fn=Stream),
        "sparse_clip": refusal(sparse_model, max_grad_norm=1.0),
    }
    try:
        local_worker(make_model, with_a_dtype).configure_checkpoint(f"file://{tmp}/ckpt", {}, "run", 1, True)
    except UnsaveableState as exc:
        found["unsaveable"] = str(exc)

    frozen_sparse = lambda: torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True).requires_grad_(False),
                                                torch.nn.Linear(4, 2))
    local_worker(frozen_sparse, max_grad_norm=1.0)  # no gradient: no refusal
    # An optimizer holding none of the model's parameters (one stepping master copies of its own)
    local_worker(make_model, lambda p: torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))

    def one_step(loss) -> tuple[bool, str | None]:
        """A rank of a one-rank DDP group takes step 1 with ``loss``: (weights moved, error)."""
        worker = local_worker(make_model, loss=loss)
        join_pair(worker, 0, 1, None, 1, 20.0)  # a group of one
        before, error = worker.param_checksum(), None
        try:
            worker.train_steps(1, [list(range(8))], 1)
        except ValueError as exc:
            error = str(exc)
        moved = worker.param_checksum() != before
        worker.leave()
        return moved, error

    def through_forward(model, batch):  # DDP's forward called by name: its all-reduce is set up
        x, y = batch
        return torch.nn.functional.cross_entropy(model.forward(x), y)

    def bypassing_ddp(model, batch):  # the bare model's forward: no all-reduce is set up
        x, y = batch
        return torch.nn.functional.cross_entropy(model.module(x), y)

    found["forward_by_name"] = one_step(through_forward)
    found["stepped"], found["bypass"] = one_step(bypassing_ddp)

    class TimesOut(torch.utils.data.Dataset):  # a network-backed dataset whose read fails
        def __len__(self):
            return 64

        def __getitem__(self, i):
            raise RuntimeError("read timed out (test)")

    reader = local_worker(make_model, dataset_fn=TimesOut)
    join_pair(reader, 0, 1, None, 1, 20.0)
    try:
        reader.train_steps(1, [list(range(8))], 1)
    except Exception as exc:  # noqa: BLE001 - which one is the point
        found["data_error"] = type(exc).__name__, str(exc)
    reader.leave()
    out.put(found)


def test_user_code_that_would_train_wrongly_or_fail_in_the_first_step_is_refused_early(tmp_path):
    # optimizer_fn got model.parameters()'s generator: a second pass over it (the biases' group)
    # was empty and those parameters never trained. A trainable parameter in no group was never
    # stepped and its gradient piled up. A loss_fn calling model.module skipped DDP's forward:
    # each rank stepped on its own gradient, with nothing said until the replicas' checksums.
    found = in_spawned_process(_user_code_checks, str(tmp_path))
    assert found["groups"] == [2, 2]
    # optimizer_fn's list has the names beside it (params.named), for a rule by name
    assert found["by_name"] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    assert found["torch_named"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert found["left_out"].startswith("optimizer_fn left 2 trainable parameter(s) out of its param groups "
                                        "(0.bias, 2.bias)")
    assert found["bypass"].startswith("loss_fn never called the model it was given")
    # At build, not at the first step after the all-reduce: an optimizer that needs a closure, and
    # clipping sparse gradients (torch computes no norm for them)
    assert found["closure"].startswith("optimizer_fn returned a LBFGS, whose step() needs a closure")
    # A state no checkpoint can hold: at the writer's set-up, before any step (it was a
    # checkpoint_failed event every step, with no step ever committed and fit() succeeding)
    assert found["unsaveable"].startswith("the training state cannot be checkpointed: checkpoint state at "
                                          "optimizer/param_groups/0/compute_dtype has a dtype")
    assert found["iterable"].startswith("dataset_fn returned a Stream, which cannot be read by index")
    assert found["sparse_clip"].startswith("max_grad_norm clips the gradient's norm") and "0 has sparse=True" in \
        found["sparse_clip"]
    assert found["stepped"] is False  # refused before the optimizer step
    # The dataset's own error, though its words ("timed out") read like a broken group's: it was a
    # CollectiveError, replayed after a rebuild until max_failures ended the run
    assert found["data_error"] == ("RuntimeError", "read timed out (test)")
    assert found["forward_by_name"] == (True, None)  # model.forward(x) goes through DDP as model(x) does


def _mixed_precision_steps(out) -> None:
    from helpers import loss_fn, make_model, reference_weights

    from elastic.checkpoint.codec import flatten_state
    from elastic.checkpoint.worker_hook import live_state
    from elastic.data import ShardPlan

    found = {}
    plan = ShardPlan(256, 0)
    batches = [plan.take(1, 32)[1][0] for _ in range(3)]

    def trained(worker, shards, first=1):
        """``worker`` as rank 0 of a group of one, after steps ``first``... on ``shards`` (their
        results in ``worker.results``)."""
        join_pair(worker, 0, 1, None, 1, 20.0)
        try:
            worker.results = worker.train_steps(first, shards, 1)
        finally:
            worker.leave()
        return worker

    fp16 = trained(local_worker(make_model, mixed_precision="fp16"), batches)
    reference = reference_weights(3, 32, batches=batches, fp16=True)
    found["fp16_diff"] = max(float((fp16.model_state()[k] - v).abs().max()) for k, v in reference.items())
    found["fp16_state"] = fp16.get_state()["scaler"]
    flatten_state(live_state(fp16))  # saveable, as the checkpoint writer takes it

    # A step whose scaled gradient overflows: skipped, its scale halved, the scheduler not stepped
    halve = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    reported = lambda w: [r.extra.get("update_skipped") for r in w.results]  # the steps', to the controller

    def overflowed(optimizer_fn=None):
        """An fp16 worker (its LR halved each step) after step 1, then step 2 with the scale far
        past fp16's range, so its gradients overflow: (the worker, its weights unchanged by step 2)."""
        worker = trained(local_worker(make_model, optimizer_fn, mixed_precision="fp16", scheduler_fn=halve),
                         batches[:1])
        before = {k: v.clone() for k, v in worker.model_state().items()}
        worker.scaler.update(2.0 ** 100)
        trained(worker, batches[1:2], first=2)
        return worker, all(torch.equal(before[k], v) for k, v in worker.model_state().items())

    worker, found["skipped"] = overflowed()
    found["after_overflow"] = (worker.scaler.get_scale(), worker.scheduler.last_epoch, worker.optimizer.param_groups[0]["lr"])
    found["reported"], found["fp16_reported"] = reported(worker), reported(fp16)
    # A fused optimizer is always called, with the overflow flag, and skips inside its kernel:
    # its step hook fires on a skipped step too, so the skip is read from the scale
    fused, unchanged = overflowed(lambda p: torch.optim.AdamW(p, lr=0.1, fused=True))
    found["fused"] = (unchanged, reported(fused), fused.scheduler.last_epoch)
    fresh = local_worker(make_model, mixed_precision="fp16")
    fresh.set_state(worker.get_state())  # a peer's, or a checkpoint's, state: the scale comes along
    found["restored_scale"] = fresh.scaler.get_scale()
    fresh.set_state(local_worker(make_model).get_state())  # a run without fp16 had no scaler: a fresh one
    found["no_scaler_state"] = fresh.scaler.get_scale()

    # A step that fails as a collective after the scaler unscaled its gradient (here inside the
    # clipping) and is trained again: GradScaler remembered the unscale, so the replay raised
    # "unscale_() has already been called" (or, without clipping, stepped on the scaled gradient)
    from elastic.actors.protocol import CollectiveError

    real_clip = torch.nn.utils.clip_grad_norm_

    def fails_once(*args, **kwargs):
        torch.nn.utils.clip_grad_norm_ = real_clip
        raise dist.DistBackendError("gloo: connection closed by peer (test)")  # as torch raises it

    replayed = local_worker(make_model, mixed_precision="fp16", max_grad_norm=0.5)
    torch.nn.utils.clip_grad_norm_ = fails_once
    try:
        trained(replayed, batches[:1])
    except CollectiveError:
        found["failed_once"] = True
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    trained(replayed, batches[:1])
    clean = trained(local_worker(make_model, mixed_precision="fp16", max_grad_norm=0.5), batches[:1])
    found["replayed_diff"] = max(float((clean.model_state()[k] - v).abs().max())
                                 for k, v in replayed.model_state().items())

    # An update applied by a replica that never ran a backward (first-N: one sitting out its
    # first steps, a spare just promoted): GradScaler.step refuses a scaler whose scale() never ran
    idle = local_worker(make_model, mixed_precision="fp16")
    before = {k: v.clone() for k, v in idle.model_state().items()}
    for p in idle.model.parameters():
        p.grad = torch.full_like(p, 65536.0)  # a gradient of ones, scaled
    idle._apply_update(1)
    found["idle_step"] = max(float((before[k] - v - 0.1).abs().max()) for k, v in idle.model_state().items())

    seen = []

    def noting_loss(model, batch):
        seen.append(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None)
        return loss_fn(model, batch)

    bf16 = trained(local_worker(make_model, loss=noting_loss, mixed_precision="bf16"), batches[:1])
    found["bf16"] = (seen, bf16.scaler, "scaler" in bf16.get_state())
    out.put(found)


def test_mixed_precision_autocasts_the_forward_and_fp16_scales_the_loss_as_torchs_amp_recipe():
    # fp16 had no path: a step_fn could not reach the optimizer, so GradScaler's unscale, step and
    # update could not be done. Now Trainer.mixed_precision does them, and the scaler is state.
    found = in_spawned_process(_mixed_precision_steps)
    assert found["fp16_diff"] <= 1e-6  # torch's AMP recipe in one process, on the same batches
    assert found["fp16_state"]["scale"] == 65536.0 and found["fp16_state"]["_growth_tracker"] == 3
    assert found["skipped"] is True and found["reported"] == [True] and found["fp16_reported"] == [None] * 3
    assert found["after_overflow"] == (2.0 ** 99, 1, 0.05)  # halved once; the LR of step 1's scheduler step only
    assert found["fused"] == (True, [True], 1)
    assert found["restored_scale"] == 2.0 ** 99 and found["no_scaler_state"] == 65536.0
    assert found["idle_step"] <= 1e-6  # SGD's lr 0.1 times the unscaled gradient of ones
    assert found["failed_once"] and found["replayed_diff"] == 0.0
    assert found["bf16"] == (["torch.bfloat16"], None, False)


def test_step_seeds_repeat_across_no_ranks_steps_or_run_seeds():
    # The linear mix gave rank r at step s the seed of rank r+1 at step s-10,007 (past 10,007
    # steps, ranks repeated each other's dropout draws), and seed k at step s+1,000,003 that of
    # seed k+1 at step s.
    from elastic.actors.protocol import step_seed

    seeds = {step_seed(0, r, s) for r in range(8) for s in range(1, 20_001)}
    assert len(seeds) == 8 * 20_000
    assert step_seed(0, 0, 10_008) != step_seed(0, 1, 1) and step_seed(1, 0, 1) != step_seed(0, 0, 1_000_004)
    assert step_seed(0, 3, 7) == step_seed(0, 3, 7) and 0 <= step_seed(2**70, 3, 7) < 2**64


def test_a_calls_finished_steps_are_kept_for_its_generations_recovery_only():
    # A window's call that fails at its third step keeps the first two results for the recovery
    # of that group; a queued call of the broken generation that fails at once leaves them be; a
    # reader naming another generation (a survivor a shrink stood by, read after a rollback
    # replayed those step numbers) gets none.
    from types import SimpleNamespace

    from elastic.actors.worker import StepResult, TrainWorker

    def step(s, indices, generation):
        if s == 3:
            raise RuntimeError("the group broke (test)")
        return StepResult(0, s, 0.5, 0.01, 0.01, len(indices), s, {})

    worker = SimpleNamespace(_unreported=(-1, []), _fn_store=None, _bind_device=lambda: None,
                             _first_n_step=None, _train_step=None, _guarded_step=lambda run, s, i, g: step(s, i, g))
    with pytest.raises(RuntimeError):
        TrainWorker.train_steps(worker, 1, [[1], [2], [3], [4]], 7)
    with pytest.raises(RuntimeError):
        TrainWorker.train_steps(worker, 3, [[3]], 7)  # the queued call behind it
    assert [r.step for r in TrainWorker.unreported_results(worker, 2, 9, 7)] == [2]
    assert TrainWorker.unreported_results(worker, 1, 9, 7) == []  # read once
    with pytest.raises(RuntimeError):
        TrainWorker.train_steps(worker, 1, [[1], [2], [3]], 7)
    assert TrainWorker.unreported_results(worker, 1, 9, 8) == []  # another generation's recovery
