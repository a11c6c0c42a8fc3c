"""The THREAD executor's staging: ``stage()`` for a save that runs in this process.

One stage, top-down, in the order it runs (the writer's docstring has the whole save)::

    caller (training thread)   ThreadStaging.stage: open a SaveStats, take the save's turn
                               at its directory (path_turns.py), record the state (its
                               structure, version counters, copies of tiny tensors; capture.py,
                               replayed from the last save's layout by replay.py) and hand it to
                               the runtime. A state the record cannot cover (device tensors,
                               subclasses, objects) is planned here instead.
    planning thread            ThreadStaging.plan_captured: resolve the record, make the pool
                               on the first save, plan the providers; the runtime then queues
                               the session's snapshot.
    snapshot threads           the copies of the pieces into the pool (SnapshotScheduler in
                               snapshot/), until the staged future resolves (SAFE).

Owns: the ``CaptureCache`` (the last layout saved, which the next ``stage()`` replays) and the
layout ``warm_up`` learns before the first save. The DCP calls that follow are the writer's;
the sessions, the pool and the threads are the runtime's (``runtime.py``). A plain
``dcp.save`` (no ``stage()``) is snapshotted here too, on its save thread, from DCP's plan
(``session_for_plan``). The PROCESS executor's staging is ``process_staging.py``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from .. import _dcp_private
from ..options import WriterOptions
from ..snapshot import cow as _cow
from ..snapshot.capture import Capture
from ..snapshot.replay import CaptureCache
from ..snapshot.session import SnapshotSession
from ..stats import SaveStats
from ..storage import localfile
from ..storage.base import is_local
from . import incremental, path_turns
from .calls import _current_rank, _world_size, fails_on_every_rank
from .planner import plan_providers, planned_elsewhere, provider_from_any_planner
from .runtime import SnapshotRuntime

logger = logging.getLogger(__name__)


class ThreadStaging:
    """``stage()``'s work for one writer, on the caller and on the planning thread."""

    def __init__(self, runtime: SnapshotRuntime, options: WriterOptions) -> None:
        self.runtime = runtime
        self.options = options
        # The last layout of the state saved, replayed by the next stage() (replay.py).
        self.captures = CaptureCache(options.eager_copy_bytes)
        # The last save's records per rank, which the next may link (incremental.py).
        self.increments = incremental.IncrementalMemo() if options.incremental else None

    def forget(self) -> None:
        """Drop the recorded layout (the writer is closing)."""
        self.captures.forget()

    # -- on the caller (the training thread) -------------------------------------------------
    def stage(
        self,
        state_dict: STATE_DICT_TYPE,
        call: _dcp_private.AsyncSaveCall,
        path: str | os.PathLike,
        *,
        announced: bool,
        start: float,
    ) -> tuple[STATE_DICT_TYPE, SaveStats]:
        """Stage ``state_dict`` for the save ``call`` to ``path``; returns what DCP is to save
        and the save's record. ``announced``: dcp_datastates.async_save told the writer its
        call (it plans the state itself, so no placeholder is returned)."""
        rank = _current_rank()
        stats = SaveStats(
            checkpoint_id=os.fspath(path),  # set_up_storage_writer writes the storage's name
            rank=rank,  # for it; a save failing first has this one
            pool_bytes=self.runtime.pool_capacity,
            world_size=_world_size(call),
        )
        path_turns.end_owned()  # a plain dcp.save this thread ran has returned
        turn = path_turns.take(path)
        try:
            with _cow.paused():  # the call's own reads and copies are not writes to watch
                staged = self._stage_session(
                    state_dict, call, stats, turn, start, announced, os.fspath(path)
                )
        except BaseException:
            turn.leave()  # no save will run: the saves after it need not wait
            raise
        return staged, stats

    def _stage_session(
        self,
        state_dict: STATE_DICT_TYPE,
        call: _dcp_private.AsyncSaveCall,
        stats: SaveStats,
        turn: path_turns.Turn,
        start: float,
        announced: bool,
        path: str,
    ) -> STATE_DICT_TYPE:
        """stage()'s snapshot: recorded for the planning thread, or planned here."""
        rank = stats.rank
        try:
            if call.state_error is not None:
                raise call.state_error
            captured = self.captures.capture(state_dict)
            items = None if captured is not None else plan_providers(state_dict)
        except Exception as exc:
            if not fails_on_every_rank(exc, call):
                raise
            # Raised here, on this rank only, the error would leave the other ranks' saves
            # waiting in DCP's collectives for good: it fails this rank's save instead (its
            # write_data raises it), which DCP reports to every rank.
            logger.error(
                "rank %d: the state cannot be saved (%s: %s); the save fails on every rank",
                rank,
                type(exc).__name__,
                exc,
            )
            session = self.runtime.stage_later(
                functools.partial(_raise, exc),
                (stats, turn),
                rank=rank,
                started=start,
                expect_claim=True,
            )
            turn.dropped_with(session)
            return state_dict
        staged: STATE_DICT_TYPE = state_dict
        if captured is not None:  # host tensors and plain values: plan on the planning thread
            if call.found and call.planner is None and not announced:
                # A plain dcp.async_save: its save thread plans what this returns with a
                # DefaultSavePlanner of DCP's; the planning thread's plan takes its place.
                staged = planned_elsewhere()
            stats.eager_bytes = captured.eager_bytes
            session = self.runtime.stage_later(
                functools.partial(self.plan_captured, captured, call, path),
                (stats, turn),
                rank=rank,
                started=start,
                expect_claim=call.found,
                after=functools.partial(self.captures.learn, captured),
            )
        else:
            assert items is not None
            if self.increments is not None:
                incremental.reuse(items, self.increments, path, rank)
            session = self.runtime.new_session(
                items, rank, expected_bytes=_expected_write_bytes(items, call)
            )
            try:
                stats.eager_bytes = session.freeze_small(self.options.eager_copy_bytes)
            except BaseException as exc:
                self.runtime.abort(session, exc)
                raise
            self.runtime.stage(session, (stats, turn), started=start, expect_claim=call.found)
        turn.dropped_with(session)
        return staged

    def warm_up(self, state_dict: STATE_DICT_TYPE, path: str, *, wait: bool) -> None:
        """``DataStatesWriter.warm_up`` for a writer of ``path`` (its docstring says why)."""
        tensors = _tensors_of(state_dict)
        nbytes = sum(t.numel() * t.element_size() for t in tensors) + 64 * len(tensors)
        pool = self.runtime.prepare(nbytes, _current_rank())
        self.runtime.start_threads()
        opts = self.options
        if opts.direct_writes and opts.sync_files and is_local(path):
            localfile.prepare_buffers(opts.flush_workers)
        if not self.captures.has_record():
            self._learn_layout(state_dict)
        if wait:
            pool.wait_populated()

    def _learn_layout(self, state_dict: STATE_DICT_TYPE) -> None:
        """What a first save's ``stage()`` and planning thread record of ``state_dict``: its
        layout and local plan (nothing is copied for a save; the plan's providers are dropped)."""
        captured = self.captures.capture(state_dict)
        if captured is None:  # device tensors, subclasses, objects: planned at each stage()
            return
        captured.resolve()
        items = plan_providers(
            captured.state,
            versions=captured.versions,
            private=captured.private,
            probes=captured.probes,
        )
        captured.local_plan = items.local_plan
        self.captures.learn(captured)

    # -- on the planning thread --------------------------------------------------------------
    def plan_captured(
        self, captured: Capture, call: _dcp_private.AsyncSaveCall, path: str
    ) -> tuple[list[tuple[Any, Any]], int]:
        """On the planning thread: the items (and the bytes this rank will write) of what
        ``stage()`` recorded for a save to ``path``."""
        captured.resolve()
        if self.runtime.pool is None:
            # The first save: faulting the pool in (pool.py) overlaps the planning below. The
            # save is staged: a close() since waits for it, so the pool is made even then.
            self.runtime.prepare(
                captured.tensor_bytes() + 64 * captured.tensors, _current_rank(), staged=True
            )
        items = plan_providers(
            captured.state,
            versions=captured.versions,
            previous=captured.previous_plan,
            private=captured.private,
            probes=captured.probes,
        )
        captured.local_plan, captured.previous_plan = items.local_plan, None
        if self.increments is not None:
            incremental.reuse(items, self.increments, path, _current_rank())
        return items, _expected_write_bytes(items, call)

    # -- on the save thread, for a plain dcp.save (no stage()) -------------------------------
    def session_for_plan(
        self, plan: SavePlan, planner: SavePlanner, rank: int, path: str = ""
    ) -> SnapshotSession:
        """``write_data``'s snapshot of the live tensors: the items of DCP's plan, as ``planner``
        resolves them, for a save to ``path``."""
        self.runtime.check_open()
        items = [(item, provider_from_any_planner(item, planner)) for item in plan.items]
        if self.increments is not None:
            incremental.reuse(items, self.increments, path, rank)
        return self.runtime.new_session(items, rank)  # plan.items: exactly what we write


def _raise(error: BaseException) -> Any:
    raise error


def _expected_write_bytes(items: list, call: _dcp_private.AsyncSaveCall) -> int:
    """Bytes this rank is expected to write: its shards, and its share of replicated items
    (DCP gives each replicated item to one rank, balancing bytes across ranks)."""
    world = _world_size(call)
    total = 0
    for item, provider in items:
        if item.type == WriteItemType.SHARD:
            total += provider.nbytes
        else:
            total += provider.nbytes // world
    return total


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []
