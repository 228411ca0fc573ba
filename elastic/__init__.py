"""elastic: synchronous PyTorch training on Ray that keeps going when machines fail or slow down."""

from elastic.config import CheckpointConfig, ConfigError, FailureConfig, RunConfig, ScalingConfig
from elastic.controller import ReplicaDivergence, State, TrainingFailed, WorkerError
from elastic.trainer import Result, Trainer

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "FailureConfig",
    "ReplicaDivergence",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "State",
    "Trainer",
    "TrainingFailed",
    "WorkerError",
    "__version__",
]
