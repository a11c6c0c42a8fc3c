"""A fake device for tests: CPU tensors, asynchronous copies whose completion the test controls.

It models what the CUDA device layer promises, so CI checks the engine's gating logic without a
GPU: ``copy()`` only *enqueues* (the pool block keeps its old bytes), a copy may run only after
the producing streams' gate fired, and the bytes land when the test says so (:meth:`complete`) or
fail when it says so (:meth:`fail`). Anything that breaks the model is recorded in ``violations``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import SnapshotMutationError
from .device import Part


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def fire(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()


@dataclass(eq=False)
class FakeCopy:
    parts: list[Part]
    dst: torch.Tensor
    gate: FakeEvent
    event: FakeEvent = field(default_factory=FakeEvent)
    fenced: int = 0  # how many times a stream was made to wait on it
    landed: bool = False  # its bytes are in the pool

    # Completion protocol
    def query(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event._done.wait()
        if self.event.error is not None:
            raise self.event.error

    def fence(self) -> bool:
        # A real fence queues the caller's next kernels behind the copy; the caller here mutates
        # on the host right away, so the copy's bytes land now (its event still fires later).
        self.fenced += 1
        self.land()
        return True

    def land(self) -> None:
        if not self.landed:
            self.landed = True
            for provider, start, stop, at in self.parts:
                # A device copy compares no sampled bytes (probes are taken of CPU sources
                # only): as on CUDA, the version checks at enqueue and completion decide.
                with contextlib.suppress(SnapshotMutationError):
                    provider.copy_into(self.dst[at : at + stop - start], start, stop)


class FakeDevice:
    """Copies queue in enqueue order (one stream); the test runs them with :meth:`complete`."""

    synchronous = False

    def __init__(self, *, gate_fired: bool = True, auto: bool = False) -> None:
        self.gate_fired = gate_fired
        self.auto = auto  # complete each copy as soon as it is enqueued
        self.gates: list[FakeEvent] = []
        self.copies: list[FakeCopy] = []
        self.violations: list[str] = []
        self._cond = threading.Condition()

    # -- the device interface ------------------------------------------------------------------
    def gate(self, devices: set[torch.device]) -> FakeEvent:
        event = FakeEvent()
        if self.gate_fired:
            event.fire()
        with self._cond:
            self.gates.append(event)
        return event

    def copy(self, parts: Sequence[Part], dst: torch.Tensor, gate: FakeEvent) -> FakeCopy:
        copy = FakeCopy(list(parts), dst, gate)
        with self._cond:
            self.copies.append(copy)
            self._cond.notify_all()
        if self.auto:
            self._run(copy, None)
        return copy

    # -- what the test drives ------------------------------------------------------------------
    def fire_gates(self) -> None:
        """The producing streams reached the recorded events."""
        with self._cond:
            for gate in self.gates:
                gate.fire()

    def wait_enqueued(self, n: int, timeout: float = 30.0) -> list[FakeCopy]:
        """Wait until at least ``n`` copies were enqueued; returns them all."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.copies) >= n, timeout=timeout):
                raise TimeoutError(f"only {len(self.copies)} of {n} copies were enqueued")
            return list(self.copies)

    def pending(self) -> list[FakeCopy]:
        with self._cond:
            return [c for c in self.copies if not c.query()]

    def complete(self, copy: FakeCopy | None = None) -> FakeCopy:
        """Run ``copy`` (default: the oldest pending one): its bytes land, its event fires."""
        copy = copy if copy is not None else self.pending()[0]
        self._run(copy, None)
        return copy

    def complete_all(self) -> None:
        for copy in self.pending():
            self._run(copy, None)

    def release(self) -> None:
        """From now on copies complete as soon as they are enqueued; pending ones complete now."""
        self.auto = True
        self.fire_gates()
        self.complete_all()

    def fail(self, error: BaseException, copy: FakeCopy | None = None) -> FakeCopy:
        copy = copy if copy is not None else self.pending()[0]
        self._run(copy, error)
        return copy

    def _run(self, copy: FakeCopy, error: BaseException | None) -> None:
        if not copy.gate.query():
            self.violations.append("a copy ran before its producing streams' event")
        if error is None:
            copy.land()
        copy.event.fire(error)


__all__ = ["FakeCopy", "FakeDevice", "FakeEvent"]
