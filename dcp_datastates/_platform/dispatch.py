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
    _disable_current_modes,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

__all__ = ["DispatchMode", "disabled", "innermost", "pop", "push", "remove"]

#: A block in which the calling thread's dispatch modes are off (``with disabled(): ...``).
disabled = _disable_current_modes


def push(mode: DispatchMode) -> None:
    """Make ``mode`` the calling thread's innermost dispatch mode."""
    _push_mode(mode)


def pop() -> DispatchMode:
    """Remove the calling thread's innermost dispatch mode and return it."""
    return _pop_mode()


def innermost() -> DispatchMode | None:
    """The calling thread's innermost dispatch mode, if any."""
    return _get_current_dispatch_mode()


def remove(mode: DispatchMode) -> None:
    """Take ``mode`` off the calling thread's stack wherever it is, keeping the modes pushed
    after it in their order (one pushed inside a block may outlive it, as copy-on-write's
    does: the simulated GPU's mode, ``snapshot/device_fake``, leaves from under it)."""
    above = []
    while (top := _get_current_dispatch_mode()) is not None and top is not mode:
        above.append(_pop_mode())
    if top is mode:
        _pop_mode()
    for other in reversed(above):
        _push_mode(other)
