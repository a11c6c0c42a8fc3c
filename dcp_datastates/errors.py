"""Exception types. Each message says what failed, where (rank, item, path) and what to do.

Every type survives pickling with its message and attributes: DCP gathers each rank's failure
on the coordinator by pickling it, and an error that cannot be rebuilt there replaces the real
cause with a ``TypeError`` (and can leave the other ranks waiting in a collective).
"""

from __future__ import annotations

import difflib
import pickle
from typing import Any


class DataStatesError(Exception):
    """Base class of every error raised by dcp_datastates."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without calling the subclass's __init__, whose signature subclasses are free
        # to choose (ObjectStoreError's is keyword-only: OSError's own reduce called it).
        if isinstance(self, OSError):  # errno, strerror and filename are OSError's own fields
            _, os_args, *state = super().__reduce__()
            return (_rebuild_os, (type(self), os_args, state[0] if state else None))
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


def _rebuild_os(cls: type[OSError], args: tuple, state: dict[str, Any] | None) -> OSError:
    err = cls.__new__(cls, *args)
    OSError.__init__(err, *args)  # errno, strerror, filename: what OSError's reduce gave
    err.__dict__.update(state or {})
    return err


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a :class:`DataStatesError` that carries
    its type and message (chained to it), so that DCP can ship it to the coordinator.

    Our own types always survive; this covers errors from user providers or storage backends.
    """
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        err = DataStatesError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        err.__cause__ = exc
        return err


class InvalidStateDictError(DataStatesError, ValueError):
    """The state dict cannot be checkpointed; raised at the call site, before any write (in a
    save of several ranks, through every rank's future: the others would wait for this one)."""


class SnapshotMutationError(DataStatesError):
    """A tensor changed in place before its snapshot was taken: the checkpoint would be torn."""

    def __init__(
        self, *, fqn: str, rank: int, before: int, after: int, unversioned: bool = False
    ) -> None:
        how = (
            "its bytes changed without a version bump: a write through NumPy (.numpy(), a "
            "torch.from_numpy array), or with copy_on_write off a write through .data or a "
            "module's forward updating a buffer with guard_forward off; or an in-place op on "
            "another thread still running as its copy ended (its version counter moves when it "
            "returns)"
            if unversioned
            else f"version {before} -> {after}"
        )
        super().__init__(
            f"rank {rank}: tensor {fqn!r} was modified in place while its snapshot was in flight "
            f"({how}); the checkpoint was not committed. Copy-on-write sees writes made by "
            "torch operators on the thread that called the save; a write from another thread, "
            "through NumPy or inside a torch.compile graph is not seen: wait for the snapshot "
            "first (writer.synchronize_staging(), or the save's staging_completion), and keep "
            "copy_on_write, guard_optimizer_step and guard_forward on."
        )
        self.fqn = fqn
        self.rank = rank
        self.before = before
        self.after = after
        self.unversioned = unversioned


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
    """A checkpoint directory has no ``.metadata``: its save never committed (or, asked of
    ``Checkpointer.load(step=)``, there is no directory for that step)."""


class CheckpointLoadError(DataStatesError):
    """No checkpoint could be loaded: ``Checkpointer.load_latest`` tried each committed step,
    newest first, or ``Checkpointer.load`` the step asked for.

    ``failures`` maps each step tried to why it failed. DCP reports a failed load as
    ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses; this error
    carries it as ``__cause__``.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class CooperativeLoadError(DataStatesError):
    """Another rank of a cooperative load (``DataStatesReader(cooperative=True)``) failed to read
    or receive its part, so this rank's load stops too, naming that rank's item and file.

    ``failures`` maps each failed rank to what it said."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class ChecksumMismatchError(DataStatesError):
    """Bytes read back do not match the checksum recorded when they were written."""


class UnsafeCheckpointError(DataStatesError):
    """A checkpoint asks for something a safe load refuses: a pickled global outside the DCP
    metadata types, a file path that leaves the checkpoint directory, or an object record that
    ``torch.load(weights_only=True)`` rejects. Load it with ``DataStatesReader(path,
    trusted=True)`` only if you trust whoever wrote it."""


def unknown_options(owner: str, unknown: list[str], known: list[str]) -> TypeError:
    """The error for options ``owner`` does not take, with the nearest known names (the writer,
    the reader and ``Checkpointer`` all answer a typo this way)."""
    near = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
    guesses = [f"{u} (did you mean {m[0]}?)" if m else u for u, m in near.items()]
    return TypeError(
        f"{owner} got unknown option(s) {', '.join(guesses)}; the options are {', '.join(known)}"
    )
