"""A simulated GPU for tests on CPU: a device timeline that runs behind the host.

:class:`FakeCuda` is a CUDA runtime (``_platform.cuda.Runtime``): the real device layer
(``device.CudaDevice``) and the load's bounce buffers run on it unchanged (:meth:`FakeCuda.device`),
so CI checks their ordering, not a model of it. Its "device memory" is CPU tensors it knows
(:meth:`FakeCuda.adopt`, and every tensor a device op made or wrote). The model, and what it
must catch:

- **The host runs ahead.** An aten op that touches device memory, issued on a thread inside
  :meth:`FakeCuda.active` (the training thread) or :meth:`FakeCuda.on` (the device layer's
  threads), is *enqueued* on that thread's current stream and returns at once. Its version
  counter moves now, as on CUDA (at enqueue); its effect on memory happens when the device runs
  it. A whole training loop can be queued before one kernel ran.
- **Streams are independent** FIFO queues of kernels, event records and event waits; only a
  wait on an event orders one after another. A fence (``stream.wait_event``) orders; it
  completes nothing.
- **Unfinished memory is garbage.** A tensor a queued op produces holds NaN bytes (0xFF) until
  the op ran, and a device-to-host copy's destination is garbage until the copy ran: a missing
  wait shows as a wrong checkpoint, not as luck. A kernel that reads memory an earlier-enqueued
  kernel has not written yet is also noted in ``violations``.
- **The device runs only when driven**, in an adversarial ``order``: ``"copies_first"`` runs the
  side streams the device layer made (its copies) before any other stream whenever both can
  run (a copy that waits on too little reads memory not produced yet); ``"compute_first"`` runs
  the other streams first (a step that is not fenced overwrites what a copy has yet to read).
  The test drives it (:meth:`run`, :meth:`run_until`, :meth:`background`); a thread inside
  ``active()`` that synchronizes (``.item()``, ``torch.equal``, ``Event.synchronize``) drives it
  until what it waits for is done; any other thread waits for a driver.
- How an op is taken (``device_fake_ops``): a host scalar it reads is read at enqueue, a
  ``non_blocking`` copy reads or writes host memory when it runs. A kernel's failure is sticky
  on its stream, raised by a later ``synchronize`` (:meth:`fail_copy` injects one).

Not modelled: the caching allocator's reuse of freed memory (``keep`` is a no-op), the legacy
default stream's implicit synchronization (every stream is non-blocking, as torch's side
streams are), concurrency inside the device (one operation runs at a time).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._platform import dispatch
from .device import CudaDevice
from .device_fake_ops import GARBAGE, QueueMode, below, fill_garbage

HANG_S = 20.0  # upper bound on any wait for the simulated device: one that hits it has hung
COPIES_FIRST, COMPUTE_FIRST = "copies_first", "compute_first"
ORDERS = (COPIES_FIRST, COMPUTE_FIRST)


class FakeDeviceHang(RuntimeError):
    """A wait on the simulated device that nothing could ever end."""


class _Op:
    __slots__ = (
        *("seq", "stream", "kind", "fn", "target", "label"),
        *("done", "error", "reads", "writes"),
    )

    def __init__(self, seq: int, stream: FakeStream, kind: str, label: str) -> None:
        self.seq, self.stream, self.kind, self.label = seq, stream, kind, label
        self.fn: Callable[[], None] | None = None
        self.target: _Op | None = None  # a wait's record
        self.done = False
        self.error: BaseException | None = None
        self.reads: list[int] = []  # storages a kernel reads
        self.writes: list[int] = []  # and writes

    def __repr__(self) -> str:
        return f"#{self.seq} {self.kind} {self.label} on {self.stream.name}"


class FakeStream:
    """A FIFO queue of operations on one simulated device."""

    def __init__(self, fake: FakeCuda, index: int, role: str, name: str) -> None:
        self.fake, self.device_index, self.role, self.name = fake, index, role, name
        self.ops: deque[_Op] = deque()
        self.last: _Op | None = None
        self.error: BaseException | None = None  # sticky, as a CUDA error is

    def wait_event(self, event: FakeEvent) -> None:
        target = event.op
        if target is not None:
            self.fake._enqueue(self, "wait", f"for {target!r}", target=target)

    def wait_stream(self, stream: FakeStream) -> None:
        event = self.fake.new_event()
        event.record(stream)
        self.wait_event(event)

    def query(self) -> bool:
        return self.last is None or self.last.done

    def synchronize(self) -> None:
        last = self.last
        self.fake._wait(lambda: last is None or last.done, f"stream {self.name}")
        if last is not None and self.error is not None:
            raise RuntimeError(f"simulated CUDA error on {self.name}: {self.error}")

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """An event: done once the device ran the stream up to its last ``record``."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.op: _Op | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.fake.current_stream(0)
        self.op = self.fake._enqueue(stream, "record", "event")

    def query(self) -> bool:
        op = self.op
        return op is None or op.done

    def synchronize(self) -> None:
        op = self.op
        self.fake._wait(lambda: op is None or op.done, f"event {op!r}")
        if op is not None and op.error is not None:
            raise RuntimeError(f"simulated CUDA error on {op.stream.name}: {op.error}")


class FakeCuda:
    """A simulated GPU with ``devices`` devices whose kernels run behind the host (see the module
    docstring). ``order`` is the adversary the device plays when it may run several streams."""

    def __init__(self, *, devices: int = 1, order: str = COPIES_FIRST) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
        self.order = order
        self.violations: list[str] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._streams: list[FakeStream] = []
        self._defaults = [self._new_stream(i, "compute", f"default{i}") for i in range(devices)]
        #: storage -> (weak reference, device index): what is device memory
        self._memory: dict[int, tuple[StorageWeakRef, int]] = {}
        #: storage -> kernels enqueued to write it that have not run
        self._pending_writes: dict[int, list[_Op]] = {}
        self._tls = threading.local()
        self._faults: list[list[Any]] = []  # [copies to let through, error]
        #: what threads that do not drive the device wait for (``_wait``)
        self._waiters: list[Callable[[], bool]] = []
        self.kernels_run = 0
        #: device-to-host copies enqueued
        self.d2h_copies = 0

    # -- the Runtime interface -------------------------------------------------------------
    def device_of(self, tensor: torch.Tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        entry = self._memory.get(key)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def new_stream(self, index: int) -> FakeStream:
        """A side stream the device layer made (its copies): ``copies_first`` favours these."""
        return self._new_stream(index, "copy", f"copy{index}.{len(self._streams)}")

    def compute_stream(self, index: int = 0) -> FakeStream:
        """A side stream for the test's own work (training on a stream other than the default)."""
        return self._new_stream(index, "compute", f"compute{index}.{len(self._streams)}")

    def current_stream(self, index: int) -> FakeStream:
        streams = getattr(self._tls, "streams", None)
        stream = streams.get(index) if streams else None
        return stream if stream is not None else self._defaults[index]

    def new_event(self, *, blocking: bool = False) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def on(self, index: int, stream: FakeStream) -> Iterator[None]:
        with self.use_stream(stream):
            yield

    def keep(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        return None

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        fill_garbage(tensor)
        self._register(tensor, index)
        return tensor

    def is_stream(self, obj: Any) -> bool:
        return isinstance(obj, FakeStream) and obj.fake is self

    def set_device(self, index: int) -> None:
        return None

    # -- what the test uses ------------------------------------------------------------------
    def device(self, *, coalesce: bool = True) -> CudaDevice:
        """The real CUDA device layer, running on this simulated GPU."""
        return CudaDevice(coalesce=coalesce, runtime=self)

    def adopt(self, *objects: torch.Tensor | torch.nn.Module, index: int = 0) -> None:
        """Make these tensors (a module's parameters and buffers) device memory of ``index``,
        as they are now (their bytes are produced)."""
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                for t in itertools.chain(obj.parameters(), obj.buffers()):
                    self._register(t, index)
            else:
                self._register(obj, index)

    def to_device(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        """A device copy of the host tensor ``tensor`` (produced already)."""
        with below():
            out = tensor.detach().clone()
        self._register(out, index)
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` once the work writing it has run (driving the device)."""
        if self.device_of(tensor) is not None:
            key = tensor.untyped_storage()._cdata
            with self._cond:
                pending = list(self._pending_writes.get(key, ()))
            self._wait(lambda: all(op.done for op in pending), "a host read", drive=True)
        with below():
            return tensor.detach().clone()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Device work issued on this thread in the block is enqueued (the host runs ahead), and
        a synchronization on it drives the device (this is the training thread)."""
        tls = self._tls
        before = getattr(tls, "driver", False)
        tls.driver = True
        try:
            with self._mode():
                yield
        finally:
            tls.driver = before

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        """Work issued on this thread in the block goes to ``stream`` (``torch.cuda.stream``)."""
        tls = self._tls
        streams = getattr(tls, "streams", None)
        if streams is None:
            streams = tls.streams = {}
        before = streams.get(stream.device_index)
        streams[stream.device_index] = stream
        try:
            with self._mode():
                yield
        finally:
            streams[stream.device_index] = before

    def run(self, order: str | None = None) -> int:
        """Run everything that can run, in ``order`` (default: the device's); returns how many
        operations ran."""
        ran = 0
        with self._cond:
            while self._run_one(order):
                ran += 1
        return ran

    def run_until(
        self,
        done: Future[Any] | Callable[[], bool],
        order: str | None = None,
        *,
        lazy: bool = False,
        timeout: float = HANG_S,
    ) -> None:
        """Drive the device until ``done`` (a future, or a condition on state that host threads
        change: it is checked whenever the device or the host moved). ``lazy``: run only what
        other threads wait for, and let them act on it before going on (the host is fast: a
        thread that reads memory without waiting for the device reads it as it is then)."""
        if isinstance(done, Future):
            future = done
            future.add_done_callback(lambda _: self.notify())
            done = future.done
        self._wait(done, "run_until", drive=True, order=order, lazy=lazy, timeout=timeout)

    def wait_for(self, done: Callable[[], bool], timeout: float = HANG_S) -> None:
        """Wait, without driving the device, until ``done()`` (host state the device layer
        changes as it enqueues, such as :attr:`d2h_copies`)."""
        self._wait(done, "wait_for", drive=False, timeout=timeout)

    def notify(self) -> None:
        """Wake waiters: host state a ``run_until`` condition reads may have changed."""
        with self._cond:
            self._cond.notify_all()

    def spawn(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on a new thread inside :meth:`active` (a second training thread, or a
        step the host guard may hold); its future wakes ``run_until``."""
        future: Future[Any] = Future()
        future.add_done_callback(lambda _: self.notify())

        def body() -> None:
            try:
                with self.active():
                    result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        threading.Thread(target=body, name="fake-cuda-host", daemon=True).start()
        return future

    @contextlib.contextmanager
    def background(self, order: str | None = None) -> Iterator[None]:
        """A device that runs by itself in the block (a thread drives it whenever something can
        run): for host code that blocks on the snapshot (the host guard) without a sync here."""
        stop = threading.Event()

        def drive() -> None:
            with self._cond:
                while not stop.is_set():
                    if not self._run_one(order):
                        self._cond.wait()

        thread = threading.Thread(target=drive, name="fake-cuda-device", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            self.notify()
            thread.join(HANG_S)

    def fail_copy(self, error: BaseException, *, after: int = 0) -> None:
        """Make the device-to-host copy after the next ``after`` ones fail with ``error``."""
        with self._cond:
            self._faults.append([after, error])

    def pending(self) -> int:
        """Operations enqueued and not run yet."""
        with self._cond:
            return sum(len(s.ops) for s in self._streams)

    # -- the timeline --------------------------------------------------------------------------
    def _new_stream(self, index: int, role: str, name: str) -> FakeStream:
        stream = FakeStream(self, index, role, name)
        with self._cond:
            self._streams.append(stream)
        return stream

    def _register(self, tensor: torch.Tensor, index: int) -> None:
        storage = tensor.untyped_storage()
        with self._cond:
            self._memory[storage._cdata] = (StorageWeakRef(storage), index)
            if len(self._memory) % 4096 == 0:
                for key in [k for k, (ref, _) in self._memory.items() if ref.expired()]:
                    del self._memory[key]
                    self._pending_writes.pop(key, None)

    def _enqueue(
        self,
        stream: FakeStream,
        kind: str,
        label: str,
        *,
        fn: Callable[[], None] | None = None,
        target: _Op | None = None,
        reads: list[int] | None = None,
        writes: list[int] | None = None,
    ) -> _Op:
        with self._cond:
            op = _Op(next(self._seq), stream, kind, label)
            op.fn, op.target, op.reads, op.writes = fn, target, reads or [], writes or []
            for key in op.writes:
                self._pending_writes.setdefault(key, []).append(op)
            stream.ops.append(op)
            stream.last = op
            self._cond.notify_all()
        return op

    def _runnable(self, stream: FakeStream) -> bool:
        if not stream.ops:
            return False
        head = stream.ops[0]
        return head.kind != "wait" or head.target is None or head.target.done

    def _run_one(self, order: str | None) -> bool:
        # caller holds self._cond
        order = order or self.order
        first = "copy" if order == COPIES_FIRST else "compute"
        ready = [s for s in self._streams if self._runnable(s)]
        if not ready:
            return False
        preferred = [s for s in ready if s.role == first]
        stream = (preferred or ready)[0]
        op = stream.ops.popleft()
        if op.kind == "kernel":
            self._check_reads(op)
            assert op.fn is not None
            try:
                if op.label.startswith("d2h") and self._faults:
                    fault = self._faults[0]
                    if fault[0] == 0:
                        self._faults.pop(0)
                        raise fault[1]
                    fault[0] -= 1
                op.fn()
            except BaseException as exc:
                stream.error = stream.error or exc
            self.kernels_run += 1
            for key in op.writes:
                pending = self._pending_writes.get(key)
                if pending is not None and op in pending:
                    pending.remove(op)
        elif op.kind == "record":
            op.error = stream.error
        op.done = True
        op.fn = None  # the tensors it held may go
        self._cond.notify_all()
        return True

    def _check_reads(self, op: _Op) -> None:
        for key in op.reads:
            for writer in self._pending_writes.get(key, ()):
                if writer.seq < op.seq and not writer.done:
                    self.violations.append(f"{op!r} read memory {writer!r} had not written yet")
                    return

    def _wait(
        self,
        done: Callable[[], bool],
        what: str,
        *,
        drive: bool | None = None,
        order: str | None = None,
        lazy: bool = False,
        timeout: float = HANG_S,
    ) -> None:
        """Wait until ``done()``. A driving thread runs the device meanwhile: every operation
        that can run, or with ``lazy`` only while another thread waits for the device (which
        then runs only as far as that thread needs; the host acts on what it got before the
        device goes on)."""
        drive = getattr(self._tls, "driver", False) if drive is None else drive
        with self._cond:
            if not drive:
                self._waiters.append(done)
                self._cond.notify_all()  # a lazy driver runs for it
            try:
                while not done():
                    wanted = not lazy or any(not w() for w in self._waiters)
                    if drive and wanted and self._run_one(order):
                        continue
                    if not self._cond.wait(timeout):
                        heads = {s.name: list(s.ops)[:2] for s in self._streams if s.ops}
                        raise FakeDeviceHang(f"waited {timeout}s for {what}; queued: {heads}")
            finally:
                if not drive:
                    self._waiters.remove(done)

    @contextlib.contextmanager
    def _mode(self) -> Iterator[None]:
        # At the bottom of this thread's stack and removed from under any mode pushed inside
        # the block (``_platform.dispatch``): copy-on-write's, pushed in stage(), outlives it.
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        mode = None
        if not depth:
            mode = QueueMode(self)
            dispatch.push_device(mode)
        try:
            yield
        finally:
            tls.depth = depth
            if mode is not None:
                dispatch.remove(mode)


__all__ = [
    "COMPUTE_FIRST",
    "COPIES_FIRST",
    "GARBAGE",
    "FakeCuda",
    "FakeDeviceHang",
    "FakeEvent",
    "FakeStream",
]
