"""The flush stage: writes each item to storage as soon as its snapshot pieces land.

Items are spread over ``flush_workers`` files per rank (``__{rank}_{n}.distcp``), balanced by
bytes, each file keeping snapshot order; one thread writes one file, front to back, fsyncs it
once, and releases every piece back to the pool as soon as its bytes are written. A big
tensor's bytes go to a direct local file straight from the pool (``localfile.py``), the record
padded so that they lie in the file at their pool address modulo a block.

A *live* session (its pool holds all of it, host tensors; ``SnapshotSession.live``) is also
written from the live tensors: each file then puts its big host tensors first, from the back of
the snapshot order, and writes each of their pieces that no copy has started on from the live
tensor (``claim_live``, ``TensorProvider.begin_live``), a step at a time through the file's
buffer, while the copies go from the front; what the flush reads before the copies get there is
never copied into the pool. Such a piece lies in the pool at its source address modulo a block
(``pieces.lay_out``), so one padding suits both paths. Once an optimizer step
begins (``stop_live``) or the copies are done, the rest is copied into the pool and comes from
there (``take_over_live``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from crc32c import crc32c
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .._concurrency.latch import Latch
from .._concurrency.priority import lower_thread_priority
from ..errors import DataStatesError, StorageWriteError
from ..format import DATA_SUFFIX, RecordInfo
from ..snapshot.pieces import LiveWrite
from ..snapshot.session import SnapshotSession
from ..storage import localfile
from ..storage.base import Storage, _write_error
from . import incremental as _incremental
from . import transforms as _transforms

logger = logging.getLogger(__name__)


def assign_files(
    items: Sequence[WriteItem], session: SnapshotSession, n_files: int
) -> list[list[WriteItem]]:
    """Split items over at most ``n_files`` files, balanced by bytes, each in snapshot order
    (in a live session, its big host tensors first, from the back: ``live_first``)."""
    order = {key: i for i, key in enumerate(session.providers)}
    ordered = sorted(items, key=lambda item: order[item.index])
    files: list[list[WriteItem]] = [[] for _ in range(max(1, min(n_files, len(ordered))))]
    loads = [0] * len(files)
    for item in ordered:
        target = loads.index(min(loads))
        files[target].append(item)
        provider = session.providers[item.index]
        payload = provider.payload
        loads[target] += provider.nbytes + (len(payload) if payload is not None else 0) + 2048
    if session.live:
        files = [live_first(f, session) for f in files]
    return [f for f in files if f]


def live_first(items: list[WriteItem], session: SnapshotSession) -> list[WriteItem]:
    """``items`` (in snapshot order) with those the flush may write from the live tensor first,
    last to first, then the rest in order: the copies go from the front of the snapshot, so the
    flush starts where they will come last. A pool that holds the whole session never makes a
    piece wait for another piece's flush, so the order cannot stall the snapshot."""
    live = [item for item in items if _live_skew(session.providers[item.index]) is not None]
    if not live:
        return items
    chosen = {id(item) for item in live}
    return live[::-1] + [item for item in items if id(item) not in chosen]


def _live_skew(provider: Any) -> int | None:
    skew = getattr(provider, "live_skew", None)
    return skew(0) if skew is not None else None


#: Tensor records with at most this much data are joined and written whole (one write, one
#: checksum per record instead of three: thousands of small tensors a save).
_JOINED_MAX = 64 << 10


def _wait(session: SnapshotSession, slice_: Any, submit: Any) -> memoryview:
    """The slice's bytes once copied; a direct file first writes what it queued from the pool
    (``submit``), so that it never holds pool blocks while the snapshot waits for space."""
    if submit is not None and not session.ready(slice_):
        submit()
    return session.wait(slice_)


def _record_parts(session: SnapshotSession, provider: Any, key: Any, submit: Any) -> Iterator[Any]:
    """A record's bytes in order, for a transformed record (``transforms.py``): each piece of
    the pool goes back once the next part is asked for (the transforms have taken it)."""
    if provider.payload is not None:
        yield provider.payload
        return
    yield provider.frame.head
    for slice_ in session.slices[key]:
        yield _wait(session, slice_, submit)
        session.drop(slice_)
    yield provider.frame.tail


def _flush_file(
    storage: Storage,
    name: str,
    items: list[WriteItem],
    session: SnapshotSession,
    *,
    sync: bool,
    transforms: Sequence[Any] = (),
) -> list[WriteResult]:
    results: list[WriteResult] = []
    pos = 0
    with storage.open_write(name, sync=sync) as f:
        # A direct local file writes a big tensor's bytes from the pool, if they start on a
        # block of the file (localfile.py): pad before such a record so that they do.
        external = getattr(f, "write_external", None)
        submit = getattr(f, "submit", None)
        live = session.live and external is not None
        for item in items:
            provider = session.providers[item.index]
            if transforms:  # compressed (or otherwise transformed) as it is written
                parts = _record_parts(session, provider, item.index, submit)
                kind = provider.kind
                done = _transforms.write_record(
                    f, transforms, parts, name=name, offset=pos, index=item.index, kind=kind
                )
                results.append(done)
                pos += done.size_in_bytes
                continue
            payload = provider.payload
            if payload is not None:
                start = pos
                f.write(payload)
                crc = crc32c(payload)
                data_offset, data_length = pos, len(payload)
                pos += data_length
            else:
                frame = provider.frame
                assert frame is not None
                slices = session.slices[item.index]
                direct = external is not None and frame.data_length >= localfile.EXTERNAL_MIN
                if direct:
                    # The data at its pool address (and, for a piece the flush may write from
                    # the live tensor, its source address) modulo a block.
                    skew = slices[0].start % localfile.ALIGN
                    pad = (skew - pos - len(frame.head)) % localfile.ALIGN
                    f.write(bytes(pad))  # zeros between records: no record covers them
                    pos += pad
                start = pos
                data_offset, data_length = pos + len(frame.head), frame.data_length
                if len(slices) == 1 and data_length <= _JOINED_MAX:
                    # A small tensor: its record in one piece, one write and one checksum.
                    data = _wait(session, slices[0], submit)
                    record = b"".join((frame.head, data, frame.tail))
                    session.drop(slices[0])
                    f.write(record)
                    crc = crc32c(record)
                    pos += len(record)
                else:
                    f.write(frame.head)
                    crc = crc32c(frame.head)
                    for slice_ in slices:
                        if live and direct:
                            written = _write_live(f, session, slice_, crc)
                            if written is not None:
                                crc = written
                                continue
                        data = _wait(session, slice_, submit)
                        crc = crc32c(data, value=crc)
                        drop = functools.partial(session.drop, slice_)
                        if not direct or not external(data, drop):
                            f.write(data)
                            drop()
                    f.write(frame.tail)
                    crc = crc32c(frame.tail, value=crc)
                    pos = data_offset + data_length + len(frame.tail)
            info = RecordInfo(
                relative_path=name,
                offset=start,
                length=pos - start,
                data_offset=data_offset,
                data_length=data_length,
                crc32c=crc,
                kind=provider.kind,
            )
            results.append(
                WriteResult(index=item.index, size_in_bytes=pos - start, storage_data=info)
            )
        if session.error is not None:  # a live write found its tensor changed
            raise session.error
    return results


#: Bytes read from a live tensor at a time (into the file's buffer, then written from there): a
#: take-over (``SnapshotSession.take_over_live``) waits for at most one such read per file.
LIVE_STEP = 4 << 20


def _write_live(f: Any, session: SnapshotSession, slice_: Any, crc: int) -> int | None:
    """Write ``slice_`` from the live tensor if no copy has started on it and the save is still
    live; returns the record's crc32c so far, or None (nothing done: it is copied).

    Each step reads the live bytes into the file's own buffer under the write's lock, and the
    disk writes them from there with the lock let go: the live tensor is never the source of a
    disk write, so a take-over (the last copy done, an optimizer step beginning) waits for one
    step's read at most, and copies the rest into the pool itself. Until item 23 of
    ``CHANGELOG.md`` the disk wrote straight from the live tensor, and the snapshot's end
    waited for one disk write per file in flight: 7-16 ms, up to 85 ms on a slow write."""
    piece = slice_.piece
    if len(piece.parts) != 1 or session.hurry():
        return None
    # The scheduler admits pieces from the front while the flush starts from the back: a
    # piece not admitted yet is waited for here, or the copy it fell back to (which needs
    # the same admission) wrote it, and a piece the flush reached first was never live.
    session.wait_admitted(piece)
    provider, start, stop, _ = piece.parts[0]
    begin = getattr(provider, "begin_live", None)
    view = begin(start, stop) if begin is not None else None
    if view is None:
        return None
    src = localfile._address(view)
    assert src is not None  # a tensor's memory is writable
    write = LiveWrite(piece, provider, view, src, (start, stop, slice_.start))
    # queue_buffered: False once the file writes plainly (the steps would wait for the disk).
    if not f.queue_buffered() or not session.claim_live(piece, write):
        provider.cancel_live()
        return None
    if f.room() < LIVE_STEP + localfile.ALIGN:
        f.submit()  # then the buffer holds less than a block: no step below fills it
    try:
        last = False
        while not last:
            with write.lock:
                if write.ended:  # taken over: the rest is in the pool
                    break
                # A file that came to write plainly would write the next step under the lock,
                # and a take-over would wait for the disk: the rest goes through the pool.
                if session.hurry() or not f.writes_directly:
                    session.end_live_write(write)
                    break
                part = view[write.read : write.read + min(LIVE_STEP, write.n - write.read)]
                copied = f.copy_in(part)
                write.read += part.nbytes
                last = write.read == write.n
                if last:  # every byte read: the piece is done before its disk write
                    session.end_live_write(write)
            crc = crc32c(copied, value=crc)  # from the copy: what the disk writes
            f.queue_buffered()
            f.submit()
    except BaseException as exc:
        with write.lock:
            if not write.ended:
                session.end_live_write(write, exc)
        raise
    if write.error is not None:
        raise write.error
    done, n = write.read, write.n
    if done == n:
        session.drop(slice_)
        return crc
    data = session.live_rest(write)
    crc = crc32c(data, value=crc)
    drop = functools.partial(session.drop, slice_)
    if not f.write_external(data, drop):
        f.write(data)
        drop()
    return crc


def flush(
    *,
    storage: Storage,
    items: Sequence[WriteItem],
    session: SnapshotSession,
    prefix: str,
    workers: int,
    sync: bool,
    nice: int = 0,
    start_after: Latch | None = None,
    incremental: bool = False,
    transforms: Sequence[Any] = (),
) -> Future[list[WriteResult]]:
    """Start writing ``items``; the future holds their results, or the first error (once).
    ``transforms``: stream transforms every record goes through (``transforms.py``).

    Each file gets a thread of its own, started here, which writes once ``start_after`` (if
    given) is set. It drops to nice value ``nice`` (``priority.py``) once the snapshot is staged:
    before that, with a pool smaller than the state, the snapshot (the caller's time to safe)
    waits for the space this flush frees, and a niced flush would hold it back.
    A shared, bounded pool would let saves that overlap deadlock: later saves could hold every
    thread waiting for pieces that the pool admits only after an earlier save's pieces, which
    only that save's (queued) flush would release.

    ``incremental``: items whose records an older checkpoint holds (``incremental.py``) are
    linked here, before the files start; the future's ``evidence`` attribute keeps what the
    next save compares against (the providers are released once the flush ends).
    """
    wanted = {item.index for item in items}
    for key, slices in session.slices.items():
        if key not in wanted:  # another rank writes this replicated item
            for slice_ in slices:
                session.drop(slice_)
    result: Future[list[WriteResult]] = Future()
    result.set_running_or_notify_cancel()
    collected: list[WriteResult] = []
    if incremental:
        result.evidence = _incremental.evidence(items, session.providers)  # type: ignore[attr-defined]
        items, linked = _incremental.split_linked(items, session.providers)
        try:
            collected = _incremental.link(storage, linked, session.providers, prefix, sync=sync)
        except OSError as exc:
            result.set_exception(_write_error(exc, storage.describe(""), session.rank))
            session.abort(result.exception())
            return result
    groups = assign_files(items, session, workers)
    if not groups:
        result.set_result(collected)
        return result
    lock = threading.Lock()
    pending = [len(groups)]
    errors: list[BaseException] = []
    complete: list[str] = []

    def one_file(n: int, group: list[WriteItem]) -> None:
        name = f"{prefix}{n}{DATA_SUFFIX}"
        tid, running = threading.get_native_id(), [True]

        def yield_cores(_: object) -> None:
            with lock:  # never renice a thread id this thread left behind (ids are reused)
                if running[0]:
                    lower_thread_priority(nice, tid)

        session.staged.add_done_callback(yield_cores)
        if start_after is not None:
            start_after.wait()
        try:
            written = _flush_file(storage, name, group, session, sync=sync, transforms=transforms)
            collected.extend(written)
            complete.append(name)
        except BaseException as exc:  # every error reaches the future, none dies here
            if isinstance(exc, OSError) and not isinstance(exc, DataStatesError):
                exc = _write_error(exc, storage.describe(name), session.rank)
            errors.append(exc)
            session.abort(exc)
        finally:
            with lock:
                running[0] = False
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                if errors:
                    _remove_complete(storage, complete)
                    result.set_exception(_first_cause(errors, session))
                else:
                    result.set_result(collected)

    for n, group in enumerate(groups):
        threading.Thread(
            target=one_file, args=(n, group), name=f"datastates-flush-{prefix}{n}"
        ).start()
    return result


def _remove_complete(storage: Storage, names: list[str]) -> None:
    """A failed save's files that were written whole are no use (nothing will commit them):
    removed like the partial ones, so a full device gets its space back at once. With several
    files per rank, one may finish before another fails."""
    for name in names:
        try:
            storage.remove(name)
        except Exception as exc:  # the save's own error is the one to report
            logger.warning("could not remove %s of a failed save: %s", storage.describe(name), exc)


def _first_cause(errors: list[BaseException], session: SnapshotSession) -> BaseException:
    # Files that failed only because another file aborted the session report that root cause.
    if session.error is not None:
        return session.error
    return errors[0]


__all__ = ["StorageWriteError", "assign_files", "flush"]
