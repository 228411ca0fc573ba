"""Model, data and reference training shared by the tests (imported by workers too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from elastic.data import ShardPlan


def make_dataset(n: int = 256, dim: int = 16, classes: int = 4, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


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
                      model_fn=make_model) -> dict:
    """One process trains on the same global batches (concatenated shards) the ranks used."""
    model = initial_model(seed, model_fn)
    opt = optimizer_fn(model.parameters())
    ds = make_dataset()
    if batches is None:
        plan = ShardPlan(len(ds), seed)
        batches = [sum(plan.take(1, global_batch)[1], []) for _ in range(steps)]
    for idx in batches:
        x, y = ds[idx]
        opt.zero_grad()
        loss_fn(model, (x, y)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k} differs by {(a[k] - b[k]).abs().max()}"
