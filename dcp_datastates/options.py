"""Frozen, validated options for :class:`~dcp_datastates.DataStatesWriter`."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How a :class:`~dcp_datastates.DataStatesWriter` stages and flushes.

    Attributes:
        host_pool_bytes: Bytes of host memory used to stage snapshots. Allocated once, on the first
            save, and reused by every later save of the same writer. ``None`` sizes it to the first
            state this rank saves, capped at ``max_pool_fraction`` of physical memory. A state
            larger than the pool is still saved correctly: big tensors are chunked and the
            snapshot waits for the flush to free space (back-pressure).
        chunk_bytes: Largest piece of a tensor that is copied and written as one unit. Smaller
            chunks let a small pool stream a big tensor; larger ones cost fewer calls.
        coalesce_bytes: Tensors smaller than this are copied together into one pool block, so that
            thousands of tiny tensors do not cost thousands of separate copies.
        copy_workers: Threads that copy tensors into the host pool.
        flush_workers: Files each rank writes in parallel (one thread per file).
        max_pool_fraction: Cap on the automatically sized pool, as a fraction of physical memory.
        guard_optimizer_step: Make every ``torch.optim`` optimizer's ``step()`` wait for in-flight
            snapshots, so unmodified training loops can never tear a checkpoint.
        guard_on_device: On CUDA, let the guarded step wait on the device instead of the host:
            the step's stream waits on the snapshot copies' events and Python runs ahead. Off,
            or where a copy is not on a GPU, the step waits on the host.
        sync_files: ``fsync`` every data file (once) and the commit record before a save is
            reported durable. Turning it off trades crash safety for speed.
        overwrite: Allow saving into a directory that already holds a committed checkpoint. The old
            commit record is removed before any data is written, so a crash mid-overwrite leaves an
            uncommitted directory, never a checkpoint that mixes old and new data.
    """

    host_pool_bytes: int | None = None
    chunk_bytes: int = 32 * MiB
    coalesce_bytes: int = 1 * MiB
    copy_workers: int = 1
    flush_workers: int = 2
    max_pool_fraction: float = 0.25
    guard_optimizer_step: bool = True
    guard_on_device: bool = True
    sync_files: bool = True
    overwrite: bool = True

    def __post_init__(self) -> None:
        if self.host_pool_bytes is not None and self.host_pool_bytes < MiB:
            raise ValueError(
                f"host_pool_bytes={self.host_pool_bytes!r} is too small; use at least {MiB} bytes "
                "or None to size the pool automatically"
            )
        for name in ("chunk_bytes", "coalesce_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 4096:
                raise ValueError(f"{name}={value!r} must be an int of at least 4096 bytes")
        if self.coalesce_bytes > self.chunk_bytes:
            raise ValueError(
                f"coalesce_bytes={self.coalesce_bytes!r} must not exceed "
                f"chunk_bytes={self.chunk_bytes!r}"
            )
        for name in ("copy_workers", "flush_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{name}={value!r} must be an int between 1 and 64")
        if not 0.0 < self.max_pool_fraction <= 0.9:
            raise ValueError(f"max_pool_fraction={self.max_pool_fraction!r} must be in (0, 0.9]")

    def effective_chunk_bytes(self, pool_bytes: int) -> int:
        """Chunk size that always fits the pool at least twice, so copy and flush can overlap."""
        return max(4096, min(self.chunk_bytes, pool_bytes // 2))
