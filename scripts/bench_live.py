"""What flushing straight from the live tensors could save in the training loop (issue 11):
the floor against the live floor (``bench_lib/live_floor.py``), in paired blocks.

    python scripts/bench_live.py 20       # cycles

The train scenario's model (0.33 GB state, AdamW) runs as blocks of 4 steps, each starting with
a checkpoint of one system and ending once it is durable, round-robin over: no checkpoint, ours,
the floor, the live floor with its flusher at the floor's nice value (10) and at nice 0. A
system's overhead is the median over cycles of its block minus the no-checkpoint block of the
same cycle (``bench_priority.py``, whose blocks these are). Printed: each overhead, and the live
floors' median bytes written without a copy. Nothing is asserted.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

from bench_lib.floor import LazyFloor  # noqa: E402
from bench_lib.live_floor import LiveFloor  # noqa: E402
from bench_lib.train import TrainConfig, _Trainee  # noqa: E402
from bench_priority import STEPS_PER_BLOCK, _block  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from dcp_datastates import DataStatesWriter  # noqa: E402


def _floor_block(floor: LazyFloor, trainee: _Trainee, path: Path) -> float:
    t0 = time.perf_counter()
    msd, osd = get_state_dict(trainee.model, trainee.opt)
    path.mkdir(parents=True, exist_ok=True)
    future, hook = floor.save({"model": msd, "optim": osd}, path / "floor.bin", trainee.opt)
    for _ in range(STEPS_PER_BLOCK):
        trainee.step()
    future.result()
    took = time.perf_counter() - t0
    hook.remove()
    shutil.rmtree(path, ignore_errors=True)
    return took


def main(cycles: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_live_"))
    trainee = _Trainee.make(TrainConfig())
    floors: dict[str, LazyFloor] = {
        "floor": LazyFloor(),
        "live floor, flush nice 10": LiveFloor(10),
        "live floor, flush nice 0": LiveFloor(0),
    }
    writer = DataStatesWriter(root / "ours")
    systems = ["none", "ours", *floors]
    blocks: dict[str, list[float]] = {s: [] for s in systems}

    def block(system: str, path: Path) -> float:
        if system in floors:
            return _floor_block(floors[system], trainee, path)
        return _block(system, trainee, writer if system == "ours" else None, path)

    try:
        for f in floors.values():
            f.prepare(get_state_dict(trainee.model, trainee.opt))
        for s in systems:  # warm-up: optimizer state, allocator, the writer's pool
            block(s, root / "warm")
        for c in range(cycles):
            k = c % len(systems)
            for s in systems[k:] + systems[:k]:
                blocks[s].append(block(s, root / f"c{c}"))
    finally:
        writer.close()
        for f in floors.values():
            f.close()
        shutil.rmtree(root, ignore_errors=True)
    base = blocks["none"]
    print(f"{cycles} cycles of {STEPS_PER_BLOCK}-step blocks, load {os.getloadavg()[0]:.1f}")
    print(f"  {'none':28s} block {statistics.median(base):.3f}s")
    for s in systems[1:]:
        over = statistics.median(a - b for a, b in zip(blocks[s], base, strict=True))
        live = ""
        if isinstance(floors.get(s), LiveFloor):
            live = f", {statistics.median(floors[s].live_bytes[1:]) / 1e6:.0f} MB written live"
        print(f"  {s:28s} overhead {over:+.4f}s{live}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit(__doc__)
    main(int(sys.argv[1]))
