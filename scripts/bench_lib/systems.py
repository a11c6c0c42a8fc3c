"""The save systems compared, each behind the same ``save(state, path) -> SaveTimes``.

Stock systems use DCP's own entry points exactly as a user would call them. Every save is timed
from the caller's side: *blocked* is how long the call held the caller, *safe* when the state
could change again (the staging future, or the return of a call that copies before returning),
*durable* when the checkpoint was written, fsynced and committed (the upload future).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from dcp_datastates import DataStatesWriter, async_save

from .common import now

#: StagingOptions of ``dcp.async_save``'s own default stager (it builds the same, positionally).
DEFAULT_STAGING = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=False,
    use_non_blocking_copy=False,
)
#: DefaultStager with its background staging thread; pinning and non-blocking copies need an
#: accelerator, and the state here lives in host memory anyway.
ASYNC_STAGING = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=True,
    use_non_blocking_copy=False,
)


@dataclass
class SaveTimes:
    """Seconds from the start of the save call, as the caller saw them."""

    blocked_s: float
    safe_s: float
    durable_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        return {"blocked_s": self.blocked_s, "safe_s": self.safe_s, "durable_s": self.durable_s}


class _Marks:
    """Timestamps set by futures' done callbacks (which may run after ``result()`` returns)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._events: dict[str, threading.Event] = {}

    def watch(self, name: str, fut: Any) -> None:
        event = self._events[name] = threading.Event()

        def done(_: Any) -> None:
            self.at[name] = now()
            event.set()

        fut.add_done_callback(done)

    def wait(self, name: str) -> float:
        self._events[name].wait()
        return self.at[name]


def _finish(t0: float, blocked_at: float, staging: Future | None, upload: Future) -> SaveTimes:
    marks = _Marks()
    if staging is not None:
        marks.watch("safe", staging)
    marks.watch("durable", upload)
    upload.result()  # DCP raises CheckpointException (a BaseException) on failure: let it out
    if staging is not None:
        staging.result()
    safe = marks.wait("safe") if staging is not None else blocked_at
    return SaveTimes(blocked_at - t0, max(safe, blocked_at) - t0, marks.wait("durable") - t0)


class SaveSystem:
    """One way of saving; ``close()`` releases what it keeps between saves.

    ``keeps_state``: whether a save leaves something that changes the next one (a pool, a cached
    staging copy), so that the steady state is only seen from the second save on.
    """

    name = ""
    keeps_state = False

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class StockSync(SaveSystem):
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.name = f"stock dcp.save t{threads}"

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        writer = FileSystemWriter(path, thread_count=self.threads)
        dcp.save(state, storage_writer=writer, **dcp_kwargs)
        t = now() - t0
        return SaveTimes(t, t, t)


class StockAsyncDefault(SaveSystem):
    """``dcp.async_save(sd, checkpoint_id=...)``: DCP's default stager copies before returning."""

    name = "stock async_save default"

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        upload = dcp.async_save(state, checkpoint_id=path, **dcp_kwargs)
        return _finish(t0, now(), None, upload)


class NoStageWriter(FileSystemWriter, AsyncStager):
    """Stock ``FileSystemWriter`` that is its own stager and stages nothing: ``stage()`` hands
    the state back as it is, so what ``dcp.async_save`` still blocks for is its own work."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        return state_dict


#: Display name of :class:`OursDcpAsync`.
DCP_OURS = "ours via dcp.async_save, pool 1/1"


class Floor(SaveSystem):
    """``dcp.async_save`` through :class:`NoStageWriter`: the least any stager under
    ``dcp.async_save`` can block for, since nothing is copied. The writer is built before the
    clock starts (ours is reused too)."""

    name = "floor: dcp.async_save, no-op stager"

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        writer = NoStageWriter(path)
        t0 = now()
        upload = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, **dcp_kwargs)
        return _finish(t0, now(), None, upload)


class StockAsyncStager(SaveSystem):
    """``dcp.async_save`` with a caller-owned ``DefaultStager`` staging on its own thread (it
    keeps its staging copy between saves, as DCP's docs recommend reusing it)."""

    name = "stock async_save DefaultStager"
    keeps_state = True

    def __init__(self) -> None:
        self.stager = DefaultStager(ASYNC_STAGING)

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        resp = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager, **dcp_kwargs)
        return _finish(t0, now(), resp.staging_completion, resp.upload_completion)

    def close(self) -> None:
        self.stager.close()


class OursSync(SaveSystem):
    name = "ours dcp.save"
    keeps_state = True

    def __init__(self, root: Path, pool_bytes: int | None) -> None:
        self.writer = DataStatesWriter(root, host_pool_bytes=pool_bytes)

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        dcp.save(state, storage_writer=self.writer, checkpoint_id=path, **dcp_kwargs)
        t = now() - t0
        return SaveTimes(t, t, t, _stats(self.writer))

    def close(self) -> None:
        self.writer.close()


class OursAsync(SaveSystem):
    """``dcp_datastates.async_save`` with one reused writer whose pool is ``1/denominator`` of
    the state; the full pool (1/1) is the writer's own sizing (``host_pool_bytes=None``), what a
    user gets by default: the state's bytes plus room for the alignment of its pieces. A pool of
    exactly the tensors' bytes is a few KB short of that (5,440 bytes at 3 GB / 120 tensors), so
    its last piece waited for the flush to free the first: 0.24-0.33 s to safe instead of
    0.21-0.24 s (the full run of 2026-12-01 10:28 read 0.287 s against DefaultStager's 0.220 s)."""

    keeps_state = True

    def __init__(self, root: Path, state_bytes: int, denominator: int) -> None:
        self.name = f"ours async pool 1/{denominator}"
        pool = None if denominator == 1 else max(1 << 20, state_bytes // denominator)
        self.writer = DataStatesWriter(root, host_pool_bytes=pool)

    def warm_up(self, state: dict[str, Any]) -> float:
        """``DataStatesWriter.warm_up`` as a user calls it at set-up, waited for here (a
        training run's first checkpoint comes many steps later); returns its seconds."""
        t0 = now()
        self.writer.warm_up(state, wait=True)
        return now() - t0

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        resp = async_save(state, self.writer, checkpoint_id=path, **dcp_kwargs)
        times = _finish(t0, now(), resp.staging_completion, resp.upload_completion)
        times.extra = _stats(self.writer)
        return times

    def close(self) -> None:
        self.writer.close()


class OursDcpAsync(OursAsync):
    """``dcp.async_save(state, storage_writer=writer)``, the drop-in call of the README, with one
    reused writer and the full pool: the save runs on the thread ``dcp.async_save`` starts for
    it, where ``dcp_datastates.async_save`` (:class:`OursAsync`) uses the writer's own reused
    save threads (scaling scenario, count axis: what that difference costs the caller)."""

    def __init__(self, root: Path, state_bytes: int) -> None:
        super().__init__(root, state_bytes, 1)
        self.name = DCP_OURS

    def save(self, state: dict[str, Any], path: Path, **dcp_kwargs: Any) -> SaveTimes:
        t0 = now()
        upload = dcp.async_save(state, storage_writer=self.writer, checkpoint_id=path, **dcp_kwargs)
        blocked_at = now()
        times = _finish(t0, blocked_at, self.writer.staging_future, upload)
        times.extra = _stats(self.writer)
        return times


def _stats(writer: DataStatesWriter) -> dict[str, Any]:
    s = writer.last_stats
    if s is None:
        return {}
    return {
        "library_stats": {
            "blocked_s": s.blocked_s,
            "safe_to_mutate_s": s.safe_to_mutate_s,
            "durable_s": s.durable_s,
            "pool_bytes": s.pool_bytes,
            "pool_peak_bytes": s.pool_peak_bytes,
            "bytes_written": s.bytes_written,
        }
    }


#: Short keys (used on worker command lines) -> display names, in the order tables list them.
SAVE_SYSTEMS = {
    "stock-sync-t1": "stock dcp.save t1",
    "stock-sync-t2": "stock dcp.save t2",
    "stock-async": "stock async_save default",
    "stock-stager": "stock async_save DefaultStager",
    "ours-sync": "ours dcp.save",
    "ours-async-1": "ours async pool 1/1",
    "ours-async-4": "ours async pool 1/4",
    "ours-async-16": "ours async pool 1/16",
}
#: Not a way to save, so not in ``SAVE_SYSTEMS`` (the save scenario runs all of those): the floor
#: under every stager, measured by the scaling scenario's count axis.
FLOOR_KEY = "floor"
FLOOR = Floor.name
#: Ours through ``dcp.async_save`` itself (count axis only): :class:`OursDcpAsync`.
DCP_OURS_KEY = "ours-dcp-async-1"


def make(key: str, root: Path, state_bytes: int) -> SaveSystem:
    if key.startswith("stock-sync-t"):
        return StockSync(int(key.rsplit("t", 1)[1]))
    if key == "stock-async":
        return StockAsyncDefault()
    if key == "stock-stager":
        return StockAsyncStager()
    if key == FLOOR_KEY:
        return Floor()
    if key == DCP_OURS_KEY:
        return OursDcpAsync(root, state_bytes)
    if key == "ours-sync":
        return OursSync(root, None)  # sized by the writer, as OursAsync 1/1
    if key.startswith("ours-async-"):
        return OursAsync(root, state_bytes, int(key.rsplit("-", 1)[1]))
    raise ValueError(f"unknown save system {key!r}; known: {', '.join(SAVE_SYSTEMS)}")


# -- instrumented writers, for the timeline -------------------------------------------------------
class PhaseLog:
    """(phase, save index, start, end) spans, appended from any thread."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, int, float, float]] = []
        self._lock = threading.Lock()

    def add(self, phase: str, index: int, start: float, end: float) -> None:
        with self._lock:
            self.spans.append((phase, index, start, end))


class _Timed:
    """Mixin timing ``write_data`` (flush: until its future resolves) and ``finish`` (commit).
    Behaviour is the parent class's; only timestamps are added."""

    phases: PhaseLog
    save_index: int

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        start, index = now(), self.save_index
        fut = super().write_data(plan, planner)  # type: ignore[misc]
        fut.add_done_callback(lambda _f: self.phases.add("flush", index, start, now()))
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        start = now()
        super().finish(metadata, results)  # type: ignore[misc]
        self.phases.add("commit", self.save_index, start, now())


class TimedFileSystemWriter(_Timed, FileSystemWriter):
    def __init__(self, path: Path, phases: PhaseLog, save_index: int) -> None:
        super().__init__(path)
        self.phases, self.save_index = phases, save_index


class TimedDataStatesWriter(_Timed, DataStatesWriter):
    def __init__(self, path: Path, phases: PhaseLog) -> None:
        super().__init__(path)
        self.phases, self.save_index = phases, 0
