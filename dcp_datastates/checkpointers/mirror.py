"""Copying one committed checkpoint from one storage to another: the upload behind
:class:`~dcp_datastates.checkpointers.tiers.TieredCheckpointer`.

The copy commits the way a direct save does: data files first, sizes checked, the manifest, then
``.metadata`` last as one atomic put. A save of the same step that overwrites the source while
it is copied (:class:`Superseded`) leaves the target uncommitted. Retries and the record of what
was uploaded stay with the checkpointer.

May import: ``load``, ``storage`` and the leaves.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os

from ..errors import DataStatesError
from ..format import MANIFEST_NAME, METADATA_NAME
from ..load.safety import load_metadata
from ..storage.base import LocalStorage, Storage

logger = logging.getLogger(__name__)

_COPY_BYTES = 8 << 20


class MirrorError(DataStatesError):
    """Uploading a committed local checkpoint to the remote tier failed after every retry."""


class Superseded(Exception):
    """The local checkpoint being uploaded was overwritten by a save of the same step."""


def copy_checkpoint(
    source: Storage, target: Storage, uploaded: dict[tuple[int, ...], str] | None = None
) -> bytes:
    """Copy the committed checkpoint in ``source`` to ``target``; returns the ``.metadata``
    committed there. Raises :class:`Superseded` (``target`` left uncommitted) if ``source`` was
    saved again meanwhile.

    ``uploaded``: the local files this mirror copied before (device, inode, size, mtime) and the
    object each became. A file that is one of them (an incremental save hard-linked it from an
    older checkpoint) is copied server-side from that object where the target can
    (``S3Storage.copy_within``) and the object is still there; else it is uploaded."""
    metadata_blob = read_all(source, METADATA_NAME)
    metadata = load_metadata(io.BytesIO(metadata_blob), source.describe(METADATA_NAME))
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    target.makedirs()
    if target.exists(METADATA_NAME):  # an earlier copy: uncommit before replacing data
        target.remove(METADATA_NAME)
    sizes = {}
    for name in files:
        sizes[name] = _copy_or_link(source, target, name, uploaded)
    target.check_sizes(sizes)
    manifest = read_all(source, MANIFEST_NAME) if source.exists(MANIFEST_NAME) else None
    # A save of the same step overwrites the local files while they are read: it removes
    # the local .metadata before writing any data (and commits one of its own, with a new
    # save id, after), so the same .metadata now means the bytes copied are all its own (a
    # user sweep: the remote committed a mix of two saves). The remote stays uncommitted.
    if not source.exists(METADATA_NAME) or read_all(source, METADATA_NAME) != metadata_blob:
        raise Superseded()
    if manifest is not None:
        target.put_atomic(MANIFEST_NAME, manifest, sync=True)
    target.put_atomic(METADATA_NAME, metadata_blob, sync=True)
    return metadata_blob


def digest(metadata_blob: bytes) -> bytes:
    """Identifies one save of a step: its ``.metadata`` holds the save's own id."""
    return hashlib.blake2b(metadata_blob, digest_size=16).digest()


def read_all(storage: Storage, name: str) -> bytes:
    with storage.open_read(name) as f:
        return f.read()


def _copy_or_link(
    source: Storage, target: Storage, name: str, uploaded: dict[tuple[int, ...], str] | None
) -> int:
    copy_within = getattr(target, "copy_within", None)
    if uploaded is None or copy_within is None or not isinstance(source, LocalStorage):
        return _copy_file(source, target, name)
    st = os.stat(source.describe(name))
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = uploaded.get(ident)
    if known is not None:
        try:
            copy_within(name, known, st.st_size)
            uploaded[ident] = target.key(name)  # type: ignore[attr-defined]
            return st.st_size
        except OSError as exc:  # the older object is gone (remote retention): upload it
            logger.info("uploading %s: no server-side copy from %s (%s)", name, known, exc)
    copied = _copy_file(source, target, name)
    uploaded[ident] = target.key(name)  # type: ignore[attr-defined]
    return copied


def _copy_file(source: Storage, target: Storage, name: str) -> int:
    copied = 0
    with source.open_read(name) as src, target.open_write(name, sync=True) as dst:
        while chunk := src.read(_COPY_BYTES):
            dst.write(chunk)
            copied += len(chunk)
    return copied
