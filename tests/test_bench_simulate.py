"""``scripts/bench.py simulate --quick`` runs end to end: the real save and load planning of
simulated jobs, stock's and ours, a table row per point and a picture that decodes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120)]

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
FIGURES = {"plan_s", "commit_s", "repeat_plan_s", "metadata_mb", "load_plan_s", "objects"}


def test_simulate_quick_plans_every_point_for_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "simulate",
            "--quick",
            "--out",
            str(out),
            "--dir",
            str(tmp_path / "scratch"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    points = {(r["model"], r["world"]) for r in records}
    assert len(points) == 3  # fsdp, hsdp, fsdp+tp
    for point in points:
        systems = {r["system"]: r["figures"] for r in records if (r["model"], r["world"]) == point}
        assert set(systems) == {"stock", "ours"}
        for figures in systems.values():
            assert set(figures) >= FIGURES
            assert all(math.isfinite(v) and v >= 0 for v in figures.values())
        ours = systems["ours"]
        assert ours["manifest_mb"] > 0
        # served from the writer's plan cache: a fraction of the first save's planning
        assert ours["repeat_plan_s"] < ours["plan_s"], point
    summary = (out / "summary.md").read_text()
    assert "### Simulated scale" in summary
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
