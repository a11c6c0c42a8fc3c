"""The benchmark suite's --quick mode runs end to end, so the suite never rots.

``scripts/bench.py all --quick`` runs as a real subprocess in a temporary directory (its save
workers and two gloo ranks are real processes too). The test judges what it printed and wrote:
JSON lines for every scenario and system with positive finite figures, the summary with every
target given a verdict, and a PNG timeline that decodes. Targets themselves are not asserted.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(240)]

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
MiB = 1 << 20

FLOOR = "floor: dcp.async_save, no-op stager"
#: The training blocks' floor (``bench_lib/floor.py``): what the training target judges ours by.
TRAIN_FLOOR = "floor: copy + crc32c + direct write"
#: Timed saves per system at each count point of the scaling scenario (--quick's repeat budget is
#: never reached, so every system saves its full count).
COUNT_SAVES = {
    "stock dcp.save t1": 1,
    "stock async_save default": 3,
    FLOOR: 5,
    "ours async pool 1/1": 5,
    "ours async pool 1/1, first save after warm_up": 1,
}
VERDICTS = {"met", "MISSED", "limited"}
SAVE_SYSTEMS = {
    "stock dcp.save t1",
    "stock dcp.save t2",
    "stock async_save default",
    "stock async_save DefaultStager",
    "ours dcp.save",
    "ours async pool 1/1",
    "ours async pool 1/4",
    "ours async pool 1/16",
}
#: scenario -> (systems that must appear, figures every record of it must carry)
EXPECTED: dict[str, tuple[set[str], set[str]]] = {
    "limits": (
        {"best writer (max of the sweep)", "read warm", "memcpy"},
        {"seconds", "gb_per_s"},
    ),
    "save": (
        SAVE_SYSTEMS | {"raw best writer (max of the sweep)"},
        {"durable_s", "durable_gb_per_s"},
    ),
    "load": (
        {
            "raw read 1 stream",
            "raw read 4 streams",
            "stock FileSystemReader",
            "ours DataStatesReader",
        },
        {"seconds", "gb_per_s"},
    ),
    "train": (
        {"no checkpoint", "stock dcp.save", "stock async_save", "ours async_save"},
        {"total_s", "step_median_s", "step_max_s"},
    ),
    "train_block": (
        {"no checkpoint", "stock async_save", "ours async_save", TRAIN_FLOOR},
        {"block_s"},
    ),
    "forward": (
        {"ours default", "ours eager only", "ours gate only", "ours unprotected"},
        {"blocked_s", "first_forward_s", "plain_forward_s"},
    ),
    "cow_step": (
        {
            "no snapshot",
            "no snapshot, pass-through mode",
            "ours copy_on_write",
            "ours copy_on_write=False",
        },
        {"step_s", "fwd_bwd_s", "opt_s"},
    ),
    "cow_ema": (
        {"ours copy_on_write", "ours copy_on_write=False", "stock dcp.async_save"},
        {"blocked_s", "eval_after_save_s", "plain_eval_s"},
    ),
    "scaling": (
        {
            "stock dcp.save t1",
            "stock async_save default",
            "ours async pool 1/1",
            "ours async pool 1/1, first save after warm_up",
            FLOOR,
        },
        {"blocked_s", "safe_s", "durable_s", "durable_gb_per_s"},
    ),
    "ranks": (
        {"stock dcp.save t1", "stock async_save default", "ours async pool 1/1"},
        {"blocked_s", "safe_s", "durable_s", "durable_gb_per_s"},
    ),
}
TARGETS = [
    "blocked: ours async / stock async_save default",
    "many tensors: ours blocked s at the largest count",
    "many tensors: ours / stock async blocked, worst count point",
    "first save after warm_up: safe / steady safe, worst size point",
    "safe to mutate (host state): ours async / stock DefaultStager staging",
    "durable throughput: ours async / best writer's write+fsync limit",
    "durable throughput, worst round: ours / limit of the same round",
    "durable time: pool 1/4 / full pool",
    "cold load: ours reader / best raw read bandwidth",
    "warm load: ours reader speed / stock reader",
    "warm load, checksums verified: ours reader / best raw warm read",
    "object-heavy load: ours reader speed / stock reader",
    "training overhead: ours / the floor's, same cycles",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out"
    cmd = [sys.executable, str(BENCH), "all", "--quick", "--out", str(out), "--dir", str(tmp / "d")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=200)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"bench.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    records = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return {"out": out, "tmp": tmp, "stdout": proc.stdout, "records": records, "elapsed": elapsed}


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_every_scenario_emits_json_lines_with_positive_finite_figures(
    quick_run: dict[str, Any], scenario: str
) -> None:
    records = [r for r in quick_run["records"] if r["scenario"] == scenario]
    systems, figures = EXPECTED[scenario]
    assert systems <= {r["system"] for r in records}, f"{scenario}: missing systems"
    for r in records:
        assert {"scenario", "system", "figures", "torch", "machine", "run_id", "quick"} <= set(r)
        assert r["quick"] is True and r["torch"] and r["machine"]["cpus"] >= 1
        if r["system"] in systems and not r["system"].startswith("raw"):
            assert figures <= set(r["figures"]), f"{scenario}/{r['system']}: {r['figures']}"
        assert r["figures"] and all(_positive_finite(v) for v in r["figures"].values()), r


def test_each_rounds_disk_limit_is_the_best_of_its_sweep(quick_run: dict[str, Any]) -> None:
    """The save rotation's limit of a round is the fastest configuration of that round's sweep
    (our own write pattern among them where the file system takes O_DIRECT)."""
    sweep = [
        r for r in quick_run["records"] if r["scenario"] == "disk_sweep" and r["context"] == "save"
    ]
    best = [
        r
        for r in quick_run["records"]
        if r["system"] == "raw best writer (max of the sweep)" and r["scenario"] == "save"
    ]
    assert best and len(sweep) >= 3 * len(best)
    for b in best:
        mine = {r["system"]: r["figures"]["gb_per_s"] for r in sweep if r["round"] == b["round"]}
        assert b["config"] == max(mine, key=lambda k: mine[k])
        assert b["figures"]["durable_gb_per_s"] == pytest.approx(mine[b["config"]])
        direct = any(r["direct"] for r in sweep)
        assert any(k.endswith("(ours)") for k in mine) == direct, mine
    assert "### Disk write limit: the sweep" in quick_run["stdout"]


def test_save_times_are_ordered_and_memory_is_reported(quick_run: dict[str, Any]) -> None:
    saves = [r for r in quick_run["records"] if r["scenario"] == "save" and "memory" in r]
    assert {r["system"] for r in saves} == SAVE_SYSTEMS
    for r in saves:
        f = r["figures"]
        assert f["blocked_s"] <= f["safe_s"] + 1e-6 <= f["durable_s"] + 2e-6, r
        assert r["bytes"] > 0 and r["tensors"] > 0
        assert all(math.isfinite(v) for v in r["memory"].values())
        # Linux batches RSS counters per thread (up to 64 pages each), so the kernel's peak can
        # read a little under an RSS sampled earlier from /proc: allow a few MiB of that skew.
        assert r["memory"]["maxrss_bytes"] > r["memory"]["base_rss_bytes"] - 4 * MiB > 0
    # Every steady save of a process is a record of its own; what the process measured once
    # (its first save, its copy limit) rides on the first only.
    ours = [r for r in saves if r["system"] == "ours async pool 1/1"]
    assert ours[0]["saves_per_process"] > 2
    assert [r["save_index"] for r in ours] == list(range(1, ours[0]["saves_per_process"]))
    assert [bool(r.get("first_save")) for r in ours] == [True] + [False] * (len(ours) - 1)
    assert [bool(r.get("copy_limit_s")) for r in ours] == [True] + [False] * (len(ours) - 1)
    # The safe target's limit: the processes of the two systems it compares time a copy of the
    # state (limits.state_copy); no other system's does.
    timed = {r["system"] for r in saves if _positive_finite(r.get("copy_limit_s", -1.0))}
    assert timed == {"ours async pool 1/1", "stock async_save DefaultStager"}


def test_load_covers_both_checkpoints_cold_and_warm(quick_run: dict[str, Any]) -> None:
    loads = [r for r in quick_run["records"] if r["scenario"] == "load"]
    combos = {(r["checkpoint"], r["cache"].split(" ")[0], r["system"]) for r in loads}
    readers = EXPECTED["load"][0]
    expected = {(c, k, s) for c in ("ours", "stock") for k in ("cold", "warm") for s in readers}
    assert expected <= combos


def test_scaling_repeats_saves_at_count_points_and_runs_the_floor_only_there(
    quick_run: dict[str, Any],
) -> None:
    scaling = [r for r in quick_run["records"] if r["scenario"] == "scaling"]
    counts = {r["tensors"] for r in scaling if r["axis"] == "count"}
    assert len(counts) == 2, counts
    for tensors in counts:
        at = [r for r in scaling if r["axis"] == "count" and r["tensors"] == tensors]
        saves = {name: sum(r["system"] == name for r in at) for name in COUNT_SAVES}
        assert saves == COUNT_SAVES, f"{tensors} tensors: {saves}"
        ours = [r for r in at if r["system"] == "ours async pool 1/1"]
        # The untimed first save (the pool's allocation) rides on the first record only.
        assert [bool(r.get("first_save")) for r in ours] == [True] + [False] * (len(ours) - 1)
        assert sorted(r["round"] for r in ours) == list(range(len(ours)))
    sizes = [r for r in scaling if r["axis"] == "size"]
    assert sizes and FLOOR not in {r["system"] for r in sizes}


def test_results_file_holds_the_same_json_lines(quick_run: dict[str, Any]) -> None:
    lines = (quick_run["out"] / "results.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in lines] == quick_run["records"]


def test_summary_table_gives_every_target_a_verdict(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["stdout"]
    summary = stdout[stdout.index("## Summary") :]
    for heading in (
        "### Limits",
        "### Save",
        "### Load",
        "### Training",
        "### Forward",
        "### Copy-on-write: the first training step",
        "### Copy-on-write: EMA evaluation",
        "### Scaling",
        "### First save",
    ):
        assert heading in summary
    assert "### Ranks" in summary and "### Targets" in summary
    targets = summary[summary.index("### Targets") :].split("\n\n")[1]
    rows = {ln.split("|")[1].strip(): ln.split("|") for ln in targets.splitlines()[2:]}
    assert set(rows) == set(TARGETS)
    for target, cells in rows.items():
        result = cells[4].strip()
        assert result in VERDICTS or result.startswith("n/a ("), f"{target}: {result!r}"
    assert (quick_run["out"] / "summary.md").read_text().strip() in stdout


def test_scaling_table_has_the_floor_at_count_points_only(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["stdout"]
    table = stdout[stdout.index("### Scaling") :].split("\n\n")[1].splitlines()
    header = [c.strip() for c in table[0].split("|")]
    floor = header.index(f"{FLOOR}: blocked / durable s")
    for line in table[2:]:
        cells = [c.strip() for c in line.split("|")]
        if cells[1] == "count":
            assert cells[floor].endswith(f"({COUNT_SAVES[FLOOR]} saves)"), line
        else:
            assert cells[floor] == "-", line


def test_train_blocks_pair_every_system_in_every_cycle_with_its_cpu(
    quick_run: dict[str, Any],
) -> None:
    blocks = [r for r in quick_run["records"] if r["scenario"] == "train_block"]
    cycles: dict[int, list[str]] = {}
    for r in blocks:
        cycles.setdefault(r["cycle"], []).append(r["system"])
    systems = EXPECTED["train_block"][0]
    assert len(cycles) >= 2 and all(sorted(c) == sorted(systems) for c in cycles.values())
    # Round-robin: the cycles do not all start with the same system.
    assert len({c[0] for c in cycles.values()}) > 1, cycles
    for r in blocks:
        cpu = r["cpu"]
        assert r["cores"] >= 1 and r["blocked_s"] >= 0
        # Two clocks of one scheduler, subtracted: allow their rounding below zero.
        assert all(math.isfinite(v) and v >= -0.01 for v in cpu.values()), r
        # The process cannot run more CPU than its cores give over the block (and the clocks).
        assert (
            cpu["training_s"] + cpu["checkpoint_s"] <= r["cores"] * r["figures"]["block_s"] + 0.05
        )
        if r["system"] == "no checkpoint":
            assert r["blocked_s"] == 0 and cpu["checkpoint_s"] < 0.05, r
        else:
            assert cpu["checkpoint_s"] > 0, r  # a save's threads ran


def test_training_target_is_judged_against_the_floor_with_its_cpu_bound_beside(
    quick_run: dict[str, Any],
) -> None:
    stdout = quick_run["stdout"]
    table = stdout[stdout.index("### Training") :].split("\n\n")[1].splitlines()
    header = [c.strip() for c in table[0].split("|")]
    bound = header.index("lower bound s")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")] for ln in table[2:]}
    assert rows["ours async_save"][bound] != "-" and rows["no checkpoint"][bound] == "-"
    assert "our lower bound is" in stdout[stdout.index("No-checkpoint block:") :]
    row = next(ln for ln in stdout.splitlines() if ln.startswith("| training overhead:"))
    assert rows[TRAIN_FLOOR][bound] != "-"  # the floor's own row, beside ours
    if "| n/a (baseline within noise" in row:
        # At --quick sizes the floor's median overhead can be <= 0: no ratio, and the row says so.
        return
    assert "| met |" in row or "| MISSED |" in row, row  # judged against the floor: no limit


def test_training_table_gives_each_overhead_against_the_floor(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["stdout"]
    table = stdout[stdout.index("### Training") :].split("\n\n")[1].splitlines()
    header = [c.strip() for c in table[0].split("|")]
    column = header.index("overhead / floor")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")] for ln in table[2:]}
    assert rows["no checkpoint"][column] == "-"
    if rows[TRAIN_FLOOR][column] == "-":  # the floor's median overhead is <= 0 at --quick sizes
        assert rows["ours async_save"][column] == "-"
        return
    assert rows["ours async_save"][column].endswith("x")
    assert rows[TRAIN_FLOOR][column] == "1.00x"
    assert "Ours / the floor's overhead:" in stdout[stdout.index("No-checkpoint block:") :]


def test_copy_on_write_pairs_every_step_system_in_each_cycle_and_checks_every_save(
    quick_run: dict[str, Any],
) -> None:
    steps = [r for r in quick_run["records"] if r["scenario"] == "cow_step"]
    cycles: dict[int, list[str]] = {}
    for r in steps:
        cycles.setdefault(r["cycle"], []).append(r["system"])
        assert r["ops"] > 0
        if r["system"].startswith("ours"):
            assert r["blocked_s"] > 0 and r["cow_bytes"] >= 0, r
    systems = EXPECTED["cow_step"][0]
    assert len(cycles) >= 2 and all(sorted(c) == sorted(systems) for c in cycles.values())
    assert len({c[0] for c in cycles.values()}) > 1, cycles  # the order rotates
    saves = [r for r in quick_run["records"] if r["scenario"] == "cow_ema"]
    for system in EXPECTED["cow_ema"][0]:
        done = [r for r in saves if r["system"] == system]
        assert [r["save"] for r in done] == list(range(len(done))) and len(done) >= 2
        if system != "ours copy_on_write=False":  # without the mode a save may fail or tear
            assert all(r["committed"] and r["correct"] for r in done), done
    stdout = quick_run["stdout"]
    assert "aten operators" in stdout[stdout.index("### Copy-on-write: the first") :]


def test_timeline_png_is_a_valid_png(quick_run: dict[str, Any]) -> None:
    png = quick_run["out"] / "timeline.png"
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert kind == b"IHDR" and length == 13 and width > 100 and height > 100
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (height, width)


def test_quick_mode_takes_seconds_and_cleans_its_scratch_directory(
    quick_run: dict[str, Any],
) -> None:
    # Generous: the point of --quick is seconds, but CI machines are shared.
    assert quick_run["elapsed"] < 120, f"--quick took {quick_run['elapsed']:.0f} s"
    scratch = quick_run["tmp"] / "d"
    assert not any(p.is_file() for p in scratch.rglob("*")), "scratch files left behind"


def test_a_run_the_scratch_disk_cannot_hold_is_refused_before_it_starts(tmp_path: Path) -> None:
    """A save scenario of 100,000 GB on the test's disk: refused at once, naming the size, the
    directory and what to do, with nothing written (no results file, no scratch files)."""
    out, scratch = tmp_path / "out", tmp_path / "d"
    cmd = [sys.executable, str(BENCH), "save", "--gb", "100000", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--dir", str(scratch)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert f"save need about 200000.0 GB free on {scratch}'s file system" in proc.stderr
    assert "pass --dir on another disk" in proc.stderr
    assert not (out / "results.jsonl").exists()
    assert not any(p.is_file() for p in scratch.rglob("*"))
