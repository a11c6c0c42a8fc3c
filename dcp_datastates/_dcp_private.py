"""Every use of a PyTorch DCP name that is not public API, in one place.

DCP's public surface does not tell a stager which executor will run the save, nor hand out the
storage record type of ``.metadata``. What we need of its private parts lives here, and only
here, so that a torch upgrade that moves one of them breaks this file (and its tests), not the
writer. Each entry says what it is for and what happens if it stops matching.
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict_saver as _saver
from torch.distributed.checkpoint._dedup_save_plans import (  # noqa: F401 - re-exported
    dedup_save_plans,
)
from torch.distributed.checkpoint._extension import (  # noqa: F401 - re-exported
    ExtensionRegistry,
    StreamTransformExtension,
)
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401 - re-exported
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner

logger = logging.getLogger(__name__)

#: The record ``.metadata`` keeps per item (``storage_data``): stock ``FileSystemReader`` reads
#: exactly this type, so a checkpoint it can load must carry it.
StorageInfo = _StorageInfo

#: Private names that a stock ``.metadata`` pickle refers to; the safe metadata unpickler allows
#: them (with the public DCP metadata types).
PRIVATE_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_StorageInfo.__module__, _StorageInfo.__qualname__),
        # TensorProperties pickles its memory format as this enum's value.
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        # Checkpoints of older torch (and of ShardedTensors) hold the legacy _shard types.
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    }
)

# dedup_save_plans (re-exported): DCP's dedup of replicated items, which ``DefaultSavePlanner``
# runs first in its global plan; ``save/global_plan.py`` plans the same way without the rest of
# that method (its validation is quadratic in the ranks).

# ExtensionRegistry / StreamTransformExtension (re-exported): stock stream transforms
# (``FileSystemWriter(_extensions=[ZStandard()])``); the reader decodes records that name them
# in ``_StorageInfo.transform_descriptors`` through the registry, as ``FileSystemReader`` does.


def plan_caching_in_use() -> bool:
    """Whether a save planner in this process caches plans (``DefaultSavePlanner(
    enable_plan_caching=True)``). The coordinator then plans from the cached local plans of
    ranks whose plan did not change, ``storage_data`` included, which names the checkpoint of
    the save they were made for: the writer does not compare the ranks' checkpoints there. The
    cache is ``SavePlanner._cached_all_plans``, a class attribute filled at the first global
    plan; should it move, this answers False and the comparison runs with caching too (it would
    then refuse a save whose ranks' plans changed unevenly, naming an earlier save's path;
    ``test_dcp_private`` checks the name)."""
    return bool(getattr(SavePlanner, "_cached_all_plans", None))


def no_synchronize_after_execute(cls: type) -> type:
    """Class decorator: tell ``dcp.async_save`` not to call ``synchronize_staging()`` right after
    starting the save (which would wait for the whole snapshot on the caller's thread).

    DCP reads the public ``should_synchronize_after_execute`` (which returns this attribute) on
    the caller's thread once the save thread is started, as ``dcp.async_save`` returns: the
    property installed here answers False and first calls the class's
    ``_returning_from_async_save()``, if it has one.
    """
    cls._synchronize_after_execute = False  # type: ignore[attr-defined]

    def should_synchronize_after_execute(self: Any) -> bool:
        returning = getattr(self, "_returning_from_async_save", None)
        if returning is not None:
            returning()
        return False

    cls.should_synchronize_after_execute = property(  # type: ignore[attr-defined]
        should_synchronize_after_execute
    )
    return cls


# -- which dcp.async_save called stage() -----------------------------------------------------
class AsyncSaveCall(NamedTuple):
    """What a stager learns from the ``dcp.async_save`` frame that called it.

    ``found`` is False when no such frame was seen (``stage()`` called directly, or DCP changed
    so that the probe no longer recognises its frame). A named tuple: a frozen dataclass's
    ``__init__`` cost ``dcp_datastates.async_save`` 15-25 us with caches cold.
    """

    found: bool
    mode: str | None = None  # AsyncCheckpointerType value: "thread" or "process"
    checkpoint_id: Any = None
    storage_writer: Any = None
    async_stager: Any = None
    planner: Any = None  # the SavePlanner given to dcp.async_save (None: DCP's default)
    no_dist: bool = False
    process_group: Any = None
    #: A ``Stateful``'s ``state_dict()`` raised in ``dcp_datastates.async_save`` on this rank
    #: alone: ``stage()`` hands it to the save, which fails on every rank.
    state_error: BaseException | None = None


NOT_FOUND = AsyncSaveCall(found=False)
#: How many frames above ``stage()`` the probe looks (DCP wraps its calls in a logger).
_MAX_DEPTH = 8


def _async_save_code() -> Any:
    try:
        return inspect.unwrap(_saver.async_save).__code__
    except (AttributeError, ValueError):  # pragma: no cover - depends on the torch version
        return None


_ASYNC_SAVE_CODE = _async_save_code()


def _is_async_save(code: Any) -> bool:
    if _ASYNC_SAVE_CODE is not None and code is _ASYNC_SAVE_CODE:
        return True
    # Fallback (a wrapper or reload changed the code object): the function's name and file.
    return code.co_name == "async_save" and code.co_filename.endswith("state_dict_saver.py")


def async_save_call(depth: int = 1) -> AsyncSaveCall:
    """Arguments of the ``dcp.async_save`` that (directly or through DCP's wrappers) called the
    function ``depth`` frames up; :data:`NOT_FOUND` when there is none.

    Raises ``RuntimeError`` when the frame is found but no longer holds the arguments we read:
    that means DCP changed, and guessing the executor would risk handing live tensors to it.
    """
    frame = sys._getframe(depth + 1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return NOT_FOUND
        if _is_async_save(frame.f_code):
            local = frame.f_locals
            missing = [
                name
                for name in ("async_checkpointer_type", "checkpoint_id", "storage_writer")
                if name not in local
            ]
            if missing:
                raise RuntimeError(
                    "dcp_datastates cannot read dcp.async_save's arguments "
                    f"({', '.join(missing)} missing) in this torch version; use "
                    "dcp_datastates.async_save, or report this with your torch version"
                )
            mode = local.get("async_checkpointer_type")
            return AsyncSaveCall(
                found=True,
                mode=getattr(mode, "value", mode),
                checkpoint_id=local.get("checkpoint_id"),
                storage_writer=local.get("storage_writer"),
                async_stager=local.get("async_stager"),
                planner=local.get("planner"),
                no_dist=bool(local.get("no_dist", False)),
                process_group=local.get("process_group"),
            )
        frame = frame.f_back
    return NOT_FOUND


#: ``dist.is_available()`` (whether torch was built with it) cannot change in a process: read
#: once, not on the caller's path at every save (here and in ``save.calls._current_rank``).
DIST_AVAILABLE = dist.is_available()


def require_cpu_backend(process_group: Any) -> None:
    """``dcp.async_save``'s check before it stages, for ``dcp_datastates.async_save``, which
    runs the save on its own threads: the save thread's collectives need a CPU backend. Reads
    the default group (``_get_default_group``) and a group's ``_device_types``, as DCP does."""
    if not (DIST_AVAILABLE and dist.is_initialized()):
        return
    group = process_group or dist.distributed_c10d._get_default_group()
    if torch.device("cpu") not in group._device_types:
        raise AssertionError(
            "A CPU backend must be enabled for async save; try initializing process group "
            "with 'cpu:gloo,cuda:nccl'"
        )


def warn_call_not_found() -> None:
    """Say that ``stage()`` ran outside any ``dcp.async_save`` we recognise (Python's default
    warning filter shows it once per calling line)."""
    warnings.warn(
        "DataStatesWriter.stage() was not called by a dcp.async_save this version of "
        "dcp_datastates recognises; it assumes the THREAD executor and this writer as the storage "
        "writer. Use dcp_datastates.async_save (which tells the writer directly), or "
        "dcp.async_save with storage_writer=the writer and no async_stager.",
        RuntimeWarning,
        stacklevel=4,
    )


__all__ = [
    "DIST_AVAILABLE",
    "NOT_FOUND",
    "PRIVATE_METADATA_GLOBALS",
    "AsyncSaveCall",
    "ExtensionRegistry",
    "StreamTransformExtension",
    "StorageInfo",
    "async_save_call",
    "no_synchronize_after_execute",
    "require_cpu_backend",
    "set_element",
    "warn_call_not_found",
]
