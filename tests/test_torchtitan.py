"""TorchTitan 0.3.0 with DataStatesCheckpointManager, on CPU gloo ranks (skipped without it).

Install: ``pip install torchtitan==0.3.0 triton torch==2.13.0`` (the CPU adaptations TorchTitan
needs live in ``_torchtitan_harness.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="pip install torchtitan==0.3.0 triton torch==2.13.0")
pytest.importorskip("triton", reason="TorchTitan imports triton unconditionally")

from _dist_workers import check_all_ok, launch  # noqa: E402
from _torchtitan_harness import make_assets  # noqa: E402

HARNESS = str(Path(__file__).with_name("_torchtitan_harness.py"))

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

BASE = [
    "--module", "_torchtitan_configs", "--config", "llama3_debug_datastates",
    "--training.local-batch-size", "2", "--training.seq-len", "64",
    "--checkpoint.folder", "ckpt", "--debug.seed", "0",
]  # fmt: skip
TWO_RANKS = ["--parallelism.spmd-backend", "partial_dtensor"]


@pytest.fixture
def tt(tmp_path: Path, monkeypatch: Any) -> Any:
    make_assets(tmp_path / "assets")

    def run(name: str, *args: str, world: int = 2, stop_after: int = 0) -> list[dict[str, Any]]:
        dump = tmp_path / "dump"
        cli = [*BASE, *(TWO_RANKS if world > 1 else []), "--dump-folder", str(dump), *args]
        monkeypatch.setenv("TT_ARGS", json.dumps(cli))
        monkeypatch.setenv("TT_STOP_AFTER", str(stop_after))
        results = launch("run", tmp_path / name, world_size=world, script=HARNESS, timeout=300)
        check_all_ok(results)
        return [r.report for r in results]

    run.ckpt = tmp_path / "dump" / "ckpt"
    return run


def _committed(ckpt: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / ".metadata").exists()
    )


def test_two_rank_restart_matches_uninterrupted_losses(tt: Any, tmp_path: Path) -> None:
    steps = ["--training.steps", "6", "--checkpoint.interval", "3"]
    # Interrupted after step 4: step 3 was saved asynchronously (our lazy snapshot) and committed.
    first = tt("first", *steps, stop_after=4)
    assert [r["manager"] for r in first] == ["DataStatesCheckpointManager"] * 2
    assert _committed(tt.ckpt) == [3]
    # Restarted with the same arguments: resumes from step 3 and runs to 6.
    second = tt("second", *steps)
    assert sorted(second[0]["losses"]) == ["4", "5", "6"]
    # An uninterrupted run in a fresh folder gives the same losses, bit for bit.
    (tmp_path / "dump").rename(tmp_path / "dump_restarted")
    full = tt("full", *steps)
    for k in ("1", "2", "3", "4"):
        assert first[0]["losses"][k] == full[0]["losses"][k]
    for k in ("4", "5", "6"):
        assert second[0]["losses"][k] == full[0]["losses"][k]
    assert [r["digest"] for r in second] == [r["digest"] for r in full]


def test_pinned_mode_retention_load_step_exclude_sync_and_hf(tt: Any) -> None:
    # async_with_pinned_mem: our writer is the stager (no DefaultStager, no daemon process).
    first = tt(
        "pinned",
        *("--training.steps", "4", "--checkpoint.interval", "1"),
        *("--checkpoint.async-mode", "async_with_pinned_mem", "--checkpoint.keep-latest-k", "2"),
        "--checkpoint.no-last-save-model-only",
        world=1,
    )
    assert first[0]["stager"] == "DataStatesWriter"
    assert _committed(tt.ckpt) == [3, 4]  # keep_latest_k counted committed checkpoints only
    assert not (tt.ckpt / "step-1").exists() and not (tt.ckpt / "step-2").exists()

    # Sync mode, load_step=3 (not the newest), the dataloader excluded from loading; step 5
    # saved synchronously through our writer, the last step (6) in HF safetensors.
    second = tt(
        "sync",
        *("--training.steps", "6", "--checkpoint.interval", "5"),
        *("--checkpoint.async-mode", "disabled", "--checkpoint.keep-latest-k", "2"),
        *("--checkpoint.load-step", "3", "--checkpoint.exclude-from-loading", "dataloader"),
        *("--checkpoint.last-save-model-only", "--checkpoint.last-save-in-hf"),
        world=1,
    )
    assert sorted(second[0]["losses"]) == ["4", "5", "6"]  # resumed after step 3
    # With the dataloader excluded, step 4 reads the first batch again: another loss.
    assert second[0]["losses"]["4"] != first[0]["losses"]["4"]
    assert (tt.ckpt / "step-5" / ".datastates.json").exists()  # our writer's manifest
    assert list((tt.ckpt / "step-6").glob("*.safetensors"))  # TorchTitan's HF writer
    kept = sorted(p.name for p in tt.ckpt.glob("step-*"))
    assert kept == ["step-5", "step-6"], kept
