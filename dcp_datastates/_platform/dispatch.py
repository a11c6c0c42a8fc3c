"""The dispatch-mode stack of the calling thread (``snapshot/cow.py``'s one way in).

``TorchDispatchMode`` is public; keeping one on a thread's stack beyond a ``with`` block is not.
The copy-on-write mode outlives the ``stage()`` call that pushes it and leaves at a later hook on
the same thread, so it goes through torch's own push and pop, which change only this thread's
stack (``TorchDispatchMode.__enter__`` also sets process-wide flags that other threads'
``torch.compile`` reads, which a mode left on one thread must not touch).

It sits at the bottom of the stack, under any mode the caller has entered: a ``with
FlopCounterMode():`` around a training step that saves must pop its own mode at its exit, not
ours (``__exit__`` pops the innermost). Every private name used is here; a torch that moves one
breaks this module and ``tests/test_cow.py``, not the snapshot.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

__all__ = [
    "DispatchMode",
    "disabled",
    "in_tracing",
    "push_device",
    "push_under",
    "remove",
    "stack",
]

#: A block in which the calling thread's dispatch modes are off (``with disabled(): ...``).
disabled = _disable_current_modes

_INFRA = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def in_tracing() -> bool:
    """Whether torch's own tracing modes (fake tensors, proxies, functionalization) are on:
    the caller is inside ``torch.compile`` or ``export``, not a training loop."""
    return any(torch._C._get_dispatch_mode(key) is not None for key in _INFRA)


def stack() -> list[DispatchMode]:
    """The calling thread's dispatch modes, innermost last."""
    return _get_current_dispatch_mode_stack()


def push_under(mode: DispatchMode) -> None:
    """Put ``mode`` under every mode the caller entered, so each still sees operators first and
    still pops its own at its exit; above a simulated device's (``simulates_device``), which
    stands for the hardware under everything."""
    _insert(mode, sum(1 for _ in _leading_devices()))


def push_device(mode: DispatchMode) -> None:
    """Put a simulated device's mode at the very bottom of the calling thread's stack."""
    _insert(mode, 0)


def _leading_devices() -> list[DispatchMode]:
    found = []
    for m in stack():
        if not getattr(m, "simulates_device", False):
            break
        found.append(m)
    return found


def _insert(mode: DispatchMode, position: int) -> None:
    above = [_pop_mode() for _ in range(len(stack()) - position)]  # innermost first
    _push_mode(mode)
    for other in reversed(above):
        _push_mode(other)


def remove(mode: DispatchMode) -> bool:
    """Take ``mode`` out of the calling thread's stack, wherever it is, leaving the others in
    their order; False if it is not there (something else popped it)."""
    if not any(m is mode for m in stack()):
        return False
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        _push_mode(other)
    return True
