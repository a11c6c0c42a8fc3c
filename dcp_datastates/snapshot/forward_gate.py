"""The forward gate: the first module forward after a save copies the buffers it may update.

Forward updates module buffers in place (BatchNorm's running statistics and batch counter, EMA
buffers kept by a forward hook, step counters), and unlike parameters it does so before the next
``optimizer.step()``, which the optimizer guard holds back. While a snapshot is in flight, a
global module forward pre-hook runs once per module tree: on the first forward of a module it
walks that module's buffers (its submodules' included) and, for each buffer whose snapshot has not
been fully copied yet, takes a private copy of it right there (``TensorProvider.freeze``: a
``clone()`` on the buffer's own device, before forward can write it). The snapshot then copies
those bytes from the private copy; the live buffer is free to change.

Cost: one walk of the module tree per save, a clone of the buffers not yet copied (BatchNorm
statistics are tiny), and while a snapshot is in flight the hook call on every module forward.
The hook removes itself at the first forward after every snapshot has completed, so modules run
on PyTorch's hook-free fast path the rest of the time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ..providers.tensor import storage_key

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: Storage base address -> (session, provider) pairs of snapshots still in flight.
_by_storage: dict[int, list[tuple[Any, Any]]] = {}
#: Session -> its storage keys, to forget them once the session's snapshot is complete.
_keys: dict[Any, list[int]] = {}
#: Modules whose tree was walked since the last session was protected.
_visited: set[int] = set()
_handle: Any = None
#: Sessions ``stage()`` recorded whose planning (and so :func:`protect`) has not run yet: a
#: module forward waits for them, so that it never updates a buffer protect() would freeze.
_planning: set[Any] = set()
_released = threading.Condition(_lock)
#: Sessions held or protected with ``forward=False``: forwards neither wait for their
#: planning nor freeze their tensors (copy-on-write alone looks them up).
_unguarded: set[Any] = set()
#: Sessions held or protected for copy-on-write (``cow.py``), until staged or never planned.
_cow: set[Any] = set()


def _after_fork_in_child() -> None:
    """A process made by ``os.fork()`` protects none of its parent's snapshots: its forwards
    neither wait for their planning (for good) nor freeze buffers into them."""
    global _lock, _released
    _lock = threading.Lock()
    _released = threading.Condition(_lock)
    _by_storage.clear()
    _keys.clear()
    _visited.clear()
    _planning.clear()
    _unguarded.clear()
    _cow.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(session: Any, *, forward: bool = True, cow: bool = False) -> None:
    """Until :func:`release`, module forwards (``forward``) and copy-on-write (``cow``,
    :func:`wait_planned`) wait for the planning thread to plan and protect ``session``. Call on
    the training thread, in ``stage()``: it installs the hook there."""
    global _handle
    with _lock:
        _planning.add(session)
        _enter(session, forward, cow)


def _enter(session: Any, forward: bool, cow: bool) -> None:
    # caller holds _lock
    global _handle
    if not forward:
        _unguarded.add(session)
    if cow:
        _cow.add(session)
    if _handle is None and forward:
        _handle = register_module_forward_pre_hook(_pre_forward)


def release(session: Any) -> None:
    """``session`` is planned and protected (or will never be): forwards go on."""
    with _released:
        _planning.discard(session)
        if session not in _keys:  # not protected: nothing of it is in the index
            _unguarded.discard(session)
            _cow.discard(session)
        _released.notify_all()


def protect(session: Any, *, forward: bool = True, cow: bool = False) -> None:
    """Enter ``session``'s tensors in the index of storages in flight until it is staged: a
    forward about to update one freezes it first (``forward``), as does copy-on-write before
    an operator writes one (``cow``, ``cow.py``).

    Call on the training thread (it installs the hook there, where forward runs)."""
    entries: list[tuple[int, Any]] = []
    for provider in session.raw_providers():
        if getattr(provider, "freeze", None) is None or getattr(provider, "private", False):
            continue  # a private copy (an eager one): no forward can write it
        key = provider.storage_key
        if key:
            entries.append((key, provider))
    if not entries:
        return
    with _lock:
        for key, provider in entries:
            _by_storage.setdefault(key, []).append((session, provider))
        _keys[session] = [key for key, _ in entries]
        _visited.clear()
        _enter(session, forward, cow)
    # A weak reference: a future keeps its callbacks after it resolves, and a callback holding
    # the session made each save a reference cycle (session -> future -> callback -> session)
    # that only the cyclic GC freed, with the session's pieces and write items: 5,000 objects
    # a save of the train benchmark's state. The gate's entries hold the session until the
    # callback runs.
    ref = weakref.ref(session)
    session.staged.add_done_callback(lambda _f: _forget_ref(ref))


def _forget_ref(ref: weakref.ref) -> None:
    session = ref()
    if session is not None:
        _forget(session)


def _forget(session: Any) -> None:
    with _lock:
        _unguarded.discard(session)
        _cow.discard(session)
        for key in _keys.pop(session, ()):
            entries = [e for e in _by_storage.get(key, ()) if e[0] is not session]
            if entries:
                _by_storage[key] = entries
            else:
                _by_storage.pop(key, None)


def _pre_forward(module: torch.nn.Module, args: Any) -> None:
    global _handle
    if _planning and not _planning <= _unguarded:
        start = time.perf_counter()
        with _released:
            _released.wait_for(lambda: _planning <= _unguarded)
        logger.debug("forward waited %.3fs for snapshot planning", time.perf_counter() - start)
    if not _by_storage:
        # Nothing in flight: leave the hook-free fast path to every later forward. Removing the
        # hook here, on the thread that runs forward, never races with its own hook loop.
        with _lock:
            if not _by_storage and not _planning and _handle is not None:
                _handle.remove()
                _handle = None
        return
    if id(module) in _visited:
        return
    _freeze_tree(module)


def _buffers(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    for buf in module.buffers():
        if buf is None:
            continue
        local = getattr(buf, "to_local", None)  # a DTensor buffer: its local shard
        yield local() if callable(local) and type(buf) is not torch.Tensor else buf


def _freeze_tree(module: torch.nn.Module) -> None:
    start = time.perf_counter()
    with _lock:
        for sub in module.modules():
            _visited.add(id(sub))
        index = dict(_by_storage)
    if not index:
        return
    frozen: dict[Any, int] = {}
    for buf in _buffers(module):
        if buf.numel() == 0:
            continue
        for session, provider in index.get(storage_key(buf), ()):
            if session in _unguarded or session.fenced:
                continue  # fenced: this stream's forward runs after the copies
            made = provider.freeze()
            frozen[session] = frozen.get(session, 0) + made
            if made:  # on a device: its copies read the private copy once it is made
                session.after_freeze([provider])
    elapsed = time.perf_counter() - start
    for session, nbytes in frozen.items():
        session.forward_frozen_bytes += nbytes
        session.forward_blocked_s += elapsed
    if frozen:
        logger.debug(
            "forward of %s: froze %d bytes of buffers in %.6fs",
            type(module).__name__,
            sum(frozen.values()),
            elapsed,
        )


def in_flight() -> bool:
    """Whether a snapshot held or protected for copy-on-write is in flight."""
    return bool(_cow)


def wait_planned() -> None:
    """Wait until no copy-on-write session is planning (each has entered its tensors, or
    never will)."""
    if _planning & _cow:
        start = time.perf_counter()
        with _released:
            _released.wait_for(lambda: not _planning & _cow)
        logger.debug("a write waited %.3fs for snapshot planning", time.perf_counter() - start)


def tracked(key: int) -> list[tuple[Any, Any]]:
    """The ``(session, provider)`` pairs of copy-on-write snapshots in flight whose tensor
    lives in the storage whose base address is ``key``. A session the optimizer step fenced on
    the device is left out: every write enqueued after the fence runs after its copies."""
    return [entry for entry in _by_storage.get(key, ()) if entry[0] in _cow and not entry[0].fenced]


def installed() -> bool:
    """Whether the forward pre-hook is currently installed (for tests)."""
    return _handle is not None
