"""``async_save``: DCP's ``async_save`` with our writer, answering with DCP's AsyncSaveResponse."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.stateful import Stateful

from .._dcp_private import AsyncSaveCall, require_cpu_backend
from ..errors import CheckpointSaveError
from ..stats import SaveStats
from . import path_turns
from .calls import _ANNOUNCED, _current_rank, announce, fails_on_every_rank, lost_process_group
from .records import record_failure
from .writer import DataStatesWriter

logger = logging.getLogger(__name__)


def async_save(
    state_dict: dict[str, Any],
    path_or_writer: str | os.PathLike | DataStatesWriter,
    **kwargs: Any,
) -> AsyncSaveResponse:
    """Save ``state_dict`` asynchronously; returns in milliseconds.

    ``path_or_writer`` is a checkpoint path/URL (a new writer is made) or a
    :class:`DataStatesWriter` (reuse one writer, and so its host pool, across saves, giving each
    save its own ``checkpoint_id``). Other keyword arguments go to ``dcp.async_save``
    (``checkpoint_id``, ``process_group``, ``no_dist``, ``async_checkpointer_type``, ...).

    With a writer passed in and the THREAD executor (the default), the save runs on the
    writer's own save threads, kept from one save to the next, rather than on a thread that
    ``dcp.async_save`` starts for each save: the caller is blocked for ``stage()`` and little
    else (0.6-0.8 ms against 1.4-1.6 ms through ``dcp.async_save`` at 99 tensors here). What runs is
    what ``dcp.async_save`` runs: ``state_dict()`` of every ``Stateful`` value on the caller,
    ``stage()``, then ``dcp.save`` of the staged state on another thread.

    Returns:
        ``AsyncSaveResponse``: ``staging_completion`` resolves when the snapshot is complete and
        the state may change; ``upload_completion`` resolves to DCP ``Metadata`` once the
        checkpoint is durable and committed, or raises :class:`CheckpointSaveError` (an
        ``Exception``, unlike DCP's ``CheckpointException``) naming the failing ranks.
    """
    for name in ("storage_writer", "async_stager"):
        if name in kwargs:
            raise TypeError(f"async_save got {name}=; pass a DataStatesWriter as path_or_writer")
    owned = not isinstance(path_or_writer, DataStatesWriter)
    writer = DataStatesWriter(path_or_writer) if owned else path_or_writer
    writer._check_open()
    mode = kwargs.get("async_checkpointer_type")
    call = AsyncSaveCall(
        found=True,
        mode=_THREAD if mode is None else getattr(mode, "value", mode),
        checkpoint_id=kwargs.get("checkpoint_id"),
        storage_writer=writer,
        async_stager=kwargs.get("async_stager"),
        planner=kwargs.get("planner"),
        no_dist=bool(kwargs.get("no_dist", False)),
        process_group=kwargs.get("process_group"),
    )
    start = time.monotonic()
    writer._forget_staged_stats()
    try:
        state_dict = _stateful_to_state_dict(state_dict)
    except Exception as exc:
        if not fails_on_every_rank(exc, call):
            if owned:
                _close_owned(writer)
            raise
        # Raised here on one rank, the other ranks' saves would wait in DCP's collectives
        # until the process group's timeout (a user sweep): this rank's save fails instead,
        # which DCP reports to every rank, as for a state stage() cannot save.
        call, state_dict = call._replace(state_error=exc), {}
    token = announce(writer, call)
    try:
        if not owned and call.mode == _THREAD:
            upload = _save_on_writer_threads(state_dict, writer, kwargs, start)
            staging = writer.staging_future or _done_future()
            return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)
        # A writer made for this save is closed by its own save thread (relay below), and
        # PROCESS mode runs in DCP's daemon: both keep dcp.async_save's own executors, and
        # their futures are relayed to report failures as _save_staged does.
        returned = dcp.async_save(state_dict, storage_writer=writer, **kwargs)
    except BaseException as exc:
        writer._abandon_staged(exc)  # staged, but the save that would write it never started
        if owned:
            _close_owned(writer)
        raise
    finally:
        _ANNOUNCED.reset(token)
    blocked = time.monotonic() - start
    stats = writer._staged_stats()  # this save's own record (None in PROCESS mode)
    if isinstance(returned, AsyncSaveResponse):  # PROCESS mode: staging is a future already
        upload, staging = returned.upload_completion, returned.staging_completion
    else:
        upload = returned
        staging = writer.staging_future or _done_future()
    out: Future[Any] = Future()
    out.set_running_or_notify_cancel()

    def relay(f: Future[Any]) -> None:
        raw = f.exception()
        if stats is not None:
            stats.blocked_s = blocked
        error = None if raw is None else _report_failure(writer, stats, raw)
        if owned:  # a writer made for one save: release its pool and threads before reporting
            # This callback may run on DCP's save thread: close() would wait for the snapshot
            # that thread claimed and never wrote (the save failed first) until it exited.
            writer._save_ended()
            _close_owned(writer)
        if error is None:
            out.set_result(f.result())
        else:
            out.set_exception(error)

    upload.add_done_callback(relay)
    return AsyncSaveResponse(staging_completion=staging, upload_completion=out)


#: The THREAD executor's ``async_checkpointer_type`` value (an enum's ``value`` is a Python
#: property: two frames a read, on the caller).
_THREAD = AsyncCheckpointerType.THREAD.value

#: dcp.async_save's keyword arguments that reach dcp.save (the others are checked above).
_SAVE_KWARGS = frozenset(
    {"checkpoint_id", "planner", "process_group", "no_dist", "use_collectives"}
)


def _save_on_writer_threads(
    state_dict: dict[str, Any], writer: DataStatesWriter, kwargs: dict[str, Any], start: float
) -> Future[Any]:
    """``dcp.async_save`` for the THREAD executor, with the writer's reused save threads.

    ``dcp.async_save`` starts a thread for every save (``ThreadPoolExecutor(1)``) and logs each
    of its steps; on the caller that costs more than ``stage()`` itself for states of a few
    hundred tensors. The steps are the same: ``Stateful`` values' ``state_dict()`` on the
    caller (``async_save`` did it), the CPU-backend check, ``stage()``, ``dcp.save`` on a save
    thread, and then the writer is told the caller is returning
    (``should_synchronize_after_execute``). The save thread's future is the caller's
    ``upload_completion`` (``_save_staged`` reports a failure as ``async_save``'s relay does):
    a second future and its callback cost the caller 20 us with caches cold after the last
    save."""
    unknown = set(kwargs) - _SAVE_KWARGS - {"async_checkpointer_type"}
    if unknown:
        raise TypeError(f"async_save() got unexpected keyword arguments: {sorted(unknown)}")
    save_kwargs = {k: v for k, v in kwargs.items() if k in _SAVE_KWARGS}
    require_cpu_backend(kwargs.get("process_group"))
    staged = writer.stage(state_dict)  # Stateful values converted by async_save
    stats = writer._staged_stats()
    try:
        upload = writer._run_save(_save_staged, staged, writer, save_kwargs, stats)
    except BaseException as exc:
        writer._abandon_staged(exc)
        raise
    if stats is not None:  # before planning may start (and so before the save can end)
        stats.blocked_s = time.monotonic() - start
    writer._returning_from_async_save()
    return upload


def _save_staged(
    staged: Any,
    writer: DataStatesWriter,
    save_kwargs: dict[str, Any],
    stats: SaveStats | None,
) -> Any:
    """On a writer save thread: what DCP's save thread runs, ``dcp.save`` of the staged state,
    raising a failure as ``async_save``'s relay reports one (``CheckpointSaveError``, recorded
    in ``stats``). The thread is reused, so what its exit told the writer is said here: the
    save's per-thread record is dropped, and so is a snapshot it claimed but never wrote
    (``save_ended``)."""
    if save_kwargs.get("planner") is None:  # reuse the plan of the snapshot being saved
        save_kwargs = {**save_kwargs, "planner": writer._staged_planner()}
    try:
        lost = lost_process_group(stats)
        if lost is not None:  # before DCP, which would fail naming no cause, or save as 1 rank
            writer._abandon_staged(lost)
            raise lost
        return dcp.save(staged, storage_writer=writer, **save_kwargs)
    except BaseException as exc:
        lost = lost_process_group(stats)  # DCP's own error for it names no cause
        if lost is not None and lost is not exc:
            lost.__cause__ = exc
            exc = lost
        error = _report_failure(writer, stats, exc)
        if error is exc:
            raise
        raise error from exc
    finally:
        writer._forget_save()
        writer._save_ended()  # a snapshot it claimed and never wrote is dropped
        path_turns.end_owned()  # saves after it to the same directory may write (path_turns.py)


#: Values that are never ``Stateful`` (exact types): no protocol check for them, which costs
#: 7-9 us a value (``runtime_checkable`` inspects the type), on the caller.
_PLAIN_TYPES = frozenset(
    {dict, list, tuple, str, int, float, bool, type(None), bytes, torch.Tensor, torch.nn.Parameter}
)


def _stateful_to_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """As ``dcp.async_save`` does on the caller: a shallow copy in which every ``Stateful``
    value is replaced by its ``state_dict()``."""
    return {
        key: value.state_dict()
        if type(value) not in _PLAIN_TYPES and isinstance(value, Stateful)
        else value
        for key, value in state_dict.items()
    }


def _close_owned(writer: DataStatesWriter) -> None:
    """Close a writer made for one save (``close()`` also drops a snapshot a failed save left);
    without this every ``async_save(sd, path)`` kept a host pool and threads for good."""
    try:
        writer.close()
    except Exception:  # the save's own outcome is what the caller must see
        logger.exception("closing the writer of %s failed", writer.path)


def _report_failure(
    writer: DataStatesWriter, stats: SaveStats | None, exc: BaseException
) -> BaseException:
    """A failed save's error as the caller sees it (``_as_error``), recorded in its own
    ``stats`` (``last_stats`` keeps the last good save)."""
    rank = stats.rank if stats is not None else _current_rank()
    error = _as_error(exc, rank)  # CheckpointException: a BaseException
    if stats is not None:
        record_failure(writer, stats, error)
    return error


def _as_error(exc: BaseException, rank: int) -> CheckpointSaveError:
    """Every failure as ``CheckpointSaveError``, as the README promises: DCP's
    ``CheckpointException`` with its per-rank failures, or an error ``dcp.save`` raised
    outside its collectives (``reset()`` of a writer that ``close(timeout)`` shut while the
    save thread was starting) as this rank's only failure."""
    if isinstance(exc, CheckpointSaveError):
        return exc
    failures = getattr(exc, "failures", None)
    if failures is None:
        failures = {rank: exc}
    if failures:
        # DCP wraps each rank's error as (exception, traceback summary); keep the exceptions.
        failures = {r: e[0] if isinstance(e, tuple) else e for r, e in failures.items()}
        ranks = ", ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items()))
        err = CheckpointSaveError(
            f"checkpoint save failed on {len(failures)} rank(s): {ranks}", failures
        )
    else:
        err = CheckpointSaveError(f"checkpoint save failed: {exc}")
    err.__cause__ = exc
    return err


def _done_future() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f
