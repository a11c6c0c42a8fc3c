"""``dcp-datastates memory list|clean``: this user's memory-tier segments (``/dev/shm`` by
default), what they hold, whether a process still uses them, and removing those of dead jobs.

A segment is a job's checkpoints in host memory (``checkpointers/memory.py``). One whose
processes are all gone may still be what a restart of that job resumes from: ``clean`` removes
only those, and only this user's; ``--job`` removes one job's segment even while it runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .checkpointers.memory import remove_segment, segments


def add_parser(sub: Any) -> None:
    help_text = "list or clean this user's memory-tier segments (checkpoints in host memory)"
    cmd = sub.add_parser("memory", help=help_text, description=help_text)
    cmd.add_argument("action", choices=("list", "clean"))
    cmd.add_argument("--base", default="/dev/shm", help="where the segments are (/dev/shm)")
    cmd.add_argument("--json", action="store_true", help="list: print JSON")
    cmd.add_argument("--job", default=None, help="clean: this job's segment, alive or not")


def run(args: argparse.Namespace) -> int:
    found = segments(args.base)
    if args.action == "list":
        if args.json:
            print(json.dumps(found, indent=1))
            return 0
        for s in found:
            state = f"alive (pids {s['live_pids']})" if s["live_pids"] else "dead"
            held = ", ".join(f"node {n}: step(s) {st}" for n, st in s["steps"].items())
            problem = f"  UNUSABLE: {s['problem']}" if s["problem"] else ""
            print(
                f"{s['path']}  job {s['job']}  {s['bytes'] / 1e6:.1f} MB  {state}  "
                f"{held or 'no steps'}  durable root {s['durable_root']}{problem}"
            )
        if not found:
            print(f"no segments of this user under {args.base}")
        return 0
    chosen = [s for s in found if (s["job"] == args.job if args.job else not s["live_pids"])]
    failed = 0
    for s in chosen:
        try:
            remove_segment(s["path"])
        except OSError as exc:  # another user's, named like ours: the others are still removed
            failed += 1
            print(f"could not remove {s['path']}: {exc}")
            continue
        print(f"removed {s['path']} ({s['bytes'] / 1e6:.1f} MB, job {s['job']})")
    kept = len(found) - len(chosen)
    if kept:
        print(f"kept {kept} segment(s) of running jobs (--job JOB removes one anyway)")
    return 1 if failed else 0
