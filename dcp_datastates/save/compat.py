"""Stock ``FileSystemWriter`` arguments, mapped onto :class:`~dcp_datastates.WriterOptions`.

``DataStatesWriter`` takes every argument of ``torch.distributed.checkpoint.FileSystemWriter``
(torch 2.9 to 2.13: ``path, single_file_per_rank, sync_files, thread_count,
per_thread_copy_ahead, cache_staged_state_dict, overwrite, _extensions, serialization_format``)
by name and in the same positions, so that replacing the class name is enough. Each maps to one
of our options, or is accepted without effect because our pipeline already does what it asks
(see the README's table), or is refused at construction when we cannot honour it (stream
transforms, safetensors records), naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import unknown_options
from ..options import WriterOptions

#: Methods that decide what a save holds: a planner overriding any of them is the user's own.
_PLANNING_METHODS = (
    "set_up_planner",
    "create_local_plan",
    "create_global_plan",
    "resolve_data",
    "lookup_object",
    "transform_object",
)

#: Stock ``FileSystemWriter.__init__``'s positional parameters after ``path``, in order.
STOCK_WRITER_ARGS = (
    "single_file_per_rank",
    "sync_files",
    "thread_count",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "overwrite",
    "_extensions",
    "serialization_format",
)


def _format_name(serialization_format: Any) -> str | None:
    if serialization_format is None:
        return None
    value = getattr(serialization_format, "value", serialization_format)
    return str(value).lower()


def writer_options(
    *,
    single_file_per_rank: bool,
    sync_files: bool,
    thread_count: int | None,
    per_thread_copy_ahead: int,
    cache_staged_state_dict: bool,
    overwrite: bool,
    _extensions: Sequence[Any] | None,
    serialization_format: Any,
    options: dict[str, Any],
) -> WriterOptions:
    """Our options from stock arguments plus our own keyword-only ``options``.

    - ``sync_files``, ``overwrite``: the same meaning, the same options.
    - ``thread_count``: files written in parallel per rank, one thread each: ``flush_workers``
      (when given; our default stays 2).
    - ``single_file_per_rank``, ``per_thread_copy_ahead``, ``cache_staged_state_dict``: accepted
      without effect (file layout is ours: a few files per rank; the bounded host pool already
      copies ahead and is reused across saves).
    - ``_extensions`` (stream transforms, e.g. ``ZStandard`` compression): refused, our records
      are raw bytes streamed from the host pool; a non-empty sequence raises ``ValueError``.
    - ``serialization_format``: ``TORCH_SAVE`` (what we write) or refused.
    """
    if _extensions:
        names = ", ".join(type(e).__name__ for e in _extensions)
        raise ValueError(
            f"DataStatesWriter(_extensions=[{names}]): stream transforms (compression) are not "
            "supported: records are written as raw bytes straight from the host pool, which a "
            "stream transform would have to re-encode. Use torch's FileSystemWriter for "
            "compressed checkpoints (DataStatesReader reads them)"
        )
    fmt = _format_name(serialization_format)
    if fmt not in (None, "torch_save"):
        raise ValueError(
            f"DataStatesWriter(serialization_format={serialization_format!r}): only TORCH_SAVE "
            "records are written (stock readers and ours load them); use torch's "
            "FileSystemWriter for safetensors records"
        )
    # sync_files and overwrite are options of ours too: WriterOptions checks them.
    for name, value in (
        ("single_file_per_rank", single_file_per_rank),
        ("cache_staged_state_dict", cache_staged_state_dict),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"DataStatesWriter({name}={value!r}): must be True or False")
    if (
        not isinstance(per_thread_copy_ahead, int)
        or isinstance(per_thread_copy_ahead, bool)
        or per_thread_copy_ahead < 0
    ):
        raise ValueError(
            f"DataStatesWriter(per_thread_copy_ahead={per_thread_copy_ahead!r}): expected a "
            "non-negative int (accepted for compatibility; the host pool bounds copies ahead)"
        )
    unknown = sorted(set(options) - set(WriterOptions.names()))
    if unknown:
        raise unknown_options("DataStatesWriter", unknown, WriterOptions.names())
    merged = dict(options, sync_files=sync_files, overwrite=overwrite)
    if thread_count is not None:
        if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
            raise ValueError(
                f"DataStatesWriter(thread_count={thread_count!r}): expected an int of at least 1 "
                "(stock's thread_count is our flush_workers: writing threads per rank)"
            )
        if "flush_workers" in merged and merged["flush_workers"] != thread_count:
            raise TypeError(
                f"DataStatesWriter(thread_count={thread_count!r}, "
                f"flush_workers={merged['flush_workers']!r}): thread_count is flush_workers, "
                "give one of them"
            )
        merged["flush_workers"] = thread_count
    return WriterOptions(**merged)


def lazy_staging_planner(planner: Any) -> bool:
    """Whether our lazy snapshot (planned from the state dict by our own ``DefaultSavePlanner``)
    saves what ``planner`` would: no planner, or a ``DefaultSavePlanner`` with default flags
    (plan caching allowed) whose planning methods are DCP's own.

    For any other planner passed to ``dcp.async_save``, ``stage()`` stages as stock does (a
    blocking CPU copy) and every item is resolved through that planner (its ``resolve_data``
    included) when written."""
    if planner is None:  # every save's case: no import on the caller's thread
        return True
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from .planner import DataStatesSavePlanner, StagedSavePlanner

    if not isinstance(planner, DefaultSavePlanner):
        return False
    # Our own planners (exactly these classes, not a user's subclass of them) plan as we do.
    if type(planner) not in (DataStatesSavePlanner, StagedSavePlanner) and any(
        getattr(type(planner), name, None) is not getattr(DefaultSavePlanner, name)
        for name in _PLANNING_METHODS
    ):
        return False
    return bool(
        getattr(planner, "flatten_state_dict", True)
        and getattr(planner, "flatten_sharded_tensors", True)
        and not getattr(planner, "dedup_save_to_lowest_rank", False)
    )


def stock_stage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of ``state_dict``, as stock ``FileSystemWriter.stage`` makes it."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager().stage(state_dict)


__all__ = [
    "STOCK_WRITER_ARGS",
    "lazy_staging_planner",
    "stock_stage",
    "writer_options",
]


class StockWriterAttributes:
    """Stock ``FileSystemWriter``'s attributes that are options of ours, read off ``options``
    (a user sweep: code reading ``writer.overwrite`` or ``writer.thread_count`` broke on ours)."""

    options: WriterOptions

    @property
    def sync_files(self) -> bool:
        return self.options.sync_files

    @property
    def overwrite(self) -> bool:
        return self.options.overwrite

    @property
    def thread_count(self) -> int:
        """Files written in parallel per rank: ``flush_workers``."""
        return self.options.flush_workers
