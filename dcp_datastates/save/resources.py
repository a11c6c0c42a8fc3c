"""What a writer's runtime allocates once and reuses: the host pool, sized here, and its threads.

Owns the automatic pool size (``auto_pool_bytes`` from ``physical_memory`` and
``local_world_size``), :class:`Resources` (pool, snapshot scheduler, running flushes), the
check that a session's pieces fit the pool, and :class:`SaveThreads`. Holds no lock: the
runtime (``runtime.py``) makes and gives back a ``Resources`` under its own. May import
``snapshot``, ``options`` and ``errors``; nothing else of ``save/``.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from ..errors import InvalidStateDictError
from ..options import MiB, WriterOptions
from ..snapshot.pool import HostPool, block_slack
from ..snapshot.scheduler import SnapshotScheduler
from ..snapshot.session import SnapshotSession
from ..storage.base import Storage
from .flush import flush

#: Smallest automatically sized pool.
MIN_AUTO_POOL = 16 * MiB
#: Most saves of one writer that run at once on its save threads (``run_save``); a save
#: beyond them would wait for one to end, and its snapshot's claim with it.
MAX_SAVE_THREADS = 32


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def local_world_size() -> int:
    """Ranks on this node, from the launcher's environment (torchrun, Open MPI); 1 if unknown."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def auto_pool_bytes(options: WriterOptions, expected_bytes: int) -> int:
    """The automatic pool size: what this rank will write and its blocks' rounding
    (``block_slack``), capped at this rank's share of the node (``max_pool_fraction`` of
    physical memory divided by ``LOCAL_WORLD_SIZE``)."""
    cap = int(physical_memory() * options.max_pool_fraction) // local_world_size()
    need = int(expected_bytes) + block_slack(int(expected_bytes), options.coalesce_bytes)
    return max(MIN_AUTO_POOL, min(need, cap))


class Resources:
    """What a runtime allocates once, on the first save, and reuses: pool and threads."""

    def __init__(self, options: WriterOptions, pool_bytes: int, on_stall: Any) -> None:
        self._options = options
        self.pool = HostPool(pool_bytes, populate=True)
        self.chunk_bytes = options.effective_chunk_bytes(self.pool.capacity)
        self.coalesce_bytes = min(options.coalesce_bytes, self.chunk_bytes)
        self.scheduler = SnapshotScheduler(
            self.pool,
            copy_workers=options.effective_copy_workers(local_world_size()),
            on_stall=on_stall,
        )
        self.live_flush = options.effective_live_flush(local_world_size())
        self.flushes: set[Future[Any]] = set()  # running flushes, which close() waits for

    def flush(
        self,
        session: SnapshotSession,
        storage: Storage,
        items: Sequence[WriteItem],
        prefix: str,
        transforms: Sequence[Any] = (),
    ) -> Future[Any]:
        """Start writing ``items`` of ``session`` (one the runtime let flush) on the flush
        threads, tracked until it resolves; ``transforms``: stream transforms for every record
        (``transforms.py``)."""
        # Host copies whose pool holds the whole session: the flush writes what the copies
        # have not reached straight from the live tensors (snapshot/session.py, flush.py), from
        # now on. Not through transforms: a live write goes straight to a direct file.
        if (
            self.live_flush
            and not transforms
            and session.live_parts > 0
            and session.device.synchronous
            and session.pool is not None
            and session.nbytes <= session.pool.capacity
        ):
            session.start_live()
        result = flush(
            storage=storage,
            items=items,
            session=session,
            prefix=prefix,
            workers=self._options.flush_workers,
            sync=self._options.sync_files,
            nice=self._options.flush_nice,
            incremental=self._options.incremental,
            transforms=transforms,
            # Other host copies: writes started while the snapshot copies take cores and memory
            # bandwidth from it on a small machine, and the copy is what the caller waits for.
            # The flush threads wait until the snapshot is staged, or needs pool space that only
            # a flush can free (a state larger than the pool still streams).
            start_after=(
                session.flush_may_start if session.device.synchronous and not session.live else None
            ),
        )
        self.track(result)
        return result

    def track(self, flush: Future[Any]) -> None:
        self.flushes.add(flush)
        flush.add_done_callback(self.flushes.discard)

    def wait_for_flushes(self) -> None:
        concurrent.futures.wait(list(self.flushes))

    def close(self) -> None:
        self.wait_for_flushes()
        self.scheduler.close()  # waits for copies in flight; they release their blocks
        self.pool.close()

    def abandon(self) -> None:
        """Stop without waiting (from a finalizer): the threads exit once their copies end and
        then drop the pool's buffer."""
        self.scheduler.stop(on_exit=self.pool.discard)


def check_fits(session: SnapshotSession, pool: HostPool) -> None:
    """Refuse a session with a piece larger than the whole pool: it could never be copied."""
    for piece in session.pieces:
        if piece.nbytes > pool.capacity:
            fqn = piece.parts[0][0].fqn
            raise InvalidStateDictError(
                f"rank {session.rank}: a row of non-contiguous tensor {fqn!r} needs "
                f"{piece.nbytes} bytes, more than the {pool.capacity}-byte host pool; "
                "raise host_pool_bytes or save a contiguous copy"
            )


class SaveThreads:
    """The writer's save threads (``dcp_datastates.async_save``), made at the first save and
    kept between saves; one per save running at once."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, save: Any, *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                MAX_SAVE_THREADS, thread_name_prefix="datastates-save"
            )
        return self._pool.submit(save, *args)

    def start(self) -> None:
        """Start one thread now (``warm_up``): the pool starts a thread for its first job,
        which then waits idle for the first save."""
        self.submit(int)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
