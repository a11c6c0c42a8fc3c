"""The CUDA path on a real GPU: round trips from device memory, gating on producing streams, the
fenced optimizer step over training loops (several optimizers, steps while copies run,
gradient accumulation, skipped steps), clones read after they are made, loads that follow the
caller's streams on every device, the pinned pool and its free, a DTensor over nccl. The same
scenarios run on the simulated GPU (``test_device_fake.py``) in every CI run.

Skipped (with the reason) where no CUDA device is present; ``scripts/gpu_check.sh`` runs them
and prints the figures they record (``GPU_CHECK_FIGURES``: one JSON line each).
Races are made deterministic with ``torch.cuda._sleep``: a long kernel on the producing stream
holds the gate event back, so the copies provably wait for it, and the host runs ahead.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _device_loops import LOOPS, flat, model, train
from conftest import (
    EVENT_TIMEOUT_S,
    MiB,
    assert_same_state,
    failure_of,
    load,
    load_like,
    pool_drains,
)

import cuda_ext
from dcp_datastates import (
    CheckpointSaveError,
    DataStatesReader,
    DataStatesWriter,
    SnapshotMutationError,
    async_save,
)
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


def _figure(name: str, **values: object) -> None:
    """Record one figure for ``scripts/gpu_check.sh`` to print (a JSON line appended to the file
    ``GPU_CHECK_FIGURES`` names; nothing without it)."""
    path = os.environ.get("GPU_CHECK_FIGURES")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"figure": name, **values}) + "\n")


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


# -- issue 38: fences over training loops, clones, loads on every device, the pool's free -------
@pytest.mark.parametrize("name", list(LOOPS))
def test_a_training_loop_on_the_gpu_saves_what_each_step_left(
    tmp_path: Path, make_writer, name: str
) -> None:
    loop = LOOPS[name]
    net = model().cuda()
    writer = make_writer(tmp_path, guard_on_device=loop.guard_on_device, **SMALL_POOL)
    saved: dict[int, dict] = {}
    expected: dict[int, dict] = {}
    responses: dict[int, object] = {}
    fences, waits = guard.fences, guard.waits

    def on_save(state: dict, i: int) -> None:
        for earlier in responses.values():
            earlier.upload_completion.result(timeout=EVENT_TIMEOUT_S)
        # The copies wait behind it: the host issues the next passes' steps while they wait.
        torch.cuda._sleep(3 * LONG_KERNEL)
        path = str(tmp_path / f"it{i}")
        responses[i] = async_save(state, writer, checkpoint_id=path, no_dist=True)
        saved[i] = state
        # On the training stream, right after stage(): what the checkpoint must hold.
        expected[i] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat(state).items()
        }

    start = time.perf_counter()
    train(net, loop, lambda t: t.cuda(), on_save, scaler_device="cuda")
    issued_s = time.perf_counter() - start
    for response in responses.values():
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)  # raises what failed it
    torch.cuda.synchronize()
    for i in responses:
        got = load_like(tmp_path / f"it{i}", saved[i], "datastates")
        assert_same_state(_to(expected[i], "cpu"), _to(flat(got), "cpu"), f"after pass {i}")
    _figure(
        "training_loop",
        loop=name,
        saves=len(responses),
        fenced_steps=guard.fences - fences,
        host_waited_steps=guard.waits - waits,
        loop_issued_s=round(issued_s, 3),
    )
    if loop.guard_on_device and not loop.scaler:
        # More fenced steps than saves: some snapshot was fenced again while its copies ran.
        assert guard.fences - fences > len(loop.save_at)


def test_small_tensors_copied_in_stage_are_read_after_their_copy_was_made(
    tmp_path: Path, make_writer
) -> None:
    state = {
        "weight": torch.randn(64, 64, device="cuda"),  # copied from the live tensor
        "bias": torch.randn(64, device="cuda"),  # copied in stage() (eager_copy_bytes)
        "count": torch.tensor(7, device="cuda"),
    }
    expected = _to(state, "cpu")
    torch.cuda._sleep(LONG_KERNEL)  # the gate, then the clones: the copies start with them
    response = async_save(state, make_writer(tmp_path), no_dist=True)
    state["bias"].add_(1)  # later writes: the snapshot reads the copies made in stage()
    state["count"].add_(1)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert_same_state(expected, load(tmp_path, _blank(expected), "datastates"))


def test_buffers_the_forward_copies_while_the_snapshot_runs_are_read_after_that_copy(
    tmp_path: Path, make_writer
) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32)).cuda()
    state = {"model": dict(net.state_dict())}
    expected = _to(state, "cpu")
    torch.cuda._sleep(LONG_KERNEL)
    writer = make_writer(tmp_path, eager_copy_bytes=0)  # the forward gate copies the buffers
    response = async_save(state, writer, no_dist=True)
    net(torch.randn(8, 32, device="cuda"))  # updates the running statistics in place
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert_same_state(expected, load(tmp_path, _blank(expected), "datastates"))


def _load_behind_the_callers_streams(path: Path, saved: dict[str, torch.Tensor]) -> dict:
    """Load ``path`` into new targets on ``saved``'s devices while each device's caller stream
    is still busy with a fill of those targets; returns what a stream the load knows nothing
    of reads right after it returned, and what the targets hold once everything ran."""
    targets = {k: torch.empty_like(v) for k, v in saved.items()}
    devices = sorted({v.device.index for v in saved.values()})
    sides = {d: torch.cuda.Stream(device=d) for d in devices}
    with contextlib.ExitStack() as streams:
        for d, side in sides.items():
            side.wait_stream(torch.cuda.current_stream(d))
            streams.enter_context(torch.cuda.stream(side))
            torch.cuda._sleep(LONG_KERNEL)  # on this device's caller stream
        for target in targets.values():
            target.zero_()  # the caller's work, still queued when the load starts
        start = time.perf_counter()
        dcp.load(targets, storage_reader=DataStatesReader(path), no_dist=True)
        load_s = time.perf_counter() - start
    right_after = {}
    for key, target in targets.items():
        other = torch.cuda.Stream(device=target.device)
        with torch.cuda.stream(other):
            right_after[key] = target.to("cpu")
    torch.cuda.synchronize()
    later = {k: t.cpu() for k, t in targets.items()}
    _figure("load_behind_caller_streams", devices=len(devices), load_s=round(load_s, 3))
    return {"right_after": right_after, "later": later}


def test_a_load_waits_for_the_callers_stream_and_lands_before_it_returns(
    tmp_path: Path, make_writer
) -> None:
    saved = {"w": torch.randn(20 * MiB, device="cuda"), "s": torch.randn(1000, device="cuda")}
    dcp.save(saved, storage_writer=make_writer(tmp_path), no_dist=True)
    got = _load_behind_the_callers_streams(tmp_path, saved)
    assert_same_state(_to(saved, "cpu"), got["right_after"])
    assert_same_state(_to(saved, "cpu"), got["later"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one CUDA device: no second to load to")
def test_a_load_to_two_gpus_lands_on_both_before_it_returns(tmp_path: Path, make_writer) -> None:
    saved = {"a": torch.randn(4 * MiB, device="cuda:0"), "b": torch.randn(4 * MiB, device="cuda:1")}
    dcp.save(saved, storage_writer=make_writer(tmp_path), no_dist=True)
    got = _load_behind_the_callers_streams(tmp_path, saved)
    assert_same_state(_to(saved, "cpu"), got["right_after"])
    assert_same_state(_to(saved, "cpu"), got["later"])


def test_a_writer_closed_on_a_thread_without_a_context_frees_its_pinned_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not cuda_ext.host_memory.available():
        pytest.skip("cuda-python is not installed: the pool came from torch's pinned allocator")
    from cuda.bindings import driver

    writer = DataStatesWriter(tmp_path, host_pool_bytes=4 * MiB)
    dcp.save({"w": torch.randn(1024, device="cuda")}, storage_writer=writer, no_dist=True)
    pointer = writer._runtime.pool._buffer.data_ptr()
    with caplog.at_level("ERROR"):
        closer = threading.Thread(target=writer.close)  # it never made a CUDA call
        closer.start()
        closer.join(EVENT_TIMEOUT_S)
        del writer
        gc.collect()
    assert not [r for r in caplog.records if "pinned host pool" in r.getMessage()], caplog.text
    err, _ = driver.cuMemHostGetFlags(pointer)
    assert err != driver.CUresult.CUDA_SUCCESS, "the pinned pool is still allocated"


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
