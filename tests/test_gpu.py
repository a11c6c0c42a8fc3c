"""The CUDA path on a real GPU: round trips from device memory, gating on producing streams, the
fenced optimizer step, mutation detection, the pinned pool, a DTensor over nccl.

Skipped (with the reason) where no CUDA device is present; ``scripts/gpu_check.sh`` runs them.
Races are made deterministic with ``torch.cuda._sleep``: a long kernel on the producing stream
holds the gate event back, so the copies provably wait for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, MiB, assert_same_state, failure_of, load, pool_drains

import cuda_ext
from dcp_datastates import CheckpointSaveError, DataStatesReader, SnapshotMutationError, async_save
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import guard
from dcp_datastates.snapshot.device import CPU, CudaDevice, for_providers, producing_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: the CUDA path cannot run here"
    ),
]

SMALL_POOL = {"host_pool_bytes": 4 * MiB, "chunk_bytes": 256 * 1024, "coalesce_bytes": 64 * 1024}
#: GPU cycles of one "long kernel": tens of milliseconds on any current GPU.
LONG_KERNEL = 200_000_000


def cuda_zoo() -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cpu = {
        "float32": r(33, 17),
        "float64": r(9).double(),
        "float16": r(5).half(),
        "bfloat16": r(2, 3).bfloat16(),
        "float8_e4m3fn": r(16).to(torch.float8_e4m3fn),
        "int8": torch.randint(-128, 128, (9,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 256, (11,), dtype=torch.uint8, generator=g),
        "int16": torch.randint(-(2**15), 2**15, (4,), dtype=torch.int16, generator=g),
        "int32": torch.randint(-(2**31), 2**31, (4,), dtype=torch.int32, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (3, 3), dtype=torch.int64, generator=g),
        "bool": torch.rand(7, generator=g) > 0.5,
        "complex64": torch.complex(r(6), r(6)),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0),
        "transposed": r(64, 48).t(),
        "strided": r(6, 8)[:, 1:7:2],
        "big": r(3 * MiB),  # 12 MiB: chunked through the 4 MiB pool
        "tiny": {f"t{i}": r(3) for i in range(500)},  # coalesced on the device
    }
    return _to(cpu, "cuda")


def _to(state, device):
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    return state


def _blank(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return None


@pytest.mark.parametrize("reader", ["stock", "datastates"])
@pytest.mark.parametrize("api", ["dcp.save", "async_save"])
def test_every_dtype_round_trips_from_cuda_memory_through_a_smaller_pool(
    tmp_path: Path, make_writer, api: str, reader: str
) -> None:
    state = cuda_zoo()
    writer = make_writer(tmp_path, **SMALL_POOL)
    if api == "dcp.save":
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        async_save(state, writer, no_dist=True).upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert writer.last_stats.pool_peak_bytes <= 4 * MiB
    loaded = load(tmp_path, _blank(state), reader)  # CUDA targets: pinned bounce buffers
    assert_same_state(_to(state, "cpu"), _to(loaded, "cpu"))


def test_the_pool_is_pinned_and_exactly_the_size_asked(tmp_path: Path, make_writer) -> None:
    writer = make_writer(tmp_path, host_pool_bytes=3 * MiB + 4096)
    dcp.save({"w": torch.randn(1024, device="cuda")}, storage_writer=writer, no_dist=True)
    buffer = writer._runtime.pool._buffer
    assert buffer is not None and buffer.is_pinned()
    assert buffer.numel() == 3 * MiB + 4096
    if not cuda_ext.host_memory.available():
        pytest.skip("cuda-python is not installed: the pool came from torch's pinned allocator")
    from cuda.bindings import driver

    err, flags = driver.cuMemHostGetFlags(buffer.data_ptr())
    assert err == driver.CUresult.CUDA_SUCCESS
    assert flags & driver.CU_MEMHOSTALLOC_PORTABLE  # ours: cuMemHostAlloc(PORTABLE)


def test_cuda_sources_copy_through_the_cuda_layer() -> None:
    cuda = TensorProvider("w", torch.ones(3, device="cuda"))
    assert isinstance(for_providers([cuda]), CudaDevice)
    assert for_providers([TensorProvider("c", torch.ones(3))]) is CPU


def test_the_snapshot_waits_for_kernels_queued_before_stage(tmp_path: Path, make_writer) -> None:
    value = torch.zeros(MiB, device="cuda")
    torch.cuda._sleep(LONG_KERNEL)  # the producing stream is busy...
    value.fill_(3.0)  # ...and this write is still queued when stage() returns
    response = async_save({"w": value}, make_writer(tmp_path), no_dist=True)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(load(tmp_path, {"w": torch.zeros(MiB)}, "datastates")["w"], value.cpu())


def test_state_produced_on_a_side_stream_is_gated_when_named(tmp_path: Path, make_writer) -> None:
    side = torch.cuda.Stream()
    value = torch.zeros(MiB, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(LONG_KERNEL)
        value.fill_(5.0)
    with producing_streams(side):
        response = async_save({"w": value}, make_writer(tmp_path), no_dist=True)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(load(tmp_path, {"w": torch.zeros(MiB)}, "datastates")["w"], value.cpu())


@pytest.mark.parametrize("on_device", [True, False])
def test_the_optimizer_step_after_stage_never_tears_the_checkpoint(
    tmp_path: Path, make_writer, on_device: bool
) -> None:
    weight = torch.nn.Parameter(torch.randn(512, 512, device="cuda"))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    before = weight.detach().cpu()
    fences, waits = guard.fences, guard.waits
    torch.cuda._sleep(LONG_KERNEL)  # copies cannot finish before the step is issued
    writer = make_writer(tmp_path, guard_on_device=on_device)
    response = async_save({"w": weight}, writer, no_dist=True)
    optimizer.step()
    if on_device:  # the host ran ahead: the step's kernels wait on the copies' events
        assert guard.fences == fences + 1 and guard.waits == waits
    else:
        assert guard.waits == waits + 1 and response.staging_completion.done()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    torch.cuda.synchronize()
    assert torch.equal(weight.detach().cpu(), before - 0.5)
    assert torch.equal(load(tmp_path, {"w": torch.zeros(512, 512)}, "datastates")["w"], before)


def test_an_unguarded_in_place_change_fails_the_save(tmp_path: Path, make_writer) -> None:
    value = torch.randn(MiB, device="cuda")
    torch.cuda._sleep(LONG_KERNEL)
    writer = make_writer(tmp_path, guard_optimizer_step=False)
    response = async_save({"w": value}, writer, no_dist=True)
    value.mul_(2.0)  # enqueued while the snapshot's copy still waits on the long kernel
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert failure_of(raised.value, SnapshotMutationError) is not None
    assert pool_drains(writer)


def test_a_big_cuda_target_loads_through_the_double_buffers(tmp_path: Path, make_writer) -> None:
    value = torch.randn(20 * MiB, device="cuda")  # 80 MiB: several 32 MiB bounce regions
    dcp.save({"w": value}, storage_writer=make_writer(tmp_path), no_dist=True)
    target = {"w": torch.zeros_like(value)}
    dcp.load(target, storage_reader=DataStatesReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], value)


@pytest.mark.multiprocess
def test_a_dtensor_saves_and_loads_over_nccl(tmp_path: Path) -> None:
    from _dist_workers import check_all_ok, launch

    world = min(2, torch.cuda.device_count())
    results = launch("dtensor_nccl", tmp_path, world_size=world, timeout=120.0, script=_workers())
    check_all_ok(results)
    for r in results:
        assert r.report["sharded_equal"] and r.report["replicated_equal"], r.report
        assert r.report["step"] == 3 and r.report["device"] == r.rank


def _workers() -> str:
    return str(Path(__file__).with_name("_gpu_workers.py"))
