"""Frozen, validated options for :class:`~dcp_datastates.DataStatesWriter`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

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
        copy_workers: Threads that copy tensors into the host pool. ``None`` (default) picks
            them from the machine: this rank's share of the CPU cores (``os.cpu_count()``
            divided by ``LOCAL_WORLD_SIZE``), at most 4 (host memory bandwidth is saturated
            by then; ``effective_copy_workers``).
        flush_workers: Files each rank writes in parallel (one thread per file). 4 by
            default: data files are written with ``O_DIRECT`` (``localfile.py``), where ext4 and
            most file systems serialize the writes to one file, so the files in parallel are
            the device's queue depth; on the benchmark VM 4 files reached 1.54-1.72 GB/s against
            0.76-1.24 GB/s with 2 (``docs/benchmarks.md``, "Targets").
        flush_nice: Nice value (0 to 19) the flush threads drop to on Linux once the snapshot
            is staged (before, a pool smaller than the state makes the snapshot wait for the
            space they free): the higher, the more the training threads win the cores while a
            checkpoint is written in the background (the flush then fills the time they leave
            idle). 0 keeps the caller's priority.
            Copies into the pool keep the caller's priority: an optimizer step may wait for them.
        max_pool_fraction: Cap on the automatically sized pool, as a fraction of this node's
            physical memory shared by its ranks (divided by ``LOCAL_WORLD_SIZE``).
        guard_optimizer_step: Make every ``torch.optim`` optimizer's ``step()`` wait for in-flight
            snapshots, so unmodified training loops can never tear a checkpoint.
        guard_forward: While a snapshot is in flight, the first forward of a module copies that
            module's buffers (BatchNorm statistics, EMA buffers, counters) that are not snapshotted
            yet, before forward can update them (see ``snapshot/forward_gate.py``).
        copy_on_write: While a snapshot is in flight, an in-place write on the thread that called
            the save (forward, ``torch.no_grad()`` updates, ``load_state_dict``, ``.data``, views)
            to a tensor not copied yet copies that tensor first, on its own device, and the
            snapshot takes that copy (``snapshot/cow.py``). Costs a Python call per operator on
            that thread while the snapshot is in flight. Off, such a write fails the save where
            the version counter or sampled bytes show it, and one through ``.data`` to a tensor
            under 4 MiB can commit torn.
        eager_copy_bytes: Tensors of at most this many bytes are copied during ``stage()`` itself,
            so any later in-place change (a step counter) leaves the checkpoint alone. 0 turns it
            off.
        guard_on_device: On CUDA, let the guarded step wait on the device instead of the host:
            the step's stream waits on the snapshot copies' events and Python runs ahead. Off,
            or where a copy is not on a GPU, the step waits on the host.
        sync_files: ``fsync`` every data file (once) and the commit record before a save is
            reported durable. Turning it off trades crash safety for speed.
        direct_writes: Write local data files with ``O_DIRECT`` where the file system allows it
            (``localfile.py``): no page-cache copy, so less CPU and a short ``fsync``. Then a
            pool block is free again only once its bytes reach the disk, so with a pool
            smaller than the state the snapshot (time to safe) follows the disk; ``False``
            writes through the page cache, which frees blocks at memory speed and holds the
            dirty bytes until ``fsync`` (``docs/benchmarks.md``, "Targets"). Only with
            ``sync_files``; object stores ignore it.
        live_flush: Let the flush write big host tensors from the live state while the
            snapshot copies run, where the pool holds the whole state and data files are
            written with ``O_DIRECT``: it starts at the back of the state as the copies start at
            the front, and what it reads before they get there is never copied into the pool
            (``flush.py``). A live write checks the tensor's version counter afterwards, as a
            copy does, and stops at the next ``optimizer.step()`` (the rest of its piece is then
            copied). ``None`` (default) turns it on where this rank has more cores than copy
            workers (``effective_live_flush``): on a machine whose copies take every core, the
            flush's reads, checksums and writes slow the copies that the next optimizer step
            waits for (3 GB on 2 cores: safe 0.30 s with it, 0.26 s without) and buy no
            training time (``CHANGELOG.md``, item 24).
        overwrite: Allow saving into a directory that already holds a committed checkpoint. The old
            commit record is removed before any data is written, so a crash mid-overwrite leaves an
            uncommitted directory, never a checkpoint that mixes old and new data.
        node_local: The ranks of a save may name different directories, one per node (a
            memory-backed directory each node holds, as the memory tier's ``MemoryTier(node=)``
            does): each rank writes its files into its own, and the coordinator commits
            (``.metadata``, manifest) into its own, checking the sizes of the files of the ranks
            that share its directory only. What commits is then no whole checkpoint until the
            other directories' files are brought beside it; off (default), ranks naming
            different directories are refused before anything is written. Every rank of a
            save must pass the same value.
        incremental: Do not copy or write again a host tensor that provably did not change
            since this writer's last committed save (a frozen base, frozen embeddings): the
            data file holding its record is hard-linked whole into the new checkpoint, which
            stays complete and self-standing (``save/incremental.py`` states the rule). Local
            checkpoints only; off by default (README, "Incremental saves", says why).
        storage_options: Keyword arguments for the fsspec file system of a URL path (for
            ``s3://``: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ...; see
            ``docs/storage.md``). Ignored for local paths.

    Every field is checked (type and range) when the options are made, so a bad value fails at
    the call that passed it, with a :class:`ValueError` naming it.
    """

    host_pool_bytes: int | None = None
    chunk_bytes: int = 32 * MiB
    coalesce_bytes: int = 1 * MiB
    copy_workers: int | None = None
    flush_workers: int = 4
    flush_nice: int = 10
    max_pool_fraction: float = 0.25
    guard_optimizer_step: bool = True
    guard_forward: bool = True
    copy_on_write: bool = True
    eager_copy_bytes: int = 4096
    guard_on_device: bool = True
    sync_files: bool = True
    direct_writes: bool = True
    live_flush: bool | None = None
    overwrite: bool = True
    node_local: bool = False
    incremental: bool = False
    # Not hashed (a dict is not hashable; the PROCESS daemon keys its runtimes by options), but
    # compared: options that differ only here are still different options.
    storage_options: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.host_pool_bytes is not None:
            _check_int(
                "host_pool_bytes",
                self.host_pool_bytes,
                low=MiB,
                hint=" or None to size the pool automatically",
            )
        _check_int("chunk_bytes", self.chunk_bytes, low=4096)
        _check_int("coalesce_bytes", self.coalesce_bytes, low=4096)
        if self.coalesce_bytes > self.chunk_bytes:
            raise ValueError(
                f"coalesce_bytes={self.coalesce_bytes!r} must not exceed "
                f"chunk_bytes={self.chunk_bytes!r} (tensors are coalesced into one chunk): "
                f"pass coalesce_bytes={self.chunk_bytes} or less with this chunk_bytes"
            )
        if self.copy_workers is not None:
            _check_int("copy_workers", self.copy_workers, low=1, high=64)
        _check_int("flush_workers", self.flush_workers, low=1, high=64)
        _check_int("flush_nice", self.flush_nice, low=0, high=19)
        _check_int("eager_copy_bytes", self.eager_copy_bytes, low=0, high=64 * MiB)
        fraction = self.max_pool_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0.0 < fraction <= 0.9
        ):
            raise ValueError(f"max_pool_fraction={fraction!r} must be a number in (0, 0.9]")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"storage_options={self.storage_options!r} must be a mapping of fsspec file "
                "system arguments (e.g. {'endpoint_url': ...}) or None"
            )
        for name in (
            "guard_optimizer_step",
            "guard_forward",
            "copy_on_write",
            "guard_on_device",
            "sync_files",
            "direct_writes",
            "overwrite",
            "node_local",
            "incremental",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False")
        if self.live_flush is not None and not isinstance(self.live_flush, bool):
            raise ValueError(
                f"live_flush={self.live_flush!r} must be True, False or None (the machine decides)"
            )

    def effective_copy_workers(self, local_ranks: int = 1) -> int:
        """``copy_workers``, or this rank's share of the cores (1 to 4) when it is ``None``.
        Measured on 2 cores, 0.5 GB: 2 workers 0.09 s to safe, 1 worker 0.10-0.13 s, 4 workers
        (oversubscribed) 0.11-0.16 s."""
        if self.copy_workers is not None:
            return self.copy_workers
        return max(1, min(4, (os.cpu_count() or 1) // max(1, local_ranks)))

    def effective_live_flush(self, local_ranks: int = 1) -> bool:
        """``live_flush``, or, when it is ``None``, whether this rank's share of the cores
        outnumbers its copy workers (``effective_copy_workers``): only then can the flush run
        beside the copies without taking a core from them."""
        if self.live_flush is not None:
            return self.live_flush
        cores = (os.cpu_count() or 1) // max(1, local_ranks)
        return cores > self.effective_copy_workers(local_ranks)

    def effective_chunk_bytes(self, pool_bytes: int) -> int:
        """Chunk size that always fits the pool at least twice, so copy and flush can overlap."""
        return max(4096, min(self.chunk_bytes, pool_bytes // 2))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_int(
    name: str, value: object, *, low: int, high: int | None = None, hint: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        suggestion = f"; write {name}=int({value!r})" if isinstance(value, float) else ""
        raise ValueError(
            f"{name}={value!r} is a {type(value).__name__}; it must be an int{suggestion}"
        )
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name}={value!r} must be {bound}{hint}")
