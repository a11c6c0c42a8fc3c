"""``async_save``: DCP's ``async_save`` with our writer, answering with DCP's AsyncSaveResponse."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from ._dcp_private import AsyncSaveCall
from .errors import CheckpointSaveError
from .writer import _ANNOUNCED, DataStatesWriter, record_failure

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
    writer._runtime.check_open()
    mode = kwargs.get("async_checkpointer_type", AsyncCheckpointerType.THREAD)
    call = AsyncSaveCall(
        found=True,
        mode=getattr(mode, "value", mode),
        checkpoint_id=kwargs.get("checkpoint_id"),
        storage_writer=writer,
        no_dist=bool(kwargs.get("no_dist", False)),
        process_group=kwargs.get("process_group"),
    )
    start = time.monotonic()
    writer._local.staged_stats = None
    token = writer._announce(call)
    try:
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
        error = None if raw is None else _as_error(raw)  # CheckpointException: a BaseException
        if stats is not None:
            stats.blocked_s = blocked
            if error is not None:  # its own record; last_stats keeps the last good save
                record_failure(writer, stats, error)
        if owned:  # a writer made for one save: release its pool and threads before reporting
            _close_owned(writer)
        if error is None:
            out.set_result(f.result())
        else:
            out.set_exception(error)

    upload.add_done_callback(relay)
    return AsyncSaveResponse(staging_completion=staging, upload_completion=out)


def _close_owned(writer: DataStatesWriter) -> None:
    """Close a writer made for one save (``close()`` also drops a snapshot a failed save left);
    without this every ``async_save(sd, path)`` kept a host pool and threads for good."""
    try:
        writer.close()
    except Exception:  # the save's own outcome is what the caller must see
        logger.exception("closing the writer of %s failed", writer.path)


def _as_error(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)
    if isinstance(exc, Exception) and failures is None:
        return exc
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
