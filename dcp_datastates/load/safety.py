"""Safe loading: what an untrusted checkpoint may ask of the reader.

``.metadata`` is a pickle, and unpickling runs whatever globals it names. A safe load unpickles it
with :class:`MetadataUnpickler`, which resolves only the types stock DCP puts there (found by
unpickling ``.metadata`` written by ``DataStatesWriter`` and by stock ``FileSystemWriter`` for
tensors of many dtypes and memory formats, DTensor chunks and object items). File names from
``.metadata`` and the manifest must stay inside the checkpoint directory, and every record must
lie inside its file.

Object items load with ``torch.load(weights_only=True)``, which also allows ``io.BytesIO``: DCP
saves a ``BytesIO`` value of a state dict that way, and rebuilding one only copies bytes. An
empty ``bytes`` (``b""``, an empty ``BytesIO``'s value) pickles as a call of ``bytes()``, which
is allowed with no arguments only (``bytes(10**12)`` would allocate what it says).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._dcp_private import PRIVATE_METADATA_GLOBALS
from ..errors import ChecksumMismatchError, UnsafeCheckpointError
from ..storage.base import FsspecStorage, LocalStorage
from .object_records import MISS, fast_load

_HOW_TO_TRUST = (
    "Load it with DataStatesReader(path, trusted=True) only if you trust whoever wrote it"
)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = (
    frozenset(
        {
            (_DCP_METADATA, "Metadata"),
            (_DCP_METADATA, "MetadataIndex"),
            (_DCP_METADATA, "TensorStorageMetadata"),
            (_DCP_METADATA, "BytesStorageMetadata"),
            (_DCP_METADATA, "ChunkStorageMetadata"),
            (_DCP_METADATA, "TensorProperties"),
            (_DCP_METADATA, "StorageMeta"),
            ("torch", "Size"),
            # torch.layout pickles as _get_layout("torch.strided"): a dict lookup, nothing else.
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
            # Stock FileSystemWriter stores StorageMeta.checkpoint_id as a Path.
            ("pathlib", "Path"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "PureWindowsPath"),
        }
    )
    | PRIVATE_METADATA_GLOBALS
)
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata``; any other global raises :class:`UnsafeCheckpointError`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        # dtypes, layouts and memory formats pickle as module attributes: torch.float32, ...
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"it asks to unpickle the global {module}.{name}, which is not a DCP metadata type; "
            f"a safe load refuses it. {_HOW_TO_TRUST}"
        )


def load_metadata(f: IO[bytes], where: str) -> Metadata:
    """Unpickle ``.metadata`` from ``f`` allowing only DCP metadata types."""
    try:
        metadata = MetadataUnpickler(f).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where}: {exc}") from None
    except Exception as exc:  # a damaged pickle raises whatever its bytes lead to
        raise ChecksumMismatchError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged: "
            "load an earlier one"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{where} holds a {type(metadata).__name__}, not DCP Metadata; refusing to load it"
        )
    _check_fields(metadata, where)
    return metadata


def _check_fields(metadata: Metadata, where: str) -> None:
    """A damaged byte can leave a well-formed pickle whose fields are missing or of another type
    (a field's name changed, a number read as a string): refuse it here, by name, rather than
    fail later on an attribute."""
    try:
        fields_ok = (
            isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, (dict, type(None)))
            and all(
                isinstance(index.fqn, str)
                and isinstance(info.relative_path, str)
                and type(info.offset) is int
                and type(info.length) is int
                for index, info in (metadata.storage_data or {}).items()
            )
        )
    except AttributeError:
        fields_ok = False
    if not fields_ok:
        raise ChecksumMismatchError(
            f"{where} is not the metadata DCP writes (a field is missing or of another type); "
            "the checkpoint is damaged: load an earlier one"
        )


def check_relative_path(storage: LocalStorage | FsspecStorage, relative_path: Any) -> None:
    """Refuse a file name that is absolute, climbs with ``..`` or (locally, through symlinks)
    resolves outside the checkpoint directory."""
    where = storage.describe("")
    if not isinstance(relative_path, str) or not relative_path:
        raise UnsafeCheckpointError(
            f"{where}: a record names the file {relative_path!r}, which is not a file name; "
            "refusing to load the checkpoint"
        )
    parts = relative_path.replace("\\", "/").split("/")
    if (
        os.path.isabs(relative_path)
        or relative_path.startswith(("/", "\\"))
        or "://" in relative_path
        or (len(relative_path) > 1 and relative_path[1] == ":")  # a Windows drive
        or ".." in parts
    ):
        raise UnsafeCheckpointError(
            f"{where}: a record names the file {relative_path!r}, which is outside the "
            f"checkpoint directory; refusing to read it. {_HOW_TO_TRUST}"
        )
    if isinstance(storage, LocalStorage):
        root = os.path.realpath(storage.root)
        target = os.path.realpath(os.path.join(root, relative_path))
        if os.path.commonpath([root, target]) != root:
            raise UnsafeCheckpointError(
                f"{where}: the file {relative_path!r} resolves to {target}, outside the "
                f"checkpoint directory; refusing to read it. {_HOW_TO_TRUST}"
            )


def file_size(storage: LocalStorage | FsspecStorage, name: str) -> int:
    with storage.open_read(name) as f:
        return f.seek(0, io.SEEK_END)


def check_extents(
    storage: LocalStorage | FsspecStorage,
    records: Iterable[tuple[str, str, int, int]],
) -> None:
    """Refuse a record ``(item, file, offset, length)`` that is negative or ends past its file."""
    sizes: dict[str, int] = {}
    for item, name, offset, length in records:
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise UnsafeCheckpointError(
                f"{storage.describe(name)}: item {item!r} has offset {offset!r} and length "
                f"{length!r}; refusing to read it"
            )
        if name not in sizes:
            try:
                sizes[name] = file_size(storage, name)
            except FileNotFoundError:
                raise ChecksumMismatchError(
                    f"{storage.describe(name)} is missing (item {item!r} is in it); the "
                    "checkpoint is damaged"
                ) from None
        if offset + length > sizes[name]:
            raise ChecksumMismatchError(
                f"{storage.describe(name)}: item {item!r} ends at byte {offset + length} but the "
                f"file has {sizes[name]} bytes (truncated); the checkpoint is damaged"
            )


def _empty_bytes(*args: Any) -> bytes:
    """``builtins.bytes`` as a safe load resolves it: ``bytes()`` (how pickle's protocol 2
    writes ``b""``); a call with arguments is refused."""
    if args:
        raise pickle.UnpicklingError(f"bytes{args!r:.60} is refused: only bytes() is allowed")
    return b""


#: What object items may name beyond ``torch.load(weights_only=True)``'s own allowlist.
_OBJECT_GLOBALS: list[Any] = [io.BytesIO, (_empty_bytes, "builtins.bytes")]


def check_object_record(blob: bytes, where: str, fqn: str) -> Any:
    """The object in ``blob``, loaded with ``torch.load(weights_only=True)``; refuse a record
    that it rejects: DCP's planner loads object items with ``weights_only=False``, which would
    run the pickle's globals. Plain data skips ``torch.load`` (:mod:`.object_records`)."""
    value = fast_load(blob)
    if value is not MISS:
        return value
    try:
        with torch.serialization.safe_globals(_OBJECT_GLOBALS):
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        # torch's message is long; the line naming the refused global is the useful one.
        reason = next(
            (ln for ln in lines if "Unsupported global" in ln or "is refused" in ln), lines[0]
        )
        reason = reason.strip()
        raise UnsafeCheckpointError(
            f"{where}: object item {fqn!r} does not load with torch.load(weights_only=True) "
            f"({reason}); a safe load refuses it. Allow the classes you trust with "
            "torch.serialization.safe_globals([...]) around the load, or load it with "
            "DataStatesReader(path, trusted=True) only if you trust whoever wrote it"
        ) from exc
