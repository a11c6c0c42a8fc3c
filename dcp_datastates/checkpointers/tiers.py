"""Tiered checkpoints: commit to a fast local directory, mirror to a remote URL in the background.

:class:`TieredCheckpointer` saves each step with our writer into ``<local>/step-<n>``; once that
checkpoint is committed (durable), one background thread copies it to ``<remote>/step-<n>``,
data files and manifest first, sizes checked, ``.metadata`` last as one PUT, the same commit as
a direct save. Training waits only for the local stage; the upload reads the committed local
files, so it holds neither the host pool nor the training thread.

Each save answers a :class:`TieredSave` with three futures: ``staged`` (the state may change),
``local`` (committed locally) and ``remote`` (committed remotely). A failed upload is retried
(``upload_attempts``) and then reported through ``remote`` and in :attr:`failed_uploads`; its
local copy is kept (it is the only one) until :meth:`TieredCheckpointer.mirror` succeeds.

Retention runs after each commit, per tier: keep the newest ``keep`` committed checkpoints and
delete older committed ones, never the newest, never one being uploaded or read through this
object (:meth:`reading`), and locally never one not yet committed remotely. A checkpoint is
deleted ``.metadata`` first, so a crash mid-delete leaves an uncommitted prefix, never a torn
checkpoint. :meth:`latest` finds the newest step committed in any tier and the fastest tier that
holds it; :meth:`load` loads from there.

With a process group (every rank calls ``save`` and ``load``, on a local directory all ranks
share): DCP's collectives run on a gloo group of the checkpointer's own (``process_group``), so
they never pair with the training's; a save waits for the previous one to commit locally (two
saves' collectives on one group would pair wrongly); only rank 0 of the group uploads and runs
retention, and on the other ranks ``remote`` resolves to ``None`` once the step commits locally.

Scope: one process writes, or every rank of a group on a local directory they all share (rank 0
uploads); other processes reading the tiers are not known to retention.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointLoadError, WriterUsageError
from ..format import METADATA_NAME
from ..load.reader import DataStatesReader
from ..save.api import async_save
from ..save.writer import DataStatesWriter
from .mirror import MirrorError, Superseded, copy_checkpoint, digest, read_all
from .resume import why
from .retention import InUse, delete_checkpoint, delete_expired
from .tier import Tier

logger = logging.getLogger(__name__)


@dataclass
class TieredSave:
    """One tiered save. Times are seconds from the call to ``save``.

    Attributes:
        step: The step saved.
        staged: Resolves when the snapshot is complete and the state may change.
        local: Resolves when the local checkpoint is committed (DCP ``Metadata``).
        remote: Resolves to the remote URL once the remote copy is committed (on ranks other
            than 0 of a process group, which upload nothing: to ``None`` once ``local`` does).
        blocked_s: How long ``save`` held the caller.
    """

    step: int
    staged: Future[Any]
    local: Future[Any]
    remote: Future[str] = field(default_factory=Future)
    blocked_s: float = 0.0
    local_s: float | None = None
    remote_s: float | None = None


class TieredCheckpointer:
    """Save to ``local`` at local speed; mirror every committed step to ``remote``.

    Args:
        local: The fast tier (a directory), or its :class:`Tier`.
        remote: The remote tier (a URL such as ``s3://bucket/run``), or its :class:`Tier`.
        keep_local / keep_remote: Retention, when the tiers are given as strings.
        upload_attempts: Whole-checkpoint upload tries before ``remote`` fails.
        process_group: With ``torch.distributed`` initialized, the CPU-capable group for DCP's
            collectives (default: a new gloo group, made here, so every rank must make the
            checkpointer; the save thread then never shares a group with the training loop's
            collectives). Rank 0 of it uploads and runs retention.
        **writer_options: :class:`~dcp_datastates.WriterOptions` for the local writer.
    """

    def __init__(
        self,
        local: str | os.PathLike | Tier,
        remote: str | Tier,
        *,
        keep_local: int | None = 2,
        keep_remote: int | None = None,
        upload_attempts: int = 3,
        process_group: dist.ProcessGroup | None = None,
        **writer_options: Any,
    ) -> None:
        self.local = (
            local if isinstance(local, Tier) else Tier(url=os.fspath(local), keep=keep_local)
        )
        self.remote = remote if isinstance(remote, Tier) else Tier(url=remote, keep=keep_remote)
        if upload_attempts < 1:
            raise ValueError(f"upload_attempts={upload_attempts!r} must be at least 1")
        self.upload_attempts = upload_attempts
        # Local files uploaded and the object each became: a linked one is copied server-side.
        self._uploaded: dict[tuple[int, ...], str] = {}
        # A save thread's collectives on the training loop's group pair with its own: with an
        # all_reduce per step, two ranks hung at the second save (a user sweep).
        if dist.is_available() and dist.is_initialized():
            self.process_group = (
                process_group if process_group is not None else dist.new_group(backend="gloo")
            )
            self.rank: int = dist.get_rank(self.process_group)
        else:
            self.process_group, self.rank = None, 0
        self.writer = DataStatesWriter(self.local.url, **writer_options)
        self._uploads = concurrent.futures.ThreadPoolExecutor(1, "datastates-mirror")
        self._lock = threading.Lock()
        self._in_use = InUse()  # (tier url, step) being read or uploaded
        #: step -> digest of the ``.metadata`` of the save of it committed remotely: a step
        #: saved again (a rollback) is a new save, not mirrored until its own upload commits.
        self._mirrored: dict[int, bytes] = {}
        self.failed_uploads: dict[int, BaseException] = {}
        self._queued: list[Future[None]] = []  # saves whose local outcome is not handled yet
        self._last_local: Future[Any] | None = None  # the latest save's local commit

    # -- saving --------------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], step: int) -> TieredSave:
        """Start saving ``state_dict`` as ``step``; returns once the snapshot is staged. With a
        process group, call it on every rank; it first waits for the previous save to commit
        locally."""
        start = time.monotonic()
        path = self.local.path(step)
        kwargs: dict[str, Any] = {}
        if self.process_group is not None:
            kwargs["process_group"] = self.process_group
            if self._last_local is not None:  # saves take turns on the group's collectives
                concurrent.futures.wait([self._last_local])
        response = async_save(state_dict, self.writer, checkpoint_id=path, **kwargs)
        self._last_local = response.upload_completion
        handle = TieredSave(
            step=step,
            staged=response.staging_completion,
            local=response.upload_completion,
            blocked_s=time.monotonic() - start,
        )
        handle.remote.set_running_or_notify_cancel()

        queued: Future[None] = Future()  # the local outcome is handled (upload queued or not)

        def committed_locally(fut: Future[Any]) -> None:
            try:
                _committed_locally(fut)
            finally:
                queued.set_result(None)

        def _committed_locally(fut: Future[Any]) -> None:
            handle.local_s = time.monotonic() - start
            exc = fut.exception()
            if exc is not None:
                handle.remote.set_exception(exc)  # nothing to mirror: the same error, once more
                return
            if self.rank != 0:
                handle.remote.set_result(None)  # rank 0 uploads the step all ranks committed
                return
            self._protect(self.local, step, 1)  # until uploaded
            try:
                self._uploads.submit(self._mirror_job, handle, start)
            except RuntimeError as exc:  # closed meanwhile: say so, never drop it silently
                self._protect(self.local, step, -1)
                err = MirrorError(f"step {step} was not uploaded: the checkpointer is closed")
                err.__cause__ = exc
                handle.remote.set_exception(err)

        with self._lock:
            self._queued = [q for q in self._queued if not q.done()] + [queued]
        handle.local.add_done_callback(committed_locally)
        return handle

    def _mirror_job(self, handle: TieredSave, start: float) -> None:
        try:
            url = self.mirror(handle.step)
        except BaseException as exc:
            handle.remote_s = time.monotonic() - start
            handle.remote.set_exception(exc)
        else:
            handle.remote_s = time.monotonic() - start
            handle.remote.set_result(url)
        finally:
            self._protect(self.local, handle.step, -1)
        self.retain(self.remote)
        self.retain(self.local)

    def mirror(self, step: int) -> str:
        """Upload committed local ``step`` to the remote tier (retried); returns its URL.

        Called in the background for every save; call it again for a step in
        :attr:`failed_uploads` once the remote is reachable. With a process group, on rank 0
        only."""
        self._check_coordinator("mirror")
        last: BaseException | None = None
        for attempt in range(self.upload_attempts):
            try:
                local, remote = self.local.storage(step), self.remote.storage(step)
                blob = copy_checkpoint(local, remote, self._uploaded)
            except Superseded:
                raise MirrorError(
                    f"step {step} was saved again at {self.local.path(step)} while it was being "
                    f"uploaded: {self.remote.path(step)} is left uncommitted and the newer "
                    "save's upload replaces it"
                ) from None
            except Exception as exc:
                last = exc
                logger.warning(
                    "mirroring step %d to %s failed (try %d of %d): %s",
                    step,
                    self.remote.path(step),
                    attempt + 1,
                    self.upload_attempts,
                    exc,
                )
                if attempt + 1 < self.upload_attempts:
                    time.sleep(min(5.0, 0.2 * 2**attempt))
                continue
            with self._lock:
                self._mirrored[step] = digest(blob)
                self.failed_uploads.pop(step, None)
            logger.info("step %d committed at %s", step, self.remote.path(step))
            return self.remote.path(step)
        err = MirrorError(
            f"uploading step {step} from {self.local.path(step)} to {self.remote.path(step)} "
            f"failed {self.upload_attempts} times (last: {last}); the local copy is kept. Call "
            f"mirror({step}) again once the remote is reachable"
        )
        err.__cause__ = last
        with self._lock:
            self.failed_uploads[step] = err
        logger.error("%s", err)
        raise err

    # -- finding and loading -------------------------------------------------------------------
    def committed_steps(self, tier: Tier) -> list[int]:
        """Steps with a committed checkpoint in ``tier``, oldest first (listed fresh)."""
        return tier.committed_steps()

    def latest(self) -> tuple[int, Tier] | None:
        """The newest step committed in any tier, and the fastest tier holding it. A tier that
        cannot be listed (the remote unreachable) is left out with a warning, so that a
        restart loads from the local tier then; raises if the tiers that can be listed hold
        none."""
        held: list[tuple[Tier, list[int]]] = []
        errors: list[Exception] = []
        for tier in self.tiers:
            try:
                held.append((tier, self.committed_steps(tier)))
            except Exception as exc:
                errors.append(exc)
                logger.warning(
                    "listing %s failed, so its steps are left out of the newest step (%s)",
                    tier.url,
                    exc,
                )
        newest = max((steps[-1] for _, steps in held if steps), default=None)
        if newest is None:
            if errors:  # "no checkpoint" would be a guess: the unlisted tier may hold some
                raise errors[0]
            return None
        return newest, next(tier for tier, steps in held if newest in steps)

    @property
    def tiers(self) -> tuple[Tier, Tier]:
        return (self.local, self.remote)

    @contextlib.contextmanager
    def reading(self, tier: Tier, step: int) -> Iterator[str]:
        """Protect ``step`` in ``tier`` from retention while the block reads it."""
        self._protect(tier, step, 1)
        try:
            yield tier.path(step)
        finally:
            self._protect(tier, step, -1)

    def load(
        self, state_dict: dict[str, Any], step: int | None = None, **reader_options: Any
    ) -> int:
        """Load ``step`` (default: the newest committed anywhere) from the fastest tier holding
        it, in place into ``state_dict``; returns the step. With a process group, call it on
        every rank: rank 0 picks the step and the tier for all (ranks listing the tiers apart
        could read a step rank 0's retention was deleting, a user sweep)."""
        if self.process_group is not None and self._last_local is not None:
            concurrent.futures.wait([self._last_local])  # its collectives use the same group
        chosen: tuple[int, Tier] | None = None
        error: Exception | None = None
        if self.rank == 0:
            try:
                chosen = self._choose(step)
            except Exception as exc:
                error = exc
        if self.process_group is not None:
            box: list[Any] = [None]
            if chosen is not None:
                box[0] = (chosen[0], self.tiers.index(chosen[1]))
            elif error is not None:
                box[0] = f"rank 0 found nothing to load: {error}"
            try:
                dist.broadcast_object_list(box, group=self.process_group, group_src=0)
            except BaseException:
                if chosen is not None:
                    self._protect(chosen[1], chosen[0], -1)
                raise
            if self.rank != 0:
                if isinstance(box[0], str):
                    raise FileNotFoundError(box[0])
                chosen = (box[0][0], self.tiers[box[0][1]])
                self._protect(chosen[1], chosen[0], 1)
        if error is not None:
            raise error
        assert chosen is not None
        step, tier = chosen
        try:
            reader = DataStatesReader(
                tier.path(step), storage_options=tier.storage_options, **reader_options
            )
            dcp.load(state_dict, storage_reader=reader, process_group=self.process_group)
        except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
            raise CheckpointLoadError(
                f"rank {self.rank}: loading step {step} from {tier.url} failed: {why(exc)}; "
                f"`dcp-datastates verify {tier.path(step)}` checks its data, and "
                "load(state_dict, step=...) loads another step",
                {step: why(exc)},
            ) from exc
        finally:
            self._protect(tier, step, -1)
        return step

    def _choose(self, step: int | None) -> tuple[int, Tier]:
        """The step to load and the fastest tier holding it, protected from retention (as
        :meth:`reading` protects it) once found still committed."""
        for _ in range(3):  # retention may delete a local step between the listing and here
            if step is None:
                found = self.latest()
                if found is None:
                    raise FileNotFoundError(
                        f"no committed checkpoint in {self.local.url} or {self.remote.url}"
                    )
                chosen, tier = found
            else:
                chosen = step
                held = (t for t in self.tiers if step in self.committed_steps(t))
                if (tier := next(held, None)) is None:
                    raise FileNotFoundError(f"step {step} is committed in no tier")
            self._protect(tier, chosen, 1)
            if tier.storage(chosen).exists(METADATA_NAME):
                return chosen, tier
            self._protect(tier, chosen, -1)
        raise FileNotFoundError(
            f"step {chosen} was deleted by retention as it was chosen, three times; load again"
        )

    def _protect(self, tier: Tier, step: int, by: int) -> None:
        self._in_use.add((tier.url, step), by)

    # -- retention -----------------------------------------------------------------------------
    def retain(self, tier: Tier) -> list[int]:
        """Delete committed checkpoints of ``tier`` beyond its ``keep``; returns those deleted.
        With a process group, on rank 0 only."""
        self._check_coordinator("retain")
        if tier.keep is None:
            return []
        try:
            steps = self.committed_steps(tier)
        except Exception:
            logger.exception("listing %s for retention failed; nothing deleted", tier.url)
            return []
        return delete_expired(
            steps,
            tier.keep,
            lambda step: _delete(tier, step),
            needed=(lambda step: not self._is_mirrored(step)) if tier is self.local else None,
            claim=lambda step: self._in_use.claim((tier.url, step)),
            on_error=lambda step, exc: logger.error(
                "deleting %s failed", tier.path(step), exc_info=exc
            ),
        ).deleted

    def _check_coordinator(self, what: str) -> None:
        if self.rank != 0:
            raise WriterUsageError(
                f"TieredCheckpointer.{what}() on rank {self.rank}: rank 0 of the process group "
                "uploads and runs retention for every rank (two ranks doing it would delete "
                "what the other uploads); call it on rank 0 only"
            )

    def _is_mirrored(self, step: int) -> bool:
        """Whether the remote tier holds the save of ``step`` that is committed locally now
        (the same ``.metadata``): uploaded by this object, or by an earlier one whose record of
        its uploads was lost with its process (a user sweep: after a restart no local step was
        ever deleted again). A step saved again is a new save: the record of the previous
        one's upload does not count for it (a user sweep: a rolled-back step whose new upload
        failed was deleted locally, the only copy of that save)."""
        try:
            local = read_all(self.local.storage(step), METADATA_NAME)
        except Exception:
            logger.warning("could not read %s; it counts as not uploaded", self.local.path(step))
            return False
        saved = digest(local)
        with self._lock:
            if self._mirrored.get(step) == saved:
                return True
        try:
            remote = self.remote.storage(step)
            same = remote.exists(METADATA_NAME) and read_all(remote, METADATA_NAME) == local
        except Exception:
            logger.warning("could not compare step %d with %s", step, self.remote.path(step))
            return False
        if same:
            with self._lock:
                self._mirrored[step] = saved
        return same

    def local_only(self) -> list[int]:
        """Steps committed locally and not (or not as the same save) remotely, oldest first:
        uploads that failed, here or before a restart. Retention keeps them; :meth:`mirror`
        uploads one."""
        return [step for step in self.committed_steps(self.local) if not self._is_mirrored(step)]

    def wait(self) -> None:
        """Wait until every upload started so far has finished (committed or failed)."""
        self._uploads.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for local saves and uploads in flight, then release the writer."""
        with self._lock:
            queued = list(self._queued)
        concurrent.futures.wait(queued)  # local saves in flight queue their uploads first
        self._uploads.shutdown(wait=True)
        self.writer.close()


def _delete(tier: Tier, step: int) -> None:
    delete_checkpoint(tier.storage(step))  # uncommitted first: no torn checkpoint on a crash
    logger.info("retention: deleted %s", tier.path(step))


__all__ = ["MirrorError", "Tier", "TieredCheckpointer", "TieredSave"]
