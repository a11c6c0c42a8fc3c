"""The parts of the CUDA path that run without a GPU: the coalesced copy's layout, importing the
CUDA layer without CUDA, the load's double-buffered bounce buffers, the pool pinning in the
background, and the GPU check and benchmark scripts (which must exit cleanly, or dry-run, here).
"""

from __future__ import annotations

import ctypes
import enum
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import EVENT_TIMEOUT_S, MiB
from crc32c import crc32c

import cuda_ext
from dcp_datastates._platform import cuda as _cuda
from dcp_datastates.load.bounce import BounceBuffers
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot.device import CPU, coalesced_sources, for_providers
from dcp_datastates.snapshot.device_fake import ORDERS, FakeCuda
from dcp_datastates.snapshot.pool import HostPool
from dcp_datastates.snapshot.session import SnapshotSession
from dcp_datastates.storage.base import LocalStorage

pytestmark = pytest.mark.timeout(120)


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


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


@pytest.mark.parametrize("order", ORDERS)
def test_a_load_on_two_devices_follows_the_callers_streams_and_lands_before_it_returns(
    tmp_path: Path, order: str
) -> None:
    gpu = FakeCuda(devices=2, order=order)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g) for _ in range(2)]
    (tmp_path / "f").write_bytes(b"".join(d.numpy().tobytes() for d in data))
    targets = [gpu.to_device(torch.full((3000,), 7, dtype=torch.uint8), i) for i in range(2)]
    bounces = BounceBuffers(1024, pin=False, runtime=gpu)
    ranged = LocalStorage(tmp_path).open_ranged("f")

    def read_all() -> None:  # a reading thread: its current streams are the default ones
        for i, target in enumerate(targets):
            bounces.fill(
                target,
                ranged.read_into,
                data_at=3000 * i,
                head=bytearray(),
                tail=bytearray(),
                checksum=False,
            )

    callers = [gpu.compute_stream(i) for i in range(2)]
    try:
        with gpu.active(), gpu.use_stream(callers[0]), gpu.use_stream(callers[1]):
            for target in targets:
                target.zero_()  # the caller's own work on its streams comes first
            bounces.begin([0, 1])
            gpu.spawn(read_all).result(timeout=EVENT_TIMEOUT_S)
            bounces.end()
    finally:
        ranged.close()
    # Read without running the device: the load has landed on both devices when it returns...
    assert all(torch.equal(t, d) for t, d in zip(targets, data, strict=True))
    gpu.run()  # ...and nothing queued before it overwrites the targets later
    assert all(torch.equal(t, d) for t, d in zip(targets, data, strict=True))
    assert gpu.violations == []


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


class _Driver:
    """cuda-python's driver calls the pinned pool makes, as the driver answers them: every call
    returns ``(CUresult, value...)``, and memory calls need a context current on the thread."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_INVALID_CONTEXT = 201

    CU_MEMHOSTALLOC_PORTABLE = 1

    def __init__(self, *, free_fails: bool = False) -> None:
        self.free_fails = free_fails
        self.pinned: dict[int, ctypes.Array] = {}
        self.retained = 0
        self._local = threading.local()

    def _current(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        return (self.CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, index):  # noqa: N802
        return self.CUresult.CUDA_SUCCESS, f"device {index}"

    def cuDevicePrimaryCtxRetain(self, device):  # noqa: N802
        self.retained += 1
        return self.CUresult.CUDA_SUCCESS, f"context of {device}"

    def cuDevicePrimaryCtxRelease(self, device):  # noqa: N802
        self.retained -= 1
        return (self.CUresult.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, context):  # noqa: N802
        self._current()[:] = [context]
        return (self.CUresult.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, context):  # noqa: N802
        self._current().append(context)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):  # noqa: N802
        return self.CUresult.CUDA_SUCCESS, self._current().pop()

    def cuMemHostAlloc(self, nbytes, flags):  # noqa: N802
        if not self._current():
            return self.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0
        memory = (ctypes.c_uint8 * nbytes)()
        self.pinned[ctypes.addressof(memory)] = memory
        return self.CUresult.CUDA_SUCCESS, ctypes.addressof(memory)

    def cuMemFreeHost(self, ptr):  # noqa: N802
        if not self._current():
            return (self.CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self.free_fails:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.pinned[ptr]
        return (self.CUresult.CUDA_SUCCESS,)

    def cuGetErrorString(self, err):  # noqa: N802
        return self.CUresult.CUDA_SUCCESS, self.CUresult(err).name.encode()


def _drop_on_a_new_thread(buffers: list[torch.Tensor]) -> None:
    """Drop the last reference on a thread that never made a CUDA call (a dropped writer's
    scheduler thread freeing its pool)."""
    thread = threading.Thread(target=buffers.clear)
    thread.start()
    thread.join(EVENT_TIMEOUT_S)


def test_the_pinned_pool_is_freed_in_its_context_on_a_thread_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = _Driver()
    buffers = [cuda_ext.host_memory.pinned_with(driver, 3 * 4096, 2)]
    buffers[0].fill_(1)
    assert len(driver.pinned) == 1 and driver.retained == 1

    with caplog.at_level("ERROR", logger="cuda_ext.host_memory"):
        _drop_on_a_new_thread(buffers)
    assert driver.pinned == {} and driver.retained == 0
    assert caplog.records == []


def test_a_failed_free_of_the_pinned_pool_is_logged_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = _Driver(free_fails=True)
    buffers = [cuda_ext.host_memory.pinned_with(driver, 4096, 1)]
    with caplog.at_level("ERROR", logger="cuda_ext.host_memory"):
        _drop_on_a_new_thread(buffers)
    (record,) = caplog.records
    assert "4096-byte pinned host pool" in record.getMessage() and "cuda:1" in record.getMessage()
    assert "CUDA_ERROR_INVALID_VALUE" in caplog.text
    assert driver.retained == 0  # the context's retain is released all the same


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
