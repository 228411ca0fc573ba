"""Sharded, deduplicated, atomically committed checkpoints on any fsspec storage (file, memory, s3).

Ranks snapshot their share of the replicated state inside the step; each node's agent writes the
snapshots of its ranks in the background (``CheckpointAgent``, ``AgentCheckpointer`` on the rank),
or a rank writes its own (``WorkerCheckpointer``); the controller commits a step with a manifest
written last (``CheckpointCommitter``); ``CheckpointStore`` reads, verifies, lists and cleans up.
"""

from elastic.checkpoint.agent import CheckpointAgent, NodeAgents
from elastic.checkpoint.codec import capture_rng, restore_rng
from elastic.checkpoint.committer import CheckpointCommitter
from elastic.checkpoint.compat import CheckpointMismatch, UnsaveableState, state_mismatches
from elastic.checkpoint.persister import AsyncPersister
from elastic.checkpoint.storage import RetryPolicy, Storage, StorageError, StorageUnavailable, resolve_url
from elastic.checkpoint.store import (
    CheckpointStore,
    CleanupReport,
    CorruptCheckpoint,
    FileEntry,
    Snapshot,
    StepInfo,
)
from elastic.checkpoint.worker_hook import AgentCheckpointer, WorkerCheckpointer

__all__ = [
    "AgentCheckpointer", "AsyncPersister", "CheckpointAgent", "CheckpointCommitter", "CheckpointMismatch", "CheckpointStore", "CleanupReport", "CorruptCheckpoint", "FileEntry",
    "NodeAgents", "RetryPolicy", "Snapshot", "StepInfo", "Storage", "StorageError", "StorageUnavailable", "UnsaveableState", "WorkerCheckpointer",
    "capture_rng", "resolve_url", "restore_rng", "state_mismatches",
]
