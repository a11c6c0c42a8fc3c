"""Snapshot sessions on their own: how pieces are planned, their state transitions, aborts,
retiring, freezing, the runtime's hand-off and the flush's file assignment."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _faults_util import wait_until
from conftest import EVENT_TIMEOUT_S

from dcp_datastates.errors import (
    SnapshotAbortedError,
    SnapshotMutationError,
    WriterClosedError,
)
from dcp_datastates.options import WriterOptions
from dcp_datastates.save import deferred as deferred_mod
from dcp_datastates.save import handoff as handoff_mod
from dcp_datastates.save.flush import assign_files
from dcp_datastates.save.planner import plan_providers
from dcp_datastates.save.runtime import SnapshotRuntime
from dcp_datastates.snapshot.pieces import (
    ADMITTED,
    COPIED,
    FAILED,
    PENDING,
    RELEASED,
    SKIPPED,
    lay_out,
)
from dcp_datastates.snapshot.pool import HostPool
from dcp_datastates.snapshot.scheduler import SnapshotScheduler, _copy_piece
from dcp_datastates.snapshot.session import SnapshotSession


def never() -> bool:
    return False


def make_session(sd: dict, pool_bytes: int = 1 << 20, chunk: int = 4096, small: int = 1024):
    items = plan_providers(sd)
    pool = HostPool(pool_bytes)
    session = SnapshotSession(
        [(item.index, provider) for item, provider in items],
        pool=pool,
        chunk_bytes=chunk,
        coalesce_bytes=small,
        rank=0,
    )
    return session, items, pool


def admit_and_copy(session: SnapshotSession, piece) -> None:
    offset = session.pool.reserve(piece.nbytes, cancelled=never)
    assert session.admit(piece, offset)
    _copy_piece(session, piece)


# -- planning -------------------------------------------------------------------------------------
def test_big_tensors_are_chunked_and_small_ones_coalesced_in_snapshot_order() -> None:
    sd = {"big": torch.zeros(3000), "a": torch.zeros(8), "b": torch.zeros(8), "obj": [1, 2]}
    session, items, _ = make_session(sd)
    # big: 12000 bytes in 4096-byte chunks -> 3 pieces; a and b share one piece; obj has none
    assert [p.nbytes for p in session.pieces][:3] == [4096, 4096, 12000 - 8192]
    assert len(session.pieces) == 4
    coalesced = session.pieces[3]
    assert [part[0].fqn for part in coalesced.parts] == ["a", "b"]
    assert all(part[3] % 64 == 0 for part in coalesced.parts)  # aligned inside the piece
    assert session.slices[items[-1][0].index] == []  # the object is eager: no slices
    assert all(p.state == PENDING for p in session.pieces)


def test_lay_out_cuts_and_coalesces_without_a_session_or_a_pool() -> None:
    items = [
        (item.index, provider)
        for item, provider in plan_providers(
            {
                "a": torch.zeros(8),
                "big": torch.zeros(2048),
                "b": torch.zeros(8),
                "c": torch.zeros(8),
            }
        )
    ]
    layout = lay_out(items, chunk=4096, small=1024)
    # a alone (big ends its piece), big in two 4096-byte chunks, then b and c share one piece
    assert [[part[0].fqn for part in p.parts] for p in layout.pieces] == [
        ["a"],
        ["big"],
        ["big"],
        ["b", "c"],
    ]
    assert [p.seq for p in layout.pieces] == [0, 1, 2, 3]
    assert all(p.state == PENDING and p.offset == -1 for p in layout.pieces)
    assert [p.refs for p in layout.pieces] == [1, 1, 1, 2]
    assert list(layout.providers) == [key for key, _ in items]
    b, c = layout.pieces[3].parts
    assert (b[3], c[3]) == (0, 64)  # each part 64-byte aligned inside its piece


def test_a_session_with_no_tensor_bytes_is_staged_at_once() -> None:
    session, _, _ = make_session({"obj": {"a": 1}})
    assert session.staged.done() and session.pieces == []


# -- transitions ----------------------------------------------------------------------------------
def test_piece_states_from_pending_to_released_and_staged_when_all_are_copied() -> None:
    src = torch.arange(2048, dtype=torch.float32)
    session, items, pool = make_session({"t": src})
    key = items[0][0].index
    pieces = session.pieces
    assert len(pieces) == 2
    admit_and_copy(session, pieces[0])
    assert pieces[0].state == COPIED and not session.staged.done()
    admit_and_copy(session, pieces[1])
    assert session.staged.done()
    data = b"".join(bytes(session.wait(s)) for s in session.slices[key])
    assert data == src.numpy().tobytes()
    for s in session.slices[key]:
        session.drop(s)
    assert all(p.state == RELEASED for p in pieces) and pool.in_use == 0
    assert session.finished


def test_a_piece_no_item_needs_is_skipped_and_never_admitted() -> None:
    session, items, pool = make_session({"t": torch.zeros(512)}, chunk=4096)
    piece = session.pieces[0]
    session.drop(session.slices[items[0][0].index][0])
    assert piece.state == SKIPPED and session.staged.done()
    offset = pool.reserve(piece.nbytes, cancelled=never)
    assert not session.admit(piece, offset)  # gives the block straight back
    assert pool.in_use == 0


def test_abort_releases_copied_pieces_skips_pending_ones_and_fails_waiters() -> None:
    session, items, pool = make_session({"t": torch.zeros(3000)})
    first, second, third = session.pieces
    admit_and_copy(session, first)
    offset = pool.reserve(second.nbytes, cancelled=never)
    session.admit(second, offset)  # ADMITTED: a copy in flight
    error = SnapshotAbortedError("dropped")
    session.abort(error)
    assert first.state == RELEASED and third.state == SKIPPED
    assert second.state == ADMITTED  # its copy releases it
    with pytest.raises(SnapshotAbortedError, match="dropped"):
        session.wait(session.slices[items[0][0].index][0])
    _copy_piece(session, second)  # the copy sees the abort, reads nothing, releases the block
    assert second.state == RELEASED and pool.in_use == 0 and session.staged.done()


def test_a_copy_that_sees_a_mutation_fails_the_piece_and_aborts_the_session() -> None:
    src = torch.zeros(3000)
    session, items, _ = make_session({"t": src})
    src.add_(1)  # changed after stage: versions differ
    admit_and_copy(session, session.pieces[0])
    assert session.pieces[0].state in (FAILED, RELEASED)
    assert isinstance(session.error, SnapshotMutationError)
    assert session.staged.done()


def test_retire_waits_for_copies_in_flight_then_lets_go_of_the_tensors() -> None:
    src = torch.zeros(3000)
    session, items, pool = make_session({"t": src})
    provider = items[0][1]
    first = session.pieces[0]
    offset = pool.reserve(first.nbytes, cancelled=never)
    session.admit(first, offset)
    session.abort(SnapshotAbortedError("over"))
    session.retire()
    assert not session.retired and provider.source is not None  # a copy is in flight
    _copy_piece(session, first)
    assert session.retired and provider.source is None and session.providers == {}


# -- freezing -------------------------------------------------------------------------------------
def test_a_frozen_tensor_may_change_and_the_snapshot_keeps_the_frozen_bytes() -> None:
    src = torch.arange(3000, dtype=torch.float32)
    expected = src.clone()
    session, items, _ = make_session({"t": src})
    provider = items[0][1]
    assert provider.freeze() == src.numel() * 4
    src.mul_(-1)
    for piece in session.pieces:
        admit_and_copy(session, piece)
    assert session.error is None
    data = b"".join(bytes(session.wait(s)) for s in session.slices[items[0][0].index])
    assert data == expected.numpy().tobytes()


def test_a_freeze_that_comes_after_a_change_is_reported_as_a_mutation() -> None:
    src = torch.zeros(3000)
    session, items, _ = make_session({"t": src})
    src.add_(1)
    assert items[0][1].freeze() == 0
    admit_and_copy(session, session.pieces[0])
    assert isinstance(session.error, SnapshotMutationError)


def test_freeze_small_copies_only_tensors_up_to_the_limit() -> None:
    session, items, _ = make_session({"tiny": torch.zeros(4), "big": torch.zeros(3000)})
    assert session.freeze_small(1024) == 16
    providers = {p.fqn: p for _, p in items}
    assert providers["tiny"]._frozen is not None and providers["big"]._frozen is None


# -- the scheduler --------------------------------------------------------------------------------
def test_the_scheduler_streams_a_state_larger_than_the_pool_in_order() -> None:
    src = torch.randn(64 * 1024)  # 256 KiB through a 64 KiB pool
    session, items, pool = make_session({"t": src}, pool_bytes=64 * 1024, chunk=16 * 1024)
    scheduler = SnapshotScheduler(pool, copy_workers=2, on_stall=lambda: None)
    scheduler.submit(session)
    out = bytearray()
    for s in session.slices[items[0][0].index]:
        out += bytes(session.wait(s))
        session.drop(s)
    scheduler.close()
    assert bytes(out) == src.numpy().tobytes()
    assert pool.peak_in_use <= pool.capacity and pool.in_use == 0


# -- the runtime's hand-off -----------------------------------------------------------------------
def runtime_with(sd: dict, **options) -> tuple[SnapshotRuntime, SnapshotSession]:
    rt = SnapshotRuntime(WriterOptions(**options), "test")
    session = rt.new_session(plan_providers(sd), 0)
    return rt, session


def test_a_staged_session_is_claimed_by_another_thread_only() -> None:
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.stage(session, "token", started=time.monotonic(), expect_claim=True)
    assert rt.claim() is None  # the staging thread never claims its own session
    got = []
    t = threading.Thread(target=lambda: got.append(rt.claim()))
    t.start()
    t.join(EVENT_TIMEOUT_S)
    assert got == [(session, "token")] and session.owner is t
    rt.reap_abandoned()  # the owner died before writing: dropped
    assert session.aborted and "exited before writing" in str(session.error)
    rt.close()
    assert session.retired


def test_a_session_never_claimed_is_dropped_after_the_claim_timeout(monkeypatch) -> None:
    monkeypatch.setattr(handoff_mod, "CLAIM_TIMEOUT_S", 0.05)
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.stage(session, None, started=time.monotonic(), expect_claim=True)
    time.sleep(0.1)
    rt.reap_abandoned()
    assert session.aborted and "never picked up" in str(session.error)
    assert not rt.has_unclaimed()
    rt.close()


def _stage_later(rt: SnapshotRuntime) -> threading.Event:
    """A session staged to be planned later; the event is set once its planning starts."""
    started = threading.Event()

    def plan() -> tuple[list, int]:
        started.set()
        return plan_providers({"t": torch.zeros(1000)}), 4000

    rt.stage_later(plan, "token", rank=0, started=time.monotonic(), expect_claim=True)
    return started


def test_planning_starts_once_claimed_and_the_staging_thread_is_returning(monkeypatch) -> None:
    # Planning that starts while the caller is still inside dcp.async_save takes the GIL from
    # it for a switch interval (5 ms): it waits for the claim and for the caller's signal.
    monkeypatch.setattr(deferred_mod, "RETURN_WAIT_S", EVENT_TIMEOUT_S)
    rt = SnapshotRuntime(WriterOptions(), "test")
    started = _stage_later(rt)
    claimer = threading.Thread(target=rt.claim)  # returns once the session is planned
    claimer.start()
    wait_until(lambda: not rt.has_unclaimed(), EVENT_TIMEOUT_S, "the claim")
    other = threading.Thread(target=rt.caller_returning)  # not the thread that staged
    other.start()
    other.join(EVENT_TIMEOUT_S)
    assert not started.wait(0.2)  # claimed, yet planning waits for the staging thread's signal
    rt.caller_returning()
    assert started.wait(EVENT_TIMEOUT_S)
    claimer.join(EVENT_TIMEOUT_S)
    assert not claimer.is_alive() and rt._deferred._returning == []
    rt.close()


def test_planning_starts_anyway_when_the_caller_never_says_it_returns(monkeypatch) -> None:
    monkeypatch.setattr(deferred_mod, "RETURN_WAIT_S", 0.05)
    rt = SnapshotRuntime(WriterOptions(), "test")
    started = _stage_later(rt)
    claimer = threading.Thread(target=rt.claim)
    claimer.start()
    assert started.wait(EVENT_TIMEOUT_S)
    claimer.join(EVENT_TIMEOUT_S)
    assert rt._deferred._returning == []  # nothing left for a later caller_returning() to find
    rt.close()


def test_close_drops_a_session_staged_outside_a_save_and_then_refuses_work() -> None:
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.stage(session, None, started=time.monotonic(), expect_claim=False)
    rt.close()
    assert session.aborted and session.retired and rt.pool is None
    with pytest.raises(WriterClosedError):
        rt.new_session(plan_providers({"t": torch.zeros(4)}), 0)
    with pytest.raises(WriterClosedError):
        rt.stage(session, None, started=0.0, expect_claim=True)


def test_a_save_whose_snapshot_close_dropped_before_its_claim_fails_as_dropped_once() -> None:
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.stage(session, None, started=time.monotonic(), expect_claim=True)
    rt.close(timeout=0)  # its save thread never claimed it
    assert session.aborted and session.retired
    with pytest.raises(WriterClosedError):  # the thread that staged it is not its save
        rt.check_open_to_save()
    errors: list[BaseException] = []

    def save_thread() -> None:
        for _ in range(2):
            try:
                rt.check_open_to_save()
            except BaseException as exc:  # noqa: BLE001 - recorded, asserted below
                errors.append(exc)

    t = threading.Thread(target=save_thread)
    t.start()
    t.join(EVENT_TIMEOUT_S)
    assert [type(e) for e in errors] == [SnapshotAbortedError, WriterClosedError]


def test_a_session_whose_stage_fails_is_dropped_not_left_for_close_to_wait_on() -> None:
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.closed = True  # close() began between new_session and stage
    with pytest.raises(WriterClosedError):
        rt.stage(session, None, started=time.monotonic(), expect_claim=True)
    assert session.aborted and session.retired
    rt.close(timeout=5)


def test_abandon_lets_the_threads_go_without_waiting() -> None:
    rt, session = runtime_with({"t": torch.zeros(1000)})
    rt.stage(session, None, started=time.monotonic(), expect_claim=True)
    scheduler_thread = rt._resources.scheduler._thread
    pool = rt.pool
    rt.abandon()
    scheduler_thread.join(EVENT_TIMEOUT_S)
    assert not scheduler_thread.is_alive()
    assert session.aborted and pool.allocated_bytes == 0 and rt.closed


# -- the flush's file assignment ------------------------------------------------------------------
def test_files_are_balanced_by_bytes_and_keep_snapshot_order() -> None:
    sd = {f"t{i}": torch.zeros(n) for i, n in enumerate([4000, 1000, 1000, 1000, 1000, 10])}
    session, items, _ = make_session(sd)
    write_items = [item for item, _ in items]
    files = assign_files(list(reversed(write_items)), session, 2)
    assert len(files) == 2
    names = [[item.index.fqn for item in f] for f in files]
    assert names[0][0] == "t0"  # the biggest goes first, to the first file
    order = [item.index.fqn for item in write_items]
    for f in names:
        assert f == sorted(f, key=order.index)  # each file in snapshot order
    sizes = [sum(session.providers[i.index].nbytes for i in f) for f in files]
    assert abs(sizes[0] - sizes[1]) <= 4000 * 4
    assert sorted(n for f in names for n in f) == sorted(order)


def test_never_more_files_than_items_nor_an_empty_one() -> None:
    session, items, _ = make_session({"a": torch.zeros(10), "b": torch.zeros(10)})
    files = assign_files([item for item, _ in items], session, 8)
    assert len(files) == 2 and all(files)
    assert assign_files([], session, 4) == []


class _HandOffRefused(SnapshotRuntime):
    """A runtime whose hand-off fails (``close()`` racing with ``stage()``, say)."""

    def _hand_off(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise WriterClosedError("closed while staging")


def test_a_stage_later_refused_at_the_hand_off_leaves_nothing_waiting_for_its_return() -> None:
    rt = _HandOffRefused(WriterOptions(), "test")
    with pytest.raises(WriterClosedError):
        _stage_later(rt)
    # No entry that only a later caller_returning() would clear.
    assert rt._deferred._returning == []
    rt.close()


def test_a_flush_of_a_session_dropped_meanwhile_fails_and_retires_it() -> None:
    """``start_flush`` refuses a session dropped after the save thread checked it, and retires
    it: with no copy in flight it retires at once, and its retirement callback takes the
    runtime's lock. That ran under the lock: the save thread waited for itself and close() for
    both (the suite hung once in a teardown's close())."""
    rt, session = runtime_with({"t": torch.zeros(1000)})
    session.abort(SnapshotAbortedError("dropped by close(timeout=...) meanwhile"))
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(rt.start_flush(session, storage=None, items=[], prefix="")),
        daemon=True,
    )
    t.start()
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive(), "start_flush deadlocked on the runtime's lock"
    with pytest.raises(SnapshotAbortedError, match="meanwhile"):
        got[0].result(timeout=EVENT_TIMEOUT_S)
    assert session.retired
    rt.close(timeout=5)
