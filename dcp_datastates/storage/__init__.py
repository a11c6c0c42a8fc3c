"""Where checkpoint bytes go: the local file system (with direct I/O) and any fsspec URL (S3 too).

Owns: the ``Storage`` protocol and "open for write, fsync, remove on failure"; the local fast
path (``localfile``); the S3 backend and its client (``s3``, imported only for ``s3://``).
May import: the leaves (``errors``, ``_platform``). Never the save or load path above it.
"""

from .base import FsspecStorage, LocalStorage, RangedFile, Storage, is_local, storage_for

__all__ = ["FsspecStorage", "LocalStorage", "RangedFile", "Storage", "is_local", "storage_for"]
