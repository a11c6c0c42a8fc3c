"""Staging for ``AsyncCheckpointerType.PROCESS``, where the save runs in another process.

There the staged state dict is pickled to DCP's checkpoint daemon, so the writer cannot stream
from live tensors: the daemon must receive a real copy. The copy is still lazy: ``stage()``
returns a future at once and a background thread copies every tensor into *one* shared-memory
segment per save (not one per tensor: thousands of segments exhaust file descriptors); the
optimizer guard makes the next step wait for it. DCP waits for the future before sending the
copy, and the daemon's writer streams it to storage.

Each tensor is read through a ``TensorProvider``, as in the THREAD executor, so the same
protections hold: small tensors are copied during ``stage()`` (``eager_copy_bytes``), the forward
gate copies module buffers before forward updates them (``guard_forward``), and the version
counter and sampled bytes catch any other change.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import DataStatesError, InvalidStateDictError
from ..providers.tensor import TensorProvider
from ..snapshot import cow as _cow
from ..snapshot import forward_gate as _forward_gate
from ..snapshot import guard as _guard
from .planner import check_state_dict

logger = logging.getLogger(__name__)


#: The key (followed by ``/`` and a token) of the one item of the state a rank hands its daemon
#: when its staging failed in a save of several ranks (``relay``). The daemon's writer
#: raises the failure in DCP's local planning step (:func:`raise_relayed`), which DCP reports to
#: every rank, naming this rank and its error. Raised here instead, it reached this rank alone
#: and the other ranks' daemons waited in DCP's collectives until the process group's timeout.
FAILED_KEY = "__dcp_datastates_staging_failed__"

#: In DCP's daemon: failures unpickled from the requests, by token, until their plan is made.
_relayed: dict[str, BaseException] = {}


class StagingFailed:
    """A rank's failed staging, sent to its daemon in place of the state (``FAILED_KEY``)."""

    def __init__(self, error: BaseException) -> None:
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - any error that does not pickle is described instead
            error = DataStatesError(f"staging failed: {type(error).__name__}: {error}")
        self.error = error
        self.token = uuid.uuid4().hex

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received, (self.error, self.token))


def _received(error: BaseException, token: str) -> StagingFailed:
    """Unpickled in the daemon: the failure is kept for the writer's local plan."""
    failed = StagingFailed.__new__(StagingFailed)
    failed.error, failed.token = error, token
    _relayed[token] = error
    return failed


def failed_state(error: BaseException, rank: int) -> dict[str, Any]:
    logger.error(
        "rank %d: the state cannot be staged (%s: %s); the save fails on every rank",
        rank,
        type(error).__name__,
        error,
    )
    failed = StagingFailed(error)
    return {f"{FAILED_KEY}/{failed.token}": failed}


def raise_relayed(plan: Any) -> None:
    """In the daemon's local planning step: raise the failure a rank's staging relayed (before
    the global plan, which the rank's missing shards would fail with a misleading error).
    Every unpickled failure is registered (``_received``): where none is, no item is looked at
    (a plan of 20,000 items costs a few ms to scan)."""
    if not _relayed:
        return
    for item in plan.items:
        key, _, token = item.index.fqn.partition("/")
        if key == FAILED_KEY:
            error = _relayed.pop(token, None)
            if error is None:
                error = DataStatesError(
                    "this rank's staging failed (its error is in the training process's log); "
                    "nothing was written"
                )
            raise error


@dataclass
class ProcessStaging:
    result: Future[Any]  # the staged copy of the state dict
    staged: Future[None]  # resolves when the copy is complete (or failed)


class _StagedDTensor:
    """A staged DTensor on its way to the daemon: pickles as its local tensor and its spec, and
    unpickles there as a DTensor.

    Not a DTensor here because pickling a DTensor whose local tensor is a view at a non-zero
    offset into a shared-memory segment crashes the process (SIGSEGV in torch 2.13), and every
    staged tensor is such a view (one segment per save). The plain view pickles fine.
    """

    def __init__(self, local: torch.Tensor, spec: Any) -> None:
        self.local = local
        self.spec = spec

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_dtensor, (self.local, self.spec))


def _rebuild_dtensor(local: torch.Tensor, spec: Any) -> DTensor:
    # The constructor, not DTensor.from_local: from_local would move a CPU copy back to the mesh's
    # device (a GPU), and would record an autograd op.
    return DTensor(local, spec, requires_grad=False)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Protected:
    """What the forward gate and copy-on-write need of a staging: its tensors, its future, its
    figures, and a session's two device members (host copies: never fenced, nothing to order)."""

    fenced = False

    def __init__(self, providers: list[TensorProvider], staged: Future[None]) -> None:
        self.providers = providers
        self.staged = staged
        self.forward_frozen_bytes = 0
        self.forward_blocked_s = 0.0
        self.cow_bytes = 0
        self.cow_blocked_s = 0.0

    def raw_providers(self) -> list[TensorProvider]:
        return [p for p in self.providers if p.nbytes > 0]

    def after_freeze(self, providers: list[TensorProvider]) -> None:
        return None  # host clones are made when freeze() returns


def stage_for_process(
    state_dict: dict[str, Any],
    *,
    guard: bool,
    guard_forward: bool = True,
    copy_on_write: bool = False,
    eager_copy_bytes: int = 0,
    state_error: Exception | None = None,
    relay: Callable[[Exception], bool] | None = None,
) -> ProcessStaging:
    """Start copying ``state_dict`` for the daemon. ``state_error``: the state could not be
    made (a ``Stateful`` raised; ``async_save``). A failure, that one, now or in the copy, for
    which ``relay`` says yes (``calls.fails_on_every_rank``: a save of several ranks) becomes
    the staged state (:func:`failed_state`), so that the daemon's save fails on every rank
    rather than this rank's alone."""
    try:
        if state_error is not None:
            raise state_error
        with _cow.paused():  # the call's own reads and copies are not writes to watch
            return _stage_for_process(
                state_dict,
                guard=guard,
                guard_forward=guard_forward,
                copy_on_write=copy_on_write,
                eager_copy_bytes=eager_copy_bytes,
                relay=relay,
            )
    except Exception as exc:
        if relay is None or not relay(exc):
            raise
        result: Future[Any] = Future()
        result.set_result(failed_state(exc, _rank()))
        staged: Future[None] = Future()
        staged.set_result(None)
        return ProcessStaging(result=result, staged=staged)


def _stage_for_process(
    state_dict: dict[str, Any],
    *,
    guard: bool,
    guard_forward: bool,
    copy_on_write: bool,
    eager_copy_bytes: int,
    relay: Callable[[Exception], bool] | None,
) -> ProcessStaging:
    check_state_dict(state_dict)
    sources: list[TensorProvider] = []  # each live tensor, read through a provider
    offsets: list[int] = []
    total = 0

    def plan(value: Any, fqn: str) -> Any:
        nonlocal total
        if isinstance(value, DTensor):
            local = plan(value.to_local(), fqn)
            # Its in-place ops (``dt.add_``, ``dt[i].fill_``) move the DTensor's own version
            # counter, not its local tensor's (``TensorProvider.watch_owner``).
            sources[-1].watch_owner(value)
            spec = value._spec  # mesh, placements, global shape/stride/dtype: all it takes
            return lambda buf: _StagedDTensor(local(buf), spec)
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise InvalidStateDictError(
                    f"item {fqn!r} is a {type(value).__name__}; the PROCESS checkpointer stages "
                    "plain tensors and DTensors only (use the THREAD checkpointer)"
                )
            t = value.detach()
            total += (-total) % 64
            start = total
            sources.append(TensorProvider(fqn, t))
            offsets.append(start)
            total += _nbytes(t)
            return lambda buf: buf[start : start + _nbytes(t)].view(t.dtype).view(t.shape)
        if isinstance(value, dict):
            parts = {k: plan(v, f"{fqn}.{k}" if fqn else str(k)) for k, v in value.items()}
            return lambda buf: {k: make(buf) for k, make in parts.items()}
        if isinstance(value, (list, tuple)):
            parts_l = [plan(v, f"{fqn}.{i}") for i, v in enumerate(value)]
            kind = type(value)
            return lambda buf: kind(make(buf) for make in parts_l)
        frozen = copy.deepcopy(value)  # objects are mutable: copy them now, on the caller thread
        return lambda buf: frozen

    build: Callable[[torch.Tensor], Any] = plan(state_dict, "")
    result: Future[Any] = Future()
    staged: Future[None] = Future()
    for provider in sources:
        provider.note_part()  # one copy each, into its place in the segment
        if 0 < provider.nbytes <= eager_copy_bytes:
            provider.freeze()
    if guard:
        _guard.guard(staged)
    if guard_forward or copy_on_write:
        _forward_gate.protect(_Protected(sources, staged), forward=guard_forward, cow=copy_on_write)
    if copy_on_write:
        _cow.activate()

    def run() -> None:
        rank = _rank()
        try:
            buf = shared_bytes(max(total, 1))
            staged_dict = build(buf)
            for provider, start in zip(sources, offsets, strict=True):
                n = provider.nbytes
                if n:
                    provider.copy_into(buf[start : start + n], 0, n)
                provider.check_unchanged(rank)
            result.set_result(staged_dict)
        except Exception as exc:  # reaches the caller through DCP's upload future
            if relay is not None and relay(exc):
                result.set_result(failed_state(exc, rank))
            else:
                result.set_exception(exc)
        except BaseException as exc:
            result.set_exception(exc)
        finally:
            for provider in sources:
                provider.release()  # hold no reference to the caller's tensors any more
            staged.set_result(None)

    threading.Thread(target=run, name="datastates-process-stage", daemon=True).start()
    return ProcessStaging(result=result, staged=staged)


def shared_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh shared memory as a uint8 tensor, written by nothing yet.

    Not ``torch.empty(n).share_memory_()``: that copies the new tensor's bytes into the shared
    segment, a parallel ATen copy of the whole state on this thread (its own OpenMP team beside
    the training's, ``docs/design.md``, "Threads"): staging the train benchmark's 0.33 GB state
    took 0.27-0.28 s of CPU with it, 0.20 s without."""
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_daemon_runtimes: dict[Any, Any] = {}
_daemon_lock = threading.Lock()


def _after_fork_in_child() -> None:  # the runtimes' threads are the parent's
    global _daemon_lock
    _daemon_lock = threading.Lock()
    _daemon_runtimes.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def daemon_runtime(options: Any, make: Callable[[], Any]) -> Any:
    """The one writer runtime (pool and threads) per options of this process, for writers that
    were unpickled here.

    DCP's checkpoint daemon unpickles a new writer for every save request and never closes it:
    each would allocate its own pool and threads and leave them behind (6 saves of 48 MiB grew
    the daemon by 3 threads and ~96 MiB per save). Sharing one runtime keeps the daemon flat and
    reuses the pool, as one long-lived writer would; the daemon runs its saves one at a time.
    """
    with _daemon_lock:
        runtime = _daemon_runtimes.get(options)
        if runtime is None:
            runtime = _daemon_runtimes[options] = make()
        return runtime
