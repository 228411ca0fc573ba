"""Train a small MLP on scikit-learn's digits data set (ships with scikit-learn, no download).

Launch it either way:

    python examples/digits.py
    ray job submit --working-dir . -- python examples/digits.py

The first starts an embedded local Ray; the second runs on the cluster that ``ray start --head``
started (Ray Jobs sets RAY_ADDRESS for the script). It reaches >= 95% test accuracy.

A straggler, and first-N-of-M aggregation that keeps it from setting the pace (fault injection
is a demo and test aid, not for production):

    python examples/digits.py --first-n 1 --slow-rank 1 --slow-factor 3 --slow-from-step 10

A worker SIGKILLed in step 40: a hot spare takes its place and the run loses that one step
(``failures`` and ``recomputed_steps`` are printed). With ``--storage`` every step is checkpointed:
stopped (Ctrl-C) and started again with the same ``--name`` and ``--storage``, a run continues
from the newest commit:

    python examples/digits.py --kill-rank 1 --kill-at-step 40 --storage file:///tmp/ckpt
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import elastic
from elastic.config import env_number


def load_digits_split(train: bool):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_, y_ = (x_train, y_train) if train else (x_test, y_test)
    return torch.tensor(x_ / 16.0, dtype=torch.float32), torch.tensor(y_, dtype=torch.long)


def train_dataset():
    return TensorDataset(*load_digits_split(train=True))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def make_optimizer(params):
    return torch.optim.Adam(params, lr=3e-3)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_accuracy(model_state) -> float:
    model = make_model()
    model.load_state_dict(model_state)
    x, y = load_digits_split(train=False)
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def scaling(args) -> elastic.ScalingConfig:
    # --wait-for-nodes: a node an autoscaler starts can take longer than the default placement
    # wait (a cloud GPU node takes minutes): 15 minutes, unless ELASTIC_PLACEMENT_TIMEOUT_S says.
    placement = dict(wait_for_nodes=True, placement_timeout_s=env_number("ELASTIC_PLACEMENT_TIMEOUT_S", 900.0)) \
        if args.wait_for_nodes else {}
    if args.first_n:
        return elastic.ScalingConfig(num_workers=args.workers, num_backups=args.first_n, aggregation="first_n",
                                     num_spares=args.spares, use_gpu=args.gpu, **placement)
    return elastic.ScalingConfig(num_workers=args.workers, num_backups=args.spares, use_gpu=args.gpu, **placement)


def faults(args) -> list[dict]:
    """``Trainer(faults=...)`` from the --slow-* and --kill-* flags: none unless --slow-rank or
    --kill-rank is given."""
    out = []
    if args.slow_rank is not None:
        factor = 3.0 if args.slow_factor is None else args.slow_factor
        pace = {"delay_s": args.slow_delay} if args.slow_delay is not None else {"factor": factor}
        out.append({"kind": "slow", "rank": args.slow_rank, "from_step": args.slow_from_step, **pace})
    if args.kill_rank is not None:
        out.append({"kind": "kill", "rank": args.kill_rank, "at_step": args.kill_at_step})
    return out


def build_trainer(args) -> elastic.Trainer:
    return elastic.Trainer(
        model_fn=make_model,
        optimizer_fn=make_optimizer,
        dataset_fn=train_dataset,
        loss_fn=loss_fn,
        global_batch_size=args.batch,
        scaling=scaling(args),
        run=elastic.RunConfig(name=args.name, storage=args.storage, seed=0, progress=not args.no_progress),
        failure=elastic.FailureConfig(evict_stragglers=args.evict_stragglers),
        faults=faults(args),
        address=args.address,
        mixed_precision=args.mixed_precision,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--storage", default=None,
                   help="checkpoint URL, e.g. file:///tmp/ckpt (one directory every node sees) or s3://bucket/prefix "
                        "(s3fs takes the endpoint and credentials from AWS_* variables, on every node of the cluster)")
    p.add_argument("--name", default="digits")
    p.add_argument("--address", default=None, help="Ray address; default: RAY_ADDRESS or an embedded local Ray")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU per replica (NCCL): each worker, --first-n backup and spare needs one")
    p.add_argument("--wait-for-nodes", action="store_true",
                   help="the cluster autoscales: wait for the nodes the run needs (up to 15 minutes, or "
                        "ELASTIC_PLACEMENT_TIMEOUT_S) instead of refusing a run the live nodes cannot hold "
                        "(ScalingConfig.wait_for_nodes)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--first-n", type=int, default=0, metavar="B",
                   help="first-N-of-M: B backup replicas compute every step too, and each update is the mean of the "
                        "first --workers gradients to arrive (--spares are then hot spares beside them)")
    p.add_argument("--slow-rank", type=int, default=None, metavar="R",
                   help="fault injection (a demo and test aid): slow rank R down")
    p.add_argument("--slow-factor", type=float, default=None,
                   help="its steps take this many times their healthy time (default 3)")
    p.add_argument("--slow-delay", type=float, default=None, metavar="SECONDS",
                   help="instead of --slow-factor: each of its steps sleeps this long")
    p.add_argument("--slow-from-step", type=int, default=10)
    p.add_argument("--kill-rank", type=int, default=None, metavar="R",
                   help="fault injection (a demo and test aid): SIGKILL rank R in step --kill-at-step")
    p.add_argument("--kill-at-step", type=int, default=40)
    p.add_argument("--evict-stragglers", action="store_true",
                   help="put a hot spare in the place of a rank that stays slower than its peers")
    p.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                   help="the forward under autocast; fp16 scales the loss (a GradScaler)")
    return p


def flags_named(message: str, args: argparse.Namespace) -> str:
    """A ``ConfigError`` names the Trainer setting; the demo's user typed a flag. The flags behind
    the settings the message names go in front of it, in the order it names them."""
    backups = "--first-n" if args.first_n else "--spares"  # plain runs: --spares are hot spares (num_backups)
    flags = {"ScalingConfig.num_workers": "--workers", "Trainer.global_batch_size": "--batch",
             "ScalingConfig.num_backups": backups, "ScalingConfig.num_spares": "--spares",
             "ScalingConfig.use_gpu": "--gpu", "RunConfig.storage": "--storage", "RunConfig.name": "--name",
             "Trainer.address": "--address", "Trainer.fit's epochs": "--epochs",
             "Trainer.faults": "--slow-rank/--slow-factor/--slow-delay/--slow-from-step/--kill-rank/--kill-at-step",
             "FailureConfig.evict_stragglers": "--evict-stragglers",
             # The cluster check's refusals (elastic/actors/cluster_fit.py): first-N's replicas
             # by their own words, and the wait for an autoscaler's nodes.
             "num_backups (first-N replicas)": "--first-n", "ScalingConfig.wait_for_nodes": "--wait-for-nodes"}
    named = sorted((message.find(field), flag) for field, flag in flags.items() if field in message)
    shown = list(dict.fromkeys(flag for _, flag in named))
    return f"{', '.join(shown)}: {message}" if shown else message


def evicted_ranks(events: list[dict]) -> list[int]:
    """The ranks evicted as stragglers (not those whose eviction was held back after its decision)."""
    from elastic.controller import evictions_carried_out

    return [e["details"]["rank"] for e in evictions_carried_out(events)]


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv=None) -> float | None:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if args.slow_rank is None and (args.slow_delay is not None or args.slow_factor is not None):
        p.error("--slow-factor and --slow-delay slow the rank --slow-rank names; give it too")
    if args.slow_delay is not None and args.slow_factor is not None:
        p.error("give --slow-factor or --slow-delay, not both")
    try:
        trainer = build_trainer(args)
        result = trainer.fit(epochs=args.epochs)
    except elastic.ConfigError as exc:  # the message names the setting (most before any actor starts)
        message = flags_named(str(exc), args)
        if message == str(exc):  # no flag behind it (ranks that see different data): not a usage error
            p.exit(2, f"{p.prog}: error: {message}\n")
        p.error(message)
    except elastic.TrainingStopped as stopped:  # Ctrl-C or `ray job stop`: the run stopped cleanly
        print(stopped, flush=True)  # first: `ray job stop` sends SIGKILL a few seconds after SIGTERM
        if stopped.result.model_state is not None:  # None: stopped before any rank had started
            print(f"test_accuracy so far={test_accuracy(stopped.result.model_state):.4f}")
        raise SystemExit(130) from None
    # None when the run ended but its final weights could not be fetched (their holder's node
    # lost right after): fit() says so in a warning, and the checkpoint has them.
    acc = test_accuracy(result.model_state) if result.model_state is not None else None
    loss = result.metrics["loss"]  # None when a resumed run had nothing left to train
    print(f"steps={result.metrics['steps']} loss={'-' if loss is None else format(loss, '.4f')} "
          f"samples/s={result.metrics['samples_per_s']:.0f} "
          f"test_accuracy={'- (no final weights)' if acc is None else format(acc, '.4f')}")
    evicted = evicted_ranks(result.events)
    if args.first_n or evicted:
        print(f"dropped_samples={result.metrics['dropped_samples']} late_gradients={result.metrics['late_gradients']} "
              f"evicted_ranks={evicted}")
    if args.evict_stragglers and args.slow_rank is not None and args.slow_rank not in evicted:
        print(f"note: rank {args.slow_rank} was slowed but not evicted: the policy evicts a rank that stays "
              f"{elastic.FailureConfig().straggler_factor:g}x slower than its peers' median for a window of "
              "steps; a longer run, or --slow-delay, shows it", flush=True)
    if args.kill_rank is not None or result.metrics.get("failures") or result.metrics.get("restored_from") is not None:
        print(f"failures={result.metrics.get('failures')} recomputed_steps={result.metrics.get('recomputed_steps')} "
              f"restored_from={result.metrics.get('restored_from')}")
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    return acc


if __name__ == "__main__":
    main()
