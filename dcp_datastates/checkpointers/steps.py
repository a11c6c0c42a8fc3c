"""The step directories under a ``Checkpointer`` root: their names, which are committed, and
retention.

May import: ``retention``, ``storage`` and the leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil

from ..format import METADATA_NAME
from ..storage.base import LocalStorage
from . import retention

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def path(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def is_committed(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, METADATA_NAME))


def committed_path(root: str, step: int) -> str | None:
    """Where step ``step``'s committed checkpoint is, or None."""
    place = path(root, step)
    return place if is_committed(place) else None


def listing(root: str) -> dict[int, bool]:
    """Steps with a directory under ``root``, and whether it is committed."""
    found: dict[int, bool] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            m = STEP_DIR.match(name)
            if m and os.path.isdir(os.path.join(root, name)):
                step = int(m.group(1))
                found[step] = found.get(step, False) or is_committed(os.path.join(root, name))
    return found


def plain_uncommitted(root: str) -> list[int]:
    """Steps whose ``step_N`` directory exists without ``.metadata``, oldest first."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(
            int(m.group(1))
            for name in os.listdir(root)
            if (m := STEP_DIR.match(name))
            and os.path.isdir(os.path.join(root, name))
            and not is_committed(os.path.join(root, name))
        )
    return []


def purge(root: str, newest: int, keep: int) -> None:
    """Retention after the commit of ``newest`` (rank 0; no save is in flight): delete the
    committed steps up to ``newest`` beyond its ``keep`` newest, and the step directories older
    than ``newest`` whose save never committed (it failed or its process died). Raises the first
    deletion's error once the others are done."""

    def delete(step: int) -> None:
        logger.info("keep_latest_k=%d: deleting checkpoint %s", keep, path(root, step))
        retention.delete_checkpoint(LocalStorage(path(root, step)), missing_ok=False)

    def on_error(step: int, exc: Exception) -> None:
        logger.error("keep_latest_k: could not delete checkpoint %s: %s", path(root, step), exc)
        exc.add_note(
            f"keep_latest_k={keep} could not delete {path(root, step)}; the other old "
            "checkpoints were deleted. Remove it by hand (or fix its permissions)."
        )

    committed = sorted(s for s, ok in listing(root).items() if ok and s <= newest)
    # OSError: the others are still deleted (one stuck step held all)
    done = retention.delete_expired(committed, keep, delete, errors=OSError, on_error=on_error)
    for step in plain_uncommitted(root):
        if step < newest:
            logger.warning(
                "deleting %s: its save never committed (it failed or died)", path(root, step)
            )
            shutil.rmtree(path(root, step), ignore_errors=True)
    if done.failed:
        raise done.failed[0][1]
