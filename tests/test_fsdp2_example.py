"""The FSDP2 example on real gloo ranks: async saves with our writer, bit-exact resume, and
checkpoints that load on another number of ranks (2 -> 1 and 1 -> 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _dist_workers import check_all_ok, launch

WORKER = str(Path(__file__).with_name("_fsdp2_workers.py"))

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _run(
    tmp_path: Path, name: str, world: int, monkeypatch: Any, *args: str
) -> tuple[dict[str, Any], str]:
    """Rank 0's report and what rank 0 printed."""
    monkeypatch.setenv("FSDP2_ARGS", json.dumps(list(args)))
    results = launch("run", tmp_path / name, world_size=world, script=WORKER, timeout=180)
    check_all_ok(results)
    reports = [r.report for r in results]
    # Every rank saw the same global losses and the same whole (unsharded) state.
    assert all(r["losses"] == reports[0]["losses"] for r in reports)
    assert all(r["final"] == reports[0]["final"] for r in reports)
    # Only rank 0 prints.
    assert all("loss" not in r.output and "resumed" not in r.output for r in results[1:])
    return reports[0], results[0].output


def _printed_losses(output: str) -> dict[str, str]:
    """``step N  loss X`` lines: step -> loss as printed."""
    return dict(re.findall(r"^step (\d+)  loss (\S+)$", output, flags=re.MULTILINE))


def test_fsdp2_resume_is_bit_exact_and_reshards(tmp_path: Path, monkeypatch: Any) -> None:
    ckpt = tmp_path / "ckpt"
    # Uninterrupted two-rank run; checkpoints at steps 4 and 8 are saved while it trains.
    full, full_out = _run(
        tmp_path,
        "full",
        2,
        monkeypatch,
        "--ckpt-dir",
        str(ckpt),
        "--steps",
        "8",
        "--save-every",
        "4",
    )
    assert sorted(full["saved"]) == ["4", "8"]
    assert (ckpt / "step_000004" / ".metadata").exists()
    # The run shows itself: a loss every --log-every steps (5) and at the last step, each
    # checkpoint it starts, and the one it ended with.
    printed = _printed_losses(full_out)
    assert printed == {s: f"{full['losses'][s]:.6f}" for s in ("5", "8")}, full_out
    assert f"step 4  saving checkpoint {ckpt / 'step_000004'} in the background" in full_out
    assert f"done at step 8; checkpoint {ckpt / 'step_000008'} committed" in full_out
    assert "resumed" not in full_out

    # Restarted from step 4 on two ranks: the same losses and state, bit for bit.
    resumed, resumed_out = _run(
        tmp_path,
        "resumed",
        2,
        monkeypatch,
        "--ckpt-dir",
        str(tmp_path / "r"),
        "--steps",
        "8",
        "--save-every",
        "4",
        "--resume-from",
        str(ckpt / "step_000004"),
    )
    assert resumed["resumed"]["step"] == 4
    assert f"resumed from step 4 ({ckpt / 'step_000004'}) on 2 rank(s)" in resumed_out
    assert _printed_losses(resumed_out) == {"5": f"{full['losses']['5']:.6f}", "8": printed["8"]}
    assert resumed["resumed"]["digest"] == full["saved"]["4"]
    assert {k: full["losses"][k] for k in ("5", "6", "7", "8")} == resumed["losses"]
    assert resumed["final"] == full["final"]

    # 2 -> 1: the two-rank checkpoint loads on one rank, whole state equal; it trains on and
    # saves step 10 from one rank.
    one, one_out = _run(
        tmp_path,
        "one",
        1,
        monkeypatch,
        "--ckpt-dir",
        str(tmp_path / "one_ckpt"),
        "--steps",
        "10",
        "--save-every",
        "5",
        "--resume-from",
        str(ckpt / "step_000008"),
    )
    assert one["resumed"]["digest"] == full["saved"]["8"]
    assert "resumed from step 8" in one_out and "on 1 rank(s)" in one_out
    assert sorted(one["saved"]) == ["10"]

    # 1 -> 2: the one-rank checkpoint loads on two ranks, whole state equal.
    two, two_out = _run(
        tmp_path,
        "two",
        2,
        monkeypatch,
        "--ckpt-dir",
        str(tmp_path / "two_ckpt"),
        "--steps",
        "10",
        "--resume",
        "--resume-from",
        str(tmp_path / "one_ckpt" / "step_000010"),
    )
    assert two["resumed"]["step"] == 10
    assert two["resumed"]["digest"] == one["saved"]["10"] == one["final"]
    assert two["losses"] == {} and two["final"] == one["final"]
    assert "resumed from step 10" in two_out and "done at step 10\n" in two_out, two_out
