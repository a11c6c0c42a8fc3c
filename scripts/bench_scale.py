"""Quick measurements behind docs/benchmarks.md's "Performance at scale" section (issue 11).

    python scripts/bench_scale.py counts 100,1000,5000,20000    # blocked: ours vs stock async
    python scripts/bench_scale.py first 1.0 [--warm]             # first save vs steady, one writer
    python scripts/bench_scale.py copy 0.5 1,2,4                 # safe vs DefaultStager, by workers
    python scripts/bench_scale.py cpu 8                          # CPU of a save of the train state
    python scripts/bench_scale.py versions 20000 14              # ours blocked vs reading versions

Each prints one line per point with stock figures of the same process; nothing is asserted.
``EAGER=0`` sets ``eager_copy_bytes=0`` for ``counts``; ``ROUNDS`` its saves per system (4).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from operator import attrgetter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from bench_lib import state  # noqa: E402
from bench_lib.systems import NoStageWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

from dcp_datastates import DataStatesWriter  # noqa: E402

#: Every scratch directory, removed when the script exits, killed by Ctrl-C or failed: the
#: checkpoints are GBs, and ones left behind by interrupted runs once filled the disk.
SCRATCH = contextlib.ExitStack()


def counts(arg: str) -> None:
    """Blocked time (wall, and CPU of the caller's thread) per system, saves alternated: stock
    default; ``dcp.async_save`` with a stager doing nothing (the floor); ours with the walk
    forced (the record forgotten before each save: the path before the replay); ours."""
    rounds = int(os.environ.get("ROUNDS", "4"))
    for n in [int(x) for x in arg.split(",")]:
        sd = state.build(0.1e9, n)
        d = SCRATCH.enter_context(tempfile.TemporaryDirectory(prefix="bench_scale_"))
        eager = int(os.environ.get("EAGER", "4096"))
        walk = DataStatesWriter(f"{d}/walk", eager_copy_bytes=eager)
        ours = DataStatesWriter(f"{d}/ours", eager_copy_bytes=eager)
        names = ["stock default", "floor (no-op stage)", "ours walk", "ours replay"]
        wall: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        for i in range(rounds):
            for k in names if i % 2 == 0 else names[::-1]:
                kwargs = {"checkpoint_id": f"{d}/{len(wall[k])}{k[:4]}", "no_dist": True}
                if k == "floor (no-op stage)":
                    kwargs["storage_writer"] = NoStageWriter(kwargs["checkpoint_id"])
                elif k == "ours walk":
                    walk._staging.captures.forget()
                    kwargs["storage_writer"] = walk
                elif k == "ours replay":
                    kwargs["storage_writer"] = ours
                t, c = time.perf_counter(), time.thread_time()
                f = dcp.async_save(sd, **kwargs)
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.thread_time() - c)
                f.result()
                del f  # freeing a save's future (its metadata) would land in the next one's time
                shutil.rmtree(kwargs["checkpoint_id"], ignore_errors=True)
        assert ours._staging.captures.replays == rounds - 1, "ours did not replay"
        walk.close()
        ours.close()
        line = f"tensors {len(state.tensors_of(sd))}:"
        for k in names:  # the first save of each is left out (pool, first layout)
            w, c = sorted(wall[k][1:]), sorted(cpu[k][1:])
            line += (
                f" | {k} {w[len(w) // 2] * 1e3:.1f} ms (min {w[0] * 1e3:.1f}, cpu {c[0] * 1e3:.1f})"
            )
        stock, mine = sorted(wall[names[0]][1:]), sorted(wall[names[3]][1:])
        line += f" | ratio stock/ours (medians) {stock[len(stock) // 2] / mine[len(mine) // 2]:.0f}"
        print(line, flush=True)


def first(gb: float, warm: bool) -> None:
    sd = state.build(gb * 1e9, 120)
    d = SCRATCH.enter_context(tempfile.TemporaryDirectory(prefix="bench_scale_"))
    w = DataStatesWriter(d)
    if warm:
        t = time.perf_counter()
        w.warm_up(sd, wait=True)
        print(f"warm_up {time.perf_counter() - t:.3f} s")
    for i in range(3):
        t = time.perf_counter()
        f = dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{d}/c{i}", no_dist=True)
        blocked = time.perf_counter() - t
        f.result()
        st = w.last_stats
        print(
            f"save {i}: blocked {blocked:.3f} safe {st.safe_to_mutate_s:.3f} "
            f"durable {st.durable_s:.3f} s"
        )
        shutil.rmtree(f"{d}/c{i}")
    w.close()


def copy(gb: float, workers: str) -> None:
    sd = state.build(gb * 1e9, 120)
    src = torch.ones(int(gb * 1e9), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    for _ in range(2):
        t = time.perf_counter()
        dst.copy_(src)
        mc = time.perf_counter() - t
        stager = DefaultStager(StagingOptions(False, True, False, False))
        stager.stage(sd)  # its cache, as in steady state
        t = time.perf_counter()
        stager.stage(sd)
        st = time.perf_counter() - t
        stager.close()
        line = f"memcpy {mc:.3f}s ({gb / mc:.1f} GB/s) DefaultStager(cached) {st:.3f}s"
        for k in [int(x) for x in workers.split(",")]:
            with tempfile.TemporaryDirectory(prefix="bench_scale_") as d:
                w = DataStatesWriter(d, copy_workers=k)
                w.warm_up(sd, wait=True)
                for i in range(2):
                    f = dcp.async_save(
                        sd, storage_writer=w, checkpoint_id=f"{d}/c{i}", no_dist=True
                    )
                    f.result()
                s = w.last_stats.safe_to_mutate_s
                w.close()
            line += f" | ours w={k} safe {s:.3f}s ({s / st:.2f}x)"
        print(line, flush=True)


def cpu(saves: int) -> None:
    """CPU seconds of one save of the train scenario's state (0.33 GB, AdamW) on an otherwise
    idle process: all threads (``process_time``), and the thread time spent copying into the
    pool and flushing; beside them a ``memcpy`` and a crc32c of as many bytes."""
    from bench_lib.train import TrainConfig, _Trainee
    from crc32c import crc32c
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dcp_datastates
    from dcp_datastates.save import flush as flush_mod
    from dcp_datastates.snapshot import scheduler as scheduler_mod

    spent: dict[str, float] = {"copy": 0.0, "flush": 0.0}

    def on_thread_clock(name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - t

        return timed

    scheduler_mod._copy_piece = on_thread_clock("copy", scheduler_mod._copy_piece)
    flush_mod._flush_file = on_thread_clock("flush", flush_mod._flush_file)
    trainee = _Trainee.make(TrainConfig())
    for _ in range(2):
        trainee.step()
    d = SCRATCH.enter_context(tempfile.TemporaryDirectory(prefix="bench_scale_"))
    w = DataStatesWriter(d)
    rows = []
    for i in range(saves + 1):  # the first save (the pool's first use) is left out
        msd, osd = get_state_dict(trainee.model, trainee.opt)
        for k in spent:
            spent[k] = 0.0
        p, t = time.process_time(), time.perf_counter()
        resp = dcp_datastates.async_save(
            {"model": msd, "optim": osd, "step": i}, w, checkpoint_id=f"{d}/c{i}", no_dist=True
        )
        resp.upload_completion.result()
        rows.append((time.process_time() - p, time.perf_counter() - t, *spent.values()))
        del resp
        shutil.rmtree(f"{d}/c{i}")
    w.close()
    nbytes = trainee.state_bytes
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    raw = {}
    for name, fn in [("memcpy", lambda: dst.copy_(src)), ("crc32c", lambda: crc32c(src.numpy()))]:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        raw[name] = min(times)
    cols = list(zip(*rows[1:], strict=True))
    med = [sorted(c)[len(c) // 2] for c in cols]
    print(
        f"state {nbytes / 1e9:.2f} GB, {saves} saves, medians: process CPU {med[0]:.3f} s "
        f"(min {min(cols[0]):.3f}), wall {med[1]:.3f} s, copy threads {med[2]:.3f} s, flush "
        f"threads {med[3]:.3f} s | memcpy {raw['memcpy']:.3f} s, crc32c {raw['crc32c']:.3f} s"
    )


def versions(n: int, rounds: int) -> None:
    """Blocked time of our steady saves of ``n`` tensors (0.1 GB) against reading every
    tensor's ``_version`` once, the least a caller that records version counters does, each
    measured right after a save of ours (which evicts what the previous measurement touched);
    the two alternate."""
    import dcp_datastates

    sd = state.build(0.1e9, n)
    tensors = state.tensors_of(sd)
    read = attrgetter("_version")
    d = SCRATCH.enter_context(tempfile.TemporaryDirectory(prefix="bench_scale_"))
    w = DataStatesWriter(f"{d}/ours")

    def save(i: int) -> float:
        t = time.perf_counter()
        resp = dcp_datastates.async_save(sd, w, checkpoint_id=f"{d}/c{i}", no_dist=True)
        blocked = time.perf_counter() - t
        resp.upload_completion.result()
        del resp
        shutil.rmtree(f"{d}/c{i}")
        return blocked

    save(0)  # the first save: the pool, the first layout
    ours, raw = [], []
    for i in range(1, rounds + 1):
        if i % 2:
            ours.append(save(i))
        else:
            save(i)
            t = time.perf_counter()
            list(map(read, tensors))
            raw.append(time.perf_counter() - t)
    w.close()
    for name, times in (("ours blocked", ours), ("read every _version", raw)):
        times.sort()
        print(
            f"tensors {len(tensors)}: {name} median {times[len(times) // 2] * 1e3:.1f} ms "
            f"[{times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f}] over {len(times)}"
        )


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "counts":
        counts(sys.argv[2])
    elif cmd == "first":
        first(float(sys.argv[2]), "--warm" in sys.argv)
    elif cmd == "copy":
        copy(float(sys.argv[2]), sys.argv[3])
    elif cmd == "versions":
        versions(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 14)
    elif cmd == "cpu":
        cpu(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    with SCRATCH:
        main()
