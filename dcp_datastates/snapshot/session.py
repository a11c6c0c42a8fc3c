"""The snapshot of one save on one rank: :class:`SnapshotSession`, its pieces' state machine.

Owns: every change of a piece's state (admit, copy, drop, abort, the live writes from
``claim_live`` to ``stop_live``), waiting for a piece (``wait``, ``fence_on_device``) and
retiring the session; they share one lock. Not here: the pieces and their layout
(``pieces.py``), admitting and copying them (``scheduler.py``), writing them (``save/flush.py``).

A *piece* is one unit of pool admission: a chunk of a big tensor, or several tiny tensors
coalesced. Each piece moves through these states (the names are used in code and logs)::

    PENDING --reserve pool block--> ADMITTED --copy + version check--> COPIED --flushed--> RELEASED
       |                                |                                          ^
       +--(no item needs it)--> SKIPPED +--(copy failed / save aborted)--> FAILED --+
       |                                |
                                        |
                                        +--(flush writes it live)--> LIVE --+--> WRITTEN
                                                                            +--> COPIED (rest)

A piece of a contiguous host tensor may be written by the flush from the live tensor instead
(``claim_live``): while no copy has started on it and the save is live, the flush claims it
(LIVE) and reads it a step at a time into its file's buffer, which the disk then writes
(``LiveWrite``); once every byte is read it checks that the tensor did not change (WRITTEN: its
pool block goes back unused). A step that begins (``stop_live``), or the last copy ending,
*takes the write over* (``take_over_live``): what the flush has not read yet is copied into the
piece's pool block there and then, and the flush writes that from there (COPIED). So ``staged``
waits for at most one step's read from memory per live piece, never for a disk write. A copy
worker skips a LIVE piece, and ``staged`` waits for it.
The flush of a session whose pool holds all of it writes such pieces from the back of the
state while the copies go from the front (``flush.py``), so what the flush reads before the
copies get there is never copied into the pool.

A piece is released when every item slice that refers to it was flushed or dropped (``refs``).

A session is *retired* once its save is over (flushed, failed or dropped) and no copy is in
flight: it then lets go of its providers, and so of the caller's tensors.

A piece is COPIED only once its copy is done, on any device (``scheduler.py`` says how); the
optimizer-step guard may *fence* on the device instead of waiting (:meth:`fence_on_device`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from .._concurrency.latch import Latch
from ..errors import SnapshotAbortedError
from ..providers import StateProvider
from ..providers.tensor import host_copy
from .device import CPU, CopyDevice, for_providers, source_of
from .pieces import (
    ADMITTED,
    COPIED,
    FAILED,
    LIVE,
    PENDING,
    RELEASED,
    SKIPPED,
    WRITTEN,
    LiveWrite,
    Piece,
    Slice,
    lay_out,
)
from .pool import HostPool


class SnapshotSession:
    """The snapshot of one save on one rank.

    ``items`` are (key, provider) pairs in snapshot order; ``key`` is the DCP ``MetadataIndex``.
    ``staged`` resolves once every piece is copied, skipped or the session aborted: from then on
    the caller may mutate the state (the save's outcome is reported by the flush stage).
    """

    def __init__(
        self,
        items: Sequence[tuple[Any, StateProvider]],
        *,
        pool: HostPool | None,
        chunk_bytes: int,
        coalesce_bytes: int,
        rank: int,
        device: CopyDevice | None = None,
        deferred: bool = False,
    ) -> None:
        self.rank = rank
        self.pool = pool  # None only while a deferred session is not planned yet
        self.providers: dict[Any, StateProvider] = {}
        self.slices: dict[Any, list[Slice]] = {}
        self.pieces: list[Piece] = []
        self.staged: Future[None] = Future()
        self.staged.set_running_or_notify_cancel()
        self.error: BaseException | None = None
        self.created = time.monotonic()
        self.staged_at: float | None = None
        self.owner: threading.Thread | None = None  # the DCP thread that flushes it
        #: The DCP ``SavePlan`` the items came from, when they were planned by the writer: the
        #: save thread's planner reuses it (``planner.StagedSavePlanner``).
        self.local_plan: Any = None
        self.flush_started = False
        self.flush_done = False
        #: Seconds optimizer steps waited for this session (set by the guard).
        self.optimizer_wait_s = 0.0
        #: Bytes copied on the caller's thread (``freeze``) at stage() and at the forward gate.
        self.eager_bytes = 0
        self.forward_frozen_bytes = 0
        self.forward_blocked_s = 0.0
        #: Bytes copied before a write reached them (``cow.py``), and the writes' wait for it.
        self.cow_bytes = 0
        self.cow_blocked_s = 0.0
        #: Bytes the flush wrote straight from the live tensors (never copied).
        self.live_bytes = 0
        #: Whether the flush may write pieces from the live tensors (``claim_live``): set by the
        #: runtime for a host session its pool holds whole; cleared when a step begins.
        self.live = False
        #: Parts the flush may write from the live tensor (big contiguous host tensors).
        self.live_parts = 0
        self._live_inflight = 0  # LIVE pieces (under _lock)
        self._live_writes: list[LiveWrite] = []  # their writes, until ended (under _lock)
        self._step_began = False  # stop_live was called: start_live refuses
        self._lock = threading.Lock()
        self._unfinished = 0
        self._retiring = False
        self.retired = False
        #: Called (once, on any thread) when the session has retired.
        self.on_retired: Callable[[SnapshotSession], None] | None = None
        #: Set once the items are known: at once, or by :meth:`plan` for a ``deferred`` session
        #: (``stage()`` recorded the state; the planning thread plans it, ``capture.py``).
        self.planned = Latch()
        #: Set once the flush of a host copy may start without slowing the snapshot: the
        #: snapshot is staged (or aborted), or it waits for pool space only a flush can free.
        self.flush_may_start = Latch()
        self.fenced = False  # the step's stream waits on every copy (the guard's fence)
        if deferred:
            self.device = CPU
            self.gate = None
            return
        self._build(items, chunk_bytes, coalesce_bytes)
        self.planned.set()
        self.device: CopyDevice = device or for_providers(list(self.providers.values()))
        # stage(), training thread: copy streams wait for what the producing streams queued.
        self.gate: Any = (
            None if self.device.synchronous else self.device.gate(list(self.providers.values()))
        )

    # -- planning --------------------------------------------------------------------------
    def plan(
        self,
        items: Sequence[tuple[Any, StateProvider]],
        *,
        pool: HostPool,
        chunk_bytes: int,
        coalesce_bytes: int,
    ) -> bool:
        """Give a ``deferred`` session its items (host copies only); False if it was dropped
        meanwhile (then it stays empty and is never started)."""
        with self._lock:
            if self.error is None and not self._retiring:
                self.pool = pool
                self._build(items, chunk_bytes, coalesce_bytes)
            planned = self.pool is not None
            self.planned.set()
        return planned

    def plan_failed(self, error: BaseException) -> None:
        """Planning a deferred session raised ``error``: the save reports it (its flush)."""
        self.abort(error)
        self.planned.set()

    def _build(self, items: Sequence[tuple[Any, StateProvider]], chunk: int, small: int) -> None:
        layout = lay_out(items, chunk, small)
        self.providers.update(layout.providers)
        self.slices.update(layout.slices)
        self.pieces.extend(layout.pieces)
        self.live_parts += layout.live_parts
        self._unfinished = len(self.pieces)
        if not self.pieces:
            self._mark_staged()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    # -- state changes ---------------------------------------------------------------------
    def _mark_staged(self) -> None:
        self.flush_may_start.set()
        if not self.staged.done():
            self.staged_at = time.monotonic()
            self.staged.set_result(None)

    def _finished_one(self) -> None:
        # caller holds self._lock
        self._unfinished -= 1
        if self._unfinished == 0:
            self._mark_staged()

    def admit(self, piece: Piece, offset: int) -> bool:
        """Record the pool block of ``piece``; False if the piece is no longer needed."""
        with self._lock:
            if piece.state != PENDING:
                self.pool.release(offset)
                return False
            piece.state, piece.offset = ADMITTED, offset
        piece.admitted.set()
        return True

    def start_copy(self, piece: Piece) -> bool:
        """A copy worker takes ``piece``; False if the flush is writing it from the live tensor
        (which then owns its block)."""
        with self._lock:
            if piece.state == ADMITTED:
                piece.copying = True
                return True
            return False

    def wait_admitted(self, piece: Piece) -> None:
        """Wait until ``piece`` has its pool block or is done: a live write may claim it then."""
        if piece.state == PENDING:
            piece.admitted.wait()

    def claim_live(self, piece: Piece, write: LiveWrite) -> bool:
        """Whether the flush writes ``piece`` from the live tensor (``write``): it is admitted
        (its pool block takes what is left if the write is taken over), no copy started on it,
        and the save is live. Then it is LIVE until ``write`` ends (:meth:`end_live_write`)."""
        with self._lock:
            if self.hurry() or piece.copying or piece.state != ADMITTED:
                return False
            assert self.pool is not None
            write.dst = self.pool.view(piece.offset + write.at, write.n).data_ptr()
            piece.state = LIVE
            self._live_inflight += 1
            self._live_writes.append(write)
            return True

    def end_live_write(self, write: LiveWrite, error: BaseException | None = None) -> None:
        """End ``write`` (the caller holds its ``lock``; not ended yet): copy what the flush has
        not read into the pool, check the tensor (version counter, stage-time probes) and
        finish the piece: WRITTEN if the flush read all of it, else COPIED; FAILED, with
        ``error`` or the check's, where either failed. Never raises: the error is the
        session's, and ``write.error`` for the flush."""
        write.ended = True
        rest = write.n - write.read
        try:
            if error is None and rest:
                host_copy(write.dst + write.read, write.src + write.read, rest)
        except BaseException as exc:
            error = exc
        try:
            write.provider.end_live(write.view, write.start, write.stop)
        except BaseException as exc:
            error = error or exc
        write.error = error
        with self._lock:
            self._live_writes.remove(write)
        self.live_done(write.piece, write.read, error, rest_copied=rest > 0)

    def take_over_live(self) -> None:
        """End every live write now (:meth:`end_live_write`: the flush's unread bytes are
        copied into the pool here): an optimizer step begins, or every other piece is done, and
        ``staged`` must not wait for the flush's next disk write."""
        with self._lock:
            writes = list(self._live_writes)
        for write in writes:
            with write.lock:
                if not write.ended:
                    self.end_live_write(write)

    def hurry(self) -> bool:
        """Whether a live write should stop reading the live tensor and copy the rest of its
        piece into the pool: an optimizer step began, the save failed, or every other piece is
        done (so ``staged`` waits only for live writes)."""
        return not self.live or self.error is not None or self._unfinished <= self._live_inflight

    def live_done(
        self, piece: Piece, nbytes: int, error: BaseException | None, *, rest_copied: bool
    ) -> None:
        """The LIVE ``piece``'s write ended (:meth:`end_live_write`): ``nbytes`` of it read by
        the flush from the live tensor, and the rest copied into its pool block
        (``rest_copied``: then it is COPIED, its block released once flushed) or none (WRITTEN,
        block released now); or it failed with ``error``."""
        with self._lock:
            self._live_inflight -= 1
            if error is not None:
                piece.state = FAILED
                if self.error is None:
                    self.error = error
                self._release(piece)
            elif rest_copied:
                piece.state = COPIED
            else:
                piece.state = WRITTEN
                if piece.offset >= 0:
                    self.pool.release(piece.offset)
                    piece.offset = -1
            self.live_bytes += nbytes
            self._finished_one()
            retire = self._retiring and self._quiet()
        self._finished(piece, error, retire)

    def start_live(self) -> bool:
        """Let the flush write from the live tensors (the runtime, as the flush starts), unless
        an optimizer step began already or the snapshot is staged; returns ``live``."""
        with self._lock:
            self.live = not self._step_began and not self.staged.done()
            return self.live

    def stop_live(self) -> None:
        """An optimizer step begins: no more writes from the live tensors (the step changes
        them), from now on; one in flight copies the rest of its piece into the pool
        (``hurry``)."""
        with self._lock:
            self._step_began = True
            self.live = False
        self.take_over_live()

    def copied(self, piece: Piece, error: BaseException | None) -> None:
        with self._lock:
            if piece.state == ADMITTED:
                piece.state = FAILED if error else COPIED
            if error is not None and self.error is None:
                self.error = error
            if piece.refs == 0 or self.error is not None:
                self._release(piece)
            self._finished_one()
            retire = self._retiring and self._quiet()
            # The last other piece is done: live writes must not make staged wait for a disk.
            take_over = 0 < self._live_inflight >= self._unfinished
        self._finished(piece, error, retire)
        if take_over:
            self.take_over_live()

    def _finished(self, piece: Piece, error: BaseException | None, retire: bool) -> None:
        # outside self._lock: a piece just done (copied, written live or failed)
        piece.finish()
        if error is not None:
            self.abort(error)
        if retire:
            self._retire_now()

    def _release(self, piece: Piece) -> None:
        # caller holds self._lock
        if piece.offset >= 0 and piece.state in (ADMITTED, COPIED, FAILED):
            self.pool.release(piece.offset)
            piece.offset = -1
            piece.state = RELEASED

    def drop(self, slice_: Slice) -> None:
        """The item slice was flushed (or is not ours to write): release the piece when unused."""
        piece = slice_.piece
        with self._lock:
            piece.refs -= 1
            if piece.refs > 0:
                return
            if piece.state == PENDING:
                piece.state = SKIPPED
                self._finished_one()
                piece.finish()
            elif piece.state == COPIED:
                self._release(piece)
            # ADMITTED: the copy in flight releases it when it completes.

    def abort(self, error: BaseException) -> None:
        """Give up: release every block, wake waiters; ``error`` is what the flush stage raises."""
        with self._lock:
            if self.error is None:
                self.error = error
            for piece in self.pieces:
                if piece.state == PENDING:
                    piece.state = SKIPPED
                    self._finished_one()
                elif piece.state in (COPIED, FAILED):
                    self._release(piece)
                if piece.state != ADMITTED:
                    piece.finish()
            if not self.planned.is_set():
                self._mark_staged()  # never planned: nothing will be copied from the state
        self.flush_may_start.set()
        if self.pool is not None:
            self.pool.wake()

    @property
    def aborted(self) -> bool:
        return self.error is not None

    def add_optimizer_wait(self, seconds: float) -> None:
        self.optimizer_wait_s += seconds

    def raw_providers(self) -> list[StateProvider]:
        """Providers with bytes to copy into the pool (tensors), in snapshot order."""
        return [p for p in self.providers.values() if p.nbytes > 0]

    def freeze_small(self, max_bytes: int) -> int:
        """Copy, on the caller's thread, every tensor of at most ``max_bytes``: later writes to
        such tensors (counters, small statistics) cannot reach the snapshot. Returns bytes."""
        frozen = [
            (provider, provider.freeze())
            for provider in self.providers.values()
            if getattr(provider, "freeze", None) is not None and 0 < provider.nbytes <= max_bytes
        ]
        self.after_freeze([provider for provider, made in frozen if made])
        self.eager_bytes += (copied := sum(made for _, made in frozen))
        return copied

    def after_freeze(self, providers: Sequence[StateProvider]) -> None:
        """``providers`` just took private copies (``freeze()``) on this thread: device copies
        read them once made (``CopyDevice.after_freeze``, which says what happens without)."""
        made = [t for p in providers if (t := source_of(p)) is not None]
        if made and not self.device.synchronous:
            self.device.after_freeze(made)

    # -- retiring --------------------------------------------------------------------------
    def _quiet(self) -> bool:
        # caller holds self._lock: no copy is running or will start
        return all(p.state not in (ADMITTED, LIVE) for p in self.pieces) and (
            self.aborted or all(p.state != PENDING for p in self.pieces)
        )

    def retire(self) -> None:
        """The save is over (flushed, failed or dropped): once no copy is in flight, release the
        providers and with them every reference to the caller's tensors."""
        with self._lock:
            if self._retiring:
                return
            self._retiring = True
            now = self._quiet()
        if now:
            self._retire_now()

    def _retire_now(self) -> None:
        with self._lock:
            if self.retired:
                return
            self.retired = True
            providers = list(self.providers.values())
            for piece in self.pieces:
                piece.parts = []
        for provider in providers:
            release = getattr(provider, "release", None)
            if release is not None:
                release()
        self.providers = {}
        self.slices = {}
        if self.on_retired is not None:
            self.on_retired(self)

    @property
    def finished(self) -> bool:
        """No piece holds pool memory any more, nor will."""
        return self.aborted or all(p.state in (RELEASED, SKIPPED, WRITTEN) for p in self.pieces)

    def fence_on_device(self) -> bool:
        """Make the calling thread's current streams wait for every copy instead of the host.

        Waits on the host only until each piece is enqueued (pieces waiting for pool space, or
        with host parts, are waited for whole); checks versions at a piece's first fence only
        (``Piece.first_fence``). False when the device copies synchronously (the host waits).
        """
        if self.device.synchronous:
            return False
        for piece in self.pieces:
            piece.enqueued.wait()
            if piece.done.is_set():
                continue
            completion = piece.completion
            if completion is None or not completion.fence():
                piece.done.wait()
                continue
            error = piece.first_fence(self.rank, self._lock)
            if error is not None:
                self.abort(error)
        self.fenced = True
        return True

    def live_rest(self, write: LiveWrite) -> memoryview:
        """The bytes a taken-over ``write`` left unread, in its piece's pool block (COPIED)."""
        return self.pool.memoryview(
            write.piece.offset + write.at + write.read, write.n - write.read
        )

    def ready(self, slice_: Slice) -> bool:
        """Whether ``wait(slice_)`` returns (or raises) without waiting."""
        return slice_.piece.done.is_set()

    def wait(self, slice_: Slice) -> memoryview:
        """Block until the slice's piece is copied; its bytes as a memoryview of the pool."""
        piece = slice_.piece
        piece.done.wait()
        if self.error is not None:
            raise self.error
        if piece.state != COPIED:
            raise SnapshotAbortedError(
                f"rank {self.rank}: snapshot piece {piece.seq} is {piece.state}, not COPIED"
            )
        return self.pool.memoryview(piece.offset + slice_.start, slice_.length)
