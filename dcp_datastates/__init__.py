"""dcp_datastates: nearly free checkpoints for PyTorch Distributed Checkpoint (DCP).

A DCP storage backend with a lazy snapshot (copies overlap training; only the next optimizer
step may wait), typed state providers and a streaming flush, writing files stock DCP can read.
"""

from .api import async_save
from .checkpointer import Checkpointer
from .errors import (
    CheckpointNotCommittedError,
    CheckpointSaveError,
    ChecksumMismatchError,
    DataStatesError,
    InvalidStateDictError,
    SnapshotAbortedError,
    SnapshotMutationError,
    StorageWriteError,
    UnsafeCheckpointError,
    WriterClosedError,
    WriterUsageError,
)
from .options import WriterOptions
from .planner import DataStatesSavePlanner
from .providers import StateProvider, register_provider, unregister_provider
from .reader import DataStatesReader
from .stats import SaveStats
from .writer import DataStatesWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointNotCommittedError",
    "CheckpointSaveError",
    "Checkpointer",
    "ChecksumMismatchError",
    "DataStatesError",
    "DataStatesReader",
    "DataStatesSavePlanner",
    "DataStatesWriter",
    "InvalidStateDictError",
    "SaveStats",
    "SnapshotAbortedError",
    "SnapshotMutationError",
    "StateProvider",
    "StorageWriteError",
    "UnsafeCheckpointError",
    "WriterClosedError",
    "WriterOptions",
    "WriterUsageError",
    "async_save",
    "register_provider",
    "unregister_provider",
]
