"""``snapshot/latch.py``: a one-shot event that makes a ``threading.Event`` only for a waiter.

A save keeps one latch per piece and state (copied, enqueued) alive until it ends; as
``threading.Event``s they were a quarter of the objects a save left for the cyclic GC to
promote. These tests pin the calls the engine relies on, and that a plain save makes no event.
"""

from __future__ import annotations

import threading

import torch
from conftest import EVENT_TIMEOUT_S

import dcp_datastates
from dcp_datastates._concurrency.latch import Latch
from dcp_datastates.snapshot.pieces import Piece


def test_a_latch_set_before_the_wait_returns_at_once_and_makes_no_event() -> None:
    latch = Latch()
    assert not latch.is_set()
    latch.set()
    assert latch.is_set()
    assert latch.wait() is True
    assert latch.wait(0) is True
    assert latch._event is None


def test_a_wait_that_times_out_says_so() -> None:
    latch = Latch()
    assert latch.wait(0.01) is False
    assert not latch.is_set()


def test_waiters_on_other_threads_wake_when_it_is_set() -> None:
    latch = Latch()
    started = threading.Barrier(4)
    woke: list[bool] = []

    def waiter() -> None:
        started.wait()
        woke.append(latch.wait(EVENT_TIMEOUT_S))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    latch.set()
    for t in threads:
        t.join(EVENT_TIMEOUT_S)
    assert woke == [True, True, True]


def test_a_set_racing_the_first_wait_never_leaves_the_waiter_asleep() -> None:
    # The flag and the event are guarded together: a set between a waiter's check of the flag
    # and its making of the event must still wake it. Many rounds, each a fresh race.
    for _ in range(300):
        latch = Latch()
        result: list[bool] = []

        def wait(latch: Latch = latch, result: list[bool] = result) -> None:
            result.append(latch.wait(EVENT_TIMEOUT_S))

        t = threading.Thread(target=wait)
        t.start()
        latch.set()
        t.join(EVENT_TIMEOUT_S)
        assert result == [True]


def test_a_save_whose_flush_starts_once_staged_makes_no_event_for_its_pieces(tmp_path) -> None:
    made: list[Latch] = []
    original = Piece.__init__

    def recording_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        made.append(self)

    sd = {f"t{i}": torch.randn(64 * 1024) for i in range(6)}
    sd["small"] = torch.ones(4)
    writer = dcp_datastates.DataStatesWriter(
        tmp_path / "w", chunk_bytes=64 * 1024, coalesce_bytes=4096
    )
    Piece.__init__ = recording_init  # type: ignore[method-assign]
    try:
        response = dcp_datastates.async_save(
            sd, writer, checkpoint_id=tmp_path / "ckpt", no_dist=True
        )
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    finally:
        Piece.__init__ = original  # type: ignore[method-assign]
        writer.close()
    assert len(made) >= 6  # one piece per 256 KiB tensor at least
    assert all(p.done.is_set() and p.enqueued.is_set() for p in made)
    assert [p for p in made if p.done._event is not None or p.enqueued._event is not None] == []
