"""Copy-on-write: while a snapshot is in flight, a write to a tensor it has not copied yet copies
that tensor first.

The snapshot is lazy: ``stage()`` returns before the state is copied. Hooks hold back the writers
that have them (the optimizer step, ``guard.py``; module forwards, ``forward_gate.py``), but many
writes have none: ``p.data.copy_(shadow)`` (EMA evaluation), ``p.mul_`` under ``torch.no_grad()``
(decoupled weight decay), ``model.load_state_dict(best)`` (a rollback), SWA's
``update_parameters``, the in-place renorm inside ``nn.Embedding(max_norm=)``'s forward.

All of them reach ATen as an operator whose schema marks an argument as written
(``Tensor(a!)``). A :class:`~torch.utils._python_dispatch.TorchDispatchMode` on the thread that
called the save sees every such operator below autograd, whatever tensor object it goes through
(``.data``, a view, a ``from_numpy`` alias of the same memory): before it runs, each written
tensor whose storage a snapshot in flight tracks (``forward_gate.tracked``) is frozen
(``TensorProvider.freeze``: a private copy on its own device, which the snapshot then copies;
nothing if it was copied already). Then the write runs.

The mode costs a Python call per operator (5-15 us on a small CPU, ``bench.py cow``), so it
is on only in the snapshot window: pushed by ``stage()`` under any mode the caller entered
(``_platform/dispatch.py``), removed on the same thread at the first optimizer step or module
forward after every snapshot has been copied, or at ``close()`` / ``synchronize_staging()``
(the mode stack is per thread). Higher-order operators pass through, and ``torch.compile``
compiles as without it.

What it does not see (the version counter and stage-time probes remain the check there, and a
change they see fails the save): writes on other threads, writes NumPy makes through an array
that shares a tensor's memory, and writes compiled into a ``torch.compile`` graph (module
buffers are covered there by the forward gate).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._platform import dispatch
from .._platform.dispatch import DispatchMode
from ..providers.tensor import storage_key
from . import forward_gate

logger = logging.getLogger(__name__)

#: ``OpOverload -> ((argument index, name), ...)`` of the arguments its schema marks written.
_writes: dict[Any, tuple[tuple[int, str], ...]] = {}
_local = threading.local()  # .mode: this thread's pushed mode, if any
_lock = threading.Lock()
_hooks: list[Any] = []  # the settle hooks, installed while any thread has the mode pushed
_active = 0  # threads whose mode is pushed

#: Bytes frozen and writes intercepted by the mode (all writers), for tests and logs.
frozen_bytes = 0
interceptions = 0


def _unmarked() -> dict[Any, tuple[tuple[int, str], ...]]:
    """Operators that write arguments their schema does not mark: the batch norms update
    ``running_mean`` and ``running_var`` in place when training (``native_batch_norm`` is what
    ``nn.BatchNorm*`` runs in eager mode on CPU; cuDNN and MIOpen on GPUs)."""
    stats = ((3, "running_mean"), (4, "running_var"))
    ops: dict[Any, tuple[tuple[int, str], ...]] = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            ops[getattr(packet, overload)] = stats
    return ops


_UNMARKED = _unmarked()


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    if func in _UNMARKED:
        return _UNMARKED[func]
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _tensors(value: Any) -> Sequence[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):  # the foreach ops write lists
        return [v for v in value if isinstance(v, torch.Tensor)]
    return ()


def _key(tensor: torch.Tensor) -> int:
    if type(tensor) is DTensor:
        # A view of a DTensor (``dt[3]``) may hold a local tensor of its own (a sharded dim
        # redistributed), yet its write moves ``dt``'s version counter: key it by its base.
        while tensor._base is not None:
            tensor = tensor._base
        tensor = tensor._local_tensor
    try:
        return storage_key(tensor)
    except (RuntimeError, NotImplementedError):  # no storage (meta, a wrapper subclass)
        return 0


class _CopyOnWrite(DispatchMode):
    """Freezes tracked tensors an operator is about to write (module docstring)."""

    #: Higher-order operators (``flex_attention``, ``cond``) come here too and pass through:
    #: without it, torch refuses them under any mode that does not say it takes them, and a
    #: model using FlexAttention in eager mode failed in the snapshot window.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``torch.compile`` runs as without the mode (a compiled graph's writes are the
        version counter's to catch, as they were for graphs compiled before the save): with
        the default, a compilation in the snapshot window fell back to eager, and FlexAttention,
        which compiles its kernel with ``fullgraph=True`` even in eager mode, failed."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        written = _writes.get(func)
        if written is None:
            written = _writes[func] = _written(func)
        if written and forward_gate.in_flight():
            kwargs = kwargs or {}
            targets: list[torch.Tensor] = []
            for index, name in written:
                targets.extend(_tensors(args[index] if index < len(args) else kwargs.get(name)))
            before_write(targets, func)
        return func(*args, **(kwargs or {}))


def before_write(tensors: Sequence[torch.Tensor], what: Any = "a write") -> None:
    """Copy each of ``tensors`` that a snapshot in flight has not copied yet, before the caller
    writes it (on any thread: the mode calls this for the operators it sees; our reader for
    the tensors it loads into behind torch's back)."""
    global frozen_bytes, interceptions
    if not forward_gate.in_flight():
        return
    keys = [k for k in map(_key, tensors) if k]
    if not keys:
        return
    forward_gate.wait_planned()  # a session still planning has not entered its tensors yet
    start = time.perf_counter()
    frozen: dict[Any, int] = {}
    for key in keys:
        for session, provider in forward_gate.tracked(key):
            made = provider.freeze()
            frozen[session] = frozen.get(session, 0) + made
            if made:  # on a device: its copies read the private copy once it is made
                session.after_freeze([provider])
    if not frozen:
        return
    elapsed = time.perf_counter() - start
    with _lock:
        interceptions += 1
        frozen_bytes += sum(frozen.values())
    for session, nbytes in frozen.items():
        session.cow_bytes += nbytes
        session.cow_blocked_s += elapsed
    logger.debug("%s: copied %d bytes before it in %.6fs", what, sum(frozen.values()), elapsed)


def activate() -> None:
    """Put the mode on the calling thread's stack (``stage()``'s), under any mode the caller
    entered, unless it is there already; not inside torch's own tracing."""
    global _active
    mode = getattr(_local, "mode", None)
    if mode is not None:
        if any(m is mode for m in dispatch.stack()):
            return
        _forget_mode()  # something popped it (torch.utils._python_dispatch's own helpers)
    if dispatch.in_tracing():
        return
    mode = _CopyOnWrite()
    dispatch.push_under(mode)
    _local.mode = mode
    with _lock:
        _active += 1
        if not _hooks:
            _hooks.append(register_optimizer_step_post_hook(_settle_hook))
            _hooks.append(register_module_forward_pre_hook(_settle_hook))


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block without this thread's mode: ``stage()``'s own reads, aliases and copies
    are not writes to watch, and under a mode left from the last save (no forward or step
    since) they paid its per-operator cost (20,000 tensors: 62 ms blocked instead of 14). A
    mode :func:`activate` pushes inside the block stays; else the one paused comes back."""
    mode = getattr(_local, "mode", None)
    if mode is None or not dispatch.remove(mode):
        yield
        return
    _local.mode = None
    try:
        yield
    finally:
        if getattr(_local, "mode", None) is None:
            dispatch.push_under(mode)
            _local.mode = mode
        else:  # a new save pushed its own: the paused one is gone for good
            _local.mode, new = mode, _local.mode
            _forget_mode()
            _local.mode = new


def settle() -> bool:
    """Take this thread's mode off its stack if no snapshot is in flight (modes the caller
    entered stay, in their order). Returns whether this thread is now free of it."""
    mode = getattr(_local, "mode", None)
    if mode is None:
        return True
    if forward_gate.in_flight():
        return False
    dispatch.remove(mode)
    _forget_mode()
    return True


def _forget_mode() -> None:
    global _active
    _local.mode = None
    with _lock:
        _active -= 1
        if _active == 0:
            for handle in _hooks:
                handle.remove()
            _hooks.clear()


def _settle_hook(*_args: Any) -> None:
    settle()


def active() -> bool:
    """Whether the calling thread has the mode pushed (for tests)."""
    return getattr(_local, "mode", None) is not None
