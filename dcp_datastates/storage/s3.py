"""Checkpoints on S3-compatible object stores, through s3fs's client but with our own requests.

Why not ``s3fs.S3File``: it uploads a part synchronously inside ``write()`` (the flush thread
stops while the part travels), copies every byte into a growing ``BytesIO``, and its retries
cover some errors and not others (a 503 without "SlowDown" in its text fails at once). Here:

* **Streaming writes.** Each data object is a multipart upload. ``write()`` fills a part buffer
  and hands full parts to s3fs's event loop, up to ``parts_in_flight`` per object at once, so an
  object holds at most ``(parts_in_flight + 1) * part_bytes`` of upload buffers; the pool pieces
  were copied out and released when ``write()`` returned, as on disk. Objects smaller than one
  part go up as a single PUT.
* **Commit without rename.** Nothing is renamed: the commit checks each data object's size with a
  fresh HEAD (never a cached listing), then PUTs the manifest, then ``.metadata`` as the last
  single PUT. A prefix without ``.metadata`` is not a checkpoint.
* **Bounded retries.** Every request is retried with exponential back-off and jitter on
  transient failures (5xx, throttling, timeouts, resets); botocore's own retries are turned off
  unless configured, so the bound is ours. Permanent ones (403, no such bucket) fail at once with
  :class:`ObjectStoreError` naming the bucket, key and cause. (The requests and their retry loop
  live in :mod:`dcp_datastates.storage._s3_client`.)
* **No orphans.** A failed object aborts its multipart upload; ``makedirs`` (every rank, before
  any rank writes) aborts uploads an earlier crashed save left under the prefix.
* **Ranged reads.** ``open_ranged`` serves ``read_into`` with a ranged GET whose body streams
  straight into the caller's buffers.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import threading
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, BinaryIO

import fsspec

from ._s3_client import ObjectStoreError, RetryPolicy, _Client, classify

#: The largest object one ``CopyObject`` copies (S3's limit); larger ones copy in parts.
_COPY_OBJECT_MAX = 5 << 30

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Defaults of ``part_bytes`` and ``parts_in_flight`` (``docs/storage.md``, "Settings").
PART_BYTES = 16 * MiB
PARTS_IN_FLIGHT = 2


class _MultipartWriter(io.RawIOBase):
    """A write-only object: parts are uploaded while later ones are still being written."""

    def __init__(self, client: _Client, key: str, part_bytes: int, parts_in_flight: int) -> None:
        super().__init__()
        self.client, self.key, self.part_bytes = client, key, part_bytes
        self.buf = bytearray()
        self.size = 0
        self.upload_id: str | None = None
        self.parts: list[Future[Any]] = []
        self.slots = threading.Semaphore(parts_in_flight)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        while view.nbytes:
            take = min(self.part_bytes - len(self.buf), view.nbytes)
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) == self.part_bytes:
                self._send_part()
        self.size += n
        return n

    def _send_part(self) -> None:
        for done in self.parts:  # fail fast: a part that failed for good ends the object
            if done.done() and done.exception() is not None:
                raise done.exception()
        if self.upload_id is None:
            self.upload_id = self.client("create_multipart_upload", self.key)["UploadId"]
        self.slots.acquire()  # at most parts_in_flight bodies travel at once
        body, self.buf = bytes(self.buf), bytearray()
        part = self.client.submit(
            "upload_part",
            self.key,
            Body=body,
            UploadId=self.upload_id,
            PartNumber=len(self.parts) + 1,
        )
        part.add_done_callback(lambda _: self.slots.release())
        self.parts.append(part)

    def finish(self) -> None:
        """Complete the object: the last part and CompleteMultipartUpload, or one PUT."""
        if self.upload_id is None:
            self.client("put_object", self.key, Body=bytes(self.buf))
            return
        if self.buf:
            self._send_part()
        etags = [
            {"PartNumber": i + 1, "ETag": p.result()["ETag"]} for i, p in enumerate(self.parts)
        ]
        self.client(
            "complete_multipart_upload",
            self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": etags},
        )

    def abandon(self) -> None:
        """Abort the multipart upload, so that no orphaned parts stay billed and listed."""
        for part in self.parts:
            with contextlib.suppress(Exception):
                part.result()
        if self.upload_id is not None:
            try:
                self.client("abort_multipart_upload", self.key, UploadId=self.upload_id)
            except ObjectStoreError as exc:
                logger.warning(
                    "could not abort the upload of %s (%s); it stays listed", exc.filename, exc
                )


class _S3RangedFile:
    """Ranged GETs streamed straight into the caller's buffers; safe from many threads.

    Small reads (a stock record's header, probed before its data is located) are served from a
    few cached 1 MiB blocks, so that probing a record does not cost a round trip per probe.
    """

    _STEP = 1 * MiB
    _SMALL = 64 << 10
    _BLOCK = 1 * MiB
    _BLOCKS = 8

    def __init__(self, client: _Client, key: str) -> None:
        self.client, self.key = client, key
        self._lock = threading.Lock()
        self._blocks: dict[int, bytes] = {}  # block index -> bytes (short at end of object)

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        targets = [b.cast("B") for b in buffers if b.nbytes]
        want = sum(b.nbytes for b in targets)
        if not want:
            return 0
        if want <= self._SMALL:
            return self._read_small(offset, targets, want)
        return self._get(offset, targets, want)

    def _block(self, index: int) -> bytes:
        with self._lock:
            data = self._blocks.get(index)
        if data is None:
            buf = bytearray(self._BLOCK)
            got = self._get(index * self._BLOCK, [memoryview(buf)], self._BLOCK)
            data = bytes(buf[:got])
            with self._lock:
                if len(self._blocks) >= self._BLOCKS:
                    self._blocks.pop(next(iter(self._blocks)))
                self._blocks[index] = data
        return data

    def _read_small(self, offset: int, targets: list[memoryview], want: int) -> int:
        data = bytearray()
        pos = offset
        while len(data) < want:
            block = self._block(pos // self._BLOCK)
            piece = block[pos % self._BLOCK : pos % self._BLOCK + want - len(data)]
            if not piece:
                break
            data += piece
            pos += len(piece)
            if len(block) < self._BLOCK:
                break  # the object ends in this block
        done = 0
        for t in targets:
            n = min(t.nbytes, len(data) - done)
            t[:n] = data[done : done + n]
            done += n
        return done

    def _get(self, offset: int, targets: list[memoryview], want: int) -> int:

        async def sink(body: Any) -> int:
            got, i, pos = 0, 0, 0  # pos: bytes filled in targets[i]
            async with body:
                while i < len(targets):
                    chunk = await body.read(min(self._STEP, targets[i].nbytes - pos))
                    if not chunk:
                        break
                    targets[i][pos : pos + len(chunk)] = chunk
                    got, pos = got + len(chunk), pos + len(chunk)
                    if pos == targets[i].nbytes:
                        i, pos = i + 1, 0
            return got

        try:
            return self.client(
                "get_object", self.key, sink, Range=f"bytes={offset}-{offset + want - 1}"
            )
        except ObjectStoreError as exc:
            if exc.code == "InvalidRange":  # reading at or past the end
                return 0
            raise

    def close(self) -> None:
        pass


class S3Storage:
    """A checkpoint prefix ``s3://bucket/path`` on an S3-compatible store.

    Args:
        url: ``s3://bucket/prefix``.
        storage_options: Passed to ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``, ``secret``,
            ``client_kwargs``, ``config_kwargs``, ...); fsspec's config and the AWS environment
            variables apply as usual. Four keys are ours and override the arguments below:
            ``retry`` (a :class:`RetryPolicy`), ``part_bytes``, ``parts_in_flight`` and
            ``spread_prefixes``.
        part_bytes: Size of a multipart part (at least 5 MiB, S3's minimum).
        parts_in_flight: Parts of one object uploading at once.
        spread_prefixes: 0 (the default): data objects sit directly under the checkpoint's
            prefix, as stock writes them. N > 0: each rank's objects go under one of N
            sub-prefixes named by a hash of the rank (``3a/__5_0.distcp``), so that a store
            that throttles per prefix (S3: about 3,500 PUT/s each) can split the requests of
            thousands of ranks flushing at once over N partitions. ``.metadata`` records the
            relative paths, so stock ``FsspecReader`` (and ours) reads such a checkpoint.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        part_bytes: int = PART_BYTES,
        parts_in_flight: int = PARTS_IN_FLIGHT,
        spread_prefixes: int = 0,
    ) -> None:
        options = dict(storage_options or {})
        retry = options.pop("retry", None) or RetryPolicy()
        part_bytes = options.pop("part_bytes", part_bytes)
        parts_in_flight = options.pop("parts_in_flight", parts_in_flight)
        spread_prefixes = options.pop("spread_prefixes", spread_prefixes)
        if part_bytes < 5 * MiB:
            raise ValueError(f"part_bytes={part_bytes!r} is below S3's 5 MiB minimum part size")
        if type(spread_prefixes) is not int or not 0 <= spread_prefixes <= 4096:
            raise ValueError(f"spread_prefixes={spread_prefixes!r} is not an int from 0 to 4096")
        self.spread_prefixes = spread_prefixes
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "max_attempts": 1})  # ours bound them
        options["config_kwargs"] = config
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.bucket, _, prefix = root.partition("/")
        self.prefix = prefix.strip("/")
        self.url = url.rstrip("/")
        self.root = root
        self.part_bytes, self.parts_in_flight = part_bytes, parts_in_flight
        self.client = _Client(self.fs, self.bucket, retry)

    #: Load I/O shape for :class:`~dcp_datastates.load.fetch.FetchOptions`: each GET costs a round
    #: trip, so neighbours share reads up to 8 MiB and big records go in 16 MiB ranges.
    read_hints = {
        "coalesce_bytes": 8 * MiB,
        "span_bytes": 32 * MiB,
        "gap_bytes": 1 * MiB,
        "split_bytes": 16 * MiB,
    }

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def data_dir(self, rank: int) -> str:
        """Where rank ``rank``'s data objects go, relative to the checkpoint: ``""``, or with
        ``spread_prefixes`` a sub-prefix named by a hash of the rank (``"3a/"``)."""
        n = self.spread_prefixes
        if not n:
            return ""
        width = len(f"{n - 1:x}")
        return f"{zlib.crc32(str(rank).encode()) % n:0{width}x}/"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def makedirs(self) -> None:
        """Check the bucket (a wrong name fails here, fast) and abort stale uploads."""
        self.client("head_bucket", None)
        self.abort_stale_uploads()

    def abort_stale_uploads(self) -> int:
        """Abort multipart uploads under this prefix (left by a save that crashed)."""
        out = self.client("list_multipart_uploads", None, Prefix=self.key(""))
        uploads = out.get("Uploads", [])
        for up in uploads:
            with contextlib.suppress(ObjectStoreError):
                self.client("abort_multipart_upload", up["Key"], UploadId=up["UploadId"])
        return len(uploads)

    def size(self, name: str) -> int | None:
        """Size of ``name`` from a fresh HEAD (``None`` if absent): never a cached listing."""
        try:
            return int(self.client("head_object", self.key(name))["ContentLength"])
        except ObjectStoreError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def copy_within(self, name: str, source_key: str, size: int) -> None:
        """Make ``name`` a server-side copy of the object ``source_key`` of the same bucket
        (``size`` bytes): one ``CopyObject`` up to 5 GB, else a multipart upload of
        ``UploadPartCopy`` ranges. No byte passes through this process. Raises
        :class:`ObjectStoreError` (``errno.ENOENT`` where the source is gone)."""
        source = {"Bucket": self.bucket, "Key": source_key}
        key = self.key(name)
        if size <= _COPY_OBJECT_MAX:
            self.client("copy_object", key, CopySource=source)
            return
        upload = self.client("create_multipart_upload", key)["UploadId"]
        try:
            parts = []
            step = max(self.part_bytes, 512 * MiB)
            for number, start in enumerate(range(0, size, step), start=1):
                stop = min(size, start + step) - 1
                out = self.client(
                    "upload_part_copy",
                    key,
                    UploadId=upload,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{stop}",
                )
                parts.append({"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]})
            self.client(
                "complete_multipart_upload",
                key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(ObjectStoreError):
                self.client("abort_multipart_upload", key, UploadId=upload)
            raise

    def remove(self, name: str) -> None:
        self.client("delete_object", self.key(name))

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool) -> Iterator[BinaryIO]:
        writer = _MultipartWriter(
            self.client, self.key(name), self.part_bytes, self.parts_in_flight
        )
        try:
            yield writer  # type: ignore[misc]
            writer.finish()
        except BaseException:
            writer.abandon()
            raise

    def put_atomic(self, name: str, data: bytes, *, sync: bool) -> None:
        """One PUT: the object appears whole or not at all (no rename, which S3 lacks)."""
        self.client("put_object", self.key(name), Body=bytes(data))

    def sync_dirs(self, *, parents: bool = False) -> None:
        """Nothing to do: an object store has no directories; an object is durable once its
        PUT or CompleteMultipartUpload returned."""

    def check_sizes(self, expected: Mapping[str, int]) -> None:
        """Refuse to commit unless every object is there with the size written (fresh HEADs)."""
        futures = {n: self.client.submit("head_object", self.key(n)) for n in expected}
        for name, fut in futures.items():
            try:
                got: int | None = int(fut.result()["ContentLength"])
            except ObjectStoreError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                got = None
            if got != expected[name]:
                raise ObjectStoreError(
                    errno.EIO,
                    f"{self.describe(name)} is {'missing' if got is None else f'{got} bytes'} but "
                    f"the save wrote {expected[name]} bytes; not committing this checkpoint "
                    "(another writer on the same prefix?); save again",
                    bucket=self.bucket,
                    key=self.key(name),
                    operation="head_object",
                    code="SizeMismatch",
                )

    def open_read(self, name: str) -> BinaryIO:
        path = f"{self.root.rstrip('/')}/{name}"
        self.fs.invalidate_cache(path)  # its size must come from a fresh HEAD
        return self.fs.open(path, "rb")

    def open_ranged(self, name: str) -> _S3RangedFile:
        return _S3RangedFile(self.client, self.key(name))

    def list_names(self) -> list[str]:
        """Names directly under the prefix, listed fresh (``ListObjectsV2``, all pages)."""
        names: list[str] = []
        token: dict[str, str] = {}
        while True:
            out = self.client("list_objects_v2", None, Prefix=self.key(""), Delimiter="/", **token)
            names += [o["Key"].rsplit("/", 1)[-1] for o in out.get("Contents", [])]
            names += [
                p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in out.get("CommonPrefixes", [])
            ]
            if not out.get("IsTruncated"):
                return sorted(names)
            token = {"ContinuationToken": out["NextContinuationToken"]}


__all__ = ["ObjectStoreError", "RetryPolicy", "S3Storage", "classify"]
