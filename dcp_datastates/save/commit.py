"""The commit: the manifest, then ``.metadata`` last and atomically. Nothing else commits.

The order of durable operations (``docs/format.md``, "Commit order") lives here and in
``flush``: ``uncommit`` (remove the commit records, sync the directory) before any data is written;
every data file fsynced once by its rank; then ``commit``: stale files of an earlier save
removed, the directory (and those above it) synced, the manifest and then ``.metadata`` each
written to a temporary file, fsynced, renamed and the directory synced.
"""

from __future__ import annotations

import errno
import logging
import pickle
import re

import torch
from crc32c import crc32c
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from .._dcp_private import StorageInfo
from ..errors import DataStatesError, WriterUsageError
from ..format import (
    DATA_SUFFIX,
    LINKED_DATA,
    METADATA_NAME,
    RANK_METADATA,
    RecordInfo,
    encode_manifest,
    manifest_key,
    manifest_name,
    metadata_name,
)
from ..storage.base import Storage, _write_error
from .transforms import TransformedRecord

logger = logging.getLogger(__name__)

#: The DCP format version stamped into ``.metadata`` (what stock ``FileSystemWriter`` writes).
DCP_VERSION = "1.0.0"


def _ours(commit_rank: int | None) -> re.Pattern[str]:
    """Files a save of ours (or of stock DCP) writes into a checkpoint directory, besides the
    commit record: data files, the manifest, and the temporary files of an interrupted commit.
    A rank that commits alone (``use_collectives=False``) owns only its own prefix."""
    # __{rank}_k{n}: a file linked from an older checkpoint (incremental.py).
    data = r"__\d+_k?\d+" if commit_rank is None else rf"__{commit_rank}_k?\d+"
    names = [re.escape(manifest_name(commit_rank)), re.escape(metadata_name(commit_rank))]
    if commit_rank is None:  # and every rank's own, of an earlier save with use_collectives=False
        names += [r"__\d+" + re.escape(manifest_name()), r"__\d+" + re.escape(metadata_name())]
    return re.compile(
        "^(" + data + re.escape(DATA_SUFFIX) + "|" + "|".join(n + "(\\.tmp)?" for n in names) + ")$"
    )


def commit_records(storage: Storage, commit_rank: int | None = None) -> list[str]:
    """The commit records in the directory whose data files a save would overwrite: for a save
    of all ranks (``commit_rank`` None) ``.metadata`` and every ``__{rank}.metadata`` (a save
    with ``use_collectives=False`` wrote those, into the same ``__{rank}_{n}`` files); for a
    rank that commits alone, its own ``__{commit_rank}.metadata`` and ``.metadata``."""
    if commit_rank is not None:
        names = [metadata_name(commit_rank), METADATA_NAME]
        return [n for n in names if storage.exists(n)]
    found = [METADATA_NAME] if storage.exists(METADATA_NAME) else []
    return found + sorted(n for n in storage.list_names() if RANK_METADATA.match(n))


def uncommit(storage: Storage, records: list[str], *, sync: bool = True) -> None:
    """Remove the commit records ``records`` (:func:`commit_records`) before overwriting a
    checkpoint's data files, durably: after a power loss the directory must not come back
    committed over half-new data. Ranks saving alone may remove ``.metadata`` at once."""
    for name in records:
        storage.remove(name)
    if records and sync:
        storage.sync_dirs()


def remove_stale(storage: Storage, keep: set[str], commit_rank: int | None = None) -> list[str]:
    """Remove files of an earlier save that this save did not write (data files of a save by
    more ranks or more flush workers, a manifest or temporary file of an interrupted commit), so
    that the committed directory holds exactly what its ``.metadata`` names. Runs on the
    coordinator before the commit, when no ``.metadata`` exists; other files are left alone."""
    ours = _ours(commit_rank)
    stale = [n for n in storage.list_names() if ours.match(n) and n not in keep]
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
    commit_rank: int | None = None,
    ranks_here: list[int] | None = None,
) -> None:
    """Write the manifest and then ``.metadata`` (``__{commit_rank}.metadata`` and its manifest
    for a save with ``use_collectives=False``). ``.metadata`` holds stock DCP types only.
    ``ranks_here``: a node-local save's ranks whose files this directory holds
    (``WriterOptions.node_local``); only theirs are checked whole, the other nodes' are
    checked where their directories are brought together. None: every rank's."""
    storage_data: dict = {}
    entries: dict[str, RecordInfo] = {}
    for rank_results in results:
        for wr in rank_results:
            info, descriptors = wr.storage_data, None
            if isinstance(info, TransformedRecord):  # as stock: None when not transformed
                info, descriptors = info.info, list(info.descriptors)
            storage_data[wr.index] = StorageInfo(
                info.relative_path, info.offset, info.length, transform_descriptors=descriptors
            )
            entries[manifest_key(wr.index.fqn, wr.index.offset)] = info
    _check_complete(metadata, entries, storage, rank)
    metadata.version = DCP_VERSION
    metadata.storage_data = storage_data
    metadata_blob = pickle.dumps(metadata)
    manifest = encode_manifest(
        entries,
        world_size=len(results),
        torch_version=torch.__version__,
        metadata_crc32c=crc32c(metadata_blob),  # a reader checks it before unpickling
    )
    _check_sizes(storage, _of_ranks(entries, ranks_here), rank)
    written = {info.relative_path for info in entries.values()}
    manifest_file, metadata_file = manifest_name(commit_rank), metadata_name(commit_rank)
    # The manifest and the commit record are replaced, not removed.
    remove_stale(storage, keep=written | {manifest_file, metadata_file}, commit_rank=commit_rank)
    if sync:  # the data files' names, the removals, and a directory this save made
        _sync_dirs(storage, rank)
    _put(storage, manifest_file, manifest, sync=sync, rank=rank)

    _put(storage, metadata_file, metadata_blob, sync=sync, rank=rank)
    logger.debug("committed %s (%d items)", storage.describe(metadata_file), len(storage_data))


def _check_complete(
    metadata: Metadata, entries: dict[str, RecordInfo], storage: Storage, rank: int | None
) -> None:
    """Every item ``metadata`` lists (each chunk of a tensor, each object) was written by a
    rank, before anything commits. DCP builds the metadata and the ranks' final plans in
    separate steps; after a save that failed in its global plan, DCP's plan cache
    (``enable_plan_caching``) handed the next save metadata of one plan and write plans of
    another, and the checkpoint it committed failed every load with a ``KeyError`` (a user
    sweep). Chunks without elements need no record."""
    missing = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                key = manifest_key(fqn, chunk.offsets)
                if key not in entries and all(chunk.sizes):
                    missing.append(key)
        elif manifest_key(fqn, None) not in entries:
            missing.append(manifest_key(fqn, None))
    if missing:
        raise WriterUsageError(
            f"rank {rank}: not committed at {storage.describe('')}: the save's metadata lists "
            f"{len(missing)} item(s) that no rank wrote ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): the ranks' plans and the metadata came "
            "from different global plans. DCP's plan cache (enable_plan_caching) does this "
            "after a save that failed while planning: save again with a planner without "
            "caching, or restart the processes"
        )


def _of_ranks(entries: dict[str, RecordInfo], ranks: list[int] | None) -> dict[str, RecordInfo]:
    """The entries whose data files the ranks ``ranks`` wrote (``__{rank}_{n}``); all for None."""
    if ranks is None:
        return entries
    prefixes = tuple(f"__{r}_" for r in ranks)
    return {k: i for k, i in entries.items() if i.relative_path.startswith(prefixes)}


def _check_sizes(storage: Storage, entries: dict[str, RecordInfo], rank: int | None) -> None:
    """Every data file whole, with the bytes the ranks wrote, before anything commits: on an
    object store this is a fresh HEAD per object, where a rename would have been."""
    sizes: dict[str, int] = {}
    for info in entries.values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    # A linked file also holds records of the older checkpoint that this one does not name.
    linked = [name for name in sizes if LINKED_DATA.match(name)]
    try:
        for name in linked:
            del sizes[name]
            if not storage.exists(name):
                raise FileNotFoundError(errno.ENOENT, "a linked data file is gone", name)
        storage.check_sizes(sizes)
    except OSError as exc:
        if isinstance(exc, DataStatesError):
            raise
        raise _write_error(exc, storage.describe(""), rank) from exc


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
