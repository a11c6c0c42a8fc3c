"""Making a step committed in memory durable: the background flush behind the memory tier.

One thread per rank runs the flushes in save order, on a gloo group of their own (so its
collectives pair with nothing else). For one step, on every rank:

1. ``share``: rank 0 reads the step's ``.metadata`` and manifest from its memory directory and
   broadcasts them, with how the durable root holds the step (absent, the same save already,
   or another save of it: then the copy goes beside it, ``steps.REPLACING``, and is swapped in);
   a node whose directory lacks them writes them, so that every node's memory copy can be read
   as a whole DCP checkpoint with its peers' files.
2. ``copy``: each rank copies the data files it wrote (``__{rank}_*.distcp``) from memory to the
   durable step directory and checks their sizes.
3. ``commit``: once every rank copied (one all-reduce), rank 0 writes the manifest and then
   ``.metadata``, atomically, as a direct save commits, and runs ``on_durable`` (``latest``,
   retention); a second all-reduce tells every rank the outcome.

A failure is stored and reaches the caller once, through ``errors`` (the checkpointer raises it
on every rank at the next save).

May import: ``load``, ``storage`` and the leaves.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DataStatesError
from ..format import MANIFEST_NAME, METADATA_NAME
from ..load.safety import load_metadata
from ..storage.base import LocalStorage, Storage
from . import steps
from .memory import Segment

logger = logging.getLogger(__name__)

_ABSENT, _SAME, _REPLACE = "absent", "same", "replace"


class FlushError(DataStatesError):
    """Copying a step committed in memory to the durable root failed on some rank."""


def _prefixed(meta: Any, prefix: str) -> list[str]:
    names = (i.relative_path for i in meta.storage_data.values())
    return [n for n in names if n.startswith(prefix)]


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


class Flusher:
    """Flushes committed memory steps of ``segment`` to ``durable_root`` in the background.

    Args:
        segment: This rank's memory segment.
        durable_root: The checkpointer's root.
        rank / group: This rank in ``group`` (a gloo group only this flusher uses; None alone).
        on_durable: Rank 0, once a step is committed durably (moves ``latest``, retention).
        on_error: A flush's error, before its future resolves (the checkpointer raises it).
    """

    def __init__(
        self,
        segment: Segment,
        durable_root: str,
        rank: int,
        group: dist.ProcessGroup | None,
        on_durable: Callable[[int], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.segment, self.durable_root = segment, durable_root
        self.rank, self.group, self.on_durable, self.on_error = rank, group, on_durable, on_error
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "datastates-memflush")
        self.peers: Any = None  # a PeerReplicator, set by the memory tier when it has one
        self.flushes: dict[int, Future[None]] = {}
        self.durable: set[int] = set()

    def storage(self, path: str) -> Storage:
        """The durable step directory (a test subclass slows it or blocks it)."""
        return LocalStorage(path)

    def submit(self, step: int) -> Future[None]:
        fut = self._pool.submit(self._reported, step)
        self.flushes = {s: f for s, f in self.flushes.items() if not f.done()}
        self.flushes[step] = fut
        return fut

    def wait(self) -> None:
        """Wait for every flush queued so far (their errors reach the caller through the
        futures' callbacks, once)."""
        concurrent.futures.wait(list(self.flushes.values()))

    def _reported(self, step: int) -> None:
        try:
            self._flush(step)
        except BaseException as exc:
            logger.error("%s", exc)
            self.on_error(exc)
            raise

    # -- one step --------------------------------------------------------------------------
    def _flush(self, step: int) -> None:
        shared = self._share(step)
        if isinstance(shared, str):
            raise FlushError(f"rank {self.rank}: flushing step {step} failed: {shared}")
        metadata, manifest, mode = shared
        if mode == _SAME:
            self.durable.add(step)
            return
        target = steps.path(self.durable_root, step) + (steps.REPLACING if mode == _REPLACE else "")
        replica = self._replicate(step, metadata, manifest is not None)
        try:
            self._to_disk(step, metadata, manifest, mode, target)
        finally:
            if replica is not None:
                try:
                    replica.result()
                except Exception as exc:  # the step is on disk (or the flush says why not)
                    logger.warning("rank %d: step %d has no peer copy: %s", self.rank, step, exc)

    def _replicate(self, step: int, metadata: bytes, manifest: bool) -> Future[Any] | None:
        """Every rank at once (the flushes run in one order): this rank's files of ``step``,
        with the commit records, to its peer on another node."""
        if self.peers is None:
            return None
        meta = load_metadata(io.BytesIO(metadata), self.segment.step_path(step))
        files = [*sorted(set(_prefixed(meta, f"__{self.rank}_"))), METADATA_NAME]
        files += [MANIFEST_NAME] if manifest else []
        place = self.segment.step_path(step)
        return self.peers.replicate(step, place, files, self.segment.root)

    def _to_disk(
        self, step: int, metadata: bytes, manifest: bytes | None, mode: str, target: str
    ) -> None:
        error: BaseException | None = None
        try:
            self._copy_own(step, metadata, target)
        except Exception as exc:
            error = exc
        failed = self._failing(error is not None)
        if failed:
            raise FlushError(
                f"rank {self.rank}: copying step {step} from {self.segment.step_path(step)} to "
                f"{target} failed on rank(s) {failed}: {error or 'see their logs'}; it stays in "
                "memory only (a restart on this node loads it from there)"
            ) from error
        if self.rank == 0:
            try:
                storage = self.storage(target)
                if manifest is not None:
                    storage.put_atomic(MANIFEST_NAME, manifest, sync=True)
                storage.put_atomic(METADATA_NAME, metadata, sync=True)
                if mode == _REPLACE:
                    steps.swap_in(self.durable_root, step)
                logger.info("rank 0: step %d flushed from memory, committed in %s", step, target)
                self.on_durable(step)
            except Exception as exc:
                error = exc
        if self._failing(error is not None):
            raise FlushError(
                f"rank {self.rank}: committing step {step} in {self.durable_root} failed on "
                f"rank 0: {error or 'see its log'}"
            ) from error
        self.durable.add(step)

    def _share(self, step: int) -> tuple[bytes, bytes | None, str] | str:
        """Step 1 of the module docstring; a string says why it cannot flush (on every rank)."""
        box: list[Any] = [None]
        if self.rank == 0:
            place = self.segment.step_path(step)
            metadata = _read(os.path.join(place, METADATA_NAME))
            if metadata is None:
                box[0] = f"{place} holds no {METADATA_NAME} on rank 0"
            else:
                steps.settle(self.durable_root)  # a crash's leftovers; nothing else writes here
                durable = _read(os.path.join(steps.path(self.durable_root, step), METADATA_NAME))
                mode = _ABSENT if durable is None else _SAME if durable == metadata else _REPLACE
                manifest = _read(os.path.join(place, MANIFEST_NAME))
                box[0] = (metadata, manifest, mode)
        if self.group is not None:
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        if isinstance(box[0], tuple) and self.rank != 0:
            metadata, manifest, _ = box[0]
            place = self.segment.step_path(step)
            if not os.path.exists(os.path.join(place, METADATA_NAME)):
                # Another node: make its copy whole. Every rank of that node gets here at once,
                # so each writes through a temporary name of its own (a shared one was renamed
                # away under the other: FileNotFoundError, a failed save).
                if manifest is not None:
                    _put_own(place, MANIFEST_NAME, manifest)
                _put_own(place, METADATA_NAME, metadata)
        return box[0]

    def _copy_own(self, step: int, metadata: bytes, target: str) -> None:
        source = self.segment.step_path(step)
        meta = load_metadata(io.BytesIO(metadata), os.path.join(source, METADATA_NAME))
        prefix = f"__{self.rank}_"
        # Every file the commit names as this rank's: one missing (a node's memory lost and
        # not restored) fails the flush rather than committing a torn checkpoint.
        names = sorted(
            {i.relative_path for i in meta.storage_data.values()} & set(_prefixed(meta, prefix))
        )
        storage = self.storage(target)
        storage.makedirs()
        sizes = {}
        for name in names:
            with open(os.path.join(source, name), "rb") as src:
                with storage.open_write(name, sync=True) as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
                sizes[name] = os.fstat(src.fileno()).st_size
        storage.check_sizes(sizes)

    def _failing(self, failed: bool) -> list[int]:
        if self.group is None:
            return [0] if failed else []
        flags = torch.zeros(dist.get_world_size(self.group), dtype=torch.uint8)
        flags[self.rank] = int(failed)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [int(r) for r in flags.nonzero().flatten().tolist()]

    # -- memory retention -------------------------------------------------------------------
    def make_room(self, keep: int) -> None:
        """Before a save writes a new step into memory: keep at most ``keep`` committed steps
        there, waiting for an older one's flush when it is still running."""
        committed = self.segment.committed_steps()
        for step in committed[: max(0, len(committed) - keep)]:
            fut = self.flushes.get(step)
            if fut is not None:
                concurrent.futures.wait([fut])  # its error reaches the caller on its own
            if step not in self.durable:
                logger.warning(
                    "rank %d: deleting step %d from memory before it was durable (its flush "
                    "failed or a newer step replaced it)",
                    self.rank,
                    step,
                )
            self.segment.delete_step(step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _put_own(directory: str, name: str, data: bytes) -> None:
    """``name`` in ``directory`` written whole, through a temporary name of this process's."""
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(directory, name))
