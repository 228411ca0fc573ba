"""Model, data and reference training shared by the tests (imported by workers too)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from elastic.checkpoint.testing import TEST_KEY, TEST_SECRET
from elastic.data import ShardPlan


def make_dataset(n: int = 256, dim: int = 16, classes: int = 4, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_dropout_model():
    """A model that draws random numbers in its forward (dropout): what a rank trains on then
    depends on its RNG at each step, not only on its batch."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))


def make_bn_model():
    """A model with buffers: BatchNorm's running statistics and batch counter."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


class _WithUnusedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.unused = torch.nn.Linear(16, 4)  # never in the forward: gets no gradient

    def forward(self, x):
        return self.body(x)


def make_model_with_unused_branch():
    """``make_model`` (as ``body``: built first, so with the same initial weights) plus a branch the
    forward never uses."""
    return _WithUnusedBranch()


class _MixedPrecision(torch.nn.Module):
    """A bf16 body and an fp32 head, as models that keep norms or heads in fp32 are."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 32).to(torch.bfloat16)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x.to(torch.bfloat16))).float())


def make_mixed_precision_model():
    return _MixedPrecision()


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def make_adamw(params):
    """Decoupled weight decay: steps a parameter whose gradient is zeros, never one without a gradient."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.5)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def initial_model(seed: int, model_fn=make_model):
    torch.manual_seed(seed)
    return model_fn()


def reference_weights(steps: int, global_batch: int, seed: int = 0, optimizer_fn=make_sgd,
                      batches: list[list[int]] | None = None, max_grad_norm: float | None = None,
                      model_fn=make_model, shards: int = 0, fp16: bool = False, loss=loss_fn,
                      device: str = "cpu") -> dict:
    """One process trains on the same global batches (concatenated shards) the ranks used.

    ``shards=k``: each batch's gradient is the mean of its k equal shards' gradients, averaged in
    the parameters' widest dtype and rounded once, as the ranks average theirs (for a model of
    several dtypes, where one backward over the whole batch would round differently).
    ``fp16``: torch's AMP recipe (the forward under fp16 autocast, a GradScaler), as
    ``Trainer(mixed_precision="fp16")`` trains. ``device``: where it trains ("cuda": the GPU
    tests' reference, on the same kernels as a GPU rank); the weights come back on the host."""
    model = initial_model(seed, model_fn).to(device)
    opt = optimizer_fn(model.parameters())
    kind = torch.device(device).type
    scaler = torch.amp.GradScaler(kind) if fp16 else None
    ds = make_dataset()
    if batches is None:
        plan = ShardPlan(len(ds), seed)
        batches = [sum(plan.take(1, global_batch)[1], []) for _ in range(steps)]
    def backward(x, y):
        if scaler is None:
            loss(model, (x, y)).backward()
            return
        with torch.autocast(kind, dtype=torch.float16):
            value = loss(model, (x, y))
        scaler.scale(value).backward()

    for idx in batches:
        x, y = (t.to(device) for t in ds[idx])
        opt.zero_grad()
        if shards:
            _mean_of_shard_gradients(model, x.chunk(shards), y.chunk(shards), backward)
        else:
            backward(x, y)
        if scaler is not None and max_grad_norm is not None:
            scaler.unscale_(opt)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _mean_of_shard_gradients(model, xs, ys, backward) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    wide = functools.reduce(torch.promote_types, (p.dtype for p in params))
    total = [torch.zeros_like(p, dtype=wide) for p in params]
    for x, y in zip(xs, ys):
        model.zero_grad(set_to_none=True)
        backward(x, y)
        for t, p in zip(total, params):
            t.add_(p.grad)
    for t, p in zip(total, params):
        p.grad = (t / len(xs)).to(p.dtype)


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k} differs by {(a[k] - b[k]).abs().max()}"


@contextlib.contextmanager
def spawned(target, arg_tuples):
    """One spawned process per ``args`` in ``arg_tuples``, each running ``target(*args, out)``;
    yields ``(processes, out)``. Any process still alive on the way out is killed. Why: a test
    that failed (a ``get`` that timed out, an assertion) left them running, and as non-daemon
    children pytest's exit waited for them, for up to gloo's 30 minutes with a rank stuck in a
    collective."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in arg_tuples]
    for p in procs:
        p.start()
    try:
        yield procs, out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)


def run_pair(target, *args) -> dict:
    """``target(rank, *args, out)`` in two spawned processes (a gloo pair of ranks 0 and 1); each
    puts one ``(key, value)`` into ``out``. Returns those as a dict, once both exited cleanly."""
    with spawned(target, [(rank, *args) for rank in (0, 1)]) as (procs, out):
        results = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    return results


def port_box():
    """What two spawned ranks share their rendezvous port through (``join_pair``)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Queue()


def join_pair(worker, rank: int, world_size: int, box, *args, **kwargs) -> None:
    """``worker.join`` for a group of spawned processes: rank 0 binds its rendezvous store on a
    port the kernel picks (``host_rendezvous``) and hands the port to the others through ``box``.
    Why not ``free_port()``: a port found free and let go can be taken before rank 0 binds it
    (EADDRINUSE in the suite, and the peer waited out its 120 s)."""
    if rank == 0:
        port = worker.host_rendezvous(60.0)
        for _ in range(world_size - 1):
            box.put(port)
    else:
        port = box.get(timeout=120)
    worker.join(rank, world_size, "127.0.0.1", port, *args, **kwargs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 the kernel just handed out (free when this returns)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The S3 credentials the tests of storage checked from every process put in the environment.
DRIVER_CREDENTIALS = {"AWS_ACCESS_KEY_ID": TEST_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}


@contextlib.contextmanager
def s3_with_credentials_in_this_process_only(monkeypatch):
    """A moto S3 endpoint and a fresh bucket whose credentials are in this process's AWS_*
    variables only, set now (a cluster started before never sees them), and not in the s3fs
    options it yields: ``(server, bucket, options)``. Skips on a machine with AWS credentials of
    its own, which the cluster's processes would find."""
    import botocore.session
    import pytest

    from elastic.checkpoint.testing import MotoS3

    if botocore.session.Session().get_credentials() is not None:
        pytest.skip("this machine has AWS credentials of its own, which the cluster's processes would find")
    s3 = MotoS3().start()
    try:
        bucket = s3.create_bucket()
        for name, value in DRIVER_CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        yield s3, bucket, {k: v for k, v in s3.storage_options().items() if k not in ("key", "secret")}
    finally:
        s3.stop()
