"""One save as the thread DCP runs it on sees it, and what it records.

Owns: ``_Save``, held on that thread from ``reset()`` to ``finish()``: the snapshot it claims
from the runtime (``begin``), the checks of DCP's plans against that snapshot and of the
commit records already at its path (``refuse_overwrite``); and the
figures written into the save's ``SaveStats`` when its flush ends (``flushed``), when it is
durable and committed (``done``) or when it fails (``failed``, ``record_failure``); and which
record the writer keeps (``last_stats`` the last good save, ``last_failed_stats`` the last
failed one).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from typing import Any, Protocol

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import InvalidStateDictError, WriterUsageError
from ..format import new_save_id
from ..options import WriterOptions
from ..snapshot.session import SnapshotSession
from ..stats import SaveStats
from ..storage.base import Storage, storage_for
from . import commit as _commit
from . import incremental, path_turns
from .calls import _current_rank, lost_process_group
from .planner import PLANNED_KEY
from .runtime import SnapshotRuntime

logger = logging.getLogger(__name__)


class Keeper(Protocol):
    """The writer, as far as its records go: the last good save's and the last failed one's."""

    last_stats: SaveStats | None
    last_failed_stats: SaveStats | None


class _Save:
    """Per-save state, held thread-locally on the thread DCP runs the save on."""

    def __init__(
        self, path: str, turn: path_turns.Turn, storage_options: Any = None, *, direct: bool = True
    ) -> None:
        self.path = path
        self.turn = turn  # its place among saves to its directory (path_turns.py)
        self.storage_options = storage_options
        self.direct = direct
        self.rank = _current_rank()
        self.is_coordinator = True
        self.use_collectives = True
        # Node-local saves whose ranks name several directories: the ranks sharing the
        # coordinator's, whose files its commit checks (calls._refuse_split_targets).
        self.here: list[int] | None = None
        # StorageMeta.save_id, as stock writers make one; ours says a manifest was committed.
        self.save_id = new_save_id()
        self.session: SnapshotSession | None = None
        self.stats: SaveStats | None = None
        self.started = time.monotonic()
        self.synchronous = False  # a plain dcp.save: no stage(), the caller waits throughout
        self.done = False  # this rank will make no more writer calls for this save

    @property
    def commit_rank(self) -> int | None:
        """Whose commit record this save writes: None for ``.metadata``, else the rank's own."""
        return None if self.use_collectives else self.rank

    @functools.cached_property
    def storage(self) -> Storage:
        return storage_for(self.path, self.storage_options, direct=self.direct)

    @classmethod
    def begin(cls, runtime: SnapshotRuntime, path: str, options: WriterOptions) -> _Save:
        """The first writer call of a save on this thread: new per-save state, and claim the
        snapshot staged for it (claiming first, so that a save dying later is seen dead)."""
        claimed = runtime.claim()
        if claimed is None:
            runtime.check_open_to_save()  # a closed writer finishes staged saves only
        session = stats = None
        if claimed is not None:
            session, (stats, turn) = claimed
        else:
            turn = path_turns.take(path)  # a plain dcp.save takes its turn here
        turn.run_here()
        save = cls(path, turn, options.storage_options, direct=options.direct_writes)
        if session is not None:
            save.session, save.stats, save.started = session, stats, session.created
        return save

    def set_up(self, is_coordinator: bool, **kwargs: Any) -> None:
        """``set_up_storage_writer``: the save's role, and its refusal if the process group it
        was staged in is gone."""
        self.is_coordinator = is_coordinator
        if kwargs.get("rank") is not None:
            self.rank = kwargs["rank"]
        # use_collectives=False (DCP passes it to a "kwargs" parameter): every rank plans,
        # writes and commits on its own, __{rank}_*.distcp and __{rank}.metadata, as stock does.
        self.use_collectives = kwargs.get("use_collectives", True)
        if not self.use_collectives:
            self.is_coordinator = True
        lost = lost_process_group(self.stats) if self.session is not None else None
        if lost is not None:  # an error nobody may wait for: the script is ending
            logger.error("%s", lost)
            raise lost
        if self.stats is None:
            self.stats = SaveStats(checkpoint_id="", rank=self.rank)
        self.stats.checkpoint_id = self.storage.describe("").rstrip("/")
        self.stats.rank = self.rank

    def writers_plan(self, placeholder: SavePlan) -> SavePlan:
        """The local plan of the snapshot this save claimed, in place of DCP's plan of the
        placeholder state dict ``stage()`` returned (``planner.PlannedElsewhere``)."""
        session = self.session
        if session is not None and session.local_plan is not None:
            return session.local_plan
        if session is not None and session.error is not None:
            return placeholder  # planning failed: write_data raises its error, as before
        raise WriterUsageError(
            f"rank {self.rank}: DCP is saving the placeholder state dict that "
            f"DataStatesWriter.stage() returns ({PLANNED_KEY!r}) but this save claimed no "
            "snapshot the writer planned; pass that state dict only to the dcp.async_save "
            "that staged it"
        )

    def check_plan_matches(self, plan: SavePlan) -> None:
        """Raise ``InvalidStateDictError`` where DCP's plan names an item the claimed snapshot
        does not hold, or holds with another shape or dtype."""
        assert self.session is not None
        rank = self.rank
        for item in plan.items:
            provider = self.session.providers.get(item.index)
            if provider is None:
                raise InvalidStateDictError(
                    f"rank {rank}: item {item.index.fqn!r} was not in the state dict given to "
                    "stage(); the state dict changed between staging and saving"
                )
            staged_shape = getattr(provider, "shape", None)
            staged_dtype = getattr(provider, "dtype", None)
            if item.tensor_data is not None and staged_shape is not None:
                shape, staged = tuple(item.tensor_data.chunk.sizes), tuple(staged_shape)
                dtype = item.tensor_data.properties.dtype
                if shape != staged or (staged_dtype is not None and dtype != staged_dtype):
                    raise InvalidStateDictError(
                        f"rank {rank}: tensor {item.index.fqn!r} was staged as {staged_dtype} of "
                        f"shape {staged} but planned as {dtype} of shape {shape}; do not replace "
                        "tensors while a save is staged, and give dcp.async_save a planner that "
                        "plans the state dict as it is"
                    )

    def refuse_overwrite(self, overwrite: bool) -> list[str]:
        """The commit records at the save's path (:func:`commit.commit_records`); raises
        ``RuntimeError`` if there are any and not ``overwrite``: what stock
        ``FileSystemWriter`` raises, with its words first (code matches on them)."""
        records = _commit.commit_records(self.storage, self.commit_rank)
        if records and not overwrite:
            raise RuntimeError(
                "Checkpoint already exists and self.overwrite=False. "
                f"rank {self.rank}: {self.storage.describe(records[0])} exists; save to a new "
                "path, or pass overwrite=True to replace it"
            )
        return records

    def clear_old_records(self, *, overwrite: bool, sync: bool) -> None:
        """Remove the commit records at the save's path before it writes (raises
        ``RuntimeError`` instead if not ``overwrite``)."""
        records = self.refuse_overwrite(overwrite)
        if records:
            _commit.uncommit(self.storage, records, sync=sync)
            logger.warning(
                "overwriting the checkpoint at %s (removed %s first)",
                self.storage.describe(""),
                ", ".join(records),
            )


def flushed(
    writer: Keeper, runtime: SnapshotRuntime, save: _Save, fut: Future[list[WriteResult]]
) -> None:
    """The save's flush ended (on the thread that ended it): its figures, and for a rank that
    does not commit, its record."""
    session, stats = save.session, save.stats
    assert session is not None and stats is not None
    if session.staged_at is not None:
        stats.safe_to_mutate_s = session.staged_at - save.started
    stats.flushed_s = time.monotonic() - save.started
    if fut.exception() is not None or not save.is_coordinator:
        save.done = True
    if fut.exception() is not None:
        failed(writer, save, fut.exception())
        return
    results = fut.result()
    staging = getattr(writer, "_staging", None)  # the writer's; its memo of the last save
    incremental.remember(
        getattr(staging, "increments", None),
        path=save.path,
        rank=save.rank,
        commit_rank=save.commit_rank,
        results=results,
        found=getattr(fut, "evidence", None),
    )
    stats.items = len(results)
    stats.bytes_written = sum(r.size_in_bytes for r in results)
    stats.linked_bytes = incremental.linked_bytes(results)
    stats.pool_bytes = runtime.pool_capacity
    stats.pool_peak_bytes = runtime.pool_peak
    if not save.is_coordinator:
        done(writer, save)


def _session_figures(save: _Save) -> None:
    stats, session = save.stats, save.session
    assert stats is not None
    stats.durable_s = time.monotonic() - save.started
    if session is not None:
        stats.optimizer_wait_s = session.optimizer_wait_s
        stats.forward_frozen_bytes = session.forward_frozen_bytes
        stats.forward_blocked_s = session.forward_blocked_s
        stats.cow_bytes = session.cow_bytes
        stats.cow_blocked_s = session.cow_blocked_s
        stats.live_bytes = session.live_bytes
    if save.synchronous:
        stats.blocked_s = stats.durable_s


def done(writer: Keeper, save: _Save) -> None:
    """The save is over on this rank: its record becomes the writer's ``last_stats``."""
    _session_figures(save)
    assert save.stats is not None
    writer.last_stats = save.stats
    logger.info("%s", save.stats.summary())


def failed(writer: Keeper, save: _Save, error: BaseException) -> None:
    """A failed save gets its own record; ``last_stats`` keeps the last good one."""
    save.done = True
    if save.stats is None:
        return
    _session_figures(save)
    record_failure(writer, save.stats, error)


def record_failure(writer: Keeper, stats: SaveStats, error: BaseException) -> None:
    """Mark ``stats`` as a failed save's and keep it as the writer's ``last_failed_stats``."""
    if stats.error is None:
        stats.error = f"{type(error).__name__}: {error}"
        logger.error("%s", stats.summary())
    writer.last_failed_stats = stats
    if writer.last_stats is stats:  # pragma: no cover - a committed save cannot fail later
        writer.last_stats = None
