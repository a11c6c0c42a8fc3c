"""Runs ``examples/fsdp2_train.py`` as one rank under ``_dist_workers.launch``.

``python _fsdp2_workers.py run RANK WORLD PORT DIR``: the example's arguments come from the
``FSDP2_ARGS`` environment variable (a JSON list); its report lands in ``DIR/rank{RANK}.json``
(``_dist_workers.run_worker``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import fsdp2_train  # noqa: E402
from _dist_workers import rendezvous_env, run_worker  # noqa: E402


def _scenario(scenario: str, rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    if scenario != "run":
        raise ValueError(f"unknown scenario {scenario!r}")
    rendezvous_env(rank, world, port)  # the example joins its process group itself
    return fsdp2_train.main(json.loads(os.environ["FSDP2_ARGS"]))


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:], _scenario))
