"""Policies decide; the controller acts. Each is testable without Ray."""

from elastic.policies.decisions import (
    Continue,
    Decision,
    EvictStraggler,
    Fail,
    ReplaceWithSpares,
    RestartFromCheckpoint,
    Shrink,
    WaitForCapacity,
)
from elastic.policies.failure import FailurePolicy, FailureView
from elastic.policies.straggler import StragglerPolicy

__all__ = [
    "Continue", "Decision", "EvictStraggler", "Fail", "FailurePolicy", "FailureView", "ReplaceWithSpares",
    "RestartFromCheckpoint", "Shrink", "StragglerPolicy", "WaitForCapacity",
]
