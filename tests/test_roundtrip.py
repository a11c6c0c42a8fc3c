"""What a DataStatesWriter saves loads back bit for bit, through stock DCP and our reader."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import READERS, MiB, assert_same_state, data_bytes_on_disk, load, load_like

from dcp_datastates import DataStatesWriter, InvalidStateDictError, async_save
from dcp_datastates.format import MANIFEST_NAME
from dcp_datastates.providers.tensor import TensorProvider

SAVE_APIS = ("dcp.save", "dcp.async_save", "dcp_datastates.async_save")


def save(state: dict[str, Any], writer: DataStatesWriter, path: Path | str, api: str) -> None:
    """Save through ``api`` and wait until the checkpoint is committed."""
    if api == "dcp.save":
        dcp.save(state, storage_writer=writer, checkpoint_id=str(path), no_dist=True)
    elif api == "dcp.async_save":
        dcp.async_save(state, storage_writer=writer, checkpoint_id=str(path), no_dist=True).result()
    else:
        response = async_save(state, writer, checkpoint_id=str(path), no_dist=True)
        response.staging_completion.result()
        response.upload_completion.result()


@dataclasses.dataclass
class RunInfo:
    name: str
    tags: list[str]


def zoo() -> dict[str, Any]:
    """Every dtype and layout the issue names, plus nested containers and Python objects."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "float32": r(3, 4),
        "float16": r(5).half(),
        "bfloat16": r(2, 3).bfloat16(),
        "float8_e4m3fn": r(16).to(torch.float8_e4m3fn),
        "float8_e5m2": r(4, 4).to(torch.float8_e5m2),
        "int8": torch.randint(-128, 128, (9,), dtype=torch.int8, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (3, 3), dtype=torch.int64, generator=g),
        "bool": torch.rand(7, generator=g) > 0.5,
        "complex64": torch.complex(r(6), r(6)),
        "scalar_float": torch.tensor(2.5),
        "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_2d_bf16": torch.empty(0, 3, dtype=torch.bfloat16),
        "transposed": r(5, 7).t(),
        "strided_slice": r(6, 8)[:, 1:7:2],
        "permuted_3d": r(2, 3, 4).permute(2, 0, 1),
        "nested": {
            "layer": {"weight": r(4, 2), "bias": r(4)},
            "tensors": [r(2), r(3).to(torch.float16)],
        },
        "lr": 0.001,
        "tags": ["warmup", "cosine"],
        "run": RunInfo(name="run-7", tags=["a", "b"]),
        "meta": {"epoch": 3, "note": "hello", "sizes": [1, 2, 3]},
    }


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("api", SAVE_APIS)
def test_every_dtype_and_layout_loads_back_bit_exact(
    tmp_path: Path, make_writer, api: str, reader: str
) -> None:
    state = zoo()
    save(state, make_writer(tmp_path / "ckpt"), tmp_path / "ckpt", api)

    # Our reader's safe mode loads objects with weights_only semantics: allow the test's own class.
    with torch.serialization.safe_globals([RunInfo]):
        assert_same_state(state, load_like(tmp_path / "ckpt", state, reader))


@pytest.mark.parametrize("reader", READERS)
def test_views_save_only_the_bytes_they_show(tmp_path: Path, make_writer, reader: str) -> None:
    base = torch.randn(MiB)  # 4 MiB of storage shared by every view below
    state = {
        "head": base[:256],
        "tail": base[-256:],
        "rows": base.view(1024, 1024)[10:12],
        "column": base.view(1024, 1024)[:, 3],
    }
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)

    shown = sum(v.numel() * v.element_size() for v in state.values())
    assert (
        data_bytes_on_disk(tmp_path) < shown + 64 * 1024 < base.numel() * base.element_size() // 8
    )
    assert_same_state(state, load_like(tmp_path, state, reader))


@pytest.fixture(scope="module")
def ten_thousand_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("tiny")
    state = {f"t{i:05d}": torch.full((2,), float(i)) for i in range(10_000)}
    writer = DataStatesWriter(path)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.last_stats is not None and writer.last_stats.items == 10_000
    finally:
        writer.close()
    return path, state


@pytest.mark.parametrize("reader", READERS)
def test_ten_thousand_tiny_tensors_load_back(ten_thousand_tiny, reader: str) -> None:
    path, state = ten_thousand_tiny
    assert_same_state(state, load_like(path, state, reader))


@pytest.mark.parametrize("api", SAVE_APIS)
def test_a_reused_writer_saves_the_values_of_each_save(
    tmp_path: Path, make_writer, api: str
) -> None:
    weight = torch.zeros(64, 64)
    state = {"weight": weight, "step": 0}
    writer = make_writer(tmp_path / "unused-default")
    for step in range(3):
        weight.fill_(float(step))  # in place: the same tensor object in every save
        state["step"] = step
        save(state, writer, tmp_path / f"step{step}", api)

    for step in range(3):
        loaded = load_like(tmp_path / f"step{step}", state, "datastates")
        assert torch.equal(loaded["weight"], torch.full((64, 64), float(step))), f"step {step}"
        assert loaded["step"] == step
    assert not (tmp_path / "unused-default").exists()


def _run_without_dcp_datastates(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter where importing dcp_datastates fails."""
    prelude = "import sys\nsys.modules['dcp_datastates'] = None  # any import of it now fails\n"
    epilogue = (
        "\nassert not any(m.startswith('dcp_datastates') and sys.modules[m] for m in sys.modules)\n"
    )
    code = prelude + textwrap.dedent(script) + epilogue
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_stock_dcp_loads_the_checkpoint_without_dcp_datastates_installed(
    tmp_path: Path, make_writer
) -> None:
    state = {k: v for k, v in zoo().items() if k != "run"}  # RunInfo lives in this test module
    dcp.save(state, storage_writer=make_writer(tmp_path / "ckpt"), no_dist=True)
    torch.save(state, tmp_path / "reference.pt")

    done = _run_without_dcp_datastates(
        f"""
        import torch, torch.distributed.checkpoint as dcp
        ref = torch.load({str(tmp_path / "reference.pt")!r}, weights_only=False)

        def blank(v):
            if isinstance(v, torch.Tensor):
                return torch.zeros_like(v)
            if isinstance(v, dict):
                return {{k: blank(x) for k, x in v.items()}}
            if isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v):
                return [blank(x) for x in v]
            return None

        def same(a, b):
            if isinstance(a, torch.Tensor):
                flat = lambda t: t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t
                return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))
            if isinstance(a, dict):
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            if isinstance(a, list) and any(isinstance(x, torch.Tensor) for x in a):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b

        target = blank(ref)
        dcp.load(target, checkpoint_id={str(tmp_path / "ckpt")!r}, no_dist=True)
        assert same(ref, target), "stock load differs from the reference"
        print("LOADED", len(ref))
        """
    )

    assert done.returncode == 0, done.stderr
    assert f"LOADED {len(state)}" in done.stdout


def test_metadata_unpickles_with_stock_types_only(tmp_path: Path, make_writer) -> None:
    state = {"w": torch.ones(3), "nested": {"b": torch.zeros(2)}, "step": 5}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)

    done = _run_without_dcp_datastates(
        f"""
        import pickle
        with open({str(tmp_path / ".metadata")!r}, "rb") as f:
            md = pickle.load(f)
        modules = {{type(md).__module__}}
        modules |= {{type(v).__module__ for v in md.state_dict_metadata.values()}}
        modules |= {{type(v).__module__ for v in md.storage_data.values()}}
        assert all(m.startswith("torch.") for m in modules), modules
        print("KEYS", sorted(md.state_dict_metadata))
        """
    )

    assert done.returncode == 0, done.stderr
    assert "KEYS ['nested.b', 'step', 'w']" in done.stdout


class Histogram:
    """A user type that is not picklable as is (it holds a lock), saved by its own provider."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts
        self.lock = threading.Lock()


class HistogramProvider:
    """An eager provider: serializes the counts (as a plain list, so stock DCP loads it too)."""

    kind = "histogram"
    nbytes = 0
    frame = None

    def __init__(self, fqn: str, value: Histogram) -> None:
        self.fqn = fqn
        buf = io.BytesIO()
        torch.save({"counts": list(value.counts)}, buf)
        self.payload = buf.getvalue()

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        return []

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        raise AssertionError("an eager provider has nothing to copy")

    def check_unchanged(self, rank: int) -> None:
        return None


@pytest.mark.parametrize("reader", READERS)
def test_a_registered_provider_saves_a_custom_type(
    tmp_path: Path, make_writer, registered_providers, reader: str
) -> None:
    registered_providers(Histogram, HistogramProvider)
    state = {"w": torch.ones(3), "hist": Histogram([4, 0, 2])}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)

    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["items"]["hist"]["kind"] == "histogram"
    loaded = load(tmp_path, {"w": torch.zeros(3), "hist": None}, reader)
    assert loaded["hist"] == {"counts": [4, 0, 2]}
    assert torch.equal(loaded["w"], torch.ones(3))


def test_a_registered_raw_provider_saves_a_custom_type_as_a_tensor_record(
    tmp_path: Path, make_writer, registered_providers
) -> None:
    @dataclasses.dataclass
    class Quantized:
        data: torch.Tensor
        scale: float

    registered_providers(Quantized, lambda fqn, q: TensorProvider(fqn, q.data))
    data = torch.randint(-128, 128, (4, 4), dtype=torch.int8)
    dcp.save({"q": Quantized(data, 0.5)}, storage_writer=make_writer(tmp_path), no_dist=True)

    for reader in READERS:
        loaded = load(tmp_path, {"q": None}, reader)
        assert_same_state(data, loaded["q"], reader)


BAD_STATES = {
    "empty": {},
    "non-string key": {"model": {None: torch.ones(2)}},
    "unpicklable object": {"w": torch.ones(2), "lock": threading.Lock()},
}


@pytest.mark.parametrize("bad", BAD_STATES)
@pytest.mark.parametrize("api", ("stage", "dcp.async_save", "dcp_datastates.async_save"))
def test_a_bad_state_dict_is_refused_at_the_call_site(
    tmp_path: Path, make_writer, api: str, bad: str
) -> None:
    writer = make_writer(tmp_path / "ckpt")
    with pytest.raises(InvalidStateDictError) as raised:
        if api == "stage":
            writer.stage(BAD_STATES[bad])
        elif api == "dcp.async_save":
            dcp.async_save(BAD_STATES[bad], storage_writer=writer, no_dist=True)
        else:
            async_save(BAD_STATES[bad], writer, no_dist=True)

    if bad == "non-string key":
        assert "None" in str(raised.value) and "model" in str(raised.value)
    if bad == "unpicklable object":
        assert "'lock'" in str(raised.value)
    assert not (tmp_path / "ckpt").exists()
    # The refusal left the writer usable.
    save({"ok": torch.ones(1)}, writer, tmp_path / "after", api="dcp.save")
    assert (tmp_path / "after" / ".metadata").exists()


@pytest.mark.parametrize("api", SAVE_APIS)
def test_an_optimizer_state_dict_with_int_keys_saves_and_loads(
    tmp_path: Path, make_writer, api: str
) -> None:
    """An unmodified loop saves ``optimizer.state_dict()`` as is: its ``state`` is keyed by
    parameter index (ints), which stock DCP accepts and loads back as ints."""
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    assert set(state["optim"]["state"]) == {0, 1}
    save(state, make_writer(tmp_path / "ckpt"), tmp_path / "ckpt", api)
    for reader in READERS:
        target = {"model": model.state_dict(), "optim": copy.deepcopy(optim.state_dict())}
        for moments in target["optim"]["state"].values():
            for value in moments.values():
                value.zero_()
        assert_same_state(state, load(tmp_path / "ckpt", target, reader), reader)


@pytest.mark.parametrize("api", SAVE_APIS)
def test_each_save_reports_sensible_stats(tmp_path: Path, make_writer, api: str) -> None:
    state = {"a": torch.randn(256, 256), "b": [torch.randn(100) for _ in range(5)], "step": 1}
    writer = make_writer(tmp_path / "default", host_pool_bytes=4 * MiB)
    save(state, writer, tmp_path / "ckpt", api)

    stats = writer.last_stats
    assert stats.checkpoint_id == str(tmp_path / "ckpt")
    assert stats.rank == 0
    assert stats.items == 7
    assert stats.bytes_written == data_bytes_on_disk(tmp_path / "ckpt")
    assert stats.bytes_written > 256 * 256 * 4
    assert stats.pool_bytes == 4 * MiB
    assert 256 * 256 * 4 <= stats.pool_peak_bytes <= stats.pool_bytes
    assert stats.safe_to_mutate_s is not None and stats.durable_s is not None
    assert 0 <= stats.safe_to_mutate_s <= stats.durable_s
    assert 0 <= stats.blocked_s <= stats.durable_s
    # The phases, in order on one clock: flushing starts, the files land, the commit finishes.
    assert stats.flush_started_s is not None and stats.flushed_s is not None
    assert 0 <= stats.flush_started_s <= stats.flushed_s <= stats.durable_s
    assert stats.commit_s is not None and 0 <= stats.commit_s <= stats.durable_s - stats.flushed_s
    if api == "dcp.save":
        assert stats.stage_s is None  # no stage(): DCP snapshots in write_data
    else:
        assert stats.stage_s is not None and 0 <= stats.stage_s <= stats.blocked_s
    assert stats.optimizer_wait_s == 0
    assert "saved 7 items" in stats.summary()
