"""Shared fixtures and helpers: writers that close themselves, bit-exact comparisons, loaders."""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import (
    DataStatesReader,
    DataStatesWriter,
    register_provider,
    unregister_provider,
)
from dcp_datastates.format import DATA_SUFFIX
from dcp_datastates.providers.tensor import TensorProvider
from dcp_datastates.snapshot import cow

#: Upper bound on any wait for a background event; a test that hits it has hung, not raced.
EVENT_TIMEOUT_S = 20.0

MiB = 1 << 20

#: Free space the suite needs where pytest keeps tmp_path (about 0.2 GB at its peak, measured with
#: passed tests' directories removed as they end), with room to spare.
NEEDED_FREE_BYTES = 1 << 30


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop at once, saying why, on a disk too full for the suite: otherwise hundreds of tests
    fail one by one in tmp_path's setup with ENOSPC, as one CI run did."""
    root = session.config.option.basetemp or tempfile.gettempdir()
    probe = Path(root)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < NEEDED_FREE_BYTES:
        pytest.exit(
            f"only {free / 2**30:.2f} GiB free at {probe}, where the tests write checkpoints; "
            f"they need {NEEDED_FREE_BYTES / 2**30:.0f} GiB. Free space there (old checkpoints, "
            "benchmark scratch), or point TMPDIR or --basetemp at a disk with room.",
            returncode=3,
        )


@pytest.fixture(autouse=True)
def _copy_on_write_settles() -> Iterator[None]:
    """A test's copy-on-write mode leaves the main thread with the test (in training, the next
    forward or optimizer step pops it): the next test starts with no mode on the stack."""
    yield
    cow.settle()


@pytest.fixture
def make_writer() -> Iterator[Callable[..., DataStatesWriter]]:
    """``make_writer(path, **options)``: a writer whose pool and threads are released afterwards."""
    writers: list[DataStatesWriter] = []

    def make(path: str | Path, **options: Any) -> DataStatesWriter:
        writer = DataStatesWriter(path, **options)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh directory URL on fsspec's in-memory file system, removed afterwards."""
    root = f"/dcp-datastates-tests/{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def registered_providers() -> Iterator[Callable[[type, Any], None]]:
    """``register(cls, factory)``: a provider registration undone when the test ends."""
    classes: list[type] = []

    def register(cls: type, factory: Any) -> None:
        register_provider(cls, factory)
        classes.append(cls)

    yield register
    for cls in classes:
        unregister_provider(cls)


class GatedTensorProvider(TensorProvider):
    """A real tensor provider whose copy waits for ``gate``: makes snapshot races deterministic."""

    def __init__(self, fqn: str, tensor: torch.Tensor, gate: threading.Event) -> None:
        super().__init__(fqn, tensor)
        self.gate = gate
        self.copy_started = threading.Event()

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        self.copy_started.set()
        if not self.gate.wait(EVENT_TIMEOUT_S):
            raise TimeoutError(f"the test never opened the gate of {self.fqn!r}")
        super().copy_into(dst, start, stop)


def pool_drains(writer: DataStatesWriter) -> bool:
    """Wait until every host-pool block of ``writer`` is back; False if that never happens.

    Copies already queued when a save fails still run (and then release their blocks), so the
    pool empties shortly after the failure is reported, not at the same instant.
    """
    pool = writer._runtime.pool
    if pool is None:
        return True
    with pool._cond:
        return pool._cond.wait_for(lambda: pool.in_use == 0, timeout=EVENT_TIMEOUT_S)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes, in logical order, as a flat uint8 tensor."""
    flat = tensor.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def assert_same_bits(expected: torch.Tensor, actual: torch.Tensor, name: str = "") -> None:
    assert actual.dtype == expected.dtype, name
    assert actual.shape == expected.shape, name
    assert torch.equal(bits(expected), bits(actual)), f"{name}: bytes differ"


def assert_same_state(expected: Any, actual: Any, path: str = "") -> None:
    """Tensors compared bit for bit, containers element by element, anything else with ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert_same_bits(expected, actual, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            assert_same_state(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, list) and any(isinstance(v, torch.Tensor) for v in expected):
        assert isinstance(actual, list) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_state(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, path


def blank_like(state: Any) -> Any:
    """A load target shaped like ``state``: zeroed tensors (same strides), ``None`` for objects."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {key: blank_like(value) for key, value in state.items()}
    if isinstance(state, list) and any(isinstance(v, torch.Tensor) for v in state):
        return [blank_like(value) for value in state]
    return None


#: How a checkpoint is read back: stock DCP (``checkpoint_id=`` picks ``FileSystemReader``) or ours.
READERS = ("stock", "datastates")


def load(path: str | Path, target: dict[str, Any], reader: str) -> dict[str, Any]:
    if reader == "stock":
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    else:
        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    return target


def load_like(path: str | Path, state: dict[str, Any], reader: str) -> dict[str, Any]:
    return load(path, blank_like(state), reader)


def data_files(path: str | Path) -> list[Path]:
    return sorted(Path(path).glob(f"*{DATA_SUFFIX}"))


def data_bytes_on_disk(path: str | Path) -> int:
    return sum(f.stat().st_size for f in data_files(path))


def failure_of(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The ``kind`` error behind ``exc``: itself, a cause, or one rank's failure in a DCP
    ``CheckpointException`` / our ``CheckpointSaveError``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, kind):
            return err
        for failure in getattr(err, "failures", {}).values():
            # DCP's CheckpointException holds (exception, traceback summary) pairs.
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo.extend([err.__cause__, err.__context__])
    return None


def write_commit_record(path: Path, blob: bytes) -> None:
    """Replace ``path``'s ``.metadata`` with ``blob`` as a consistent edit would (an attacker's,
    a tool's): the manifest's checksum of the commit record is updated to match, so a reader
    gets past it to the checks the test is about."""
    import json

    from crc32c import crc32c

    from dcp_datastates.format import MANIFEST_CRC_FIELD, MANIFEST_NAME, METADATA_CRC_FIELD

    (path / ".metadata").write_bytes(blob)
    manifest = path / MANIFEST_NAME
    if not manifest.exists():
        return
    body = json.loads(manifest.read_bytes())
    body.pop(MANIFEST_CRC_FIELD)
    body[METADATA_CRC_FIELD] = crc32c(blob)
    body[MANIFEST_CRC_FIELD] = crc32c(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    manifest.write_text(json.dumps(body))
