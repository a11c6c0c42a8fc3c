"""dcp_datastates: nearly free checkpoints for PyTorch Distributed Checkpoint (DCP).

A DCP storage backend with a lazy snapshot (copies overlap training; only the next optimizer
step may wait), typed state providers and a streaming flush, writing files stock DCP can read.
"""

from . import _moved
from .checkpointers.checkpointer import Checkpointer
from .checkpointers.memory import MemoryTier
from .checkpointers.tier import Tier
from .checkpointers.tiers import TieredCheckpointer
from .errors import (
    CheckpointLoadError,
    CheckpointNotCommittedError,
    CheckpointSaveError,
    ChecksumMismatchError,
    CooperativeLoadError,
    DataStatesError,
    InvalidStateDictError,
    SnapshotAbortedError,
    SnapshotMutationError,
    StorageWriteError,
    UnsafeCheckpointError,
    WriterClosedError,
    WriterUsageError,
)
from .load.reader import DataStatesReader
from .options import WriterOptions
from .providers import StateProvider, register_provider, unregister_provider
from .save.api import async_save
from .save.planner import DataStatesSavePlanner
from .save.writer import DataStatesWriter
from .stats import SaveStats

__version__ = "0.1.0"

_moved.install()


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """``dcp_datastates.writer`` and the other old module names, at their new places."""
    if name in _moved.MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointLoadError",
    "CheckpointNotCommittedError",
    "CheckpointSaveError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CooperativeLoadError",
    "DataStatesError",
    "DataStatesReader",
    "DataStatesSavePlanner",
    "DataStatesWriter",
    "InvalidStateDictError",
    "MemoryTier",
    "SaveStats",
    "SnapshotAbortedError",
    "SnapshotMutationError",
    "StateProvider",
    "StorageWriteError",
    "Tier",
    "TieredCheckpointer",
    "UnsafeCheckpointError",
    "WriterClosedError",
    "WriterOptions",
    "WriterUsageError",
    "async_save",
    "register_provider",
    "unregister_provider",
]
