"""Worker processes for the cooperative load (``DataStatesReader(cooperative=True)``).

``python _coop_workers.py SCENARIO RANK WORLD PORT DIR`` (run through
``_dist_workers.launch(script=__file__)``); each rank counts the bytes its reader reads from
storage through a counting subclass of the real local storage.

    loads   (four ranks) ``replicated``: every rank loads the whole state in ``DIR/ckpt``
            (saved by the test, one process) with ``cooperative=False``, then ``True``, then
            ``True`` with rank 1's storage failing every data read; each rank reports the bytes
            it read per load, what differs from the saved values, and how the failing load
            failed. ``reshard``: the ranks save row shards of two ranks (HSDP: two replicas of a
            two-way ``Shard(0)``, the files of a two-rank FSDP save) to ``DIR/sharded``, then
            load them as four uneven row shards, column shards and a replicated copy, plain and
            cooperative; each rank reports bytes read and diffs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _dist_workers import exit_without_teardown, process_group, run_worker  # noqa: E402

from dcp_datastates import DataStatesReader  # noqa: E402
from dcp_datastates.storage.base import LocalStorage  # noqa: E402

FAIL = "injected read failure"


def replicated_state() -> dict[str, Any]:
    """Big tensors (sent alone), small ones (sent packed), another dtype, an object."""
    g = torch.Generator().manual_seed(41)
    state: dict[str, Any] = {f"big{i}": torch.randn(640, 1024, generator=g) for i in range(3)}
    state.update({f"small{i}": torch.randn(7, 13, generator=g) for i in range(40)})
    state["half"] = torch.randn(300, 700, generator=g).to(torch.bfloat16)
    state["ints"] = torch.randint(0, 1 << 30, (1001,), generator=g)
    state["meta"] = {"step": 41, "tag": "replicated", "lrs": [0.1, 0.01]}
    return state


def sharded_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(1034, 300, generator=g),  # 2 ranks: 517 rows each; 4: 259,259,259,257
        "cols": torch.randn(64, 4000, generator=g),
        "both": torch.randn(100, 50, generator=g, dtype=torch.float64),
    }


class CountingStorage(LocalStorage):
    """The real local storage, counting the bytes its ranged files read (the data records);
    with ``fail``, every data read raises."""

    def __init__(self, root: str, *, fail: bool = False) -> None:
        super().__init__(root)
        self.read_bytes = 0
        self.fail = fail

    def open_ranged(self, name: str) -> Any:
        inner = super().open_ranged(name)
        outer = self

        class Counted:
            def read_into(self, offset: int, buffers: list[memoryview]) -> int:
                if outer.fail:
                    raise OSError(f"{FAIL} at offset {offset} of {name}")
                got = inner.read_into(offset, buffers)
                outer.read_bytes += got
                return got

            def close(self) -> None:
                inner.close()

        return Counted()


def counting_reader(path: Path, *, fail: bool = False, **kwargs: Any) -> DataStatesReader:
    class Reader(DataStatesReader):
        def _reset_state(self) -> None:
            super()._reset_state()
            self.storage = CountingStorage(self.path, fail=fail)

    return Reader(path, **kwargs)


def _load(target: dict[str, Any], reader: DataStatesReader) -> int:
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=reader)
    return reader.storage.read_bytes


def _replicated(rank: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import dcp_datastates.load.reader as reader_module

    path = workdir / "ckpt"
    values = replicated_state()
    report: dict[str, Any] = {"read": {}, "differs": {}}
    for mode in ("plain", "coop"):
        target = {k: torch.zeros_like(v) for k, v in values.items() if k != "meta"}
        target["meta"] = {"step": 0, "tag": "", "lrs": []}
        # A non-contiguous target (received into a buffer, then copied).
        target["big1"] = torch.zeros(1024, 640).t()
        report["read"][mode] = _load(target, counting_reader(path, cooperative=mode == "coop"))
        report["differs"][mode] = [
            k
            for k, v in values.items()
            if not (torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v)
        ]
    # Rounds of 256 KiB (two on one rank: reads overlap the previous round's transfers), and
    # rank 3 loads nothing at all yet takes part.
    reader_module.COOP_ROUND_BYTES = 256 << 10
    target = {k: torch.zeros_like(v) for k, v in values.items() if k != "meta"}
    if rank == 3:
        target = {}
    reader = counting_reader(path, cooperative=True)
    report["read"]["rounds"] = _load(target, reader)
    report["differs"]["rounds"] = [k for k in target if not torch.equal(target[k], values[k])]
    target = {k: torch.zeros_like(v) for k, v in values.items() if isinstance(v, torch.Tensor)}
    try:
        dcp.load(target, storage_reader=counting_reader(path, fail=rank == 1, cooperative=True))
        report["failed"] = None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        report["failed"] = f"{type(exc).__name__}: {exc}"
    return report


def _reshard(workdir: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_datastates import DataStatesWriter

    path = workdir / "sharded"
    values = sharded_values()
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = {k: distribute_tensor(v, hsdp, [Replicate(), Shard(0)]) for k, v in values.items()}
    dcp.save(state, storage_writer=DataStatesWriter(path))
    mesh = init_device_mesh("cpu", (4,))
    placements = {"rows": Shard(0), "cols": Shard(1), "both": Replicate()}
    expected = {k: distribute_tensor(v, mesh, [placements[k]]) for k, v in values.items()}
    report: dict[str, Any] = {"read": {}, "differs": {}}
    for mode in ("plain", "coop"):
        target = {
            k: distribute_tensor(torch.zeros_like(v), mesh, [placements[k]])
            for k, v in values.items()
        }
        report["read"][mode] = _load(target, counting_reader(path, cooperative=mode == "coop"))
        report["differs"][mode] = [
            k for k in values if not torch.equal(target[k].to_local(), expected[k].to_local())
        ]
    return report


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist

    if scenario != "loads":
        raise ValueError(f"unknown scenario {scenario!r}")
    with process_group(rank, world_size, port):
        report = {"replicated": _replicated(rank, workdir), "reshard": _reshard(workdir)}
        dist.barrier()
    return report


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
