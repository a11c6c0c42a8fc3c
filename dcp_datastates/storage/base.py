"""Where checkpoint bytes go: a local fast path and any fsspec URL, behind one small protocol.

This is the one place that owns "open for write, fsync, remove on failure" and the atomic
commit of a small file.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO, Protocol

import fsspec

from ..errors import StorageWriteError
from .localfile import DirectFile

_BUFFER = 4 << 20


class Storage(Protocol):
    """A checkpoint directory."""

    root: str

    def describe(self, name: str) -> str:
        """Full path or URL of ``name``, for messages."""
        ...

    def makedirs(self) -> None: ...

    def exists(self, name: str) -> bool: ...

    def remove(self, name: str) -> None:
        """Remove ``name`` if it exists."""
        ...

    def open_write(self, name: str, *, sync: bool) -> contextlib.AbstractContextManager[BinaryIO]:
        """A file for ``name`` that is made durable when the block ends normally (one fsync when
        ``sync``) and removed when it ends with an error."""
        ...

    def put_atomic(self, name: str, data: bytes, *, sync: bool) -> None:
        """Make ``name`` hold ``data`` in one step: readers see the old state or the new one.
        Locally a temp file, fsync, rename and directory fsync; on an object store one PUT."""
        ...

    def check_sizes(self, expected: Mapping[str, int]) -> None:
        """Raise unless each file in ``expected`` exists with that many bytes, as seen now (no
        cached listing). The commit calls it before the manifest and ``.metadata``."""
        ...

    def open_read(self, name: str) -> BinaryIO: ...

    def open_ranged(self, name: str) -> RangedFile:
        """``name`` for positional reads from many threads at once."""
        ...

    def list_names(self) -> list[str]:
        """Names of the files in the directory (empty if it does not exist)."""
        ...

    def sync_dirs(self, *, parents: bool = False) -> None:
        """Make the directory's entries (and with ``parents`` the directories above it) durable."""
        ...


class RangedFile(Protocol):
    """A file read by position, safe to use from several threads at once."""

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        """Fill ``buffers`` in order from ``offset``; fewer bytes than asked only at end of file."""
        ...

    def close(self) -> None: ...


class _LocalRangedFile:
    """``preadv`` into the caller's buffers: no intermediate copy, no shared file position."""

    _MAX_IOV = 512  # below IOV_MAX on every platform we run on
    _MAX_CALL = 1 << 30  # Linux transfers at most ~2 GiB per call

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # loads read front to back: ask for deep read-ahead
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        if len(buffers) == 1:  # a piece of a checked read (checksum.py): one call, no copies
            got = os.preadv(self.fd, buffers, offset)
            if got == buffers[0].nbytes or not got:
                return got
            return got + self.read_into(offset + got, [buffers[0].cast("B")[got:]])
        pending = [b.cast("B") for b in buffers if b.nbytes]
        total = 0
        while pending:
            batch, size = [], 0
            for b in pending[: self._MAX_IOV]:
                if size + b.nbytes > self._MAX_CALL:
                    if not batch:
                        batch.append(b[: self._MAX_CALL])
                    break
                batch.append(b)
                size += b.nbytes
            got = os.preadv(self.fd, batch, offset + total)
            if got == 0:
                break  # end of file
            total += got
            while got:  # drop what was filled, keep the rest of a partly filled buffer
                if got >= pending[0].nbytes:
                    got -= pending[0].nbytes
                    pending.pop(0)
                else:
                    pending[0] = pending[0][got:]
                    got = 0
        return total

    def close(self) -> None:
        os.close(self.fd)


class _FsspecRangedFile:
    """Byte-range requests (``cat_file``), which object stores serve in parallel."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        want = sum(b.nbytes for b in buffers)
        if not want:
            return 0
        data = memoryview(self.fs.cat_file(self.path, start=offset, end=offset + want))
        pos = 0
        for b in buffers:
            n = min(b.nbytes, data.nbytes - pos)
            b.cast("B")[:n] = data[pos : pos + n]
            pos += n
        return pos

    def close(self) -> None:
        pass


def _write_error(exc: OSError, where: str, rank: int | None = None) -> StorageWriteError:
    who = f"rank {rank}: " if rank is not None else ""
    hint = (
        " (ENOSPC: the device is full; free space or save elsewhere)"
        if exc.errno == errno.ENOSPC
        else ""
    )
    err = StorageWriteError(exc.errno or errno.EIO, f"{who}writing {where} failed: {exc}{hint}")
    err.filename = where
    return err


def _unshare(path: str) -> None:
    """A file with other hard links (an incremental save linked it into another checkpoint) is
    unlinked before it is written: truncated in place, it would change that checkpoint too."""
    try:
        if os.stat(path).st_nlink > 1:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on a local (or locally mounted) file system."""

    def __init__(self, root: str | os.PathLike, *, direct: bool = True) -> None:
        self.direct = direct  # O_DIRECT for files that are fsynced (see open_write)
        path = os.fspath(root)
        if path.startswith("file://"):
            path = path[len("file://") :]
        self.root = os.path.abspath(path)

    def describe(self, name: str) -> str:
        return os.path.join(self.root, name)

    def makedirs(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"checkpoint path {self.root} exists and is not a directory; pick another path",
                self.root,
            )
        os.makedirs(self.root, exist_ok=True)

    def exists(self, name: str) -> bool:
        return os.path.exists(self.describe(name))

    def remove(self, name: str) -> None:
        path = self.describe(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError as exc:  # a bare "[Errno 21] Is a directory" (a user sweep)
            raise IsADirectoryError(
                exc.errno, f"{path} is a directory where a checkpoint file belongs; move it away"
            ) from exc

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool) -> Iterator[BinaryIO]:
        """With ``sync`` the file is written with ``O_DIRECT`` where the file system allows it
        (``localfile.py``): a file that will be fsynced anyway skips the page cache's copy and
        its writeback at ``fsync``. Same signature as the protocol's: subclasses (tests, users
        injecting faults) override it as before, and ``put_atomic`` goes through it."""
        path = self.describe(name)
        _unshare(path)
        f: Any = DirectFile.open(path) if sync and self.direct else None
        if f is None:
            f = open(path, "wb", buffering=_BUFFER)  # noqa: SIM115 - closed below on every path
        try:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
            f.close()
        except BaseException:
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def put_atomic(self, name: str, data: bytes, *, sync: bool) -> None:
        tmp = f"{name}.tmp"
        with self.open_write(tmp, sync=sync) as f:
            f.write(data)
        os.replace(self.describe(tmp), self.describe(name))
        if sync:
            self.sync_dirs()

    def sync_dirs(self, *, parents: bool = False) -> None:
        """``fsync`` the directory, so that files created, renamed or removed in it survive a
        power loss; with ``parents``, every directory above it too, so that a directory made by
        this save (and any it made above it) is itself durable. A directory with nothing new
        costs next to nothing to fsync."""
        _fsync_dir(self.root)
        path = self.root
        while parents and os.path.dirname(path) != path:
            path = os.path.dirname(path)
            # Best effort above the checkpoint: a parent we may not open (permissions) or that
            # cannot be fsynced (EINVAL on some file systems) must not fail the save.
            with contextlib.suppress(OSError):
                _fsync_dir(path)

    def check_sizes(self, expected: Mapping[str, int]) -> None:
        for name, size in expected.items():
            got = os.stat(self.describe(name)).st_size
            if got != size:
                raise StorageWriteError(
                    errno.EIO,
                    f"{self.describe(name)} has {got} bytes but the save wrote {size}; not "
                    "committing (another writer on the same directory?); save again",
                )

    def open_read(self, name: str) -> BinaryIO:
        return open(self.describe(name), "rb")  # noqa: SIM115

    def open_ranged(self, name: str) -> RangedFile:
        return _LocalRangedFile(self.describe(name))

    def list_names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []


class FsspecStorage:
    """Any fsspec URL (``memory://``, ``s3://`` through s3fs, ...).

    Object stores have no fsync and no atomic rename: a file is durable once ``close()`` returns,
    and the commit record is a single ``pipe`` (one PUT) written last.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.url = url.rstrip("/")

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def makedirs(self) -> None:
        if self.fs.isfile(self.root):
            raise NotADirectoryError(
                errno.ENOTDIR, f"checkpoint path {self.url} is a file; pick another path", self.url
            )
        self.fs.makedirs(self.root, exist_ok=True)

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self._path(name))  # a cached listing may predate the last save
        return bool(self.fs.exists(self._path(name)))

    def remove(self, name: str) -> None:
        # Ranks saving alone may remove one global .metadata at once: gone is as good.
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(self._path(name)):
                self.fs.rm_file(self._path(name))

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool) -> Iterator[BinaryIO]:
        path = self._path(name)
        f = self.fs.open(path, "wb")
        try:
            yield f
            f.close()  # uploads / commits the object
        except BaseException:
            discard = getattr(f, "discard", None)
            with contextlib.suppress(Exception):
                discard() if discard is not None else f.close()
            with contextlib.suppress(Exception):
                self.remove(name)
            raise

    def put_atomic(self, name: str, data: bytes, *, sync: bool) -> None:
        self.fs.pipe_file(self._path(name), data)

    def check_sizes(self, expected: Mapping[str, int]) -> None:
        self.fs.invalidate_cache(self.root)
        for name, size in expected.items():
            got = self.fs.size(self._path(name))
            if got != size:
                raise StorageWriteError(
                    errno.EIO,
                    f"{self.describe(name)} has {got} bytes but the save wrote {size}; not "
                    "committing (another writer at the same URL?); save again",
                )

    def sync_dirs(self, *, parents: bool = False) -> None:
        """Nothing to do: an object store has no directories to make durable."""

    def open_read(self, name: str) -> BinaryIO:
        return self.fs.open(self._path(name), "rb")

    def open_ranged(self, name: str) -> RangedFile:
        return _FsspecRangedFile(self.fs, self._path(name))

    def list_names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            return sorted(
                p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)
            )
        except FileNotFoundError:
            return []


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a local directory (a plain path or ``file://``), not a URL."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def storage_for(
    path: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    *,
    direct: bool = True,
) -> Storage:
    """Local paths (and ``file://``) take the fast path (``direct``: fsynced files with
    ``O_DIRECT`` where allowed); ``s3://`` gets :class:`S3Storage` (streaming multipart uploads,
    retries, commit without rename); any other URL goes through fsspec. ``storage_options`` go
    to the fsspec file system."""
    text = os.fspath(path)
    if is_local(text):
        return LocalStorage(text, direct=direct)
    if text.startswith(("s3://", "s3a://")):
        from .s3 import S3Storage  # s3fs is an extra: imported only for s3 URLs

        return S3Storage(text, storage_options)
    return FsspecStorage(text, storage_options)


__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "RangedFile",
    "Storage",
    "is_local",
    "storage_for",
    "_write_error",
]
