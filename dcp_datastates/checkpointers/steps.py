"""The step directories under a ``Checkpointer`` root: their names, which are committed, and
replacing a committed one.

A step saved again while committed (a run resumed by other means saves the step ``latest``
names) is written beside it, to ``step_N.replacing``, never over it: the writer uncommits a
directory before writing into it, and with ``keep_latest_k=1`` a crash then left nothing to
load. Once the new save is committed on every rank, rank 0 swaps it in with two renames
(``step_N`` to ``step_N.replaced``, then ``step_N.replacing`` to ``step_N``) and deletes the old
one. At every point of that a committed checkpoint of step N exists, and
:func:`committed_path` finds it (between the two renames, under its ``.replacing`` name);
:func:`settle` finishes or undoes what a crash left, run by the saving checkpointer only
(another process reading the root must not delete a save in flight).

May import: ``retention``, ``storage`` and the leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile

from ..errors import StorageWriteError
from ..format import LATEST_NAME, METADATA_NAME
from ..storage.base import LocalStorage
from . import retention

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
#: Suffixes of the two directories beside ``step_N`` while it is replaced: the new save, the
#: old one moved aside. :func:`committed_path` looks in this order.
REPLACING, REPLACED = ASIDE = (".replacing", ".replaced")
_ANY = re.compile(r"^step_(\d+)(\.replacing|\.replaced)?$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def path(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def is_committed(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, METADATA_NAME))


def committed_path(root: str, step: int) -> str | None:
    """Where step ``step``'s committed checkpoint is: its directory, or, after a crash
    between the two renames of a replacement, the new save beside it (then the old one)."""
    place = path(root, step)
    for candidate in (place, *(place + suffix for suffix in ASIDE)):
        if is_committed(candidate):
            return candidate
    return None


def listing(root: str) -> dict[int, bool]:
    """Steps with a directory under ``root`` (or one beside it), and whether it is committed."""
    found: dict[int, bool] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            m = _ANY.match(name)
            if m and os.path.isdir(os.path.join(root, name)):
                step = int(m.group(1))
                found[step] = found.get(step, False) or is_committed(os.path.join(root, name))
    return found


def read_latest(root: str) -> int | None:
    """The step ``root/latest`` names, or None."""
    try:
        with open(os.path.join(root, LATEST_NAME)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def resume_order(root: str) -> list[int]:
    """The steps a resume tries (rank 0's view): ``latest``'s, then the older committed ones,
    newest first."""
    try:
        latest = read_latest(root)
    except (OSError, ValueError) as exc:
        logger.warning("rank 0: %s is unreadable (%s): ignoring it", LATEST_NAME, exc)
        latest = None
    older = sorted(s for s, ok in listing(root).items() if ok and (latest is None or s < latest))
    return ([] if latest is None else [latest]) + older[::-1]


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


def swap_in(root: str, step: int) -> None:
    """Rank 0, once the save to ``step_N.replacing`` is committed on every rank: put it in
    ``step_N``'s place and delete the old one (:func:`settle` does the second half)."""
    place = path(root, step)
    if os.path.isdir(place):
        os.rename(place, place + REPLACED)
    settle(root, only=step, crashed=False)


def settle(root: str, *, only: int | None = None, crashed: bool = True) -> None:
    """Finish or undo the replacements under ``root`` (of step ``only``, or all): move the
    committed new save, else the old one, into ``step_N``'s place if that is not committed;
    then delete what is left beside it (``.metadata`` first). Call it only where no save of
    the step is in flight."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    asides = {int(m.group(1)) for n in names if (m := _ANY.match(n)) and m.group(2)}
    for step in sorted(asides if only is None else asides & {only}):
        place = path(root, step)
        if not is_committed(place):
            moved = next((place + s for s in ASIDE if is_committed(place + s)), None)
            if moved is not None:
                if crashed:
                    logger.warning(
                        "%s: a crash interrupted its replacement; using %s", place, moved
                    )
                if os.path.isdir(place):
                    retention.delete_checkpoint(LocalStorage(place))
                os.rename(moved, place)
                _fsync_dir(root)
        for suffix in ASIDE:
            if os.path.isdir(place + suffix):
                if crashed:
                    logger.warning("deleting %s%s, left by an interrupted save", place, suffix)
                retention.delete_checkpoint(LocalStorage(place + suffix))


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


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(root: str, rank: int) -> StorageWriteError | None:
    """Whether this rank can make ``root`` and create a file in it (what every save does);
    the error to raise if not."""
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return StorageWriteError(
            exc.errno,
            f"rank {rank}: the Checkpointer root {root} is not writable ({exc.strerror or exc}: "
            f"{exc.filename or root}); pass a directory this process may create and write "
            "files in, or fix its permissions",
        )
    return None
