"""``scripts/bench.py objstore --quick`` runs end to end against a moto server on loopback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(240)]

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def test_objstore_scenario_compares_stock_and_ours_and_times_the_tiered_save(
    tmp_path: Path,
) -> None:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    cmd = [sys.executable, str(BENCH), "objstore", "--quick", "--out", str(tmp_path / "out")]
    cmd += ["--dir", str(tmp_path / "d")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    records = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    by_system = {r["system"]: r["figures"] for r in records if r["scenario"] == "objstore"}
    assert set(by_system) == {
        "stock FsspecWriter",
        "ours DataStatesWriter",
        "stock FsspecReader",
        "ours DataStatesReader",
        "ours async_save to s3",
        "ours tiered local+s3",
    }
    for figures in by_system.values():
        assert figures and all(math.isfinite(v) and v > 0 for v in figures.values())
    tiered = by_system["ours tiered local+s3"]
    assert tiered["blocked_s"] <= tiered["local_durable_s"] <= tiered["remote_committed_s"]
    assert "### Object store" in proc.stdout
    # The settings the save times depend on ride on each save record and under the table.
    saves = {r["system"]: r for r in records if "settings" in r}
    assert set(saves) == {"stock FsspecWriter", "ours DataStatesWriter"}
    ours = saves["ours DataStatesWriter"]["settings"]
    stock = saves["stock FsspecWriter"]["settings"]
    assert ours["part_bytes"] == 16 << 20 and ours["parts_in_flight"] == 2
    assert stock["objects"] == 1 and 1 <= ours["objects"] <= ours["at_once"] == 4
    assert "- ours DataStatesWriter: " in proc.stdout and "MiB parts" in proc.stdout
    assert not any(p.is_file() for p in (tmp_path / "d").rglob("*")), "scratch files left"
