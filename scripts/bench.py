"""Benchmarks against stock DCP in one run: JSON lines, a summary of ratios, a timeline picture.

    python scripts/bench.py all                   # every scenario, default sizes (<= 10 minutes)
    python scripts/bench.py all --quick           # tiny sizes, seconds: checks the suite works
    python scripts/bench.py save --gb 1 --tensors 500 --rounds 3
    python scripts/bench.py limits load --dir /mnt/nvme/bench

Scenarios: limits (disk, memory), save, load, train (with the timeline PNG), forward (a BatchNorm
loop with an EMA hook: what protecting forward-updated buffers costs), cow (what copy-on-write
costs a training step, and an EMA evaluation right after a save), scaling, ranks (two gloo
ranks); only when named: objstore (moto S3 on loopback), restart (resume from memory, disk, S3),
replication (peer replication's step cost), simulate (planning of jobs up to 4,096 ranks),
compress (ZStandard: bytes saved and durable time), coopload (four ranks loading one replicated
state). Every measurement is printed as one JSON line on stdout (and appended to
OUT/results.jsonl); the summary tables, with ratios against the stock baselines and the targets
met, MISSED or limited, come last (and go to OUT/summary.md). Progress goes to stderr.
See docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_lib import (
    compress,
    coop,
    cow,
    forward,
    limits,
    load,
    lora,
    objstore,
    ranks,
    replication,
    report,
    restart,
    save,
    scaling,
    sim_plot,
    simulate,
    systems,
    timeline,
    train,
)
from bench_lib.common import GB, Recorder, log

SCENARIOS = ["limits", "save", "load", "train", "forward", "cow", "scaling", "ranks"]
#: Run only when named (not in "all"): objstore and restart need the s3 extra and moto, compress
#: zstandard; replication, the training-step cost of peer replication, wants spare cores to mean
#: anything; simulate plans simulated jobs of up to 4,096 ranks (minutes, GBs of memory);
#: coopload (four gloo ranks loading one replicated state) holds the state four times; lora
#: saves a 1 GB frozen base five times per system.
EXTRA_SCENARIOS = [
    "objstore",
    "restart",
    "replication",
    "simulate",
    "compress",
    "coopload",
    "lora",
]

#: Defaults of the full run and of --quick; an option given on the command line wins over both.
FULL: dict[str, Any] = {
    "gb": 3.0,
    "tensors": 120,
    "limit_gb": 1.0,
    "load_gb": 2.0,
    "load_objects": 6000,
    "saves": 4,
    "limits_rounds": 2,
    "rounds": 2,
    "isolate": True,
    "drop_caches": "yes",
    "train_width": 512,
    "train_layers": 6,
    "train_vocab": 8192,
    "train_seq": 32,
    "train_steps": 12,
    "train_every": 4,
    "train_rounds": 1,
    "train_cycles": 20,
    "forward_width": 1024,
    "forward_blocks": 8,
    "forward_batch": 64,
    "forward_saves": 5,
    "cow_width": 512,
    "cow_layers": 6,
    "cow_cycles": 20,
    "cow_saves": 4,
    "scale_sizes": "0.5,1,2,4",
    "scale_counts": "100,1000,5000,20000",
    "scale_count_gb": 0.1,
    "scale_repeat_s": 4.0,
    "ranks_gb": 1.0,
    "coop_gb": 1.0,
    "s3_gb": 0.5,
    "restart_gb": 2.0,
    "lora_gb": 1.0,
    "ranks_worlds": "2,4",
    "replication_gb": 0.4,
    "compress_params": 50_000_000,  # 0.7 GB: 14 bytes a parameter
}
QUICK: dict[str, Any] = {
    **FULL,
    "gb": 0.02,
    "tensors": 30,
    "limit_gb": 0.02,
    "load_gb": 0.02,
    "load_objects": 200,
    "limits_rounds": 1,
    "rounds": 1,
    "isolate": False,
    "drop_caches": "no",
    "train_width": 64,
    "train_layers": 1,
    "train_vocab": 256,
    "train_seq": 8,
    "train_steps": 5,
    "train_every": 2,
    "train_rounds": 1,
    "train_cycles": 2,
    "forward_width": 64,
    "forward_blocks": 2,
    "forward_batch": 16,
    "forward_saves": 2,
    "cow_width": 64,
    "cow_layers": 1,
    "cow_cycles": 2,
    "cow_saves": 2,
    "scale_sizes": "0.004,0.008",
    "scale_counts": "10,100",
    "scale_count_gb": 0.004,
    # Never reached at these sizes: every system saves its full count (the test counts them).
    "scale_repeat_s": 60.0,
    "ranks_gb": 0.01,
    "coop_gb": 0.01,
    "s3_gb": 0.02,
    "restart_gb": 0.02,
    "lora_gb": 0.02,
    "ranks_worlds": "2",
    "replication_gb": 0.02,
    "compress_params": 1_000_000,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "scenarios",
        nargs="+",
        choices=[*SCENARIOS, *EXTRA_SCENARIOS, "all"],
        metavar="SCENARIO",
        help=f"one or more of: {', '.join(SCENARIOS + EXTRA_SCENARIOS)}, all",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: runs in seconds")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp/dcp_datastates_bench"),
        help="scratch directory on the disk under test (removed afterwards)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="results.jsonl, summary.md and timeline.png go here",
    )
    p.add_argument("--png", type=Path, help="timeline picture path (default OUT/timeline.png)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    g = p.add_argument_group("sizes and repeats (defaults: see FULL / QUICK in this file)")
    g.add_argument("--gb", type=float, help="state size of the save scenario, GB")
    g.add_argument("--tensors", type=int, help="tensors in the save/load state")
    g.add_argument("--rounds", type=int, help="rounds of save, load and ranks")
    g.add_argument("--limits-rounds", type=int)
    g.add_argument("--train-rounds", type=int, help="full training runs per system (the picture)")
    g.add_argument("--limit-gb", type=float, help="bytes per limits measurement, GB")
    g.add_argument("--load-gb", type=float, help="state size of the load scenario, GB")
    g.add_argument(
        "--load-objects", type=int, help="small objects of the load scenario's object state"
    )
    g.add_argument(
        "--saves", type=int, help="saves per save-worker process (all but the first reported)"
    )
    g.add_argument(
        "--systems", help=f"save systems, comma-separated: {','.join(systems.SAVE_SYSTEMS)}"
    )
    g.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        help="one process per save system and round (default; --quick: one per round)",
    )
    g.add_argument(
        "--drop-caches",
        choices=["yes", "no"],
        help="drop the page cache before cold reads (needs root)",
    )
    for name in ("width", "layers", "vocab", "seq", "steps", "every", "cycles"):
        g.add_argument(f"--train-{name}", type=int)
    for name in ("width", "blocks", "batch", "saves"):
        g.add_argument(f"--forward-{name}", type=int)
    for name in ("width", "layers", "cycles", "saves"):
        # The model is the train scenario's: --train-vocab and --train-seq size it too.
        g.add_argument(f"--cow-{name}", type=int)
    g.add_argument("--scale-sizes", help="GB, comma-separated")
    g.add_argument("--scale-counts", help="tensor counts, comma-separated")
    g.add_argument("--scale-count-gb", type=float, help="state size of the tensor-count sweep")
    g.add_argument(
        "--scale-repeat-s",
        type=float,
        help="tensor-count sweep: a system saves no more at a point once its saves there took "
        "this many seconds (it always saves once)",
    )
    g.add_argument("--s3-gb", type=float, help="state size of the objstore scenario, GB")
    g.add_argument("--restart-gb", type=float, help="state size of the restart scenario, GB")
    g.add_argument("--compress-params", type=int, help="parameters of the compress scenario")
    g.add_argument("--lora-gb", type=float, help="frozen base of the lora scenario, GB")
    g.add_argument("--ranks-gb", type=float, help="state size of the ranks save, all ranks")
    g.add_argument("--ranks-worlds", help="comma-separated rank counts of the ranks scenario")
    g.add_argument("--replication-gb", type=float, help="state replicated, all ranks, GB")
    g.add_argument("--coop-gb", type=float, help="replicated state size of the coopload loads")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.systems = args.systems.split(",") if args.systems else list(systems.SAVE_SYSTEMS)
    for key in args.systems:
        if key not in systems.SAVE_SYSTEMS:
            raise SystemExit(
                f"unknown save system {key!r}; known: {', '.join(systems.SAVE_SYSTEMS)}"
            )
    return args


def _scratch_bytes(args: argparse.Namespace, wanted: list[str]) -> int:
    """About the most the scenarios in ``wanted`` hold on the scratch disk at once, doubled: a
    checkpoint being written beside the one before it is removed, or the raw limit's files."""
    sizes = {
        "limits": args.limit_gb,
        "save": args.gb,
        "load": 2 * args.load_gb,
        "scaling": max(float(x) for x in args.scale_sizes.split(",")),
        "ranks": args.ranks_gb,
        "objstore": args.s3_gb,
        "restart": args.restart_gb,
        "compress": args.compress_params * 14 / GB,
        "coopload": args.coop_gb,
        "lora": 6 * args.lora_gb,
    }
    return int(2 * max((sizes.get(s, 0.0) for s in wanted), default=0.0) * GB)


def _check_disk(args: argparse.Namespace, wanted: list[str]) -> None:
    """Refuse to start where the scratch disk cannot hold what the run writes: a full disk at
    minute eight fails the run then, and every other job on the disk with it."""
    need = _scratch_bytes(args, wanted)
    free = shutil.disk_usage(args.dir).free
    if free < need:
        raise SystemExit(
            f"bench.py: {', '.join(wanted)} need about {need / GB:.1f} GB free on {args.dir}'s "
            f"file system, which has {free / GB:.1f} GB: free some space, pass --dir on "
            "another disk, or lower the sizes (--gb, --load-gb, --scale-sizes, --limit-gb)"
        )


def _run(args: argparse.Namespace) -> int:
    args = _resolve(args)
    wanted = SCENARIOS if "all" in args.scenarios else [s for s in SCENARIOS if s in args.scenarios]
    wanted += [s for s in EXTRA_SCENARIOS if s in args.scenarios]
    args.dir.mkdir(parents=True, exist_ok=True)
    _check_disk(args, wanted)
    rec = Recorder(args.out / "results.jsonl", quick=args.quick, target_dir=args.dir)
    cold = args.drop_caches == "yes"
    elapsed: dict[str, float] = {}
    runs: dict[str, train.Run] = {}
    started = time.monotonic()
    try:
        for scenario in wanted:
            t0 = time.monotonic()
            if scenario == "limits":
                limits.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.limit_gb * GB),
                    rounds=args.limits_rounds,
                    cold=cold,
                )
            elif scenario == "save":
                save.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                    saves=args.saves,
                    isolate=args.isolate,
                    keys=args.systems,
                )
            elif scenario == "load":
                load.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.load_gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                    cold=cold,
                    objects=args.load_objects,
                )
            elif scenario == "train":
                cfg = train.TrainConfig(
                    width=args.train_width,
                    layers=args.train_layers,
                    vocab=args.train_vocab,
                    seq=args.train_seq,
                    steps=args.train_steps,
                    every=args.train_every,
                    cycles=args.train_cycles,
                )
                runs = train.run(rec, workdir=args.dir, cfg=cfg, rounds=args.train_rounds)
            elif scenario == "forward":
                forward.run(
                    rec,
                    workdir=args.dir,
                    width=args.forward_width,
                    blocks=args.forward_blocks,
                    batch=args.forward_batch,
                    saves=args.forward_saves,
                )
            elif scenario == "cow":
                cfg = train.TrainConfig(
                    width=args.cow_width,
                    layers=args.cow_layers,
                    vocab=args.train_vocab,
                    seq=args.train_seq,
                )
                cow.run(
                    rec, workdir=args.dir, cfg=cfg, cycles=args.cow_cycles, saves=args.cow_saves
                )
            elif scenario == "scaling":
                scaling.run(
                    rec,
                    workdir=args.dir,
                    sizes=[float(x) * GB for x in args.scale_sizes.split(",")],
                    size_tensors=args.tensors,
                    counts=[int(x) for x in args.scale_counts.split(",")],
                    count_bytes=args.scale_count_gb * GB,
                    repeat_s=args.scale_repeat_s,
                )
            elif scenario == "ranks":
                ranks.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.ranks_gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                    timeout=120 if args.quick else 600,
                    worlds=tuple(int(x) for x in args.ranks_worlds.split(",")),
                )
            elif scenario == "replication":
                replication.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.replication_gb * GB),
                    world=2,
                    rounds=args.rounds + 1,
                    steps=args.train_steps,
                    width=args.train_width,
                    timeout=120 if args.quick else 600,
                )
            elif scenario == "objstore":
                objstore.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.s3_gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                )
            elif scenario == "restart":
                restart.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.restart_gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                    cold=args.drop_caches == "yes",
                )
            elif scenario == "simulate":
                simulate.run(rec, workdir=args.dir, quick=args.quick, png=args.out / "simulate.png")
            elif scenario == "compress":
                compress.run(rec, workdir=args.dir, params=args.compress_params, rounds=args.rounds)
            elif scenario == "coopload":
                coop.run(
                    rec,
                    workdir=args.dir,
                    nbytes=int(args.coop_gb * GB),
                    tensors=args.tensors,
                    rounds=args.rounds,
                    timeout=120 if args.quick else 600,
                    cold=cold,
                )
            elif scenario == "lora":
                lora.run(rec, workdir=args.dir, nbytes=int(args.lora_gb * GB))
            elapsed[scenario] = time.monotonic() - t0
            log(f"{scenario}: {elapsed[scenario]:.1f} s")
    finally:
        if not args.keep:
            for sub in SCENARIOS + EXTRA_SCENARIOS:
                shutil.rmtree(args.dir / sub, ignore_errors=True)
    if runs:
        png = timeline.plot(runs, args.png or args.out / "timeline.png")
        rec.note(f"timeline picture: {png}")
    text = report.summary(rec)
    text += objstore.table(rec) + restart.table(rec)
    text += replication.table(rec)
    text += sim_plot.table(rec)
    text += compress.table(rec)
    text += coop.table(rec)
    text += lora.table(rec)
    text += "\nScenario wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in elapsed.items())
    text += f"; total {time.monotonic() - started:.0f} s.\n"
    (args.out / "summary.md").write_text(text)
    print("\n" + text, flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_save-worker":  # internal: one process of the save scenario
        p = argparse.ArgumentParser(prog="bench.py _save-worker")
        p.add_argument("--systems", required=True)
        p.add_argument("--bytes", type=int, required=True)
        p.add_argument("--tensors", type=int, required=True)
        p.add_argument("--saves", type=int, required=True)
        p.add_argument("--dir", type=Path, required=True)
        a = p.parse_args(argv[1:])
        save.worker(a.systems.split(","), a.bytes, a.tensors, a.saves, a.dir)
        return 0
    if argv and argv[0] in ("_rank-worker", "_replication-worker"):  # internal: one rank
        rank, world, port, workdir, args = argv[1:6]
        run = ranks.worker if argv[0] == "_rank-worker" else replication.worker
        run(int(rank), int(world), int(port), Path(workdir), json.loads(args))
        return 1  # not reached: the worker leaves through os._exit
    if argv and argv[0] == "_coop-worker":  # internal: one rank of the coopload scenario
        rank, world, port, workdir, args = argv[1:6]
        coop.worker(int(rank), int(world), int(port), Path(workdir), json.loads(args))
        return 1  # not reached: the worker leaves through os._exit
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
