"""elastic: synchronous PyTorch training on Ray that keeps going when machines fail or slow down.

Names are imported lazily, so ``elastic.cli`` (and ``import elastic``) start without loading torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointConfig": "elastic.config",
    "ConfigError": "elastic.config",
    "FailureConfig": "elastic.config",
    "LeaseHeld": "elastic.checkpoint.lease",
    "RunConfig": "elastic.config",
    "ScalingConfig": "elastic.config",
    "ModelParameters": "elastic.actors.protocol",
    "ReplicaDivergence": "elastic.controller",
    "State": "elastic.controller",
    "TrainingFailed": "elastic.controller",
    "WorkerError": "elastic.controller",
    "Result": "elastic.trainer",
    "Trainer": "elastic.trainer",
    "TrainingStopped": "elastic.trainer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
