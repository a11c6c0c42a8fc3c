"""The gating logic of asynchronous (CUDA-like) snapshot copies, checked without a GPU.

The fake device (``dcp_datastates.snapshot.device_fake``) only enqueues copies; their bytes land
and their completion events fire when the test says. The engine, pool, guard and flush are the
real ones. What is checked: no copy is read (or its pool block freed) before its event, every copy
is gated on the events stage() recorded, the optimizer step waits (on the host) or fences (on the
device), a change before the fence fails the save, aborts release pool space, copy errors reach the
future. The same round trips run through every device layer that runs here (one contract suite).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, MiB, assert_same_state, failure_of, load_like, pool_drains

from dcp_datastates import CheckpointSaveError, SnapshotMutationError, async_save
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import guard
from dcp_datastates.snapshot.device import (
    CPU,
    CpuDevice,
    use_device,
)
from dcp_datastates.snapshot.device_fake import FakeDevice
from dcp_datastates.snapshot.pieces import ADMITTED
from dcp_datastates.snapshot.pool import HostPool
from dcp_datastates.snapshot.scheduler import SnapshotScheduler
from dcp_datastates.snapshot.session import SnapshotSession

pytestmark = pytest.mark.timeout(60)

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


@pytest.fixture
def fake() -> Iterator[FakeDevice]:
    device = FakeDevice()
    yield device
    device.release()  # never leave a completion thread parked


class _Engine:
    """A pool, a scheduler and sessions over it, closed by the fixture."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool = HostPool(pool_bytes)
        self.scheduler = SnapshotScheduler(self.pool, copy_workers=1, on_stall=lambda: None)

    def session(self, state: dict[str, torch.Tensor], device, chunk: int = 64 * 1024):
        items = [(key, TensorProvider(key, value)) for key, value in state.items()]
        session = SnapshotSession(
            items,
            pool=self.pool,
            chunk_bytes=chunk,
            coalesce_bytes=16 * 1024,
            rank=0,
            device=device,
        )
        self.scheduler.submit(session)
        return session


@pytest.fixture
def engine() -> Iterator[_Engine]:
    made = _Engine(MiB)
    yield made
    made.scheduler.close()


def _read(session: SnapshotSession, key: str) -> bytes:
    out = b""
    for slice_ in session.slices[key]:
        out += bytes(session.wait(slice_))
        session.drop(slice_)
    return out


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


# -- the engine over the fake --------------------------------------------------------------------
def test_a_piece_is_not_read_before_its_copy_event_fires(engine: _Engine, fake) -> None:
    value = torch.randn(64 * 1024)  # 256 KiB: four pieces of 64 KiB
    session = engine.session({"w": value}, fake)
    copies = fake.wait_enqueued(4)
    reader, got = _in_background(lambda: _read(session, "w"))

    first = session.slices["w"][0].piece
    assert first.state == ADMITTED and not first.done.is_set()
    assert not any(c.landed for c in copies)  # the pool block still holds no snapshot bytes
    assert not session.staged.done()

    for copy in copies:
        fake.complete(copy)
    reader.join(EVENT_TIMEOUT_S)
    assert got == [_bytes(value)]
    assert session.staged.done() and first.state != ADMITTED
    assert fake.violations == []


def test_every_copy_waits_on_the_events_stage_recorded(engine: _Engine) -> None:
    fake = FakeDevice(gate_fired=False)  # the producing streams have not got there yet
    value = torch.randn(32 * 1024)
    session = engine.session({"w": value}, fake)

    assert len(fake.gates) == 1 and session.gate is fake.gates[0]  # recorded in the constructor
    copies = fake.wait_enqueued(2)
    assert all(c.gate is session.gate for c in copies)
    fake.complete_all()  # run before the producing streams: the fake notes the violation
    assert fake.violations
    fake.violations.clear()
    fake.fire_gates()
    assert _read(session, "w") == _bytes(value)


def test_tiny_tensors_share_one_copy_per_piece(engine: _Engine, fake) -> None:
    state = {f"b{i}": torch.randn(16) for i in range(300)}  # 64 B each
    session = engine.session(state, fake)
    fake.wait_enqueued(len(session.pieces))
    fake.complete_all()
    got = {key: _read(session, key) for key in state}

    assert len(fake.copies) == len(session.pieces) < 300 // 10
    assert got == {key: _bytes(value) for key, value in state.items()}


def test_an_abort_frees_pool_blocks_only_after_their_copies_complete(engine: _Engine, fake) -> None:
    session = engine.session({"w": torch.randn(128 * 1024)}, fake)  # 512 KiB in 8 pieces
    copies = fake.wait_enqueued(8)
    session.abort(RuntimeError("the save was cancelled"))

    assert engine.pool.in_use > 0  # the copies may still write into their blocks
    for copy in copies:
        fake.complete(copy)
    with engine.pool._cond:
        assert engine.pool._cond.wait_for(lambda: engine.pool.in_use == 0, EVENT_TIMEOUT_S)
    assert session.finished
    with pytest.raises(RuntimeError, match="cancelled"):
        session.wait(session.slices["w"][0])


def test_a_failed_copy_fails_the_session_and_frees_the_pool(engine: _Engine, fake) -> None:
    session = engine.session({"w": torch.randn(64 * 1024)}, fake)
    copies = fake.wait_enqueued(4)
    fake.fail(RuntimeError("device-to-host copy failed: illegal address"), copies[0])
    for copy in copies[1:]:
        fake.complete(copy)

    with pytest.raises(RuntimeError, match="illegal address"):
        session.wait(session.slices["w"][0])
    assert session.staged.result(EVENT_TIMEOUT_S) is None  # the state may change again
    with engine.pool._cond:
        assert engine.pool._cond.wait_for(lambda: engine.pool.in_use == 0, EVENT_TIMEOUT_S)


def test_a_change_between_stage_and_copy_completion_fails_the_session(
    engine: _Engine, fake
) -> None:
    value = torch.randn(1024)
    session = engine.session({"w": value}, fake)
    fake.wait_enqueued(1)
    value.add_(1.0)  # not fenced: nothing orders this after the copy
    fake.complete_all()

    with pytest.raises(SnapshotMutationError, match="'w'"):
        session.wait(session.slices["w"][0])


def test_a_fence_lets_later_changes_through_and_checks_earlier_ones(engine: _Engine, fake) -> None:
    ok, torn = torch.randn(1024), torch.randn(1024)
    clean = engine.session({"ok": ok}, fake)
    fake.wait_enqueued(1)
    assert clean.fence_on_device()
    ok.add_(0.0)  # the step's kernels: enqueued (version bumped) after the fence
    fake.complete_all()
    assert clean.wait(clean.slices["ok"][0]).tobytes() == _bytes(ok)
    clean.drop(clean.slices["ok"][0])

    dirty = engine.session({"torn": torn}, fake)
    fake.wait_enqueued(2)
    torn.add_(1.0)  # changed before the fence: the copy may see either value
    assert dirty.fence_on_device()
    fake.complete_all()
    with pytest.raises(SnapshotMutationError, match="'torn'"):
        dirty.wait(dirty.slices["torn"][0])


def test_a_cpu_session_never_fences() -> None:
    pool = HostPool(MiB)
    session = SnapshotSession(
        [("w", TensorProvider("w", torch.ones(4)))],
        pool=pool,
        chunk_bytes=4096,
        coalesce_bytes=4096,
        rank=0,
    )
    assert session.device is CPU and session.gate is None
    assert not session.fence_on_device()


# -- the whole writer over the fake --------------------------------------------------------------
def _training_state() -> tuple[torch.nn.Parameter, torch.optim.Optimizer, dict]:
    weight = torch.nn.Parameter(torch.randn(128, 128))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    state = {"model": {"weight": weight}, "buffers": [torch.randn(MiB // 2) for _ in range(3)]}
    return weight, optimizer, state


def test_the_host_guard_holds_the_step_until_every_copy_completes(
    tmp_path: Path, make_writer, fake
) -> None:
    weight, optimizer, state = _training_state()
    before = weight.detach().clone()
    writer = make_writer(tmp_path, guard_on_device=False, **SMALL_POOL)
    with use_device(fake):
        response = async_save(state, writer, no_dist=True)
    fake.wait_enqueued(1)
    stepper, _ = _in_background(optimizer.step)

    assert not response.staging_completion.done()
    assert torch.equal(weight.detach(), before)  # the step is parked in the guard
    while stepper.is_alive():  # copies land as the pool frees up, until the step is released
        for copy in fake.pending():
            fake.complete(copy)
        stepper.join(0.05)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(weight.detach(), before - 0.5)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)
    assert fake.violations == []


def test_the_device_guard_fences_the_step_and_the_checkpoint_holds_pre_step_values(
    tmp_path: Path, make_writer, fake
) -> None:
    weight, optimizer, state = _training_state()
    state["buffers"] = []  # the whole state fits the pool: every copy is enqueued at once
    before = weight.detach().clone()
    fences, waits = guard.fences, guard.waits
    writer = make_writer(tmp_path, **SMALL_POOL)
    with use_device(fake):
        response = async_save(state, writer, no_dist=True)
    fake.wait_enqueued(1)
    optimizer.step()  # returns at once: its "kernels" are queued behind the copies

    assert guard.fences == fences + 1 and guard.waits == waits
    assert not response.staging_completion.done()
    assert all(c.fenced for c in fake.copies)
    fake.complete_all()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)


def test_an_in_place_change_before_the_step_fails_the_save_naming_the_tensor(
    tmp_path: Path, make_writer, fake
) -> None:
    weight, optimizer, state = _training_state()
    state["buffers"] = []
    writer = make_writer(tmp_path, copy_on_write=False, **SMALL_POOL)
    with use_device(fake):
        response = async_save(state, writer, no_dist=True)
    fake.wait_enqueued(1)
    with torch.no_grad():
        weight.mul_(2.0)  # outside the optimizer: no fence orders it after the copy
    optimizer.step()
    fake.complete_all()

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.fqn == "model.weight"
    assert not (tmp_path / METADATA_NAME).exists()
    assert pool_drains(writer)


def test_a_copy_error_reaches_the_save_future_and_the_pool_drains(
    tmp_path: Path, make_writer, fake
) -> None:
    writer = make_writer(tmp_path, **SMALL_POOL)
    with use_device(fake):
        future = dcp.async_save({"w": torch.randn(MiB // 4)}, storage_writer=writer, no_dist=True)
    copies = fake.wait_enqueued(1)
    fake.fail(RuntimeError("CUDA error: an illegal memory access"), copies[0])
    fake.release()  # copies already queued still complete (and then free their blocks)

    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        future.result(timeout=EVENT_TIMEOUT_S)
    assert "illegal memory access" in str(raised.value)
    assert not (tmp_path / METADATA_NAME).exists()
    assert pool_drains(writer)


# -- one contract suite over the device layers that run here -------------------------------------
@pytest.mark.parametrize("layer", ["cpu", "fake"])
def test_a_state_larger_than_the_pool_round_trips_through_each_device_layer(
    tmp_path: Path, make_writer, layer: str
) -> None:
    g = torch.Generator().manual_seed(3)
    state = {
        "big": torch.randn(MiB, generator=g),  # 4 MiB through a 1 MiB pool
        "rows": torch.randn(512, 1024, generator=g).t(),  # non-contiguous
        "tiny": {f"t{i}": torch.randn(5, generator=g) for i in range(120)},
        "half": torch.randn(300, 7, generator=g).half(),
        "flags": torch.rand(1000, generator=g) > 0.5,
        "step": 7,
    }
    device = CpuDevice() if layer == "cpu" else FakeDevice(auto=True)
    with use_device(device):
        dcp.save(state, storage_writer=make_writer(tmp_path, **SMALL_POOL), no_dist=True)
    assert_same_state(state, load_like(tmp_path, state, "datastates"))


class _BrokenFence(FakeDevice):
    """A device whose stream wait fails: the guard must fall back to waiting on the host."""

    def copy(self, parts, dst, gate):
        copy = super().copy(parts, dst, gate)

        def fence() -> bool:
            raise RuntimeError("cudaStreamWaitEvent failed")

        copy.fence = fence
        return copy


def test_a_failing_fence_falls_back_to_the_host_wait(tmp_path: Path, make_writer) -> None:
    weight, optimizer, state = _training_state()
    state["buffers"] = []
    before = weight.detach().clone()
    device = _BrokenFence()
    waits = guard.waits
    with use_device(device):
        response = async_save(state, make_writer(tmp_path, **SMALL_POOL), no_dist=True)
    device.wait_enqueued(1)
    stepper, _ = _in_background(optimizer.step)
    assert torch.equal(weight.detach(), before)  # parked on the host, not fenced
    device.release()
    stepper.join(EVENT_TIMEOUT_S)
    assert guard.waits == waits + 1
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)


def test_a_piece_is_readable_once_its_own_event_fired_while_later_copies_run(
    engine: _Engine, fake
) -> None:
    value = torch.randn(64 * 1024)  # four pieces
    session = engine.session({"w": value}, fake)
    copies = fake.wait_enqueued(4)
    fake.complete(copies[0])

    first = session.slices["w"][0]
    assert bytes(session.wait(first)) == _bytes(value)[: first.length]  # no device-wide wait
    assert [c.query() for c in copies] == [True, False, False, False]
    assert not session.staged.done()
    fake.complete_all()
    session.drop(first)
    assert (
        b"".join(bytes(session.wait(s)) for s in session.slices["w"][1:])
        == _bytes(value)[first.length :]
    )
