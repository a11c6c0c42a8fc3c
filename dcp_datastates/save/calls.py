"""Who is calling ``stage()``, and the guards that must hold on every rank of one save.

Owns: the call ``dcp_datastates.async_save`` announces to the writer (``_ANNOUNCED``), the one
read off DCP's frame otherwise (``which_call``), this rank and the save's world size, and the
refusals that keep ranks from failing apart: a checkpoint path that is a file, ranks naming
different checkpoints (``_RankTarget`` travels in each local plan; allowed, one directory per
node, with ``WriterOptions.node_local``), a process group destroyed
before the save ran, and which state errors are handed to the save to fail on every rank.
"""

from __future__ import annotations

import contextvars
import dataclasses
import errno
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from .. import _dcp_private
from ..errors import WriterClosedError, WriterUsageError
from ..stats import SaveStats
from ..storage.base import is_local

#: (writer, call) announced by dcp_datastates.async_save for the stage() it is about to cause.
_ANNOUNCED: contextvars.ContextVar[tuple[Any, _dcp_private.AsyncSaveCall] | None] = (
    contextvars.ContextVar("dcp_datastates_announced_call", default=None)
)


def announce(writer: Any, call: _dcp_private.AsyncSaveCall) -> contextvars.Token:
    """dcp_datastates.async_save says which call the next stage() on this thread is for."""
    return _ANNOUNCED.set((writer, call))


def announced(writer: Any) -> bool:
    """Whether dcp_datastates.async_save told this thread's next stage() its call."""
    told = _ANNOUNCED.get()
    return told is not None and told[0] is writer


def which_call(writer: Any) -> _dcp_private.AsyncSaveCall:
    """Which save called stage(): told by dcp_datastates.async_save, else read off DCP's
    frame. Refuses a call that cannot produce a correct checkpoint.

    The writer's ``_which_call`` method is this function itself (not a call to it): DCP's frame
    and the warning's ``stacklevel`` are counted from ``stage()``, two frames up."""
    told = _ANNOUNCED.get()
    if told is not None and told[0] is writer:
        return told[1]
    call = _dcp_private.async_save_call(depth=2)
    if not call.found:
        _dcp_private.warn_call_not_found()
        return call
    if call.storage_writer is not writer:
        other = type(call.storage_writer).__name__ if call.storage_writer else "none"
        raise WriterUsageError(
            f"a DataStatesWriter can only stage for itself (it streams its own snapshot in "
            f"write_data), but dcp.async_save was given storage_writer={other}. Pass "
            "storage_writer=DataStatesWriter(path) and no async_stager, or use "
            "dcp_datastates.async_save(state_dict, path); to save with another storage "
            "writer, leave async_stager out (DCP's DefaultStager)"
        )
    return call


def _current_rank() -> int:
    return dist.get_rank() if _dcp_private.DIST_AVAILABLE and dist.is_initialized() else 0


def _world_size(call: _dcp_private.AsyncSaveCall) -> int:
    """Ranks in the process group a save staged now runs on (1 for a save without one)."""
    if call.no_dist or not (_dcp_private.DIST_AVAILABLE and dist.is_initialized()):
        return 1
    return dist.get_world_size(call.process_group)


def lost_process_group(stats: SaveStats | None) -> WriterUsageError | None:
    """The error for a save staged in a process group of several ranks whose save thread finds
    none: the script destroyed it right after the call (a user sweep). DCP then saved each rank
    as rank 0 of one, into the same files, and committed one rank's state as the whole."""
    if stats is None or stats.world_size == 1:
        return None
    if _dcp_private.DIST_AVAILABLE and dist.is_initialized():
        return None
    return WriterUsageError(
        f"rank {stats.rank}: the save to {stats.checkpoint_id} was staged in a process group "
        f"of {stats.world_size} ranks, which was destroyed before its save ran; nothing was "
        "written. Wait for the save (its future, or writer.close()) before "
        "dist.destroy_process_group()"
    )


def _refuse_file_target(path: str | os.PathLike) -> None:
    """Refuse, on the caller's thread, a local checkpoint path that is an existing file.

    Otherwise the save only fails later on DCP's save thread (``prepare_local_plan``), and the
    caller of an async save learns it from a traceback of that thread.
    """
    text = os.fspath(path)
    if is_local(text) and os.path.isfile(local := text.removeprefix("file://")):
        root = os.path.abspath(local)  # as LocalStorage names it
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"checkpoint path {root} exists and is not a directory; pick another path",
            root,
        )


@dataclasses.dataclass(frozen=True)
class _RankTarget:
    """A local plan's ``storage_data`` until the global plan: the checkpoint this rank saves
    to, so that the coordinator refuses a save whose ranks name different checkpoints before
    any of them writes (a path built from the clock on each rank: each rank's files landed in
    its own directory and the commit failed on a file missing from the coordinator's), unless
    every rank saves ``node_local`` (``WriterOptions.node_local``)."""

    path: str
    node_local: bool = False


def _refuse_split_targets(plans: Sequence[SavePlan], coordinator: str) -> list[int] | None:
    """Raises ``WriterUsageError`` naming each rank's checkpoint where the ranks' local plans
    (:class:`_RankTarget`) name more than one and not every rank saves ``node_local`` (or the
    ranks disagree on it). Returns the ranks whose files the coordinator's directory
    (``coordinator``) holds, where node-local ranks name several; else None (every rank's)."""
    if _dcp_private.plan_caching_in_use():  # cached plans name earlier saves' checkpoints
        return None
    targets = {
        r: p.storage_data for r, p in enumerate(plans) if isinstance(p.storage_data, _RankTarget)
    }
    local = {r for r, t in targets.items() if t.node_local}
    if local and len(local) != len(plans):
        apart = sorted(set(range(len(plans))) - local)
        raise WriterUsageError(
            f"the ranks of one save disagree on node_local: ranks {sorted(local)[:8]} pass "
            f"node_local=True, ranks {apart[:8]} do not; nothing was written. Give every rank's "
            "DataStatesWriter the same node_local"
        )
    ranks_at: dict[str, list[int]] = {}
    for rank, target in targets.items():
        ranks_at.setdefault(target.path, []).append(rank)
    if len(ranks_at) < 2:
        return None
    if local:
        return ranks_at.get(coordinator, [])
    shown = sorted(ranks_at.items(), key=lambda kv: kv[1][0])
    where = "; ".join(
        f"rank {ranks[0]}: {path}" + (f" (and {len(ranks) - 1} more ranks)" if ranks[1:] else "")
        for path, ranks in shown[:4]
    )
    more = f"; {len(shown) - 4} more paths" if len(shown) > 4 else ""
    raise WriterUsageError(
        f"the ranks of one save name {len(shown)} different checkpoints ({where}{more}); "
        "nothing was written. Pass every rank the same checkpoint_id: build it on one rank "
        "(e.g. from the step, not the clock) or broadcast rank 0's; or, for one directory "
        "per node that is brought together later, pass node_local=True"
    )


def fails_on_every_rank(error: Exception, call: _dcp_private.AsyncSaveCall) -> bool:
    """Whether ``stage()`` hands ``error`` (about the state dict) to the save rather than raise
    it: in a save whose ranks plan and commit together, where the other ranks would wait for
    this one in DCP's collectives. (With the PROCESS executor the staging sends it to the
    daemon in place of the state: ``process_staging.failed_state``.)"""
    if isinstance(error, (WriterClosedError, WriterUsageError)):
        return False  # about the writer or the call: the same on every rank
    if not call.found:
        return False
    return _world_size(call) > 1
