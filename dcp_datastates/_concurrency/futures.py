"""The ``torch.futures.Future`` that DCP waits on, with the error held where the GC sees it.

DCP calls ``storage_writer.write_data(...)`` and ``storage_reader.read_data(...)``, then
``.wait()`` and ``.value()`` on the future they return, in a frame that holds that future, the
planner and the writer or reader. A plain ``torch.futures.Future`` keeps its error in C++,
where the cyclic GC cannot see it: once ``wait()`` had raised it, the error's traceback held
DCP's frame, the frame held the future, and the future the error, a cycle never collected.
After a failed save, a writer made for that save and dropped (DCP's writer per save) was kept
alive by it, with its threads and its host pool (``tests/test_writer_lifecycle.py``).

:class:`RelayFuture` raises the error from Python instead: ``wait()`` and ``value()`` raise the
error of the ``concurrent.futures.Future`` it relays, a Python object, so a failed save leaves
at worst a cycle the GC collects. Its C++ side completes too (for ``then()`` and
``torch.futures.wait_all``), failed with a copy of the error that has no traceback and that
nothing in DCP raises.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import portable
from .latch import Latch


class RelayFuture(torch.futures.Future):
    """A ``torch.futures.Future`` that completes as ``source`` does, once the callbacks added to
    ``source`` before it have run (the writer's bookkeeping of the save, which DCP's commit
    reads: a waiter on ``source`` itself may wake before its callbacks run)."""

    def __init__(self, source: Future[Any]) -> None:
        super().__init__()
        self._source = source
        self._relayed = Latch()
        ref = weakref.ref(self)  # no cycle: source -> callback -> this -> source
        relayed = self._relayed
        source.add_done_callback(lambda f: _relay(ref, relayed, f))

    def wait(self) -> Any:
        return self.value()

    def value(self) -> Any:
        self._relayed.wait()
        exc = self._source.exception()
        if exc is not None:
            raise portable(exc)  # DCP pickles it to the coordinator
        return self._source.result()

    def done(self) -> bool:
        return self._relayed.is_set()


def _relay(ref: weakref.ref[RelayFuture], relayed: Latch, source: Future[Any]) -> None:
    out = ref()
    if out is not None:  # the C++ side, for then() and torch.futures.wait_all
        exc = source.exception()
        if exc is None:
            torch.futures.Future.set_result(out, source.result())
        else:
            torch.futures.Future.set_exception(out, RuntimeError(f"{type(exc).__name__}: {exc}"))
    relayed.set()


def completed(value: Any = None, *, error: BaseException | None = None) -> RelayFuture:
    """A future done with ``value``, or failed with ``error``."""
    source: Future[Any] = Future()
    if error is not None:
        source.set_exception(error)
    else:
        source.set_result(value)
    return RelayFuture(source)
