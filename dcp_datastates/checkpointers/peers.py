"""Peer replication: each rank's files of a step copied to a rank on another node, in the
background, and given back at a restart that lost a node's memory.

The memory tier keeps each node's part of a checkpoint in node-local memory (``/dev/shm`` or a
directory the user names), which a process crash leaves intact but a node loss does not. A
:class:`PeerReplicator` gives every rank a *peer*: the rank with the same local index on the node
``distance`` nodes further round a ring of nodes (never its own node). After a step is committed
in memory, every rank calls :meth:`~PeerReplicator.replicate`; each sends the files it names
(its own data files, plus what a restart needs: ``.metadata``, the manifest) to its peer and
receives its *source*'s (the rank whose peer it is) into::

    dest_root/peer/rank_<source>/step_<N>/       owner-only (0700 directories, 0600 files)
        <the source's files>
        .replica.json                              step, source rank, world size, and each
                                                   file's size and CRC-32C

The directory is filled under a temporary name (``.step_<N>.partial``) and renamed into place
once every file has arrived and matched the sender's CRC-32C, with the marker inside: a replica
either has a marker that its files match, or it does not count. tmpfs needs no fsync.

At a restart every rank calls :meth:`~PeerReplicator.restore`, saying whether it lost its own
memory copy. The ranks agree (an ``all_gather``) on which did; the peer of each lost rank checks
the replica it holds against its marker; every rank learns the result, so either every rank
returns (the lost ones having their files back, verified, in ``dest_dir``) or every rank raises
:class:`PeerRestoreError` naming each lost rank whose replica is missing or corrupt, and the
caller falls back to the next tier. A rank never has to guess what the others decided.

Transport: the replicator creates its own gloo process group at construction, collectively
(``dist.new_group`` must be called by every rank of the job, in the same order as the job's
other groups). What travels is host bytes read from files, so gloo (TCP) is right even in an
NCCL job: NCCL would need them copied to the device first, and its own group would share the
training's streams. A group of its own means the background traffic never pairs with the
training's collectives, which run on their own groups at the same time. Files stream in chunks of
``chunk_bytes`` (four chunk buffers per rank, whatever the state's size), one step at a time on
one background thread, so steps never interleave. That thread and gloo's threads for the group
run ``nice`` steps below the caller's priority (see ``bench.py replication`` in
``docs/benchmarks.md`` for what replication costs a training step).

Memory: ``4 * chunk_bytes`` per rank while the replicator lives; on each node, the replicas it
keeps: one source rank's files per rank per kept step (``keep``), as much as the node's own
memory copy. The files named in :meth:`~PeerReplicator.replicate` are read while they stream:
keep them unchanged until its future is done (a file removed or cut short meanwhile fails the
step on both ends; one rewritten in place would replicate whatever bytes were read).

Failures: a disk error on either side reaches both sides as a reason (see :mod:`.peer_wire`) and
:meth:`~PeerReplicator.replicate`'s future fails with :class:`PeerReplicationError`; training is
never interrupted. A transport failure (a peer died, ``timeout`` passed) also fails the future,
and leaves the replicator *broken*: the pairing of messages on its group is lost, so every later
:meth:`~PeerReplicator.replicate` fails at once with the first error. Build a new replicator
after the job restarts. :meth:`~PeerReplicator.restore` waits for replications in flight.

The world size and the ring must be the same at restore as at replicate (the marker records the
world size); after a change, load from another tier.

May import: ``load``, ``storage`` and the leaves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..errors import DataStatesError
from .peer_replicas import (
    MARKER_NAME,
    ReplicaInvalid,
    check_names,
    partial_dir,
    read_marker,
    replica_dir,
    swap_in,
)
from .peer_ring import PeerRing
from .peer_wire import Link, Sink, Source

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class PeerReplicationError(DataStatesError):
    """Copying a step's files to the peer rank, or receiving the source rank's, failed.

    Attributes: ``rank``, ``peer`` (where this rank's files go), ``source`` (whose files it
    receives), ``step``, ``file`` (the file in flight, when known)."""

    def __init__(
        self, message: str, *, rank: int, peer: int, source: int, step: int, file: str | None
    ) -> None:
        super().__init__(message)
        self.rank, self.peer, self.source, self.step, self.file = rank, peer, source, step, file


class PeerRestoreError(DataStatesError):
    """A restart could not recover some lost rank's files from its peer; raised on every rank
    alike. ``failures`` maps each such lost rank to why; load the step from another tier."""

    def __init__(self, message: str, *, step: int, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.step, self.failures = step, failures


@dataclass(frozen=True)
class ReplicaReport:
    """What one rank's :meth:`PeerReplicator.replicate` did."""

    step: int
    rank: int
    peer: int
    source: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    replica: Path


class PeerReplicator:
    """Copies each rank's files of a step to its peer rank in the background, and gives them
    back at a restart. See the module docstring; every method is collective except
    :meth:`prune` and :meth:`close`.

    Args:
        node_of_rank: each rank's node id; or ``ranks_per_node``: ranks ``0..k-1`` are node 0,
            and so on.
        distance: nodes between a rank and its peer (:class:`PeerRing`).
        group: a gloo group dedicated to this replicator (node ids are its group ranks); by
            default one over the whole job is created here, collectively.
        chunk_bytes: bytes per message; a rank holds four such buffers (two each way).
        timeout: how long one message may take before the transfer fails.
        keep: after each successful replication, keep the newest ``keep`` steps' replicas
            under ``dest_root`` and remove older ones (``None``: keep all, see :meth:`prune`).
        nice: how much lower than the caller's the scheduling priority of the replication's
            threads is (Linux; 0: the same). The background thread, and gloo's threads for the
            group (created from it), then take the CPU time the training leaves idle rather
            than a share of the training's cores.
    """

    def __init__(
        self,
        *,
        node_of_rank: Sequence[int] | None = None,
        ranks_per_node: int | None = None,
        distance: int = 1,
        group: Any = None,
        chunk_bytes: int = 16 << 20,
        timeout: timedelta = timedelta(minutes=5),
        keep: int | None = None,
        nice: int = 10,
    ) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes!r}: give a positive number of bytes")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r}: give a number of steps >= 1, or None")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout={timeout!r}: give a positive datetime.timedelta")
        if not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice={nice!r}: give 0 (the caller's priority) to 19 (the lowest)")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("PeerReplicator needs torch.distributed initialized on every rank")
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        self.ring = PeerRing.of(
            world, node_of_rank=node_of_rank, ranks_per_node=ranks_per_node, distance=distance
        )
        self._executor = ThreadPoolExecutor(
            1, f"dcp-peers-{dist.get_rank()}", initializer=_lower_priority, initargs=(nice,)
        )
        self._owns_group = group is None
        if group is None:  # on the background thread: gloo's threads inherit its priority
            group = self._executor.submit(dist.new_group, backend="gloo", timeout=timeout)
            group = group.result()
        self.group, self.rank, self.world_size = group, dist.get_rank(group), world
        self.peer, self.source = self.ring.peer(self.rank), self.ring.source(self.rank)
        self.keep = keep
        self._link = Link(self.group, timeout, chunk_bytes)
        self._broken: str | None = None
        self._closed = False

    # -- replicate ------------------------------------------------------------------------------
    def replicate(
        self, step: int, src_dir: Path, files: Sequence[str], dest_root: Path
    ) -> Future[ReplicaReport]:
        """Send ``files`` (names in ``src_dir``) to this rank's peer and keep its source's under
        ``dest_root``, on the background thread. Collective: every rank calls it for the same
        ``step``, in the same order. The future fails with :class:`PeerReplicationError`."""
        if self._closed:
            raise ValueError("this PeerReplicator is closed")
        check_names(files)
        return self._executor.submit(
            self._replicate, int(step), Path(src_dir), list(files), Path(dest_root)
        )

    def _error(self, message: str, step: int, file: str | None = None) -> PeerReplicationError:
        return PeerReplicationError(
            f"rank {self.rank}: peer replication of step {step} (sending to rank {self.peer}, "
            f"receiving from rank {self.source}): {message}",
            rank=self.rank,
            peer=self.peer,
            source=self.source,
            step=step,
            file=file,
        )

    def _replicate(self, step: int, src_dir: Path, files: list[str], dest_root: Path):
        if self._broken is not None:
            raise self._error(f"an earlier replication broke the link ({self._broken})", step)
        start = time.perf_counter()
        final = replica_dir(dest_root, self.source, step)
        partial = partial_dir(final)

        def make_sink(header: dict[str, Any]) -> Sink:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash mid-transfer
            sink = Sink(partial, header["names"], header["sizes"], temp_suffix=".tmp")
            if header.get("step") != step and sink.error is None:
                sink.error = f"rank {self.source} replicated step {header.get('step')}"
            return sink

        def settle(sink: Sink) -> None:
            sink.commit()
            marker = sink.marker(step=step, source_rank=self.source, world_size=self.world_size)
            _write_private(partial / MARKER_NAME, json.dumps(marker).encode())
            swap_in(partial, final)

        source = Source([src_dir / n for n in files], files)
        try:
            outcome, _ = self._link.transfer(
                source, self.peer, self.source, make_sink, {"step": step}, settle=settle
            )
        except Exception as e:  # the transport: a peer died or timed out
            where = self._link.where
            self._broken = f"{where}: {type(e).__name__}: {e}"
            raise self._error(self._broken, step, _file(where)) from e
        if outcome.received_error:
            shutil.rmtree(partial, ignore_errors=True)
        if outcome.sent_error or outcome.received_error:
            parts = [f"to rank {self.peer}: {outcome.sent_error}"] if outcome.sent_error else []
            if outcome.received_error:
                parts.append(f"from rank {self.source}: {outcome.received_error}")
            raise self._error("; ".join(parts), step, source.current)
        if self.keep is not None:
            with contextlib.suppress(OSError):  # a replica left behind is retried next step
                self._prune(dest_root, self.keep)
        report = ReplicaReport(
            step,
            self.rank,
            self.peer,
            self.source,
            outcome.bytes_sent,
            outcome.bytes_received,
            time.perf_counter() - start,
            final,
        )
        logger.debug("rank %s: replicated step %s: %s", self.rank, step, report)
        return report

    # -- restore --------------------------------------------------------------------------------
    def restore(self, step: int, lost: bool, dest_dir: Path, dest_root: Path) -> list[str]:
        """Collective, at a restart: every rank says whether it ``lost`` its memory copy of
        ``step``; each lost rank gets its files back from its peer's replica (verified against
        the marker) into ``dest_dir``. Returns the names written (``[]`` on a rank that lost
        nothing). Waits for replications still running. Raises :class:`PeerRestoreError` on
        every rank if any lost rank's replica is missing, corrupt, or did not arrive whole; on
        a rank where the transport failed (a rank died, ``timeout``), with only that rank's
        reason."""
        if self._closed:
            raise ValueError("this PeerReplicator is closed")
        args = (int(step), bool(lost), Path(dest_dir), Path(dest_root))
        try:
            return self._executor.submit(self._restore, *args).result()
        except PeerRestoreError:
            raise
        except Exception as e:  # a collective failed: nothing is agreed any more
            self._broken = f"{type(e).__name__}: {e}"
            raise self._restore_error(args[0], {self.rank: self._broken}) from e

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _restore(self, step: int, lost: bool, dest_dir: Path, dest_root: Path) -> list[str]:
        lost_ranks = [r for r, flag in enumerate(self._gather(lost)) if flag]
        if not lost_ranks:
            return []
        # This rank holds its source's replica; that matters only if the source was lost.
        holding = self.source if self.source in lost_ranks else None
        marker, status = None, None
        if holding is not None:
            path = replica_dir(dest_root, holding, step)
            if lost:
                status = f"its peer, rank {self.rank}, lost its memory too"
            else:
                try:
                    marker = read_marker(
                        path, step=step, source=holding, world_size=self.world_size
                    )
                except ReplicaInvalid as e:
                    status = f"rank {self.rank}'s replica is unusable: {e}"
        failures = {
            src: why
            for src, why in ((self.ring.source(r), s) for r, s in enumerate(self._gather(status)))
            if src in lost_ranks and why is not None
        }
        if failures:
            raise self._restore_error(step, failures)
        source = None
        if marker is not None:
            names = list(marker["files"])
            source = Source([replica_dir(dest_root, holding, step) / n for n in names], names)

        def make_sink(header: dict[str, Any]) -> Sink:
            return Sink(
                dest_dir,
                header["names"],
                header["sizes"],
                temp_suffix=f".restore-{self.rank}.tmp",
                expected=header["crcs"],
            )

        received: list[str] = []
        try:
            outcome, sink = self._link.transfer(
                source,
                holding,
                self.peer if lost else None,
                make_sink,
                {"step": step, "crcs": [marker["files"][n]["crc32c"] for n in names]}
                if marker is not None
                else None,
                settle=lambda s: received.extend(s.commit()),
            )
            mine = outcome.received_error
        except Exception as e:  # the transport; the gather below tells the other ranks
            self._broken = f"{self._link.where}: {type(e).__name__}: {e}"
            mine = self._broken if lost or holding is not None else None
        failures = {
            (r if lost_r else self.ring.source(r)): why
            for r, (lost_r, why) in enumerate(self._gather((lost, mine)))
            if why is not None
        }
        if failures:
            raise self._restore_error(step, failures)
        if lost:
            logger.info(
                "rank %s: step %s restored from rank %s: %s",
                self.rank,
                step,
                self.peer,
                ", ".join(received),
            )
        return received

    def _restore_error(self, step: int, failures: dict[int, str]) -> PeerRestoreError:
        lines = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        return PeerRestoreError(
            f"step {step} cannot be restored from peer replicas ({lines}); load it from the "
            "next tier (local disk or remote)",
            step=step,
            failures=failures,
        )

    # -- cleanup --------------------------------------------------------------------------------
    def prune(self, dest_root: Path, *, keep: int) -> list[Path]:
        """Remove the replicas this rank keeps under ``dest_root`` (its source rank's) older
        than the newest ``keep`` steps, and a leftover partial one; returns what was removed.
        Local to this rank, and to its own replicas: the other ranks of a node share
        ``dest_root`` and may be writing theirs. Runs after the replications asked for."""
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep={keep!r}: give a number of steps >= 0")
        return self._executor.submit(self._prune, Path(dest_root), keep).result()

    def _prune(self, dest_root: Path, keep: int) -> list[Path]:
        holder = replica_dir(dest_root, self.source, 0).parent
        if not holder.is_dir():
            return []
        found = list(holder.iterdir())
        steps = sorted((int(m.group(1)), p) for p in found if (m := _STEP_DIR.match(p.name)))
        old = [p for _, p in steps[: max(0, len(steps) - keep)]]
        old += [p for p in found if p.name.endswith(".partial")]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        return old

    def close(self) -> None:
        """Wait for the replications asked for, then release the thread and the group."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._link.release()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self.group)

    def __enter__(self) -> PeerReplicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _file(where: str | None) -> str | None:
    return (
        where.split(" ", 1)[1] if where and where.startswith(("sending ", "receiving ")) else None
    )


def _lower_priority(nice: int) -> None:
    """Lower this thread's scheduling priority by ``nice`` (Linux schedules threads apart)."""
    if nice and sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


__all__ = [
    "PeerReplicationError",
    "PeerReplicator",
    "PeerRestoreError",
    "PeerRing",
    "ReplicaReport",
]
