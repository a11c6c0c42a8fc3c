"""The gating logic of asynchronous (CUDA-like) snapshot copies, checked without a GPU.

The fake device (``dcp_datastates.snapshot.device_fake``) only enqueues copies; their bytes land
and their completion events fire when the test says. The engine, pool, guard and flush are the
real ones. What is checked: no copy is read (or its pool block freed) before its event, every copy
is gated on the events stage() recorded, the optimizer step waits (on the host) or fences (on the
device), a change before the fence fails the save, aborts release pool space, copy errors reach the
future. The same round trips run through every device layer that runs here (one contract suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, MiB, assert_same_state, failure_of, load_like, pool_drains
from crc32c import crc32c

import cuda_ext
from dcp_datastates import CheckpointSaveError, SnapshotMutationError, _cuda, async_save
from dcp_datastates.bounce import BounceBuffers
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import guard
from dcp_datastates.snapshot.device import (
    CPU,
    CpuDevice,
    coalesced_sources,
    for_providers,
    use_device,
)
from dcp_datastates.snapshot.device_fake import FakeDevice
from dcp_datastates.snapshot.engine import ADMITTED, COPIED, SnapshotScheduler, SnapshotSession
from dcp_datastates.snapshot.pool import HostPool
from dcp_datastates.storage import LocalStorage

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
    writer = make_writer(tmp_path, **SMALL_POOL)
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


# -- pieces of the CUDA layer that run on the CPU ------------------------------------------------
def test_the_coalesced_copy_has_the_piece_layout() -> None:
    values = [torch.randn(3), torch.arange(10, dtype=torch.int16), torch.randn(2, 9).t()]
    pool = HostPool(MiB)
    session = SnapshotSession(
        [(f"v{i}", TensorProvider(f"v{i}", v)) for i, v in enumerate(values)],
        pool=pool,
        chunk_bytes=4096,
        coalesce_bytes=4096,
        rank=0,
    )
    (piece,) = session.pieces
    expected = torch.zeros(piece.nbytes, dtype=torch.uint8)
    CPU.copy(piece.parts, expected, None)
    group = [(i, part[0].source) for i, part in enumerate(piece.parts)]
    first, stop, sources = coalesced_sources(group, piece.parts, torch.zeros(64, dtype=torch.uint8))

    got = torch.cat(sources)
    assert (first, stop) == (0, piece.nbytes) and torch.equal(got, expected)


def test_the_cuda_layer_is_importable_and_idle_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_gpu.py covers this machine")
    assert not cuda_ext.host_memory.available()
    with pytest.raises(RuntimeError, match="cuda-python and a CUDA device"):
        cuda_ext.host_memory.pinned_empty(4096)
    buffer = _cuda.allocate_host_buffer(3 * MiB + 5)
    assert buffer.numel() == 3 * MiB + 5 and not buffer.is_pinned()
    assert for_providers([TensorProvider("w", torch.ones(3))]) is CPU
    assert HostPool(MiB)._allocation is None  # nothing is pinned in the background
    pinned = [t for t in threading.enumerate() if t.name == "datastates-pin"]
    assert not pinned
    assert COPIED  # the engine's state names are what the docs describe


@pytest.mark.parametrize("nbytes", [0, 1000, 4096, 10_000])
def test_bounce_buffers_fill_a_target_region_by_region_with_the_record_checksum(
    tmp_path: Path, nbytes: int
) -> None:
    head, tail = b"H" * 37, b"T" * 11
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    record = b"xx" + head + data.numpy().tobytes() + tail
    (tmp_path / "f").write_bytes(record)
    target = torch.zeros(nbytes // 4, dtype=torch.float32) if nbytes % 4 == 0 else None
    target = target if target is not None else torch.zeros(nbytes, dtype=torch.uint8)
    bounces = BounceBuffers(1024, pin=False)  # several regions, two buffers
    got_head, got_tail = bytearray(len(head)), bytearray(len(tail))

    ranged = LocalStorage(tmp_path).open_ranged("f")
    try:
        crc, got = bounces.fill(
            target,
            ranged.read_into,
            data_at=2 + len(head),
            head=got_head,
            tail=got_tail,
            checksum=True,
        )
    finally:
        ranged.close()
    assert got == len(record) - 2
    assert crc == crc32c(record[2:])
    assert (bytes(got_head), bytes(got_tail)) == (head, tail)
    assert torch.equal(target.reshape(-1).view(torch.uint8), data)


def test_bounce_buffers_report_a_short_read(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"\0" * 3000)  # the record says 5000 bytes of data
    ranged = LocalStorage(tmp_path).open_ranged("f")
    try:
        _, got = BounceBuffers(1024, pin=False).fill(
            torch.zeros(5000, dtype=torch.uint8),
            ranged.read_into,
            data_at=0,
            head=bytearray(),
            tail=bytearray(),
            checksum=True,
        )
    finally:
        ranged.close()
    assert got == 3000


def test_the_gpu_check_exits_cleanly_saying_so_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run scripts/gpu_check.sh itself")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


@pytest.mark.slow
def test_the_gpu_benchmark_runs_end_to_end_on_cpu_tensors(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "gpu_bench.py"), "--cpu-dry-run"],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [(f["figure"], f.get("system")) for f in figures]
    assert ("d2h_gbps", None) in kinds
    systems = {"ours", "ours_host_wait", "stock_default", "stock_pinned"}
    assert {s for f, s in kinds if f == "train_step_dip"} == systems
    assert {s for f, s in kinds if f == "save_times"} == systems - {"ours_host_wait"}


def test_the_pool_pins_in_the_background_on_the_creating_threads_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    calls: list[tuple[int, int | None, str]] = []

    def pin(nbytes: int, device: int | None = None) -> torch.Tensor:
        calls.append((nbytes, device, threading.current_thread().name))
        release.wait(EVENT_TIMEOUT_S)  # pinning tens of GB takes seconds
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(_cuda, "pinning", lambda: True)
    monkeypatch.setattr(_cuda, "current_device", lambda: 3)  # this rank's device
    monkeypatch.setattr(_cuda, "allocate_host_buffer", pin)
    pool = HostPool(MiB)  # returns at once: the pinning runs on its own thread
    reserved, got = _in_background(lambda: pool.reserve(4096, cancelled=lambda: False))

    assert not got  # the first reserve waits for the pinned buffer
    release.set()
    reserved.join(EVENT_TIMEOUT_S)
    assert got == [0] and calls == [(MiB, 3, "datastates-pin")]
    pool.release(0)
    pool.close()


def test_a_failed_pinning_is_reported_by_the_first_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    def pin(nbytes: int, device: int | None = None) -> torch.Tensor:
        raise RuntimeError("cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(_cuda, "pinning", lambda: True)
    monkeypatch.setattr(_cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "allocate_host_buffer", pin)
    pool = HostPool(MiB)
    with pytest.raises(RuntimeError, match="pinning the .* host pool failed.*OUT_OF_MEMORY"):
        pool.reserve(4096, cancelled=lambda: False)


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
