"""Exception types. Each message says what failed, where (rank, item, path) and what to do."""

from __future__ import annotations


class DataStatesError(Exception):
    """Base class of every error raised by dcp_datastates."""


class InvalidStateDictError(DataStatesError, ValueError):
    """The state dict cannot be checkpointed; raised at the call site, before any write."""


class SnapshotMutationError(DataStatesError):
    """A tensor changed in place before its snapshot was taken: the checkpoint would be torn."""

    def __init__(self, *, fqn: str, rank: int, before: int, after: int) -> None:
        super().__init__(
            f"rank {rank}: tensor {fqn!r} was modified in place while its snapshot was in flight "
            f"(version {before} -> {after}); the checkpoint was not committed. Keep "
            "guard_optimizer_step=True, or wait for staging_completion before changing the state."
        )
        self.fqn = fqn
        self.rank = rank


class StorageWriteError(DataStatesError, OSError):
    """Writing a checkpoint file failed."""


class SnapshotAbortedError(DataStatesError):
    """A snapshot was abandoned before it finished (its save failed or was never run)."""


class WriterUsageError(DataStatesError, ValueError):
    """The writer was used in a way that cannot produce a correct checkpoint; raised at the call,
    with what to do instead."""


class WriterClosedError(DataStatesError, ValueError):
    """A closed :class:`~dcp_datastates.DataStatesWriter` was asked to stage or save."""


class CheckpointSaveError(DataStatesError):
    """A save failed; raised by :func:`dcp_datastates.async_save`'s ``upload_completion``.

    DCP reports failures as ``CheckpointException``, a ``BaseException`` that ``except Exception``
    misses; this error carries it as ``__cause__`` and the per-rank failures as ``failures``.
    """

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class CheckpointNotCommittedError(DataStatesError, FileNotFoundError):
    """A checkpoint directory has no ``.metadata``: its save never committed."""


class ChecksumMismatchError(DataStatesError):
    """Bytes read back do not match the checksum recorded when they were written."""


class UnsafeCheckpointError(DataStatesError):
    """A checkpoint asks for something a safe load refuses: a pickled global outside the DCP
    metadata types, a file path that leaves the checkpoint directory, or an object record that
    ``torch.load(weights_only=True)`` rejects. Load it with ``DataStatesReader(path,
    trusted=True)`` only if you trust whoever wrote it."""
