"""Replica directories on the receiving rank of :mod:`.peers`: where they live, owner-only
directories, the completion marker and its check, and the rename that makes one visible.

May import: the leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crc32c import crc32c

#: The completion marker in a replica directory: the step, the source rank, and each file's size
#: and CRC-32C. Written last, inside the directory before it is renamed into place.
MARKER_NAME = ".replica.json"
#: Replicas kept by a rank live under ``dest_root/PEER_DIR/rank_<src>/step_<N>``.
PEER_DIR = "peer"
_PARTIAL = ".partial"
_DIR_MODE = 0o700
FILE_MODE = 0o600


def replica_dir(dest_root: Path, source: int, step: int) -> Path:
    return Path(dest_root) / PEER_DIR / f"rank_{source}" / f"step_{step}"


def check_names(names: Sequence[str]) -> None:
    """Refuse a file name that would leave the directory it is written into, or comes twice."""
    if len(set(names)) != len(names):
        raise ValueError(f"file names {list(names)} name a file more than once")
    for name in names:
        if (
            not isinstance(name, str)
            or not name
            or name in (".", "..", MARKER_NAME)
            or "/" in name
            or os.sep in name
            or "\0" in name
        ):
            raise ValueError(
                f"file name {name!r} cannot be replicated: give plain names inside the "
                f"checkpoint directory (no '/', not '..' or {MARKER_NAME!r})"
            )


def make_private_dirs(path: Path) -> None:
    """``path`` and its missing parents, owner-only."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=_DIR_MODE)
        os.chmod(p, _DIR_MODE)


class ReplicaInvalid(Exception):
    """A replica is missing, incomplete or does not match its marker."""


def read_marker(path: Path, *, step: int, source: int, world_size: int) -> dict[str, Any]:
    """The marker of the replica in ``path``, checked against what the caller expects and
    against the files (sizes and CRC-32C). Raises :class:`ReplicaInvalid` saying what is wrong."""
    marker_path = Path(path) / MARKER_NAME
    try:
        marker = json.loads(marker_path.read_text())
    except FileNotFoundError:
        raise ReplicaInvalid(f"no replica at {path} (no {MARKER_NAME})") from None
    except (OSError, ValueError) as e:
        raise ReplicaInvalid(f"unreadable marker {marker_path}: {e}") from None
    want = {"step": step, "source_rank": source, "world_size": world_size}
    got = {k: marker.get(k) for k in want} if isinstance(marker, dict) else marker
    if got != want or not isinstance(marker.get("files"), dict):
        raise ReplicaInvalid(f"marker {marker_path} is for {got}, not {want}")
    for name, info in marker["files"].items():
        file = Path(path) / name
        try:
            size = file.stat().st_size
        except OSError as e:
            raise ReplicaInvalid(f"{file} is missing: {e}") from None
        if size != info["size"]:
            raise ReplicaInvalid(f"{file} holds {size} bytes, its marker says {info['size']}")
        crc = file_crc(file)
        if crc != info["crc32c"]:
            raise ReplicaInvalid(
                f"{file} fails its checksum (crc32c {crc:#010x}, marker {info['crc32c']:#010x})"
            )
    return marker


def file_crc(path: Path, piece: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(piece):
            crc = crc32c(chunk, crc)
    return crc


def swap_in(partial: Path, final: Path) -> None:
    """Make the complete directory ``partial`` visible as ``final`` (an older ``final`` goes)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def partial_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}{_PARTIAL}")


__all__ = [
    "FILE_MODE",
    "MARKER_NAME",
    "PEER_DIR",
    "ReplicaInvalid",
    "check_names",
    "file_crc",
    "make_private_dirs",
    "partial_dir",
    "read_marker",
    "replica_dir",
    "swap_in",
]
