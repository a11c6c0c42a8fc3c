"""The writer runtimes of this process, which a child made by ``os.fork()`` disowns.

A child gets a copy of every runtime but none of its threads: each runtime it inherited is told
so (``SnapshotRuntime._inherited_by_fork``) right after the fork, in the child, and is closed
there for good without waiting for or freeing the parent's work.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

#: Every runtime of this process, to be disowned in a child made by ``os.fork()``.
_LIVE_RUNTIMES: weakref.WeakSet[Any] = weakref.WeakSet()


def register(runtime: Any) -> None:
    """Disown ``runtime`` in a child made by ``os.fork()`` (kept weakly: it is not kept alive)."""
    _LIVE_RUNTIMES.add(runtime)


def _after_fork_in_child() -> None:
    for runtime in list(_LIVE_RUNTIMES):
        runtime._inherited_by_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["register"]
