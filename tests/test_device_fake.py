"""The CUDA path on a simulated GPU (``device_fake.FakeCuda``): the real device layer, engine,
pool, guard and flush, with kernels that run behind the host.

The simulated device runs only when driven, in an adversarial order (copies first, or compute
first), memory not produced yet holds garbage, and a fence orders without completing anything
(the module docstring of ``device_fake`` says what it models). What is checked: no piece is read
(or its pool block freed) before its copy ran, every copy waits for the state stage() saw and
for the clones made after it, the optimizer step waits (on the host) or is fenced (on the
device) and stays correct over loops of several steps and optimizers, with gradient
accumulation and skipped steps; a change before the fence fails the save; errors reach the
save's future.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _device_loops import LOOPS, flat, model, reference, state_of, train
from conftest import EVENT_TIMEOUT_S, MiB, assert_same_state, failure_of, load_like, pool_drains

from dcp_datastates import CheckpointSaveError, SnapshotMutationError, async_save
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import guard
from dcp_datastates.snapshot.device import CPU, CpuDevice, CudaDevice, use_device
from dcp_datastates.snapshot.device_fake import (
    COMPUTE_FIRST,
    COPIES_FIRST,
    GARBAGE,
    ORDERS,
    FakeCuda,
)
from dcp_datastates.snapshot.pieces import ADMITTED
from dcp_datastates.snapshot.pool import HostPool
from dcp_datastates.snapshot.scheduler import SnapshotScheduler
from dcp_datastates.snapshot.session import SnapshotSession

pytestmark = pytest.mark.timeout(60)

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    gpu = FakeCuda()
    yield gpu
    gpu.run()  # never leave a completion thread parked on the device


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


def _enqueued(session: SnapshotSession) -> None:
    for piece in session.pieces:
        assert piece.enqueued.wait(EVENT_TIMEOUT_S)


def _drains(pool: HostPool, fake: FakeCuda) -> None:
    """Every pool block comes back once the device ran what was queued (it runs by itself)."""
    with fake.background(), pool._cond:
        assert pool._cond.wait_for(lambda: pool.in_use == 0, EVENT_TIMEOUT_S)


def _read(session: SnapshotSession, key: str) -> bytes:
    out = b""
    for slice_ in session.slices[key]:
        out += bytes(session.wait(slice_))
        session.drop(slice_)
    return out


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@contextlib.contextmanager
def _step_began() -> Iterator[threading.Event]:
    """Set as the next optimizer step begins, after the guard listed what it waits for and
    before it waits: a probe entered in the real guard, fenced (it holds nothing back)."""
    began, probe = threading.Event(), Future()
    guard.guard(probe, fence=lambda: True, on_step=began.set)
    try:
        yield began
    finally:
        probe.set_result(None)


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


# -- the simulated device itself ------------------------------------------------------------------
def test_the_fake_runs_kernels_behind_the_host_and_garbage_until_then(fake: FakeCuda) -> None:
    value = fake.to_device(torch.ones(8))
    with fake.active():
        value.mul_(3.0)  # enqueued: the version moves now, the bytes later
        made = value + 1.0
    assert value._version == 1 and fake.pending() == 2
    assert torch.equal(value, torch.ones(8))  # (read outside the device: the memory as it is)
    assert made.view(torch.uint8).eq(GARBAGE).all()
    assert torch.equal(fake.to_host(made), torch.full((8,), 4.0))


def test_streams_are_ordered_only_by_events(fake: FakeCuda) -> None:
    side = fake.new_stream(0)
    value = fake.to_device(torch.zeros(4))
    with fake.active():
        value.fill_(1.0)
        with fake.use_stream(side):
            copied = value.clone()  # nothing orders it after the fill
    fake.run(COPIES_FIRST)
    assert fake.to_host(copied).view(torch.uint8).eq(0).all()  # it ran before the fill
    assert len(fake.violations) == 1 and "fill_" in fake.violations[0]
    fake.violations.clear()

    with fake.active():
        value.fill_(2.0)
        event = fake.new_event()
        event.record(fake.current_stream(0))
        side.wait_event(event)
        with fake.use_stream(side):
            copied = value.clone()
    fake.run(COPIES_FIRST)
    assert torch.equal(fake.to_host(copied), torch.full((4,), 2.0))


# -- the engine over the simulated device --------------------------------------------------------
def test_a_piece_is_not_read_before_its_copy_ran(engine: _Engine, fake: FakeCuda) -> None:
    value = fake.to_device(torch.randn(64 * 1024))  # 256 KiB: four pieces of 64 KiB
    session = engine.session({"w": value}, fake.device())
    _enqueued(session)
    reader, got = _in_background(lambda: _read(session, "w"))

    first = session.slices["w"][0].piece
    assert first.state == ADMITTED and not first.done.is_set()
    assert fake.d2h_copies == 4 and fake.kernels_run == 0
    assert not session.staged.done()

    fake.run_until(session.staged)
    reader.join(EVENT_TIMEOUT_S)
    assert got == [_bytes(value)]
    assert first.state != ADMITTED and fake.violations == []


@pytest.mark.parametrize("order", ORDERS)
def test_every_copy_waits_for_the_work_queued_before_stage(
    engine: _Engine, fake: FakeCuda, order: str
) -> None:
    value = fake.to_device(torch.zeros(32 * 1024))
    with fake.active():
        value.fill_(3.0)  # queued, not run, when stage() records its gate
    session = engine.session({"w": value}, fake.device())
    fake.run_until(session.staged, order)
    assert _read(session, "w") == _bytes(torch.full((32 * 1024,), 3.0))
    assert fake.violations == []


def test_tiny_tensors_share_one_copy_per_piece(engine: _Engine, fake: FakeCuda) -> None:
    state = {f"b{i}": fake.to_device(torch.randn(16)) for i in range(300)}  # 64 B each
    session = engine.session(state, fake.device())
    fake.run_until(session.staged)
    got = {key: _read(session, key) for key in state}

    assert fake.d2h_copies == len(session.pieces) < 300 // 10
    assert got == {key: _bytes(value) for key, value in state.items()}


def test_an_abort_frees_pool_blocks_only_after_their_copies_ran(
    engine: _Engine, fake: FakeCuda
) -> None:
    session = engine.session({"w": fake.to_device(torch.randn(128 * 1024))}, fake.device())
    _enqueued(session)
    session.abort(RuntimeError("the save was cancelled"))

    assert engine.pool.in_use > 0  # the copies may still write into their blocks
    _drains(engine.pool, fake)
    assert session.finished
    with pytest.raises(RuntimeError, match="cancelled"):
        session.wait(session.slices["w"][0])


def test_a_failed_copy_fails_the_session_and_frees_the_pool(
    engine: _Engine, fake: FakeCuda
) -> None:
    fake.fail_copy(RuntimeError("device-to-host copy failed: illegal address"))
    session = engine.session({"w": fake.to_device(torch.randn(64 * 1024))}, fake.device())
    fake.run_until(session.staged)

    with pytest.raises(RuntimeError, match="illegal address"):
        session.wait(session.slices["w"][0])
    assert session.staged.result(EVENT_TIMEOUT_S) is None  # the state may change again
    _drains(engine.pool, fake)


def test_a_change_after_stage_that_nothing_orders_fails_the_session(
    engine: _Engine, fake: FakeCuda
) -> None:
    value = fake.to_device(torch.randn(1024))
    session = engine.session({"w": value}, fake.device())
    _enqueued(session)
    with fake.active():
        value.add_(1.0)  # not fenced: may run before the copy
    fake.run_until(session.staged, COMPUTE_FIRST)

    with pytest.raises(SnapshotMutationError, match="'w'"):
        session.wait(session.slices["w"][0])


@pytest.mark.parametrize("order", ORDERS)
def test_a_fence_orders_later_changes_and_checks_earlier_ones(
    engine: _Engine, fake: FakeCuda, order: str
) -> None:
    ok, torn = fake.to_device(torch.randn(1024)), fake.to_device(torch.randn(1024))
    expected = _bytes(fake.to_host(ok))
    clean = engine.session({"ok": ok}, fake.device())
    _enqueued(clean)
    with fake.active():
        assert clean.fence_on_device()
        ok.add_(5.0)  # the step's kernels: enqueued (version bumped) after the fence
        assert clean.fence_on_device()  # a second step: its bump is not a tear either
        ok.add_(5.0)
    fake.run_until(clean.staged, order)
    assert _read(clean, "ok") == expected

    dirty = engine.session({"torn": torn}, fake.device())
    _enqueued(dirty)
    with fake.active():
        torn.add_(1.0)  # changed before the fence: the copy may see either value
        assert dirty.fence_on_device()
    fake.run_until(dirty.staged, order)
    with pytest.raises(SnapshotMutationError, match="'torn'"):
        dirty.wait(dirty.slices["torn"][0])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("marked", [True, False], ids=["after_freeze", "unmarked"])
def test_a_part_frozen_after_its_copy_was_enqueued_is_copied_again_after_the_clone(
    engine: _Engine, order: str, marked: bool
) -> None:
    fake = FakeCuda(order=order)
    values = {f"t{i}": fake.to_device(torch.full((100,), float(i))) for i in range(4)}
    expected = {key: _bytes(fake.to_host(value)) for key, value in values.items()}
    session = engine.session(values, fake.device())  # one piece: one coalesced copy
    _enqueued(session)
    frozen = [session.providers["t1"], session.providers["t3"]]
    with fake.active():  # copy-on-write: a private copy, then the write
        for provider in frozen:
            provider.freeze()
        if marked:
            session.after_freeze(frozen)
        values["t1"].fill_(-1.0)  # nothing orders these after the copy already enqueued
        values["t3"].fill_(-3.0)
    fake.run_until(session.staged, lazy=True)

    assert {key: _read(session, key) for key in values} == expected  # t2 not padded over
    assert fake.d2h_copies == 3  # the piece, then t1 and t3 again from their clones


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


def test_a_piece_is_readable_once_its_own_copy_ran_while_later_copies_wait(
    engine: _Engine, fake: FakeCuda
) -> None:
    value = fake.to_device(torch.randn(64 * 1024))  # four pieces
    session = engine.session({"w": value}, fake.device())
    _enqueued(session)
    completions = [piece.completion for piece in session.pieces]
    fake.run_until(completions[0].query)

    first = session.slices["w"][0]
    assert bytes(session.wait(first)) == _bytes(value)[: first.length]  # no device-wide wait
    assert [c.query() for c in completions] == [True, False, False, False]
    assert not session.staged.done()
    fake.run_until(session.staged)
    session.drop(first)
    rest = b"".join(bytes(session.wait(s)) for s in session.slices["w"][1:])
    assert rest == _bytes(value)[first.length :]


# -- the whole writer over the simulated device ----------------------------------------------------
def _training_state(fake: FakeCuda) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, dict]:
    weight = torch.nn.Parameter(torch.randn(128, 128))
    fake.adopt(weight)
    weight.grad = fake.to_device(torch.ones(128, 128))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    state = {"model": {"weight": weight}}
    return weight, optimizer, state


def test_the_host_guard_holds_the_step_until_every_copy_ran(
    tmp_path: Path, make_writer, fake: FakeCuda
) -> None:
    weight, optimizer, state = _training_state(fake)
    state["buffers"] = [fake.to_device(torch.randn(MiB // 2)) for _ in range(3)]  # > the pool
    before = fake.to_host(weight)
    waits = guard.waits
    writer = make_writer(tmp_path, guard_on_device=False, **SMALL_POOL)
    with use_device(fake.device()), fake.active():
        response = async_save(state, writer, no_dist=True)
    with _step_began() as began:
        stepper = fake.spawn(optimizer.step)
        assert began.wait(EVENT_TIMEOUT_S)  # the device has not run a copy yet

        fake.run_until(stepper, COMPUTE_FIRST)  # the step's kernels first, if they were queued
    assert response.staging_completion.done() and guard.waits == waits + 1
    fake.run_until(response.upload_completion)
    assert torch.equal(fake.to_host(weight), before - 0.5)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)


@pytest.mark.parametrize("order", ORDERS)
def test_the_device_guard_fences_the_step_and_the_checkpoint_holds_pre_step_values(
    tmp_path: Path, make_writer, fake: FakeCuda, order: str
) -> None:
    weight, optimizer, state = _training_state(fake)
    before = fake.to_host(weight)
    fences, waits = guard.fences, guard.waits
    writer = make_writer(tmp_path, **SMALL_POOL)
    with use_device(fake.device()), fake.active():
        response = async_save(state, writer, no_dist=True)
        optimizer.step()  # returns at once: its kernels are queued behind the copies
        optimizer.step()  # and the next one's too

    assert guard.fences == fences + 2 and guard.waits == waits
    assert not response.staging_completion.done() and fake.kernels_run == 0
    fake.run_until(response.upload_completion, order)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)
    assert torch.equal(fake.to_host(weight), before - 0.5 - 0.5)


def test_an_in_place_change_before_the_step_fails_the_save_naming_the_tensor(
    tmp_path: Path, make_writer, fake: FakeCuda
) -> None:
    weight, optimizer, state = _training_state(fake)
    writer = make_writer(tmp_path, copy_on_write=False, **SMALL_POOL)  # the detection layer
    with use_device(fake.device()), fake.active():
        response = async_save(state, writer, no_dist=True)
        with torch.no_grad():
            weight.mul_(2.0)  # outside the optimizer: no fence orders it after the copy
        optimizer.step()
    fake.run_until(response.upload_completion)

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.fqn == "model.weight"
    assert not (tmp_path / METADATA_NAME).exists()
    with fake.background():
        assert pool_drains(writer)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda w, shadow: w.mul_(2.0), id="no-grad-decay"),
        pytest.param(lambda w, shadow: w.data.copy_(shadow), id="ema-copy"),
    ],
)
def test_an_in_place_change_before_the_step_is_copied_first_on_the_device(
    tmp_path: Path, make_writer, fake: FakeCuda, order: str, write: Any
) -> None:
    """Copy-on-write on a GPU: the write is issued behind the gate on the training stream; the
    clone is queued before it, and the copy reads the clone once it is made (an event)."""
    weight, optimizer, state = _training_state(fake)
    before = fake.to_host(weight)
    writer = make_writer(tmp_path, **SMALL_POOL)
    with use_device(fake.device()), fake.active():
        shadow = fake.to_device(torch.full((128, 128), 7.0))
        response = async_save(state, writer, no_dist=True)
        with torch.no_grad():
            write(weight, shadow)
        optimizer.step()
    fake.run_until(response.upload_completion, order)

    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)
    assert writer.last_stats.cow_bytes == 128 * 128 * 4
    assert not torch.equal(fake.to_host(weight), before)


def test_a_copy_error_reaches_the_save_future_and_the_pool_drains(
    tmp_path: Path, make_writer, fake: FakeCuda
) -> None:
    writer = make_writer(tmp_path, **SMALL_POOL)
    fake.fail_copy(RuntimeError("CUDA error: an illegal memory access"))
    with use_device(fake.device()), fake.active():
        state = {"w": fake.to_device(torch.randn(MiB // 4))}
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    fake.run_until(future)

    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        future.result(timeout=EVENT_TIMEOUT_S)
    assert "illegal memory access" in str(raised.value)
    assert not (tmp_path / METADATA_NAME).exists()
    with fake.background():  # copies queued before the failure still run, then free their blocks
        assert pool_drains(writer)


@pytest.mark.parametrize("order", ORDERS)
def test_small_tensors_copied_in_stage_are_read_after_their_copy_was_made(
    tmp_path: Path, make_writer, order: str
) -> None:
    gpu = FakeCuda(order=order)
    state = {
        "weight": gpu.to_device(torch.randn(64, 64)),  # 16 KiB: copied from the live tensor
        "bias": gpu.to_device(torch.randn(64)),  # 256 B: copied in stage() (eager_copy_bytes)
        "count": gpu.to_device(torch.tensor(7)),
    }
    expected = {k: gpu.to_host(v) for k, v in state.items()}
    writer = make_writer(tmp_path, **SMALL_POOL)
    with use_device(gpu.device()), gpu.active():
        response = async_save(state, writer, no_dist=True)
        state["bias"].add_(1)  # later writes: the snapshot reads the copies made in stage()
        state["count"].add_(1)
    assert gpu.pending() and response.staging_completion.done() is False
    gpu.run_until(response.upload_completion, lazy=True)

    assert_same_state(expected, load_like(tmp_path, state, "datastates"))
    assert gpu.violations == []


@pytest.mark.parametrize("order", ORDERS)
def test_buffers_the_forward_copies_while_the_snapshot_runs_are_read_after_that_copy(
    tmp_path: Path, make_writer, order: str
) -> None:
    gpu = FakeCuda(order=order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    gpu.adopt(model)
    state = {"model": dict(model.state_dict())}
    expected = {k: gpu.to_host(v) for k, v in state["model"].items()}
    writer = make_writer(tmp_path, eager_copy_bytes=0, **SMALL_POOL)  # the forward gate copies
    with use_device(gpu.device()), gpu.active():
        response = async_save(state, writer, no_dist=True)
        model(gpu.to_device(torch.randn(8, 32)))  # updates the running statistics in place
    gpu.run_until(response.upload_completion, lazy=True)

    got = load_like(tmp_path, state, "datastates")["model"]
    assert_same_state(expected, got)


@pytest.mark.parametrize("order", ORDERS)
def test_a_failed_copy_after_the_fence_fails_the_save_once(
    tmp_path: Path, make_writer, order: str
) -> None:
    gpu = FakeCuda(order=order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(128))
    gpu.adopt(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = make_writer(tmp_path, eager_copy_bytes=0, **SMALL_POOL)
    with use_device(gpu.device()), gpu.active():
        response = async_save({"model": dict(model.state_dict())}, writer, no_dist=True)
        gpu.wait_for(lambda: gpu.d2h_copies == 2)  # the weight's piece, the small ones' piece
        model(gpu.to_device(torch.randn(8, 128))).sum().backward()  # the BN buffers: cloned
        optimizer.step()  # fenced
    gpu.fail_copy(RuntimeError("copy from the clone failed"), after=2)
    gpu.run_until(response.upload_completion, lazy=True)

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert isinstance(raised.value, Exception) and len(raised.value.failures) == 1
    assert "copy from the clone failed" in str(raised.value.failures[0])
    assert response.staging_completion.result(timeout=EVENT_TIMEOUT_S) is None
    assert not (tmp_path / METADATA_NAME).exists()
    with gpu.background():
        assert pool_drains(writer)


# -- one contract suite over the device layers that run here -------------------------------------
@pytest.mark.parametrize("layer", ["cpu", "simulated cuda"])
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
    if layer == "cpu":
        with use_device(CpuDevice()):
            dcp.save(state, storage_writer=make_writer(tmp_path, **SMALL_POOL), no_dist=True)
    else:
        gpu = FakeCuda()
        for value in [state["big"], state["rows"], state["half"], state["flags"]]:
            gpu.adopt(value)
        gpu.adopt(*state["tiny"].values())
        with use_device(gpu.device()), gpu.background():  # dcp.save blocks this thread
            dcp.save(state, storage_writer=make_writer(tmp_path, **SMALL_POOL), no_dist=True)
        assert gpu.d2h_copies > 0 and gpu.violations == []
    assert_same_state(state, load_like(tmp_path, state, "datastates"))


class _BrokenFence(CudaDevice):
    """A device whose stream wait fails: the guard must fall back to waiting on the host."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fence_failed = threading.Event()

    def copy(self, parts, dst, gate):
        completion = super().copy(parts, dst, gate)

        def fence() -> bool:
            self.fence_failed.set()
            raise RuntimeError("cudaStreamWaitEvent failed")

        if completion is not None:
            completion.fence = fence
        return completion


def test_a_failing_fence_falls_back_to_the_host_wait(
    tmp_path: Path, make_writer, fake: FakeCuda
) -> None:
    weight, optimizer, state = _training_state(fake)
    before = fake.to_host(weight)
    waits = guard.waits
    device = _BrokenFence(runtime=fake)
    with use_device(device), fake.active():
        response = async_save(state, make_writer(tmp_path, **SMALL_POOL), no_dist=True)
    with _step_began() as began:
        stepper = fake.spawn(optimizer.step)
        assert began.wait(EVENT_TIMEOUT_S)
        # The device runs only once the fence failed: run earlier, it could finish the copies
        # first, and the step then needs neither a fence nor a wait (a CI run saw it).
        assert device.fence_failed.wait(EVENT_TIMEOUT_S)
        fake.run_until(stepper, COMPUTE_FIRST)
    assert guard.waits == waits + 1
    fake.run_until(response.upload_completion)
    assert torch.equal(load_like(tmp_path, state, "datastates")["model"]["weight"], before)


# -- training loops: several steps, optimizers, accumulation, skipped steps ------------------------
def _host(fake: FakeCuda, state: dict) -> dict:
    return {k: fake.to_host(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(LOOPS))
def test_a_training_loop_saves_what_each_step_left(
    tmp_path: Path, make_writer, name: str, order: str
) -> None:
    loop = LOOPS[name]
    expected, final = reference(loop)
    fake = FakeCuda(order=order)
    writer = make_writer(tmp_path, guard_on_device=loop.guard_on_device, **SMALL_POOL)
    responses: dict[int, object] = {}

    def on_save(state: dict, i: int) -> None:
        for earlier in responses.values():  # the device catches up with the last save only
            fake.run_until(earlier.upload_completion, lazy=True)
        path = tmp_path / f"it{i}"
        responses[i] = async_save(state, writer, checkpoint_id=str(path), no_dist=True)

    net = model()
    fake.adopt(net)
    fences = guard.fences
    # The host guard blocks this thread until the copies ran: the device runs by itself then.
    background = fake.background() if not loop.guard_on_device else contextlib.nullcontext()
    with use_device(fake.device()), fake.active(), background:
        optimizers = train(net, loop, fake.to_device, on_save)
    for response in responses.values():
        fake.run_until(response.upload_completion, lazy=True)
    fake.run()
    if loop.guard_on_device and not loop.scaler:  # (the scaler's syncs run the device)
        # More fenced steps than saves: some snapshot was fenced again while its copies ran.
        assert guard.fences - fences > len(loop.save_at)

    for i, response in responses.items():
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)  # raises what failed it
        got = load_like(tmp_path / f"it{i}", expected[i], "datastates")
        assert_same_state(flat(expected[i]), flat(got), f"checkpoint after pass {i}")
    now = _host(fake, flat(state_of(net, optimizers, loop.iterations)))
    assert_same_state(flat(final), now, "the trained state")
