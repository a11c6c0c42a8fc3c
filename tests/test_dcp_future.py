"""``RelayFuture``: the torch future DCP waits on, completed from a ``concurrent.futures``
future, its error raised from Python."""

from __future__ import annotations

import gc
import threading
import weakref
from concurrent.futures import Future

import pytest
import torch
from conftest import EVENT_TIMEOUT_S

from dcp_datastates._concurrency.futures import RelayFuture, completed


class _Held:
    """Something a failed wait's frame holds (DCP's frame holds the writer)."""


def _fail_and_wait(make) -> weakref.ref:
    held = _Held()  # noqa: F841 - held by this frame, which the error's traceback holds
    future = make(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        future.wait()
    return weakref.ref(held)


def _torch_future_failed(exc: BaseException) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_exception(exc)
    return future


def test_a_failed_wait_leaves_only_what_the_cyclic_gc_collects() -> None:
    """The frame that waited holds the future, the error's traceback holds the frame. A plain
    torch future holds the error in C++, out of the GC's sight: that cycle is never collected
    (the first assertion pins the torch behaviour the relay exists for)."""
    gc.collect()
    assert _fail_and_wait(_torch_future_failed)() is not None
    held = _fail_and_wait(lambda exc: completed(error=exc))
    gc.collect()
    assert held() is None


def test_wait_returns_after_the_callbacks_added_before_it() -> None:
    """DCP's commit reads what the writer's done callback recorded; a waiter on the source
    future itself may wake before the callbacks run."""
    source: Future[list[int]] = Future()
    release, ran = threading.Event(), threading.Event()

    def bookkeeping(_f: Future) -> None:
        release.wait(EVENT_TIMEOUT_S)
        ran.set()

    source.add_done_callback(bookkeeping)
    relay = RelayFuture(source)
    setter = threading.Thread(target=source.set_result, args=([1, 2],))
    setter.start()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append((relay.wait(), ran.is_set())))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not relay.done()  # held while the bookkeeping runs
    release.set()
    waiter.join(EVENT_TIMEOUT_S)
    setter.join(EVENT_TIMEOUT_S)
    assert got == [([1, 2], True)] and relay.done() and relay.value() == [1, 2]


def test_the_torch_side_completes_too() -> None:
    assert torch.futures.wait_all([completed([3])]) == [[3]]
    with pytest.raises(RuntimeError, match="KeyError"):
        torch.futures.wait_all([completed(error=KeyError("k"))])
    seen: list = []
    completed(7).then(lambda f: seen.append(f.value()))
    assert seen == [7]
