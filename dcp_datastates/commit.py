"""The commit: the manifest, then ``.metadata`` last and atomically. Nothing else commits."""

from __future__ import annotations

import logging
import pickle

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ._dcp_private import StorageInfo
from .errors import DataStatesError
from .format import MANIFEST_NAME, METADATA_NAME, RecordInfo, encode_manifest, manifest_key
from .storage import Storage, _write_error

logger = logging.getLogger(__name__)

#: The DCP format version stamped into ``.metadata`` (what stock ``FileSystemWriter`` writes).
DCP_VERSION = "1.0.0"


def uncommit(storage: Storage) -> bool:
    """Remove an existing commit record before overwriting a checkpoint's data files."""
    if storage.exists(METADATA_NAME):
        storage.remove(METADATA_NAME)
        return True
    return False


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
