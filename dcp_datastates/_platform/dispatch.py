"""The dispatch-mode stack of the calling thread (``snapshot/cow.py``'s one way in).

``TorchDispatchMode`` is public; pushing one without a ``with`` block is not. The copy-on-write
mode must outlive the ``stage()`` call that pushes it and is popped at a later hook on the same
thread, so it goes through torch's own push and pop. Those change only this thread's stack:
``TorchDispatchMode.__enter__`` also sets process-wide flags that other threads' ``torch.compile``
reads, which a mode left on one thread must not touch. Every private name used is here; a torch
that moves one breaks this module and ``tests/test_cow.py``, not the snapshot.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

__all__ = ["DispatchMode", "innermost", "pop", "push"]


def push(mode: DispatchMode) -> None:
    """Make ``mode`` the calling thread's innermost dispatch mode."""
    _push_mode(mode)


def pop() -> DispatchMode:
    """Remove the calling thread's innermost dispatch mode and return it."""
    return _pop_mode()


def innermost() -> DispatchMode | None:
    """The calling thread's innermost dispatch mode, if any."""
    return _get_current_dispatch_mode()
