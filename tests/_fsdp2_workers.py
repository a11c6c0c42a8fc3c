"""Runs ``examples/fsdp2_train.py`` as one rank under ``_dist_workers.launch``.

``python _fsdp2_workers.py run RANK WORLD PORT DIR``: the example's arguments come from the
``FSDP2_ARGS`` environment variable (a JSON list); its report lands in ``DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import fsdp2_train  # noqa: E402


def main(scenario: str, rank: int, world: int, port: int, workdir: Path) -> None:
    assert scenario == "run", scenario
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    report = fsdp2_train.main(json.loads(os.environ["FSDP2_ARGS"]))
    report["ok"] = True
    (workdir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
