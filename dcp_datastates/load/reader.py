"""``DataStatesReader``: DCP's storage-reader calls, on top of the load's I/O stage.

Metadata and manifest are read here and checked (safe mode); ``read_data`` groups the plan's
items by record, resolves their targets on DCP's thread and hands the reads to
:mod:`dcp_datastates.load.fetch`, which reads raw data regions straight into the targets in parallel
and verifies checksums. Stock ``FileSystemWriter`` checkpoints (no manifest) are read the same
way, with their data located by :mod:`dcp_datastates.load.locate`, and without checksums.

Loads are safe by default (see :mod:`dcp_datastates.load.safety`): ``.metadata`` unpickles only DCP
metadata types, file names must stay inside the checkpoint directory, records inside their files,
and object items must pass ``torch.load(weights_only=True)`` (``io.BytesIO`` values allowed: they
are bytes). ``trusted=True`` lifts all of this.

The constructor takes stock ``FileSystemReader``'s arguments, ``path`` and
``_extension_registry``, by name and position: records written through stream transforms
(``_extensions=[ZStandard()]``, by stock ``FileSystemWriter`` or ours) are decoded through that
registry, as stock does; ours are checked against their crc32c (over the stored bytes) first.
``read_metadata(rank=R)`` reads ``__R.metadata`` (a save with ``use_collectives=False``), which
``dcp.load`` asks for when ``.metadata`` is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import io
import logging
import os
import pickle
import uuid
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from crc32c import crc32c
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .._concurrency.futures import completed
from .._dcp_private import ExtensionRegistry
from ..errors import ChecksumMismatchError, unknown_options
from ..format import (
    RecordInfo,
    committed_with_manifest,
    decode_manifest_full,
    manifest_key,
    manifest_name,
    metadata_name,
)
from ..storage.base import LocalStorage, storage_for
from .coop import COOP_ROUND_BYTES, CooperativeRead, cooperative_group_fits
from .coop_plan import Schedule, plan_cooperative
from .decode import FRAME_SLACK, set_loaded_object, transform_from
from .fetch import Fetch, FetchOptions, Record
from .object_records import MISS, fast_load
from .safety import check_extents, check_object_record, check_relative_path, load_metadata
from .step_dirs import not_committed

logger = logging.getLogger(__name__)


class DataStatesReader(StorageReader):
    """A DCP storage reader for checkpoints written by :class:`DataStatesWriter` (and stock DCP).

    Args:
        path: Checkpoint directory (local path or fsspec URL).
        _extension_registry: As stock ``FileSystemReader``'s: the stream transforms
            (compression) that records may name in their ``transform_descriptors``. The default
            knows torch's own (``ZStandard``, which needs the ``zstandard`` package).
        verify: Check every record's crc32c while reading (default). A mismatch raises
            :class:`~dcp_datastates.ChecksumMismatchError` naming the file and item.
        io_workers: Reads in flight at once (big records are split into regions read in
            parallel; small neighbouring records share one read).
        trusted: Skip the safe-load checks and unpickle ``.metadata`` and object items with
            plain ``pickle`` (``torch.load(weights_only=False)``), which runs any code the files
            name. Only for checkpoints you trust. Untrusted (the default), anything outside the
            checks raises :class:`~dcp_datastates.errors.UnsafeCheckpointError`.
        storage_options: Keyword arguments for the fsspec file system of a URL path (for
            ``s3://``: ``endpoint_url``, ``key``, ``secret``, ...; see ``docs/storage.md``).
        cooperative: Read each record once among the ranks (:mod:`~dcp_datastates.load.coop`):
            where several ranks need the same record (replicas, replicated state, overlapping
            shards when resharding), one reads it and sends the others their part over
            ``process_group``. The coordinator's reader decides; its group must take CPU
            tensors (gloo, or ``cpu:gloo,cuda:nccl``), else the load reads as usual.
        process_group: The group ``dcp.load`` runs on (default: the default group).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: ExtensionRegistry | None = None,
        *,
        verify: bool = True,
        io_workers: int = 4,
        trusted: bool = False,
        storage_options: dict[str, Any] | None = None,
        cooperative: bool = False,
        process_group: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:  # a typo gets the name it missed, as the writer's do (not a bare TypeError)
            known = [n for n in inspect.signature(DataStatesReader).parameters if n != "unknown"]
            raise unknown_options("DataStatesReader", sorted(unknown), known[1:])
        if not isinstance(io_workers, int) or isinstance(io_workers, bool) or io_workers < 1:
            raise ValueError(f"io_workers must be an int of at least 1, got {io_workers!r}")
        for name, value in (("verify", verify), ("trusted", trusted), ("cooperative", cooperative)):
            if not isinstance(value, bool):  # "no" would be truthy: verify on, trust on
                raise ValueError(f"DataStatesReader({name}={value!r}): must be True or False")
        self.path = os.fspath(path)
        self.verify = verify
        self.io_workers = io_workers
        self.fetch_options = FetchOptions(verify=verify, io_workers=io_workers)
        self.trusted = trusted
        self.extension_registry = (
            ExtensionRegistry() if _extension_registry is None else _extension_registry
        )
        self.rank: int | None = None  # set by read_metadata(rank=) / set_up_storage_reader
        self.use_collectives = True
        self.storage_options = storage_options
        self.cooperative = cooperative
        self.process_group = process_group
        self._reset_state()

    def _reset_state(self) -> None:
        self.storage = storage_for(self.path, self.storage_options)
        # An object store prefers fewer, bigger requests (each GET costs a round trip).
        hints = getattr(self.storage, "read_hints", None)
        if hints:
            self.fetch_options = dataclasses.replace(self.fetch_options, **hints)
        if not isinstance(self.storage, LocalStorage):
            # A remote read is a request: read each region whole, then check it.
            self.fetch_options = dataclasses.replace(self.fetch_options, check_bytes=None)
        self.metadata: Metadata | None = None
        self.manifest: dict[str, RecordInfo] | None = None
        self._metadata_crc: int | None = None  # the manifest's checksum of the commit record
        self._manifest_missing = False  # no manifest file (stock DCP's, or ours lost it)
        self._checked: Metadata | None = None
        self._metadata_rank: int | None = None  # whose __{rank}.metadata was read; None: global
        self.load_id = str(uuid.uuid4())  # a new one per load, as stock FileSystemReader

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
        """``.metadata``; with ``rank=R``, ``__R.metadata`` (written by a save with
        ``use_collectives=False``; ``dcp.load`` asks for it when ``.metadata`` is missing)."""
        with _gc_paused():
            return self._read_metadata(kwargs.get("rank"))

    def _read_metadata(self, rank: int | None) -> Metadata:
        name = metadata_name(rank)
        if not self.storage.exists(name):
            raise not_committed(self.storage, self.path, name)
        with self.storage.open_read(name) as f:
            blob = f.read()
        if self._metadata_rank != rank:
            self.manifest = None  # a manifest of another commit record
        self._metadata_rank = rank
        self._load_manifest()  # first: it holds the commit record's checksum
        got = crc32c(blob) if self._metadata_crc is not None and self.verify else None
        if got is not None and got != self._metadata_crc:
            manifest = self.storage.describe(manifest_name(rank))
            raise ChecksumMismatchError(
                f"{self.storage.describe(name)} has crc32c {got:#010x}, but the "
                f"manifest was committed with {self._metadata_crc:#010x}; the checkpoint is "
                "damaged: load an earlier one. (Or another writer, such as stock "
                "FileSystemWriter, saved over a checkpoint of ours and left its manifest: "
                f"then remove {manifest}, which does not belong to this save)"
            )
        if self.trusted:
            metadata: Metadata = pickle.loads(blob)
        else:
            metadata = load_metadata(io.BytesIO(blob), self.storage.describe(name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata
        self._prepare()
        return metadata

    def _prepare(self) -> None:
        """Manifest and checks, once per metadata (DCP hands it back in set_up_storage_reader)."""
        if self.metadata is None or self._checked is self.metadata:
            return
        self._load_manifest()
        self._check_manifest_found()
        self._check_layout()
        self._check_manifest_matches_metadata()
        self._checked = self.metadata

    def _load_manifest(self) -> None:
        if self.manifest is not None:
            return
        self._metadata_crc = None
        name = manifest_name(self._metadata_rank)
        self._manifest_missing = not self.storage.exists(name)
        if self._manifest_missing:
            logger.info("%s has no manifest (stock DCP): nothing to verify", self.path)
            return
        with self.storage.open_read(name) as f:
            blob = f.read()
        try:
            self.manifest, self._metadata_crc = decode_manifest_full(
                blob, self.storage.describe(name)
            )
        except ChecksumMismatchError as exc:
            if self.verify:
                raise
            logger.warning("verify=False: reading without the manifest, unverified: %s", exc)

    def _check_manifest_found(self) -> None:
        """A commit record of our writer with no manifest beside it lost its manifest (a copy
        that skipped it, a deletion): reading it as stock DCP's would load it unverified."""
        if self.manifest is not None or not committed_with_manifest(self.metadata):
            return
        if self._manifest_missing:  # (a damaged one was refused, or warned about)
            name = manifest_name(self._metadata_rank)
            message = (
                f"{self.storage.describe(name)} is missing, but "
                f"{metadata_name(self._metadata_rank)} was committed by dcp_datastates with "
                "it: the records' checksums are lost"
            )
            if self.verify:
                raise ChecksumMismatchError(
                    f"{message}. Restore the manifest from where the checkpoint was copied, or "
                    "load it unverified with DataStatesReader(path, verify=False)"
                )
            logger.warning("verify=False: reading unverified: %s", message)

    def _check_manifest_matches_metadata(self) -> None:
        """Every item in ``.metadata`` has the manifest entry for the same record: an item the
        manifest lost would otherwise load unverified."""
        if self.metadata is None or self.manifest is None:
            return
        where = self.storage.describe(manifest_name(self._metadata_rank))
        meta = metadata_name(self._metadata_rank)
        for index, sinfo in self.metadata.storage_data.items():
            key = manifest_key(index.fqn, index.offset)
            info = self.manifest.get(key)
            if info is None:
                raise ChecksumMismatchError(
                    f"{where} has no entry for item {key!r}, which {meta} lists; the "
                    "checkpoint is damaged"
                )
            placed = (info.relative_path, info.offset, info.length)
            if placed != (sinfo.relative_path, sinfo.offset, sinfo.length):
                raise ChecksumMismatchError(
                    f"{where} places item {key!r} at {placed}, but {meta} at "
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

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # DCP passes rank= and use_collectives= to a method with a parameter named "kwargs".
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self.metadata = metadata
        with _gc_paused():
            self._prepare()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not self.cooperative or len(plans) < 2 or self.metadata is None:
            return plans
        if not cooperative_group_fits(self.process_group, len(plans)):
            return plans
        return plan_cooperative(
            plans, self.metadata, self.record_length, round_bytes=COOP_ROUND_BYTES
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        try:
            with _gc_paused():
                self._read(plan, planner)
        except BaseException as exc:
            return completed(error=exc)  # raised from Python (dcp_future.py says why)
        return completed(None)

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if isinstance(plan.storage_data, Schedule):  # the coordinator planned a cooperative load
            CooperativeRead(self, plan, planner, plan.storage_data, self.process_group).run()
            return
        fetch, targets = self.fetch_items(plan.items, planner)
        self.commit_items(fetch, targets, planner)

    def fetch_items(
        self,
        items: Sequence[ReadItem],
        planner: LoadPlanner,
        resolved: dict[ReadItem, torch.Tensor] | None = None,
    ) -> tuple[Fetch, dict[ReadItem, torch.Tensor]]:
        """Read ``items`` from storage into their targets: ``resolved``'s, else the planner's
        (a cooperative load passes staging tensors for regions it reads for other ranks)."""
        records, targets = self._plan_reads(items, planner, resolved or {})
        fetch = Fetch(self.storage, records, targets, self.fetch_options, self._decode)
        fetch.run()
        return fetch, targets

    def _plan_reads(
        self,
        items: Sequence[ReadItem],
        planner: LoadPlanner,
        resolved: dict[ReadItem, torch.Tensor],
    ) -> tuple[list[Record], dict[ReadItem, torch.Tensor]]:
        """The items' records (items sharing one are read once) and each tensor item's target
        (the simulator times this alone)."""
        assert self.metadata is not None
        records: dict[tuple[str, int], Record] = {}
        targets: dict[ReadItem, torch.Tensor] = {}
        for req in items:
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
                    transforms=tuple(getattr(sinfo, "transform_descriptors", None) or ()),
                    saved=None
                    if req.type == LoadItemType.BYTE_IO
                    else self._saved_chunk(req.storage_index),
                )
                records[(sinfo.relative_path, sinfo.offset)] = record
            record.reqs.append(req)
            if req.type != LoadItemType.BYTE_IO:
                # Resolved here, on DCP's thread: planners need not be thread-safe.
                target = resolved.get(req)
                targets[req] = planner.resolve_tensor(req).detach() if target is None else target
        return list(records.values()), targets

    def commit_items(
        self,
        fetch: Fetch,
        targets: dict[ReadItem, torch.Tensor],
        planner: LoadPlanner,
        skip: Collection[ReadItem] = (),
    ) -> None:
        """Hand what ``fetch`` read to the planner (all but ``skip``'s items)."""
        for req, target in targets.items():
            if req not in skip:
                planner.commit_tensor(req, target)
        for req, blob in fetch.blobs.items():
            if req not in skip:
                self.load_object(req, blob, planner)

    def record_length(self, index: MetadataIndex) -> int:
        """Bytes of the record that holds item ``index`` (what reading it costs)."""
        assert self.metadata is not None
        info = self._record(index)
        return info.length if info else self.metadata.storage_data[index].length

    def _decode(self, record: Record, raw: memoryview) -> bytes:
        """A record written through stream transforms (``_extensions``), decoded as stock
        ``FileSystemReader`` does."""
        where = f"{self.storage.describe(record.name)}: item {record.fqn!r}"
        try:
            extensions = self.extension_registry.from_descriptor_list(record.transforms)
        except Exception as exc:
            raise ValueError(
                f"{where} was written through the stream transforms {list(record.transforms)} "
                f"({exc}); pass DataStatesReader(path, _extension_registry=...) with them "
                "registered (torch's ZStandard needs the zstandard package)"
            ) from exc
        limit = None
        if record.saved is not None:  # a tensor record: its data plus a small zip frame
            dtype, sizes = record.saved
            limit = torch.Size(sizes).numel() * dtype.itemsize + FRAME_SLACK
        return transform_from(extensions, raw, where, limit)

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

    def load_object(self, req: ReadItem, blob: bytes, planner: LoadPlanner) -> None:
        """An object item's record (``blob``) into the planner's state, safely unless trusted."""
        assert self.metadata is not None
        name = self.metadata.storage_data[req.storage_index].relative_path
        if self.trusted:
            value = fast_load(blob)  # plain data: no torch.load (trusted or not, same value)
            if value is MISS or not set_loaded_object(planner, req, value):
                planner.load_bytes(req, io.BytesIO(blob))
            return
        # DefaultLoadPlanner.load_bytes calls torch.load(weights_only=False): load the record
        # with the weights-only unpickler first, so that a safe load never runs its globals.
        value = check_object_record(blob, self.storage.describe(name), req.storage_index.fqn)
        if not set_loaded_object(planner, req, value):
            planner.load_bytes(req, io.BytesIO(blob))  # another planner: let it deserialize


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Cyclic GC off while the reader allocates per item (manifest entries, records, objects):
    at thousands of items the full collections it triggers cost more than the work itself."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
