"""The scheduler: admits queued sessions' pieces into the host pool, in order, and copies them.

Owns: :class:`SnapshotScheduler` (one thread per writer, across saves; copy workers; a completion
thread for asynchronous devices), the copy of one piece (``_copy_piece``), and stopping every
scheduler thread before the interpreter finalizes (``_stop_at_exit``, registered with
``atexit``; a forked child forgets its parent's).
Not here: the pieces' states and their transitions (``pieces.py``, ``session.py``): a scheduler
only calls the session's ``admit``, ``start_copy`` and ``copied``.

Pieces are admitted strictly in sequence order by one scheduler thread per writer, across saves,
and the flush stage consumes each file's pieces in that same order; with no piece larger than the
pool this guarantees progress (the oldest unreleased piece is always either being copied into free
space or next in line for its file's flusher).

Copies go through the session's device layer (``device.py``). On the CPU a copy worker copies and
checks the source's version counter, then marks the piece COPIED. On a device with asynchronous
copies (CUDA, the test fake) the worker only *enqueues* the copy (gated on the events ``stage()``
recorded on the producing streams) and checks versions at enqueue time; one completion thread
per scheduler waits on each piece's own completion event, in enqueue order, checks versions again
and only then marks it COPIED: no flush reads a pool block, and no abort frees one, before its
copy is done. The optimizer-step guard may *fence* instead of waiting
(:meth:`SnapshotSession.fence_on_device`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

from .._concurrency.workers import JobThreads
from ..errors import SnapshotMutationError
from .device import Completion, source_of
from .pieces import PENDING, Piece
from .pool import HostPool
from .session import SnapshotSession

logger = logging.getLogger(__name__)


#: Schedulers not yet freed, and their threads, for :func:`_stop_at_exit`. The threads apart:
#: a scheduler dies on its own thread (its last reference is that thread's target), and the
#: thread runs on while it frees what the scheduler held.
_LIVE_SCHEDULERS: weakref.WeakSet[SnapshotScheduler] = weakref.WeakSet()
_SCHEDULER_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: How long the interpreter's exit waits for schedulers to wind down, in all.
EXIT_WAIT_S = 10.0


def _after_fork_in_child() -> None:  # their threads are the parent's: nothing to stop at exit
    _LIVE_SCHEDULERS.clear()
    _SCHEDULER_THREADS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _stop_at_exit() -> None:
    """Stop every scheduler thread and wait for it, before the interpreter finalizes.

    The scheduler thread is a daemon (an idle one must not hold the process up), and a
    dropped writer's scheduler frees the pool on it (``stop(on_exit=pool.discard)``). Freeing
    the pool's ``mmap`` releases the GIL around ``munmap``; a daemon thread taking the GIL back
    once finalization has begun is ended by ``pthread_exit``, whose unwinding through torch's
    buffer deleter called ``std::terminate``: a script that dropped a writer and exited at once
    aborted ("terminate called without an active exception", exit status 134) in about half of
    its runs here. ``atexit`` handlers run before finalization."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler._queue.put(None)  # a second stop is harmless: the thread ends at the first
    for thread in list(_SCHEDULER_THREADS):
        thread.join(max(0.0, deadline - time.monotonic()))


class SnapshotScheduler:
    """Admits pieces of queued sessions into the pool, in order, and runs their copies."""

    def __init__(self, pool: HostPool, *, copy_workers: int, on_stall: Callable[[], None]) -> None:
        self.pool = pool
        self._on_stall = on_stall
        self._on_exit: Callable[[], None] | None = None
        self._queue: queue.SimpleQueue[SnapshotSession | None] = queue.SimpleQueue()
        self._copies = JobThreads(copy_workers, "datastates-copy")
        self._thread = threading.Thread(target=self._run, name="datastates-snapshot", daemon=True)
        self._thread.start()
        _LIVE_SCHEDULERS.add(self)
        _SCHEDULER_THREADS.add(self._thread)
        # Started on the first asynchronous copy: the CPU path has no completion thread.
        self._completions: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._completer: threading.Thread | None = None
        self._completer_lock = threading.Lock()

    def submit(self, session: SnapshotSession) -> None:
        self._queue.put(session)

    def start_copy_workers(self) -> None:
        """Start the copy workers now rather than with the first copy (``warm_up``)."""
        self._copies.start()

    def close(self) -> None:
        """Stop after the queued sessions; wait for the threads (unless called on one of them)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def stop(self, on_exit: Callable[[], None]) -> None:
        """Stop after the queued sessions without waiting (safe from a finalizer on any thread);
        ``on_exit`` runs on the scheduler thread once every copy has finished."""
        self._on_exit = on_exit
        self._queue.put(None)

    def _run(self) -> None:
        try:
            while (session := self._queue.get()) is not None:
                try:
                    self._admit_all(session)
                except BaseException as exc:  # never let an error die in this thread
                    logger.exception("rank %d: snapshot scheduling failed", session.rank)
                    session.abort(exc)
                # Not held while waiting for the next: the session (a failed one's error with
                # it, whose traceback holds the frames of the save that failed, its writer's
                # among them) would live on until the next save.
                session = None
        finally:
            self._copies.shutdown()
            with self._completer_lock:
                completer, self._completer = self._completer, None
            if completer is not None:  # every enqueued copy completes (and frees its block) first
                self._completions.put(None)
                completer.join()
            if self._on_exit is not None:
                self._on_exit()

    def _admit_all(self, session: SnapshotSession) -> None:
        for piece in session.pieces:
            if session.aborted:
                return
            if piece.state != PENDING:
                continue
            offset = self.pool.reserve(
                piece.nbytes,
                cancelled=lambda piece=piece: session.aborted or piece.state != PENDING,
                on_stall=self._on_stall,
                on_full=session.flush_may_start.set,
            )
            if offset is None or not session.admit(piece, offset):
                continue
            if session.device.synchronous:
                self._copies.submit(_copy_piece, session, piece)
            else:
                self._copies.submit(self._enqueue_piece, session, piece)

    def _enqueue_piece(self, session: SnapshotSession, piece: Piece) -> None:
        error: BaseException | None = None
        completion: Completion | None = None
        # What each part is copied from now: a part whose provider takes a private copy later
        # is copied again from it once this copy is done (_recopy_frozen).
        read = [source_of(provider) for provider, _, _, _ in piece.parts]
        try:
            dst = session.pool.view(piece.offset, piece.nbytes)
            completion = session.device.copy(piece.parts, dst, session.gate)
            piece.completion = completion
            # Checked at enqueue time: a change since stage() was queued before the copy.
            piece.check_unchanged(session.rank)
        except BaseException as exc:
            error = exc
        piece.enqueued.set()
        if completion is None:
            session.copied(piece, error)
            return
        with self._completer_lock:
            if self._completer is None:
                self._completer = threading.Thread(
                    target=self._complete, name="datastates-copy-done", daemon=True
                )
                self._completer.start()
        self._completions.put((session, piece, completion, error, read))

    def _complete(self) -> None:
        while (job := self._completions.get()) is not None:
            session, piece, completion, error, read = job
            try:
                completion.wait()
            except BaseException as exc:
                error = error or exc
            if error is None:
                try:
                    _recopy_frozen(session, piece, read)
                except BaseException as exc:  # fenced or not: the bytes in the pool are wrong
                    error = exc
            if error is None:
                try:
                    piece.check_unchanged(session.rank)
                except SnapshotMutationError as exc:
                    # A fenced piece's versions were checked at the fence, before the step
                    # could enqueue its kernels; the bumps since are queued behind the copy.
                    if not piece.fenced:
                        error = exc
                except BaseException as exc:
                    error = exc
            try:
                session.copied(piece, error)
            except BaseException:  # never let an error die in this thread
                logger.exception("rank %d: completing snapshot piece %d", session.rank, piece.seq)
            job = session = piece = error = read = None  # not held while waiting (_run says why)


def _recopy_frozen(session: SnapshotSession, piece: Piece, read: list) -> None:
    """Parts whose provider took a private copy (``freeze``: buffers the forward gate saved,
    copy-on-write) after their copy was enqueued are copied again from it: that copy read the
    live tensor, which may have changed since. Through the session's device, like the first
    copy: on a GPU the copy stream waits for the clone to be made (``CudaDevice``), where a
    copy on this thread's stream would be ordered after it only under the legacy default
    stream."""
    parts = [
        part
        for part, before in zip(piece.parts, read, strict=True)
        if (now := source_of(part[0])) is not None and now is not before
    ]
    if not parts:
        return
    dst = session.pool.view(piece.offset, piece.nbytes)
    again = session.device.copy(parts, dst, session.gate)
    if again is not None:
        again.wait()


def _copy_piece(session: SnapshotSession, piece: Piece) -> None:
    if not session.start_copy(piece):  # the flush wrote it from the live tensor
        return
    error: BaseException | None = None
    try:
        for provider, start, stop, at in piece.parts:
            if session.aborted:  # dropped meanwhile: do not read (nor wait for) its sources
                error = session.error
                break
            provider.copy_into(session.pool.view(piece.offset + at, stop - start), start, stop)
            # Checked after the copy: a bump before or during it means the bytes may be torn.
            provider.check_unchanged(session.rank)
    except BaseException as exc:
        error = exc
    session.copied(piece, error)
