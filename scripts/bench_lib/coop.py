"""The coopload scenario: four gloo ranks load one replicated state (every rank needs all of it).

The state (``state.build``) is saved once by this process with our writer; then ``world``
ranks (``bench.py _coop-worker``, fresh processes) load it with each reader in turn after a
barrier: stock ``FileSystemReader``, ours (``DataStatesReader``) and ours cooperative
(``cooperative=True``: each record read by one rank, sent to the others over gloo). A load's
time is the slowest rank's; bytes read are counted on every rank through the storage each reader
reads with (a counting stream for stock's, a counting ranged file for ours) and summed. Loads
after the first read from the page cache (``--drop-caches yes`` and root drop it before each):
there, reading is a memory copy and a transfer over loopback TCP is not cheaper, which is why
``cooperative`` is an option, not the default.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import ranks, state
from .common import GB, Recorder, Spread, alternate, drop_caches, fresh_dir, log

SYSTEMS = ["stock", "ours", "ours-coop"]


class _Counted:
    """A binary stream that counts what is read through it (stock's data files)."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self._counter[0] += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        got = self._inner.readinto(buf)
        self._counter[0] += got or 0
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


def _reader(key: str, path: Path, counter: list[int]) -> Any:
    import contextlib

    from torch.distributed.checkpoint import FileSystemReader

    from dcp_datastates import DataStatesReader
    from dcp_datastates.storage.base import LocalStorage

    if key == "stock":
        reader = FileSystemReader(path)
        create = reader.fs.create_stream

        @contextlib.contextmanager
        def counted(p: Any, mode: str) -> Any:
            with create(p, mode) as stream:
                yield _Counted(stream, counter) if str(p).endswith(".distcp") else stream

        reader.fs.create_stream = counted  # type: ignore[method-assign]
        return reader

    class Storage(LocalStorage):
        def open_ranged(self, name: str) -> Any:
            inner = super().open_ranged(name)

            class Ranged:
                def read_into(self, offset: int, buffers: list[memoryview]) -> int:
                    got = inner.read_into(offset, buffers)
                    counter[0] += got
                    return got

                def close(self) -> None:
                    inner.close()

            return Ranged()

    class Reader(DataStatesReader):
        def _reset_state(self) -> None:
            super()._reset_state()
            self.storage = Storage(self.path)

    return Reader(path, cooperative=key == "ours-coop")


def _sampled(values: Any) -> list[tuple[float, float]]:
    return [(t.view(-1)[0].item(), t.view(-1)[-1].item()) for t in state._samples(values)]


def worker(rank: int, world: int, port: int, workdir: Path, args: dict[str, Any]) -> None:
    """Runs in each rank's process; writes ``rank{rank}.json`` and exits the process."""
    report: dict[str, Any] = {"ok": False}
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        source = state.build(args["bytes"], args["tensors"])
        target = state.empty_like(source)
        # The sampled values only (the state once per rank is enough to hold).
        expected = _sampled(source)
        del source
        results = []
        for r in range(args["rounds"]):
            for key in alternate(SYSTEMS, r):
                counter = [0]
                reader = _reader(key, workdir / "ckpt", counter)
                state.poison(target)
                if args["cold"] and rank == 0:
                    drop_caches()
                dist.barrier()
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=reader)
                load_s = time.perf_counter() - t0
                dist.barrier()
                got = [
                    (t.view(-1)[0].item(), t.view(-1)[-1].item()) for t in state._samples(target)
                ]
                if got != expected:
                    raise AssertionError(f"{key} loaded wrong values: {got} != {expected}")
                results.append({"key": key, "round": r, "load_s": load_s, "read": counter[0]})
        dist.barrier()
        dist.destroy_process_group()
        report = {"ok": True, "results": results}
    except BaseException:
        report = {"ok": False, "traceback": traceback.format_exc()}
        traceback.print_exc()
    ranks.exit_with(workdir, rank, report)


def run(
    rec: Recorder,
    *,
    workdir: Path,
    nbytes: int,
    tensors: int,
    rounds: int,
    timeout: float,
    cold: bool,
    world: int = 4,
) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    root = fresh_dir(workdir / "coopload")
    source = state.build(nbytes, tensors)
    dcp.save(source, storage_writer=DataStatesWriter(root / "ckpt"), no_dist=True)
    del source
    ckpt = sum(p.stat().st_size for p in (root / "ckpt").glob("*.distcp"))
    log(f"coopload: {world} gloo ranks load {ckpt / GB:.2f} GB replicated, {rounds} rounds")
    args = {"bytes": nbytes, "tensors": tensors, "rounds": rounds, "cold": cold}
    reports = ranks._launch(root, world, args, timeout, worker="_coop-worker")
    for i, first in enumerate(reports[0]["results"]):
        per_rank = [r["results"][i] for r in reports]
        read = sum(p["read"] for p in per_rank)
        rec.emit(
            "coopload",
            first["key"],
            {"load_s": max(p["load_s"] for p in per_rank), "read_x": read / ckpt},
            ranks=world,
            bytes=ckpt,
            read_bytes=read,
            round=first["round"],
        )


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    if not rec.select("coopload"):
        return ""
    lines = [
        "### Cooperative load (replicated state, gloo ranks on one machine)",
        "",
        "| reader | load s (slowest rank) | bytes read / checkpoint | load time / stock's |",
        "|---|---|---|---|",
    ]
    stock = Spread.of(r["figures"]["load_s"] for r in rec.select("coopload", system="stock"))
    for key in SYSTEMS:
        rows = rec.select("coopload", system=key)
        load_s = Spread.of(r["figures"]["load_s"] for r in rows)
        read_x = Spread.of(r["figures"]["read_x"] for r in rows)
        if load_s is None or read_x is None:
            continue
        ratio = f"{load_s.median / stock.median:.2f}x" if stock and stock.median else "-"
        lines.append(f"| {key} | {load_s.fmt(3)} | {read_x.median:.2f}x | {ratio} |")
    return "\n".join(lines) + "\n"
