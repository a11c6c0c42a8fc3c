"""Incremental saves (``WriterOptions.incremental``): a host tensor that provably did not change
since this writer's last committed save is neither copied into the pool nor written again; the
data file that holds its record in that checkpoint is hard-linked whole into the new one.

Every checkpoint stays complete and self-standing. A hard link is a second name of one file:
stock ``FileSystemReader`` reads the new checkpoint alone, at the offsets and lengths of the
older one's ``.metadata`` (the storage infos name the link, in the new directory), and removing
the older checkpoint (retention, ``rm -r``) leaves the file to the newer. The manifest entry,
CRC-32C included, carries over, so ``verify`` checks a linked record as any other.

The rule (:func:`reuse`, on the planning thread, before the snapshot is laid out, so a reused
item is never copied): the record of item K in the last checkpoint this writer committed on
this rank is reused only if

1. K is a host tensor of a plain ``TensorProvider`` (not an eager copy, not a shard), contiguous,
   and its record there is a tensor record of the same length;
2. the cheap evidence did not move since that save: the same storage address and offset, version
   counter, dtype, shape and stride (a trained tensor stops here and costs nothing more);
3. that checkpoint is still committed and says so: its commit record exists, its manifest lists
   the very record (path, offsets, CRC-32C), and the file is the one this writer wrote (same
   inode, size and modification time);
4. content proof: the CRC-32C of the record this save would write (frame head, the tensor's
   bytes as they are now, frame tail) equals the one recorded. This is what catches the writes
   the evidence in (2) cannot see: NumPy writes through ``t.numpy()`` or ``from_numpy``, a new
   tensor allocated where a freed one was, anything writing raw memory. A full read of the
   tensor, about 15 GB/s on one core here, against 0.3-1.5 GB/s for a copy and a durable write;
5. nothing wrote the tensor between ``stage()`` and the end of that read (version counter, no
   copy-on-write freeze), checked after it;
6. the file is worth linking: the records reused from it make at least :data:`LINK_MIN_SHARE`
   of its bytes (the rest is dead weight the new checkpoint keeps alive once the older one is
   deleted; records of the file that changed are written to this save's own files).

Anything else is written, as without the option. What the rule cannot see: a change that keeps
the record's CRC-32C (2^-32 for a random change; CRC-32C catches every burst of up to 32 bits),
and, as for every lazy snapshot, a NumPy write after ``stage()`` returned: one before (4) read
the tensor is written with it, as a lazy copy would take it (README, "Copy-on-write"); one
after leaves the linked, stage-time record. Evidence lives in the writer's memory only: a new
process (or writer) writes its first save in full, unless it is seeded with the last committed
checkpoint (:func:`seed`; ``Checkpointer`` does it with its newest step), whose records it then
reuses on the content proof alone. A checkpoint on an object store is written in full (tiered
uploads copy linked files server-side instead, ``checkpointers/mirror.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from crc32c import crc32c
from torch.distributed.checkpoint.storage import WriteResult

from ..format import (
    DATA_SUFFIX,
    LINKED_DATA,
    RecordInfo,
    decode_manifest,
    manifest_key,
    manifest_name,
)
from ..format import metadata_name as _metadata_name
from ..providers.tensor import TensorProvider
from ..storage.base import LocalStorage, Storage, is_local

logger = logging.getLogger(__name__)

#: A previous data file is linked only if the records reused from it are at least this share of
#: its bytes.
LINK_MIN_SHARE = 0.5
#: Threads that read candidates for their content proof at once.
PROOF_THREADS = 4


def _key(index: Any) -> str:
    return manifest_key(index.fqn, index.offset)


def evidence_of(provider: Any) -> tuple[Any, ...] | None:
    """The cheap evidence (rule 2) of ``provider``'s tensor as ``stage()`` saw it, or None where
    it is not a candidate at all (rule 1) or a write since ``stage()`` is known (rule 5)."""
    if type(provider) is not TensorProvider or provider.private or provider.nbytes == 0:
        return None
    # TensorProvider's own state (providers/tensor.py is at the module size limit).
    live = provider.source
    if (
        live is None
        or not live.is_cpu
        or not live.is_contiguous()
        or provider._owner is not None
        or provider._frozen is not None
        or provider._torn is not None
        or provider._now(live) != provider._version
    ):
        return None
    return (
        live.untyped_storage().data_ptr(),
        live.storage_offset(),
        provider._version,
        live.dtype,
        tuple(live.shape),
        live.stride(),
    )


def record_crc(provider: TensorProvider) -> int:
    """CRC-32C of the record the flush would write for ``provider`` now (rule 4)."""
    live = provider.source
    assert live is not None
    frame = provider.frame
    data = memoryview(live.detach().reshape(-1).view(dtype=torch.uint8).numpy()).cast("B")
    return crc32c(frame.tail, value=crc32c(data, value=crc32c(frame.head)))


class _Source:
    """An older data file, opened when its records are proven: what is linked is that very file
    even if its name is removed (retention) or replaced (a save over that checkpoint) before
    the flush links it; then it is copied from the open file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "rb")  # noqa: SIM115 - closed by link() or release()
        self.inode = os.fstat(self.file.fileno()).st_ino

    def close(self) -> None:
        self.file.close()


class LinkedProvider:
    """An item whose record is reused: nothing to copy (``nbytes`` 0), nothing to write; the
    flush links ``older_file`` into the new checkpoint and reports ``info`` there."""

    kind = "tensor"
    nbytes = 0
    frame = None
    payload = None

    def __init__(
        self, fqn: str, provider: TensorProvider, info: RecordInfo, source: _Source
    ) -> None:
        self.fqn = fqn
        self.shape, self.dtype = provider.shape, provider.dtype
        self.info = info
        # The file in the older checkpoint (not ``source``: the snapshot reads a provider's
        # ``source`` as the tensor it copies from).
        self.older_file = source
        self.evidence = evidence_of(provider)

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        return []

    def copy_into(self, dst: Any, start: int, stop: int) -> None:  # pragma: no cover
        raise AssertionError(f"{self.fqn!r} is linked, never copied")

    def check_unchanged(self, rank: int) -> None:
        pass

    def release(self) -> None:
        self.older_file.close()


@dataclass
class _Committed:
    """One rank's records of a save of this writer, once its flush ended."""

    root: str
    commit_rank: int | None
    records: dict[str, tuple[RecordInfo, tuple[Any, ...]]]
    files: dict[str, tuple[int, int, int]]  # name -> (inode, size, mtime_ns)


class IncrementalMemo:
    """A writer's last save per rank (:func:`remember`), which the next one may reuse."""

    def __init__(self) -> None:
        self._last: dict[int, _Committed] = {}

    def last(self, rank: int) -> _Committed | None:
        return self._last.get(rank)

    def put(self, rank: int, committed: _Committed | None) -> None:
        if committed is None:
            self._last.pop(rank, None)
        else:
            self._last[rank] = committed


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _committed_manifest(last: _Committed) -> dict[str, RecordInfo] | None:
    """Rule 3: the manifest of ``last``'s checkpoint if it is committed, else None."""
    root = last.root
    if not os.path.exists(os.path.join(root, _metadata_name(last.commit_rank))):
        return None
    try:
        with open(os.path.join(root, manifest_name(last.commit_rank)), "rb") as f:
            return decode_manifest(f.read(), root)
    except (OSError, ValueError) as exc:
        logger.info("not reusing %s: %s", root, exc)
        return None


def reuse(items: list[tuple[Any, Any]], memo: IncrementalMemo, path: str, rank: int) -> int:
    """Replace, in place, the providers of ``items`` whose records the last committed save of
    this writer on ``rank`` holds, by :class:`LinkedProvider`; returns the bytes reused."""
    last = memo.last(rank)
    if last is None or not is_local(path) or _abs(path) == last.root:
        return 0
    by_file: dict[str, list[tuple[int, RecordInfo]]] = {}
    for i, (item, provider) in enumerate(items):
        found = last.records.get(_key(item.index))
        if found is None:
            continue
        ev = evidence_of(provider)
        if ev is None or (found[1] is not None and found[1] != ev):  # None: seeded, see seed()
            continue
        info = found[0]
        if info.kind == "tensor" and info.data_length == provider.nbytes:
            by_file.setdefault(info.relative_path, []).append((i, info))
    if not by_file:
        return 0
    manifest = _committed_manifest(last)
    if manifest is None:
        return 0
    files: dict[str, tuple[str, int, list[tuple[int, RecordInfo]]]] = {}
    for name, candidates in by_file.items():
        source = os.path.join(last.root, name)
        known = last.files.get(name)
        if known is None or _stat(source) != known:
            continue
        if sum(info.length for _, info in candidates) < LINK_MIN_SHARE * known[1]:
            continue  # before reading anything
        files[name] = (source, known[1], candidates)
    # Opened before the proofs: the file proven (same inode as when written) is the one linked.
    opened: dict[str, _Source] = {}
    for name, (source, _, _) in list(files.items()):
        try:
            opened[name] = _Source(source)
        except OSError:
            del files[name]
            continue
        if opened[name].inode != last.files[name][0]:
            opened.pop(name).close()
            del files[name]
    proven = _prove([c for _, _, cs in files.values() for c in cs], items, manifest)
    reused = 0
    for name, (_, size, candidates) in files.items():
        good = [(i, info) for i, info in candidates if i in proven]
        if sum(info.length for _, info in good) < LINK_MIN_SHARE * size:
            opened[name].close()
            continue
        for i, info in good:
            item, provider = items[i]
            items[i] = (item, LinkedProvider(provider.fqn, provider, info, opened[name]))
            reused += info.data_length
    if reused:
        logger.info("rank %d: %.1f MB unchanged since %s, linked", rank, reused / 1e6, last.root)
    return reused


def _prove(
    candidates: list[tuple[int, RecordInfo]],
    items: list[tuple[Any, Any]],
    manifest: dict[str, RecordInfo],
) -> set[int]:
    """The indices in ``items`` of ``candidates`` whose committed record is theirs and whose
    bytes give its CRC-32C now, with no write since ``stage()`` (rules 3-5). The reads run on
    up to :data:`PROOF_THREADS` threads (``crc32c`` lets the GIL go for big buffers)."""

    def proves(candidate: tuple[int, RecordInfo]) -> bool:
        i, info = candidate
        item, provider = items[i]
        if manifest.get(_key(item.index)) != info:
            return False
        before = evidence_of(provider)
        if before is None or record_crc(provider) != info.crc32c:
            return False
        return evidence_of(provider) == before  # rule 5: not written while we read it

    if len(candidates) <= 1:
        return {i for i, info in candidates if proves((i, info))}
    workers = min(PROOF_THREADS, os.cpu_count() or 1, len(candidates))
    with ThreadPoolExecutor(workers, thread_name_prefix="datastates-proof") as pool:
        verdicts = list(pool.map(proves, candidates))
    return {i for (i, _), ok in zip(candidates, verdicts, strict=True) if ok}


def split_linked(items: Sequence[Any], providers: dict[Any, Any]) -> tuple[list[Any], list[Any]]:
    """``items`` to write, and those whose records are linked."""
    write, linked = [], []
    for item in items:
        (linked if type(providers.get(item.index)) is LinkedProvider else write).append(item)
    return write, linked


def link(
    storage: Storage, items: Sequence[Any], providers: dict[Any, Any], prefix: str, *, sync: bool
) -> list[WriteResult]:
    """Link each older file holding ``items``' records into ``storage`` as
    ``{prefix}k{n}.distcp``; their results, with the records' offsets and checksums. Where the
    file system refuses the link (another device, no hard links), the file is copied: its
    records were proven to hold this save's bytes."""
    if not items:
        return []
    if not isinstance(storage, LocalStorage):  # pragma: no cover - reuse() checked the path
        raise AssertionError("incremental links need a local checkpoint")
    names: dict[_Source, str] = {}
    results = []
    for item in items:
        provider: LinkedProvider = providers[item.index]
        source = provider.older_file
        name = names.get(source)
        if name is None:
            name = names[source] = f"{prefix}k{len(names)}{DATA_SUFFIX}"
            _link(source, storage.describe(name), sync=sync)
        info = replace(provider.info, relative_path=name)
        # size_in_bytes: what this save wrote for it (SaveStats.bytes_written sums them).
        results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=info))
    for source in names:
        source.close()
    return results


def _link(source: _Source, target: str, *, sync: bool) -> None:
    """``target`` becomes a hard link of ``source``'s file, or, where the file system refuses
    one or the name now holds another file, a copy of the open file."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    try:
        os.link(source.path, target)
        if os.stat(target).st_ino == source.inode:
            return
        os.unlink(target)
        why = "the older checkpoint's file was replaced"
    except OSError as exc:
        why = str(exc)
    logger.info("copying %s to %s (no hard link: %s)", source.path, target, why)
    source.file.seek(0)
    with open(target, "wb") as dst:
        shutil.copyfileobj(source.file, dst, 16 << 20)
        dst.flush()
        if sync:
            os.fsync(dst.fileno())


def linked_bytes(results: list[WriteResult]) -> int:
    """Bytes of the records in ``results`` that :func:`link` reused."""
    return sum(
        r.storage_data.length
        for r in results
        if r.size_in_bytes == 0
        and isinstance(r.storage_data, RecordInfo)
        and LINKED_DATA.match(r.storage_data.relative_path)
    )


def evidence(items: Sequence[Any], providers: dict[Any, Any]) -> dict[str, tuple[Any, ...]]:
    """Each candidate item's evidence as its flush starts (the providers are released after)."""
    found = {}
    for item in items:
        provider = providers.get(item.index)
        ev = provider.evidence if type(provider) is LinkedProvider else evidence_of(provider)
        if ev is not None:
            found[_key(item.index)] = ev
    return found


def remember(
    memo: IncrementalMemo | None,
    *,
    path: str,
    rank: int,
    commit_rank: int | None,
    results: list[WriteResult],
    found: dict[str, tuple[Any, ...]] | None,
) -> None:
    """A save's flush ended on ``rank``: its records become what the next save may reuse (once
    its checkpoint is committed, which :func:`reuse` checks)."""
    if memo is None:
        return
    if found is None or not is_local(path):
        memo.put(rank, None)
        return
    root = _abs(path)
    records = {}
    files: dict[str, tuple[int, int, int]] = {}
    for wr in results:
        info: RecordInfo = wr.storage_data
        key = _key(wr.index)
        ev = found.get(key)
        if ev is None:
            continue
        if info.relative_path not in files:
            st = _stat(os.path.join(root, info.relative_path))
            if st is None:
                continue
            files[info.relative_path] = st
        records[key] = (info, ev)
    memo.put(rank, _Committed(root, commit_rank, records, files))


def seed(writer: Any, path: str, rank: int) -> int:
    """A writer in a new process: let its first save reuse this rank's records of the committed
    checkpoint at ``path`` (a ``Checkpointer`` passes its newest step). Without evidence from
    this process, each record is reused on its content proof alone (rules 1, 3-6: the tensor's
    bytes must give the record's CRC-32C), so that save reads every host tensor whose record
    matches in length once. Returns the records offered; 0 where the writer is not incremental,
    already saved, or ``path`` is not a committed local checkpoint."""
    memo = getattr(getattr(writer, "_staging", None), "increments", None)
    if memo is None or memo.last(rank) is not None or not is_local(path):
        return 0
    root = _abs(path)
    manifest = _committed_manifest(_Committed(root, None, {}, {}))
    if manifest is None:
        return 0
    records: dict[str, tuple[RecordInfo, tuple[Any, ...] | None]] = {}
    files: dict[str, tuple[int, int, int]] = {}
    for key, info in manifest.items():
        name = info.relative_path
        if info.kind != "tensor" or not name.startswith(f"__{rank}_"):
            continue
        if name not in files:
            st = _stat(os.path.join(root, name))
            if st is None:
                continue
            files[name] = st
        records[key] = (info, None)
    memo.put(rank, _Committed(root, None, records, files))  # type: ignore[arg-type]
    return len(records)


def _abs(path: str) -> str:
    return os.path.abspath(path[len("file://") :] if path.startswith("file://") else path)
