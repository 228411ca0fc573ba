"""Sharded, deduplicated, atomically committed checkpoints on any fsspec storage (file, memory, s3).

Workers write their share of the replicated state in the background (``WorkerCheckpointer``); the
controller commits a step with a manifest written last (``CheckpointCommitter``); ``CheckpointStore``
reads, verifies, lists and cleans up.
"""

from elastic.checkpoint.codec import capture_rng, restore_rng
from elastic.checkpoint.committer import CheckpointCommitter
from elastic.checkpoint.compat import CheckpointMismatch, state_mismatches
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
from elastic.checkpoint.worker_hook import WorkerCheckpointer

__all__ = [
    "AsyncPersister", "CheckpointCommitter", "CheckpointMismatch", "CheckpointStore", "CleanupReport", "CorruptCheckpoint", "FileEntry",
    "RetryPolicy", "Snapshot", "StepInfo", "Storage", "StorageError", "StorageUnavailable", "WorkerCheckpointer",
    "capture_rng", "resolve_url", "restore_rng", "state_mismatches",
]
