"""Host-to-pool copies: byte-exact from any offset, and on the copy worker's thread alone.

A CPU ``Tensor.copy_`` from a copy worker ran an OpenMP region, which gives the worker an OpenMP
team of its own (``torch.get_num_threads()`` threads) competing with the training's team for the
cores. The copies are a ``memmove`` on the worker now; the thread test fails with ``copy_``.
A training loop's saves start no team on any thread of ours either (``docs/design.md``,
"Threads"): strided tensors are copied by numpy, the replay's buffers zeroed by ``memset``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader
from dcp_datastates.providers.tensor import TensorProvider


def test_chunked_copies_of_views_are_byte_exact(tmp_path: Path, make_writer) -> None:
    base = torch.arange(3 * (1 << 18), dtype=torch.float32)
    state = {
        "offset_view": base[1000:],  # a storage offset: the copy starts inside the storage
        "rows": base.view(3, -1)[1:],  # contiguous rows of a bigger tensor
        "strided": base.view(-1, 3)[:, 1],  # not contiguous: the row-wise torch path
        "int8": torch.randint(-128, 127, (12345,), dtype=torch.int8),
    }
    writer = make_writer(tmp_path, chunk_bytes=64 << 10, coalesce_bytes=4 << 10)  # many chunks
    dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / "c", no_dist=True)
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=DataStatesReader(tmp_path / "c"), no_dist=True)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_a_storage_freed_after_staging_fails_the_copy_instead_of_reading_freed_memory() -> None:
    # FSDP frees a storage by resizing it to 0; the provider's alias shares that storage. The raw
    # memmove must not run past it (it read freed memory and crashed the process): torch's own
    # bounds check refuses the copy.
    live = torch.arange(1 << 20, dtype=torch.float32)
    provider = TensorProvider("w", live)
    live.untyped_storage().resize_(0)
    dst = torch.empty(provider.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        provider.copy_into(dst, 0, provider.nbytes)


_CHILD = textwrap.dedent(
    """
    import os, sys, tempfile, threading
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter

    torch.set_num_threads(4)

    def native_threads_python_does_not_know():
        known = {t.native_id for t in threading.enumerate()}
        return len({int(t) for t in os.listdir("/proc/self/task")} - known)

    state = {"x": torch.ones(64 << 20, dtype=torch.uint8)}
    state["x"].add_(1)  # the caller's own OpenMP team exists before the save
    with tempfile.TemporaryDirectory() as d:
        writer = DataStatesWriter(d, copy_workers=1, host_pool_bytes=256 << 20)
        before = native_threads_python_does_not_know()
        dcp.save(state, storage_writer=writer, checkpoint_id=d + "/c", no_dist=True)
        after = native_threads_python_does_not_know()
        writer.close()
    print(before, after)
    """
)


def _run_child(script: str, cwd: Path) -> list[str]:
    """Run ``script`` in a fresh interpreter with 4 OpenMP threads; the words it printed."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc/self/task to count the process's threads")
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "4"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_copy_workers_start_no_openmp_team(tmp_path: Path) -> None:
    before, after = map(int, _run_child(_CHILD, tmp_path))
    assert after == before, (
        f"a save of 64 MiB started {after - before} native threads (an OpenMP team on a copy "
        "worker)"
    )


_LOOP_CHILD = textwrap.dedent(
    """
    import os, sys, tempfile, threading
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    import dcp_datastates
    from dcp_datastates import DataStatesReader, DataStatesWriter

    torch.set_num_threads(4)

    def native_threads_python_does_not_know():
        known = {t.native_id for t in threading.enumerate()}
        return len({int(t) for t in os.listdir("/proc/self/task")} - known)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256)
    extra = {
        # not contiguous, copied by rows; not a transpose (torch copies those on one thread)
        "strided": torch.randn(1024, 1024)[:, ::2],
        "strided_bf16": torch.randn(1024, 1024).to(torch.bfloat16)[:, ::2],
        "small": [torch.randn(1000) for _ in range(64)],  # eager copies: a replay group
    }

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the caller's own OpenMP team exists before the first save
    with tempfile.TemporaryDirectory() as d:
        writer = DataStatesWriter(d)
        before = native_threads_python_does_not_know()
        for i in range(3):  # a walk, then two replays (their buffers made on the planning thread)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}
            response = dcp_datastates.async_save(
                state, writer, checkpoint_id=f"{d}/c{i}", no_dist=True
            )
            step()
            response.upload_completion.result()
        after = native_threads_python_does_not_know()
        replays = writer._staging.captures.replays
        writer.close()
        loaded = {"extra": {
            "strided": torch.zeros(1024, 512),
            "strided_bf16": torch.zeros(1024, 512, dtype=torch.bfloat16),
            "small": [torch.zeros(1000) for _ in range(64)],
        }}
        dcp.load(loaded, storage_reader=DataStatesReader(f"{d}/c2"), no_dist=True)
        same = all(
            torch.equal(loaded["extra"][k], extra[k]) for k in ("strided", "strided_bf16")
        ) and all(map(torch.equal, loaded["extra"]["small"], extra["small"]))
    print(before, after, replays, same)
    """
)


def test_a_training_loops_saves_start_no_openmp_team_on_our_threads(tmp_path: Path) -> None:
    # An OpenMP team on a thread of ours lives as long as the thread (the writer's): the process
    # then has more OpenMP threads than cores, and every step of the training ran 20-25% slower
    # while the writer lived (2-core VM, the train scenario's state; docs/design.md, "Threads").
    before, after, replays, same = _run_child(_LOOP_CHILD, tmp_path)
    assert replays == "2", f"the later saves did not replay the layout ({replays} replays)"
    assert same == "True", "the strided tensors or the small ones did not load back as saved"
    assert after == before, (
        f"three saves in a training loop left {int(after) - int(before)} more native threads "
        "(an OpenMP team on a thread of ours)"
    )
