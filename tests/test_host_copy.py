"""Host-to-pool copies: byte-exact from any offset, and on the copy worker's thread alone.

A CPU ``Tensor.copy_`` from a copy worker ran an OpenMP region, which gives the worker an OpenMP
team of its own (``torch.get_num_threads()`` threads) competing with the training's team for the
cores. The copies are a ``memmove`` on the worker now; the thread test fails with ``copy_``.
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


def test_copy_workers_start_no_openmp_team(tmp_path: Path) -> None:
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc/self/task to count the process's threads")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "4"},
    )
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert after == before, (
        f"a save of 64 MiB started {after - before} native threads (an OpenMP team on a copy "
        "worker)"
    )
