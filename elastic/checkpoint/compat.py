"""Does a saved training state fit the model and optimizer this run built?

Why check before loading: a user who changes the model (or the optimizer) and keeps the run's
name and storage resumes the old run's checkpoint. torch's ``load_state_dict`` then fails deep
inside a worker with a traceback, after it has already copied the tensors that did match; an
optimizer of another class can even load without an error and train with the old class's
hyperparameters. Comparing first gives one error that names the checkpoint, every difference,
and the field to change, and leaves the worker's state untouched.

What is compared: the model's keys and shapes (dtype differences are allowed, as torch allows
them), and the optimizer's param groups: how many there are, how many parameters each holds,
the names of their hyperparameters (a different optimizer class has different names), and the
flags that select an algorithm within a class's names (``decoupled_weight_decay``: Adam and
AdamW have the same names, and loading restores the saved flag, so an AdamW resumed from an
Adam checkpoint trained as Adam); the keys of the per-parameter state against those this
optimizer's class keeps (Adamax's names are a subset of Adam's: its state is not); and the
shapes of the per-parameter state (moments, momentum) against the parameters it goes to by
position. The LR scheduler: one added or removed between runs starts or stops cleanly, but one
of another class (other state keys) failed in its ``load_state_dict`` after the model and
optimizer had loaded; so did one of another class or count inside a SequentialLR or a
ChainedScheduler, whose schedulers load by position.
"""

from __future__ import annotations

import functools
from typing import Any

from elastic.config import ConfigError


class UnsaveableState(ConfigError):
    """The training state holds something a checkpoint cannot store without pickle. Found when a
    rank's checkpoint writer is set up, the run ends before any step; found in a later step's
    snapshot (an optimizer that adds such a value to its state as it trains; ``step`` is then
    that step), the run ends at that step, its last committed checkpoint standing. Either way
    instead of training on with a checkpoint_failed event every step and no step committed."""

    def __init__(self, problem: str, step: int | None = None):
        self.problem, self.step = problem, step
        found = "" if step is None else f" (found in step {step}'s snapshot; the state at the run's start could be saved)"
        super().__init__(
            f"the training state cannot be checkpointed: {problem}{found}. Keep only tensors, numbers, strings, "
            "None and dicts, lists or tuples of them in the model's state_dict, the optimizer's param groups "
            "and state, and the LR scheduler's state; or run without RunConfig.storage.")

    def __reduce__(self):
        return type(self), (self.problem, self.step)


class CheckpointMismatch(ValueError):
    """A committed checkpoint does not fit the model or optimizer it would be loaded into."""

    def __init__(self, step: int, location: str, problems: list[str]):
        self.step, self.location, self.problems = step, location, list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"the committed checkpoint at step {step} in {location} does not fit this run's model or "
            f"optimizer:\n{lines}\nTo continue that run, build the model and optimizer it was trained with; "
            f"to start a new run instead, change RunConfig.name (or RunConfig.storage). Nothing was loaded "
            f"and nothing was deleted.")

    def __reduce__(self):
        # Rebuilt from its fields: it crosses from a worker to the controller pickled, and the
        # default (the message as the only argument) does not fit __init__.
        return type(self), (self.step, self.location, self.problems)


def saved_state_problem(saved: Any) -> str | None:
    """Why ``saved`` (a training state read from a checkpoint) does not have the shape the
    comparison below and torch's ``load_state_dict`` read, or None.

    Why ask: a checkpoint's checksums say its bytes are the ones written, not that this code
    wrote them. A ``param_groups`` that is a dict or an int, a group without ``params``, or
    keys that are not strings (sorted against strings: a TypeError) raised out of
    ``state_mismatches`` or the rank's ``set_state``; the store calls this while reading, so
    such a step is a corrupt one, skipped for an older step."""
    if not isinstance(saved, dict):
        return f"the state is a {type(saved).__name__}, not a dict"
    model, optimizer, scheduler = saved.get("model"), saved.get("optimizer"), saved.get("scheduler")
    if not _keyed_by_str(model):
        return "the state's model is not a dict with string keys"
    if not _keyed_by_str(optimizer) or not isinstance(optimizer.get("state"), dict):
        return "the state's optimizer is not a dict with string keys and its per-parameter state"
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list):
        return f"the state's optimizer param_groups is a {type(groups).__name__}, not a list"
    for i, group in enumerate(groups):
        if not _keyed_by_str(group) or not isinstance(group.get("params"), list):
            return f"the state's optimizer param group {i} is not a dict with string keys and a list of params"
    if scheduler is not None and not _keyed_by_str(scheduler):
        return "the state's scheduler is neither None nor a dict with string keys"
    names = saved.get(PARAM_NAMES_KEY)
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return f"the state's {PARAM_NAMES_KEY} is not a list of names"
    scaler = saved.get("scaler")
    if scaler is not None and not (isinstance(scaler, dict) and all(
            type(scaler.get(k)) in (int, float) for k in SCALER_KEYS)):
        return f"the state's fp16 loss scaler is not a dict of its numbers ({', '.join(SCALER_KEYS)})"
    return None


# The training state's key for param_names_of's list (TrainWorker.optimizer_param_names)
PARAM_NAMES_KEY = "optimizer_param_names"
# Set ("model") in a state whose optimizer state is in ``canonical_param_names``' order, as every
# checkpoint since that order is written: the same on every rank, so a restore may give it by
# name. Before it, each writer of a step used its own process's order, and only the skeleton's
# writer's names were kept: such a step, given by name, put another writer's moments on
# same-shaped parameters, so it is checked by position as before (``restore_checkpoint``).
PARAM_ORDER_KEY = "optimizer_param_order"
# What GradScaler.load_state_dict reads (``TrainWorker.scaler``, Trainer.mixed_precision="fp16")
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _keyed_by_str(d: Any) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) for k in d)


SHOWN_CHARS = 200  # of a value read from storage, in a problem message (``shown``)


def shown(value: Any) -> str:
    """``repr(value)`` cut to ``SHOWN_CHARS``: a value read from storage, in a message (a log
    line, an event, the CLI's listing, the user's terminal) that must not carry megabytes of
    it; repr escapes its control characters. A value whose repr fails (an int past Python's
    digit limit) is named by its type."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail for the value it shows
        return f"<a {type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _shape(t: Any) -> list[int] | None:
    shape = getattr(t, "shape", None)
    return list(shape) if shape is not None else None


_COMPILED = "_orig_mod."


def _model_mismatches(live: dict, saved: dict) -> list[str]:
    out = []
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    strip = lambda keys: sorted(str(k).replace(_COMPILED, "") for k in keys)
    if missing and unexpected and strip(missing) == strip(unexpected):
        # torch.compile's wrapper (OptimizedModule) prefixes every key of the model it holds
        return [f"model: the keys differ only by torch.compile's {_COMPILED!r} prefix: the model was compiled "
                "in one run and not in the other. Compile it in model_fn in both, or in neither"]
    if missing:
        out.append(f"model: {len(missing)} key(s) of the model are not in the checkpoint: {_names(missing)}")
    if unexpected:
        out.append(f"model: {len(unexpected)} key(s) in the checkpoint are not in the model: "
                   f"{_names([shown(k) for k in unexpected])}")
    for key in live:
        if key in saved and _shape(live[key]) != _shape(saved[key]):
            out.append(f"model: {key} is {_shape(saved[key])} in the checkpoint and {_shape(live[key])} in the model")
    return out


def _optimizer_mismatches(live: dict, saved: dict) -> list[str]:
    live_groups, saved_groups = live.get("param_groups", []), saved.get("param_groups", [])
    if len(live_groups) != len(saved_groups):
        return [f"optimizer: the checkpoint has {len(saved_groups)} param group(s), this optimizer "
                f"{len(live_groups)}"]
    out = []
    for i, (mine, theirs) in enumerate(zip(live_groups, saved_groups)):
        if len(mine["params"]) != len(theirs["params"]):
            out.append(f"optimizer: param group {i} holds {len(theirs['params'])} parameter(s) in the checkpoint "
                       f"and {len(mine['params'])} in this optimizer")
        # Only names the checkpoint has and this optimizer lacks: a newer torch adds
        # hyperparameters with defaults (its load_state_dict fills them in), so a checkpoint
        # from an older torch lacking one still fits.
        # Not the keys an LR scheduler or SWA adds to the groups (_NOT_CLASS_NAMES: initial_lr,
        # OneCycleLR's max_lr, min_lr and momentum bounds, CyclicLR's, SWALR's swa_lr): a run that
        # dropped its scheduler reads them in the checkpoint's groups, and the optimizer never
        # does (a OneCycleLR dropped was refused as "another optimizer class"). param_names: an
        # optimizer built from named parameters (ModelParameters.named) keeps them there, and
        # torch loads them into one built from plain parameters (the names are no hyperparameter).
        unknown = sorted(set(theirs) - set(mine) - _NOT_CLASS_NAMES)
        if unknown:
            out.append(f"optimizer: param group {i} of the checkpoint has hyperparameters this optimizer does not "
                       f"have: {shown(unknown)} (was it saved from another optimizer class?)")
        for flag in ALGORITHM_FLAGS:
            if flag in mine and flag in theirs and bool(mine[flag]) != bool(theirs[flag]):
                out.append(f"optimizer: param group {i} has {flag}={shown(theirs[flag])} in the checkpoint and "
                           f"{mine[flag]} in this optimizer; loading would set it back (was it saved from another "
                           f"optimizer class, Adam against AdamW?)")
    return out


# Per-parameter optimizer state that has the parameter's shape, in torch.optim's optimizers (Adam,
# AdamW, NAdam, RAdam, Adamax, SGD, RMSprop, Adadelta, Adagrad, ASGD, Rprop). Others (Adafactor's
# factored row and column statistics, a custom optimizer's) are not compared.
PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                      "sum", "exp_inf", "ax", "grad_avg", "prev")


def param_shapes_of(optimizer: Any) -> list[list[int]] | None:
    """The shapes of ``optimizer``'s parameters in its order, for ``state_mismatches``; None for
    an optimizer not of ``torch.optim``: others may keep state of the names above in other shapes
    (GaLore's moments are of the projected, low-rank gradient)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    return [list(p.shape) for group in optimizer.param_groups for p in group["params"]]


def param_names_of(model: Any, optimizer: Any) -> list[str]:
    """The model's name for each of ``optimizer``'s parameters, in the optimizer's order (its
    groups' ``params``), "" for one the model does not hold (a master copy of its own). Saved
    with each checkpoint (``optimizer_param_names``), for ``state_mismatches``."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names.get(id(p), "") for group in optimizer.param_groups for p in group["params"]]


def canonical_param_names(model: Any, optimizer: Any) -> list[str]:
    """The model's names of ``optimizer``'s parameters, each group's in the model's own order
    (``named_parameters``), the groups in the optimizer's: the same in every process running the
    same code, where a group built from a ``set`` of parameters lists them in each process's own
    order (by their ids). Checkpoints are written in this order (``live_state``): written in each
    rank's own, the ranks' shares of one step named another parameter's moments by the same
    position, and a step spread over several writers mixed them."""
    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    names = {id(p): name for name, p in model.named_parameters()}
    return [names.get(id(p), "") for group in optimizer.param_groups
            for p in sorted(group["params"], key=lambda p: index.get(id(p), len(index)))]


def state_by_name(saved: dict, saved_names: Any, live_names: list[str] | None, live_group_sizes: list[int]) -> dict:
    """An optimizer state dict whose per-parameter state goes to the parameters of
    ``live_names`` by name, where torch gives it by position. For a peer's state (a spare or a
    survivor catching up): the same code in another process may list a group's parameters in
    another order (groups built from a ``set`` of parameters, ordered by their ids), and loaded
    by position the moments of same-shaped layers were swapped (silent divergence), or of
    others failed the next step. Unchanged where the orders agree, where either side's names
    are not all known and distinct, or where a parameter would change group (its group's
    hyperparameters are another's: no reordering within groups makes that right)."""
    if not isinstance(saved_names, list) or not isinstance(live_names, list) or saved_names == live_names \
            or len(saved_names) != len(live_names) \
            or "" in live_names or len(set(live_names)) != len(live_names) or set(saved_names) != set(live_names):
        return saved
    ids = [pid for group in saved.get("param_groups", []) for pid in group["params"]]
    saved_groups = [g for g, group in enumerate(saved.get("param_groups", [])) for _ in group["params"]]
    live_groups = [g for g, size in enumerate(live_group_sizes) for _ in range(size)]
    if len(ids) != len(live_names) or len(live_groups) != len(live_names):
        return saved
    at = {name: i for i, name in enumerate(saved_names)}
    if any(saved_groups[at[name]] != live_groups[j] for j, name in enumerate(live_names)):
        return saved
    state = saved.get("state", {})
    # torch pairs the saved ids, in their groups' order, with the live parameters in theirs:
    # the live parameter at position j takes the state keyed by ids[j].
    moved = {ids[j]: state[ids[at[name]]] for j, name in enumerate(live_names) if ids[at[name]] in state}
    # Entries not keyed by a parameter (a custom optimizer's own counters), kept as torch keeps them.
    taken = set(ids)
    moved.update({key: value for key, value in state.items() if key not in taken})
    return {**saved, "state": moved}


def _param_order_mismatches(live: Any, saved: Any) -> list[str]:
    """The optimizer's parameters by name against the checkpoint's (``param_names_of``). Why:
    torch gives the saved state to parameters by position, so a model whose layers of the same
    shapes were declared in another order (its own state loads by name, and fits) had their
    moments swapped, silently; the shapes' check cannot see that. A checkpoint without the
    names (written before they were saved) or with another count (the groups' check names
    that) is not judged here."""
    if not isinstance(live, list) or not isinstance(saved, list) or len(live) != len(saved):
        return []
    moved = [(i, theirs, mine) for i, (mine, theirs) in enumerate(zip(live, saved))
             if mine and theirs and mine != theirs]
    if not moved:
        return []
    pairs = "; ".join(f"position {i} is {shown(theirs)} in the checkpoint and {mine} here"
                      for i, theirs, mine in moved[:3])
    more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
    return [f"optimizer: its state goes to parameters by position, and {len(moved)} position(s) hold another "
            f"parameter than in the checkpoint ({pairs}{more}): were the model's layers declared, or the "
            "optimizer's groups built, in another order?"]


def _optimizer_state_mismatches(saved: dict, param_shapes: list[list[int]]) -> list[str]:
    """The saved per-parameter state against the parameters it will be given to. Why: torch
    gives an optimizer's state to parameters by position, not by name, so a model whose
    submodules were declared in another order (the same names and shapes, which the model's
    check passes) had its moments loaded onto other parameters: with other shapes the first
    optimizer step failed inside the worker; with the same shapes they were silently swapped
    (that case ``_param_order_mismatches`` names, where the checkpoint has the names)."""
    ids = [pid for group in saved.get("param_groups", []) for pid in group["params"]]
    state = saved.get("state", {})
    out = []
    for position, (pid, shape) in enumerate(zip(ids, param_shapes)):
        if not isinstance(pid, (int, str)):
            continue  # not an id torch writes: left to the load
        entry = state.get(pid, state.get(str(pid)))
        if not isinstance(entry, dict):
            continue  # no state yet (a parameter that never had a gradient)
        for key in PARAM_SHAPED_STATE:
            theirs = _shape(entry.get(key))
            if theirs is not None and theirs != list(shape):
                out.append(f"optimizer: the state of parameter {position} ({key}) is {theirs} in the checkpoint, "
                           f"and that parameter is {list(shape)} in this model (the optimizer's state goes to "
                           "parameters by position: were the model's layers declared in another order?)")
                break
    return out


# Hyperparameters that choose the algorithm, not a value along it: the checkpoint's would replace
# this optimizer's when it loads (torch restores every hyperparameter), silently.
ALGORITHM_FLAGS = ("decoupled_weight_decay", "amsgrad", "nesterov", "centered")


# The per-parameter state of torch.optim's optimizers, by class: the keys every parameter's state
# has once it has any, and those only some settings add (amsgrad's max_exp_avg_sq, SGD's and
# RMSprop's momentum_buffer, RMSprop's centered grad_avg, Adafactor's row_var and col_var for a
# matrix, variance for a vector). Why: the hyperparameter names of Adamax are a subset of
# Adam's, AdamW's, NAdam's and RAdam's, and RAdam's of Adam's and NAdam's, so the names' check
# let an Adamax checkpoint into an Adam (KeyError 'exp_avg_sq' at the first step) or a RAdam one
# into a NAdam (KeyError 'mu_product' inside load_state_dict, after the model had loaded). LBFGS
# (state on its first parameter only, filled in as it iterates) is not listed: not compared.
OPTIMIZER_STATE_KEYS: dict[str, tuple[frozenset, frozenset]] = {
    name: (frozenset(required), frozenset(optional)) for name, required, optional in (
        ("Adam", ("step", "exp_avg", "exp_avg_sq"), ("max_exp_avg_sq",)),
        ("AdamW", ("step", "exp_avg", "exp_avg_sq"), ("max_exp_avg_sq",)),
        ("NAdam", ("step", "exp_avg", "exp_avg_sq", "mu_product"), ()),
        ("RAdam", ("step", "exp_avg", "exp_avg_sq"), ()),
        ("Adamax", ("step", "exp_avg", "exp_inf"), ()),
        ("SparseAdam", ("step", "exp_avg", "exp_avg_sq"), ()),
        ("SGD", (), ("momentum_buffer",)),
        ("RMSprop", ("step", "square_avg"), ("momentum_buffer", "grad_avg")),
        ("Adadelta", ("step", "square_avg", "acc_delta"), ()),
        ("Adagrad", ("step", "sum"), ()),
        ("ASGD", ("step", "eta", "mu", "ax"), ()),
        ("Rprop", ("step", "prev", "step_size"), ()),
        ("Adafactor", ("step",), ("row_var", "col_var", "variance")),
        ("Muon", ("momentum_buffer",), ()),
    )}
# Keys an LR scheduler or SWA adds to an optimizer's param groups (LRScheduler's initial_lr,
# OneCycleLR's and CyclicLR's, SWALR's), and a named-parameters optimizer's names: no class's own.
_NOT_CLASS_NAMES = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "base_momentum",
                              "max_momentum", "swa_lr"})


@functools.lru_cache(maxsize=1)
def _builtin_hyperparameter_names() -> dict[str, frozenset]:
    """The hyperparameter names of each optimizer in ``OPTIMIZER_STATE_KEYS``, as this process's
    torch gives them (they change between versions: built here, not listed): a class this torch
    lacks or cannot build on a plain matrix is left out, and so not recognised."""
    try:
        import torch
    except ImportError:
        return {}
    names = {}
    for name in OPTIMIZER_STATE_KEYS:
        cls = getattr(torch.optim, name, None)
        try:
            group = cls([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
        except Exception:  # noqa: BLE001 - one that needs other arguments is only not recognised
            continue
        names[name] = frozenset(group) - _NOT_CLASS_NAMES
    return names


def _classes_named_by(groups: Any) -> list[str]:
    """The classes of torch.optim whose hyperparameter names are exactly those of every group in
    ``groups`` (Adam and AdamW have the same: both); none where the groups have other names (a
    custom optimizer, one from another torch, a key the user added to a group)."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return []
    found = {frozenset(map(str, g)) - _NOT_CLASS_NAMES for g in groups}
    if len(found) != 1:
        return []
    (names,) = found
    return [cls for cls, theirs in _builtin_hyperparameter_names().items() if theirs == names]


def _states_of(optimizer: dict) -> list[frozenset]:
    """The distinct key sets of an optimizer state dict's per-parameter states. An empty one (a
    parameter whose ``optimizer.state[p]`` was only read) is left out: torch fills it in at the
    next step, whatever the class."""
    state = optimizer.get("state")
    if not isinstance(state, dict):
        return []
    return list({frozenset(map(str, entry)) for entry in state.values() if isinstance(entry, dict) and entry})


def _fits(keys: frozenset, cls: str) -> bool:
    required, optional = OPTIMIZER_STATE_KEYS[cls]
    return required <= keys <= required | optional


def _optimizer_class_mismatches(live: dict, saved: dict) -> list[str]:
    """The checkpoint's optimizer against this one's class, where the names' check above cannot
    tell them apart (``OPTIMIZER_STATE_KEYS``). This optimizer's class is known by its
    hyperparameter names (exactly a torch.optim class's in this torch; the caller knows it is of
    torch.optim); one not recognised is not compared. Two checks: the saved per-parameter state must have every key that class
    always keeps and no key it never keeps (a setting that only adds a key, amsgrad or momentum,
    fits either way); and a checkpoint whose param groups have exactly another class's names
    (saved by this torch's RAdam and resumed into an Adam: it loaded silently, and the Adam
    trained with RAdam's hyperparameters) is refused as that class's."""
    mine = _classes_named_by(live.get("param_groups"))
    if not mine or len({OPTIMIZER_STATE_KEYS[c] for c in mine}) != 1:
        return []
    if not all(_fits(keys, mine[0]) for keys in _states_of(live)):
        return []  # its own state is not that class's: a custom optimizer with the same names
    this = " or ".join(mine)
    saved_states = _states_of(saved)
    exactly = _classes_named_by(saved.get("param_groups"))
    # A checkpoint of an older torch has fewer names: then the classes of this torch that have
    # every name its groups have and whose state it has, to name in the message.
    groups = [g for g in saved.get("param_groups") or [] if isinstance(g, dict)]
    names = frozenset(str(k) for g in groups for k in g) - _NOT_CLASS_NAMES
    theirs = exactly or [c for c, known in _builtin_hyperparameter_names().items()
                         if names <= known and saved_states and all(_fits(k, c) for k in saved_states)]
    other = bool(theirs) and not set(theirs) & set(mine)
    required, optional = OPTIMIZER_STATE_KEYS[mine[0]]
    extra = sorted({k for keys in saved_states for k in keys - required - optional})
    lacking = sorted({k for keys in saved_states for k in required - keys})
    if extra or lacking:
        parts = ([f"keeps {_names([shown(k) for k in extra])}, which {this} does not keep"] if extra else []) + \
                ([f"lacks {_names(lacking)}, which {this} needs"] if lacking else [])
        source = f"it was saved from {' or '.join(theirs)}" if other else "was it saved from another optimizer class?"
        return [f"optimizer: the checkpoint's per-parameter state {', and '.join(parts)} ({source})"]
    if exactly and other:
        return [f"optimizer: the checkpoint's param groups have exactly {' or '.join(exactly)}'s hyperparameters "
                f"and this optimizer is {this}: loading would train it with the checkpoint's hyperparameters and "
                f"state (build the optimizer it was saved with)"]
    return []


# Keys a scheduler's state gained or lost between torch versions of one class (torch 2.x:
# ``verbose`` went, ``_is_initial``, ``default_min_lr`` and ``_anneal_func_type`` came). Their
# load_state_dict takes the state as it is (``__dict__.update``), so a checkpoint from another
# torch with or without them still fits.
SCHEDULER_VERSION_KEYS = frozenset({"verbose", "_is_initial", "default_min_lr", "_anneal_func_type", "anneal_func",
                                    "_get_lr_called_within_step", "_step_count", "_last_lr"})


def _scheduler_mismatches(live: Any, saved: Any, what: str = "the checkpoint's LR scheduler state") -> list[str]:
    if not isinstance(live, dict) or not isinstance(saved, dict):
        return []  # none on one side (added or removed: fine)
    theirs, mine = set(saved) - SCHEDULER_VERSION_KEYS, set(live) - SCHEDULER_VERSION_KEYS
    if theirs != mine:
        return [f"scheduler: {what} has {_names(sorted(map(shown, theirs - mine)))} "
                f"that this run's lacks and lacks {_names(sorted(mine - theirs))} (was it saved from "
                f"another scheduler class?)"]
    # SequentialLR and ChainedScheduler have the same keys whatever they chain: the chained
    # schedulers' states are in their _schedulers list, which torch loads by position (each a
    # __dict__.update). Not compared, a ConstantLR took a LinearLR's attributes silently, and a
    # checkpoint chaining more schedulers than this run raised IndexError after the model and
    # optimizer had loaded.
    inner_theirs, inner_mine = saved.get("_schedulers"), live.get("_schedulers")
    if not isinstance(inner_theirs, list) or not isinstance(inner_mine, list):
        return []
    chain = "SequentialLR" if "_milestones" in saved else "ChainedScheduler"
    if len(inner_theirs) != len(inner_mine):
        return [f"scheduler: {what} is a {chain} of {len(inner_theirs)} scheduler(s), and this run's of "
                f"{len(inner_mine)}: torch loads them by position (was a scheduler added to it or removed?)"]
    out = []
    for i, (mine_i, theirs_i) in enumerate(zip(inner_mine, inner_theirs)):
        out += _scheduler_mismatches(mine_i, theirs_i, f"the scheduler at position {i} in {what} ({chain})")
    return out


def _names(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def state_mismatches(live: dict, saved: dict, limit: int = 12,
                     param_shapes: list[list[int]] | None = None) -> list[str]:
    """Why ``saved`` cannot be loaded into ``live`` (both shaped like ``TrainWorker.get_state()``:
    ``{"model": state_dict, "optimizer": state_dict, ...}``); empty when it fits. At most
    ``limit`` lines, the last saying how many more there were. ``param_shapes``: the shapes of
    the optimizer's parameters, in its order (its groups' ``params``), to check the saved
    per-parameter state against, and given (``param_shapes_of``) only for an optimizer of
    torch.optim, whose class the saved state's keys are checked against. The parameters' names
    are checked where both states have them (``PARAM_NAMES_KEY``)."""
    problems = _model_mismatches(live["model"], saved.get("model", {}))
    optimizer_problems = _optimizer_mismatches(live["optimizer"], saved.get("optimizer", {}))
    if param_shapes is not None and not optimizer_problems:
        # Only where the names' check passed (a class it tells apart has its line), and only for
        # torch.optim's own classes: a subclass of Adam with Adam's names may keep more state.
        optimizer_problems = _optimizer_class_mismatches(live["optimizer"], saved.get("optimizer", {}))
    problems += optimizer_problems
    if not problems:
        problems += _param_order_mismatches(live.get(PARAM_NAMES_KEY), saved.get(PARAM_NAMES_KEY))
    if param_shapes is not None and not problems:
        problems += _optimizer_state_mismatches(saved.get("optimizer", {}), param_shapes)
    problems += _scheduler_mismatches(live.get("scheduler"), saved.get("scheduler"))
    if len(problems) > limit:
        problems = problems[:limit - 1] + [f"... and {len(problems) - limit + 1} more difference(s)"]
    return problems
