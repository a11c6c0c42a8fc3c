"""What to open instead, when the path given holds checkpoints rather than being one.

A ``Checkpointer`` root (``step_00000012/``, ``latest``) or a tier of a ``TieredCheckpointer``
(``step-12/``) has no ``.metadata`` of its own: calling it "not committed, the save did not
finish" sent users looking for a crash (a user sweep). The reader and the CLI both name the
step to use, with this one helper.
"""

from __future__ import annotations

import contextlib
import re

from ..format import LATEST_NAME, METADATA_NAME
from ..storage.base import Storage

#: Step directories of a ``Checkpointer`` root (``step_00000012``) or of a tier (``step-12``).
STEP_DIR = re.compile(r"^step[_-](\d+)$")


def checkpoints_inside(storage: Storage, names: list[str], *, verb: str) -> str:
    """What ``names`` (the listing of ``storage``) hold, and what to ``verb`` instead (``"load"``,
    ``"run this on"``), for a directory of step directories; "" for any other directory."""
    steps = sorted((int(m.group(1)), n) for n in names if (m := STEP_DIR.match(n)))
    if not steps:
        return ""
    if LATEST_NAME in names:
        with contextlib.suppress(OSError, ValueError), storage.open_read(LATEST_NAME) as f:
            step = int(f.read().decode().strip())
            named = next((n for s, n in steps if s == step), None)
            if named is not None:
                return (
                    f"{len(steps)} step directories of a Checkpointer, and latest names step "
                    f"{step}: {verb} {storage.describe(named)}"
                )
    # No `latest` (a tier), or one naming no directory here: the newest committed one.
    committed = [n for _, n in steps if storage.exists(f"{n}/{METADATA_NAME}")]
    if committed:
        return (
            f"{len(steps)} step directories, the newest committed "
            f"{storage.describe(committed[-1])}: {verb} that"
        )
    return f"{len(steps)} step directories, none committed"
