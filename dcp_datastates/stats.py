"""Per-save figures, kept on the writer and logged once per save."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SaveStats:
    """What one save cost this rank. Times are seconds from the start of the save.

    Attributes:
        checkpoint_id: Where the checkpoint went.
        rank: This rank.
        world_size: Ranks in the save's process group when it was staged (1 without one).
        blocked_s: How long the caller was blocked (``stage()``, or the whole ``dcp.save``;
            ``dcp_datastates.async_save`` sets it to its whole call).
        stage_s: How long ``stage()`` itself took (None for a plain ``dcp.save``).
        safe_to_mutate_s: When the snapshot finished, so the state could change again.
        flush_started_s: When ``write_data`` started writing this rank's files.
        flushed_s: When this rank's files were all written (and fsynced).
        commit_s: How long the commit took (coordinator only: manifest, then ``.metadata``).
        durable_s: When this rank's data was on storage (and, on the coordinator, committed).
        bytes_written: Bytes this rank wrote, records and framing included.
        items: Items this rank wrote.
        pool_bytes: Size of the host staging pool.
        pool_peak_bytes: Most pool bytes in use at once during this save.
        optimizer_wait_s: Time optimizer steps spent waiting on this save's snapshot (waits
            for other writers' snapshots are theirs).
        eager_bytes: Bytes of small tensors copied during ``stage()`` (``eager_copy_bytes``).
        forward_frozen_bytes: Bytes of module buffers the forward gate copied at the first forward
            after the call, before forward could update them.
        forward_blocked_s: Time forward spent in the forward gate for this save.
        cow_bytes: Bytes copy-on-write copied before an in-place write reached a tensor this
            save had not copied yet (``copy_on_write``).
        cow_blocked_s: Time those writes waited for their copies.
        live_bytes: Bytes the flush read from the live tensors a step at a time into its
            files' buffers and wrote from there, never copied into the pool (``live_flush``).
        linked_bytes: Bytes of records an incremental save reused from this writer's last
            checkpoint, by a hard link of their files, neither copied nor written
            (``incremental=True``); not in ``bytes_written``.
        error: ``None`` for a save that committed; for a failed save, its error as
            ``"Type: message"``. A writer's ``last_stats`` is always a successful save;
            ``last_failed_stats`` holds the most recent failure.
    """

    checkpoint_id: str
    rank: int
    world_size: int = 1
    blocked_s: float = 0.0
    stage_s: float | None = None
    safe_to_mutate_s: float | None = None
    flush_started_s: float | None = None
    flushed_s: float | None = None
    commit_s: float | None = None
    durable_s: float | None = None
    bytes_written: int = 0
    items: int = 0
    pool_bytes: int = 0
    pool_peak_bytes: int = 0
    optimizer_wait_s: float = 0.0
    eager_bytes: int = 0
    forward_frozen_bytes: int = 0
    forward_blocked_s: float = 0.0
    cow_bytes: int = 0
    cow_blocked_s: float = 0.0
    live_bytes: int = 0
    linked_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def summary(self) -> str:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}s"

        if self.error is not None:
            after = "" if self.durable_s is None else f" after {fmt(self.durable_s)}"
            return f"rank {self.rank}: save to {self.checkpoint_id} failed{after}: {self.error}"
        return (
            f"rank {self.rank}: saved {self.items} items, {self.bytes_written / 1e6:.1f} MB to "
            f"{self.checkpoint_id}: blocked {fmt(self.blocked_s)}, safe to mutate "
            f"{fmt(self.safe_to_mutate_s)}, durable {fmt(self.durable_s)}, pool "
            f"{self.pool_peak_bytes / 1e6:.1f}/{self.pool_bytes / 1e6:.1f} MB, optimizer waited "
            f"{self.optimizer_wait_s:.3f}s"
        )
