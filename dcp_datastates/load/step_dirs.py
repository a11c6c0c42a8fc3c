"""What to open instead, when the path given holds checkpoints rather than being one.

A ``Checkpointer`` root (``step_00000012/``, ``latest``) or a tier of a ``TieredCheckpointer``
(``step-12/``) has no ``.metadata`` of its own: calling it "not committed, the save did not
finish" sent users looking for a crash (a user sweep). The reader and the CLI both name the
step to use, with this one helper; :func:`not_committed` says what a path without a commit
record holds instead.
"""

from __future__ import annotations

import contextlib
import re

from ..errors import CheckpointNotCommittedError
from ..format import DATA_SUFFIX, LATEST_NAME, METADATA_NAME, RANK_METADATA
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


def not_committed(storage: Storage, path: str, name: str) -> CheckpointNotCommittedError:
    """The error for a path without ``name`` (``.metadata``, or a rank's): what is there instead."""
    names = storage.list_names()
    if not names:  # a typo in the path is not a save that did not finish (a user sweep)
        return CheckpointNotCommittedError(
            f"there is no checkpoint at {path}: the directory does not exist or is "
            "empty; check the path"
        )
    if name != METADATA_NAME and METADATA_NAME in names:
        # dcp.load asks for __{rank}.metadata only after reading .metadata failed: saying
        # "not committed" here hid a damaged checkpoint's cause behind a wrong one.
        return CheckpointNotCommittedError(
            f"{path} has no {name}: it was committed with collectives, in "
            f"{METADATA_NAME} (read_metadata() without rank); dcp.load asks for {name} "
            f"only after reading {METADATA_NAME} failed, and that error says why"
        )
    found = [n for n in names if n.endswith(DATA_SUFFIX)]
    if not found and (inside := checkpoints_inside(storage, names, verb="load")):
        return CheckpointNotCommittedError(
            f"{path} is not a checkpoint, but it holds checkpoint directories: {inside}"
        )
    per_rank = sorted(n for n in names if RANK_METADATA.match(n))
    hint = (
        f"; it has per-rank commit records ({', '.join(per_rank[:4])}) of a save with "
        "use_collectives=False, which dcp.load reads by itself (read_metadata(rank=R))"
        if per_rank and name == METADATA_NAME
        else ". The save that wrote it did not finish; load an earlier checkpoint"
    )
    return CheckpointNotCommittedError(
        f"{path} is not a committed checkpoint: it has no {name} "
        f"({len(found)} data file(s) found){hint}"
    )
