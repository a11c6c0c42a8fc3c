"""The commit: the manifest, then ``.metadata`` last and atomically. Nothing else commits.

The order of durable operations (``docs/format.md``, "Commit order") lives here and in
``flush``: ``uncommit`` (remove ``.metadata``, sync the directory) before any data is written;
every data file fsynced once by its rank; then ``commit``: stale files of an earlier save
removed, the directory (and those above it) synced, the manifest and then ``.metadata`` each
written to a temporary file, fsynced, renamed and the directory synced.
"""

from __future__ import annotations

import logging
import pickle
import re

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ._dcp_private import StorageInfo
from .errors import DataStatesError
from .format import (
    DATA_SUFFIX,
    MANIFEST_NAME,
    METADATA_NAME,
    RecordInfo,
    encode_manifest,
    manifest_key,
)
from .storage import Storage, _write_error

logger = logging.getLogger(__name__)

#: The DCP format version stamped into ``.metadata`` (what stock ``FileSystemWriter`` writes).
DCP_VERSION = "1.0.0"


#: Files a save of ours (or of stock DCP) writes into a checkpoint directory, besides the commit
#: record: data files, the manifest, and the temporary files of an interrupted commit.
_OURS = re.compile(
    r"^(__\d+_\d+"
    + re.escape(DATA_SUFFIX)
    + "|"
    + "|".join(re.escape(n) + "(\\.tmp)?" for n in (MANIFEST_NAME, METADATA_NAME))
    + ")$"
)


def uncommit(storage: Storage, *, sync: bool = True) -> bool:
    """Remove an existing commit record before overwriting a checkpoint's data files, durably:
    after a power loss the directory must not come back committed over half-new data."""
    if storage.exists(METADATA_NAME):
        storage.remove(METADATA_NAME)
        if sync:
            storage.sync_dirs()
        return True
    return False


def remove_stale(storage: Storage, keep: set[str]) -> list[str]:
    """Remove files of an earlier save that this save did not write (data files of a save by
    more ranks or more flush workers, a manifest or temporary file of an interrupted commit), so
    that the committed directory holds exactly what its ``.metadata`` names. Runs on the
    coordinator before the commit, when no ``.metadata`` exists; other files are left alone."""
    stale = [n for n in storage.list_names() if _OURS.match(n) and n not in keep]
    for name in stale:
        storage.remove(name)
    if stale:
        logger.info("removed %d stale file(s) from %s: %s", len(stale), storage.describe(""), stale)
    return stale


def commit(
    storage: Storage,
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    sync: bool,
    rank: int | None = None,
) -> None:
    """Write the manifest and then ``.metadata``. ``.metadata`` holds stock DCP types only."""
    storage_data: dict = {}
    entries: dict[str, RecordInfo] = {}
    for rank_results in results:
        for wr in rank_results:
            info: RecordInfo = wr.storage_data
            storage_data[wr.index] = StorageInfo(info.relative_path, info.offset, info.length)
            entries[manifest_key(wr.index.fqn, wr.index.offset)] = info
    manifest = encode_manifest(entries, world_size=len(results), torch_version=torch.__version__)
    written = {info.relative_path for info in entries.values()}
    remove_stale(storage, keep=written | {MANIFEST_NAME, METADATA_NAME})  # those two: replaced
    if sync:  # the data files' names, the removals, and a directory this save made
        _sync_dirs(storage, rank)
    _put(storage, MANIFEST_NAME, manifest, sync=sync, rank=rank)

    metadata.version = DCP_VERSION
    metadata.storage_data = storage_data
    _put(storage, METADATA_NAME, pickle.dumps(metadata), sync=sync, rank=rank)
    logger.debug("committed %s (%d items)", storage.describe(METADATA_NAME), len(storage_data))


def _put(storage: Storage, name: str, data: bytes, *, sync: bool, rank: int | None) -> None:
    # A bare OSError from write/fsync/rename names neither the file nor the rank (a full
    # device at commit time said only "[Errno 28] No space left on device").
    try:
        storage.put_atomic(name, data, sync=sync)
    except OSError as exc:
        if isinstance(exc, DataStatesError):
            raise
        raise _write_error(exc, storage.describe(name), rank) from exc


def _sync_dirs(storage: Storage, rank: int | None) -> None:
    try:
        storage.sync_dirs(parents=True)
    except OSError as exc:
        if isinstance(exc, DataStatesError):
            raise
        raise _write_error(exc, storage.describe(""), rank) from exc
