"""``DataStatesReader``: DCP's storage-reader calls, on top of the load's I/O stage.

Metadata and manifest are read here and checked (safe mode); ``read_data`` groups the plan's
items by record, resolves their targets on DCP's thread and hands the reads to
:mod:`dcp_datastates.fetch`, which reads raw data regions straight into the targets in parallel
and verifies checksums. Stock ``FileSystemWriter`` checkpoints (no manifest) are read the same
way, with their data located by :mod:`dcp_datastates.locate`, and without checksums.

Loads are safe by default (see :mod:`dcp_datastates.safety`): ``.metadata`` unpickles only DCP
metadata types, file names must stay inside the checkpoint directory, records inside their files,
and object items must pass ``torch.load(weights_only=True)``. ``trusted=True`` lifts all of this."""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ._dcp_private import set_element
from .errors import CheckpointNotCommittedError, ChecksumMismatchError
from .fetch import Fetch, FetchOptions, Record
from .format import (
    DATA_SUFFIX,
    MANIFEST_NAME,
    METADATA_NAME,
    RecordInfo,
    decode_manifest,
    manifest_key,
)
from .safety import check_extents, check_object_record, check_relative_path, load_metadata
from .storage import storage_for

logger = logging.getLogger(__name__)


class DataStatesReader(StorageReader):
    """A DCP storage reader for checkpoints written by :class:`DataStatesWriter` (and stock DCP).

    Args:
        path: Checkpoint directory (local path or fsspec URL).
        verify: Check every record's crc32c while reading (default). A mismatch raises
            :class:`~dcp_datastates.ChecksumMismatchError` naming the file and item.
        io_workers: Reads in flight at once (big records are split into regions read in
            parallel; small neighbouring records share one read).
        trusted: Skip the safe-load checks and unpickle ``.metadata`` and object items with
            plain ``pickle`` (``torch.load(weights_only=False)``), which runs any code the files
            name. Only for checkpoints you trust. Untrusted (the default), anything outside the
            checks raises :class:`~dcp_datastates.errors.UnsafeCheckpointError`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify: bool = True,
        io_workers: int = 4,
        trusted: bool = False,
    ) -> None:
        super().__init__()
        if io_workers < 1:
            raise ValueError(f"io_workers must be at least 1, got {io_workers!r}")
        self.path = os.fspath(path)
        self.verify = verify
        self.io_workers = io_workers
        self.fetch_options = FetchOptions(verify=verify, io_workers=io_workers)
        self.trusted = trusted
        self._reset_state()

    def _reset_state(self) -> None:
        self.storage = storage_for(self.path)
        self.metadata: Metadata | None = None
        self.manifest: dict[str, RecordInfo] | None = None
        self._checked: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._reset_state()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self.storage.exists(METADATA_NAME):
            raise self._not_committed()
        with self.storage.open_read(METADATA_NAME) as f:
            if self.trusted:
                metadata: Metadata = pickle.load(f)
            else:
                metadata = load_metadata(f, self.storage.describe(METADATA_NAME))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        self.metadata = metadata
        self._prepare()
        return metadata

    def _prepare(self) -> None:
        """Manifest and checks, once per metadata (DCP hands it back in set_up_storage_reader)."""
        if self.metadata is None or self._checked is self.metadata:
            return
        self._load_manifest()
        self._check_layout()
        self._check_manifest_matches_metadata()
        self._checked = self.metadata

    def _load_manifest(self) -> None:
        if self.manifest is not None:
            return
        if not self.storage.exists(MANIFEST_NAME):
            logger.info("%s has no manifest (stock DCP): nothing to verify", self.path)
            return
        with self.storage.open_read(MANIFEST_NAME) as f:
            blob = f.read()
        try:
            self.manifest = decode_manifest(blob, self.storage.describe(MANIFEST_NAME))
        except ChecksumMismatchError as exc:
            if self.verify:
                raise
            logger.warning("verify=False: reading without the manifest, unverified: %s", exc)

    def _check_manifest_matches_metadata(self) -> None:
        """Every item in ``.metadata`` has the manifest entry for the same record: an item the
        manifest lost would otherwise load unverified."""
        if self.metadata is None or self.manifest is None:
            return
        where = self.storage.describe(MANIFEST_NAME)
        for index, sinfo in self.metadata.storage_data.items():
            key = manifest_key(index.fqn, index.offset)
            info = self.manifest.get(key)
            if info is None:
                raise ChecksumMismatchError(
                    f"{where} has no entry for item {key!r}, which {METADATA_NAME} lists; the "
                    "checkpoint is damaged"
                )
            placed = (info.relative_path, info.offset, info.length)
            if placed != (sinfo.relative_path, sinfo.offset, sinfo.length):
                raise ChecksumMismatchError(
                    f"{where} places item {key!r} at {placed}, but {METADATA_NAME} at "
                    f"{(sinfo.relative_path, sinfo.offset, sinfo.length)}; the checkpoint is "
                    "damaged"
                )
            # An object record is serialized whole; a raw provider's record (kind "tensor")
            # may back an object item too, and is read whole the same way.
            is_object = info.kind == "object"
            if is_object and (info.data_offset, info.data_length) != (info.offset, info.length):
                raise ChecksumMismatchError(
                    f"{where}: object item {key!r} has data_offset/data_length "
                    f"{(info.data_offset, info.data_length)}, not its record's "
                    f"{(info.offset, info.length)}; the checkpoint is damaged"
                )

    def _check_layout(self) -> None:
        """Safe mode: every file named stays in the directory and every record in its file."""
        if self.trusted or self.metadata is None:
            return
        records = [
            (index.fqn, sinfo.relative_path, sinfo.offset, sinfo.length)
            for index, sinfo in self.metadata.storage_data.items()
        ]
        records += [
            (key, info.relative_path, info.offset, info.length)
            for key, info in (self.manifest or {}).items()
        ]
        checked: set[Any] = set()
        for _, name, _, _ in records:  # thousands of items share a few files
            if name not in checked:
                check_relative_path(self.storage, name)
                checked.add(name)
        check_extents(self.storage, records)

    def _not_committed(self) -> CheckpointNotCommittedError:
        found = [n for n in self.storage.list_names() if n.endswith(DATA_SUFFIX)]
        return CheckpointNotCommittedError(
            f"{self.path} is not a committed checkpoint: it has no {METADATA_NAME} "
            f"({len(found)} data file(s) found). The save that wrote it did not finish; load an "
            "earlier checkpoint"
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.metadata = metadata
        self._prepare()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        try:
            self._read(plan, planner)
        except BaseException as exc:
            done.set_exception(exc)
            return done
        done.set_result(None)
        return done

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        assert self.metadata is not None
        records: dict[tuple[str, int], Record] = {}
        targets: dict[ReadItem, torch.Tensor] = {}
        for req in plan.items:
            sinfo = self.metadata.storage_data[req.storage_index]
            record = records.get((sinfo.relative_path, sinfo.offset))
            if record is None:
                info = self._record(req.storage_index)
                record = Record(
                    name=sinfo.relative_path,
                    fqn=req.storage_index.fqn,
                    offset=info.offset if info else sinfo.offset,
                    length=info.length if info else sinfo.length,
                    info=info,
                    saved=None
                    if req.type == LoadItemType.BYTE_IO
                    else self._saved_chunk(req.storage_index),
                )
                records[(sinfo.relative_path, sinfo.offset)] = record
            record.reqs.append(req)
            if req.type != LoadItemType.BYTE_IO:
                # Resolved here, on DCP's thread: planners need not be thread-safe.
                targets[req] = planner.resolve_tensor(req).detach()
        fetch = Fetch(self.storage, list(records.values()), targets, self.fetch_options)
        fetch.run()
        for req, target in targets.items():
            planner.commit_tensor(req, target)
        for req, blob in fetch.blobs.items():
            name = self.metadata.storage_data[req.storage_index].relative_path
            self._load_bytes(name, req, blob, planner)

    def _record(self, index: MetadataIndex) -> RecordInfo | None:
        if self.manifest is None:
            return None
        return self.manifest.get(manifest_key(index.fqn, index.offset))

    def _saved_chunk(self, index: MetadataIndex) -> tuple[torch.dtype, torch.Size]:
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata[index.fqn]
        for chunk in md.chunks:  # type: ignore[union-attr]
            if tuple(chunk.offsets) == tuple(index.offset):
                return md.properties.dtype, chunk.sizes  # type: ignore[union-attr]
        raise KeyError(f"no saved chunk of {index.fqn!r} at offset {tuple(index.offset)}")

    def _load_bytes(self, name: str, req: ReadItem, blob: bytes, planner: LoadPlanner) -> None:
        if self.trusted:
            planner.load_bytes(req, io.BytesIO(blob))
            return
        # DefaultLoadPlanner.load_bytes calls torch.load(weights_only=False): load the record
        # with the weights-only unpickler first, so that a safe load never runs its globals.
        value = check_object_record(blob, self.storage.describe(name), req.storage_index.fqn)
        if not _set_loaded_object(planner, req, value):
            planner.load_bytes(req, io.BytesIO(blob))  # another planner: let it deserialize


def _set_loaded_object(planner: LoadPlanner, req: ReadItem, value: Any) -> bool:
    """Do what ``DefaultLoadPlanner.load_bytes`` does with an object already loaded (safely),
    instead of deserializing it a second time; only for exactly that planner."""
    if type(planner) is not DefaultLoadPlanner:
        return False
    fqn = req.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value
    return True
