"""Worker processes for failures that cross ranks and for DCP's PROCESS executor with DTensors.

``python _cross_rank_workers.py SCENARIO RANK WORLD PORT DIR`` (run through
``_dist_workers.launch(script=__file__)``):

    errors-MODE      rank 1's writer fails each save with one public error type after another
                     (MODE: ``ours`` for ``dcp_datastates.async_save``, ``dcp`` for
                     ``dcp.async_save``); every rank reports, per type, how its future failed and
                     how long that took.
    process-dtensor  several saves of DTensors through ``AsyncCheckpointerType.PROCESS``; after
                     each save rank 0 reports the checkpoint daemon's thread count and RSS.
    call-error-MODE  rank 1's state holds a value that cannot be pickled (its save fails in
                     ``stage()``), then every rank saves a good state; every rank reports
                     whether its call raised, how its future failed and how long that took.
                     ``MODE-stateful``: rank 1's state holds a ``Stateful`` whose
                     ``state_dict()`` raises (``ours``, ``path``: a writer per save, or ``process``:
                     one writer, the PROCESS executor).
    lost-group-MODE  every rank saves, then destroys the process group before its save thread
                     runs; every rank reports how its future failed and what is on disk.
    split-path-MODE  each rank names its own checkpoint directory (a path built from the clock on
                     each rank), then every rank saves to one path (MODE: ``ours``, ``dcp``
                     for ``dcp.async_save``, ``sync`` for ``dcp.save``); every rank reports
                     how its save failed and what each directory holds.
    node-local       as split-path, each rank in its own directory, with ``node_local=True``
                     (saves; each directory holds its rank's files, the coordinator's the
                     commit), then with ``node_local=True`` on rank 0 only (refused).
    cached-plans     ``dcp.save`` with DCP's plan caching on, a writer per save: to ``p0``, to
                     ``p0`` again with ``overwrite=False`` (refused), to ``p2``, to ``p3``; from
                     the second on, rank 0's state is bigger (its plan changes, rank 1's does
                     not, and the replicated item moves to rank 1); every rank reports how each
                     save failed or what its load gave back.
    dtensor-inplace-MODE  an in-place op through a DTensor (``dt[i].fill_``) as the call
                     returns (before planning starts), which moves the DTensor's own version
                     counter, not its local tensor's; every rank reports how its save failed
                     (copy-on-write off: the detection layer).
    dtensor-cow-MODE  the same write with copy-on-write on: every rank reports whether its save
                     committed and holds the state at the call.
                     MODE ``process``: through the PROCESS executor, on rank 1 only
                     (``dt.add_``), landing before the staging thread's copy.
    replayed         one writer per rank, several saves of plain tensors (replicated ones and
                     one of this rank's own) that replay the first save's layout; one save
                     gives a tensor another shape of the same bytes. Each rank reports its
                     replays, which saves reused the write items, and what loaded back wrong.
    plan-cache       one writer per rank, dcp_datastates.async_save four times with one
                     layout, then once with rank 1's own tensor in another shape, then once more
                     with a new writer on rank 0 only: the coordinator's
                     global plans made and served from the writer's cache, and what loaded
                     back wrong (through stock dcp.load).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import (  # noqa: E402
    FUTURE_TIMEOUT_S,
    _init,
    _mutate,
    _rank_state,
    exit_without_teardown,
    run_worker,
)

#: The cause every injected error carries, so a test can find it in what each rank saw.
CAUSE = "injected cross-rank cause"


def sample_errors() -> dict[str, BaseException]:
    """One instance of every public error type, built as the library builds it."""
    import errno

    from dcp_datastates import errors

    return {
        "SnapshotMutationError": errors.SnapshotMutationError(
            fqn=f"w ({CAUSE})", rank=1, before=3, after=4
        ),
        "StorageWriteError": errors.StorageWriteError(errno.EIO, f"rank 1: {CAUSE}", "/x/__1_0"),
        "SnapshotAbortedError": errors.SnapshotAbortedError(f"rank 1: {CAUSE}"),
        "InvalidStateDictError": errors.InvalidStateDictError(f"rank 1: {CAUSE}"),
        "ChecksumMismatchError": errors.ChecksumMismatchError(f"rank 1: {CAUSE}"),
        "UnsafeCheckpointError": errors.UnsafeCheckpointError(f"rank 1: {CAUSE}"),
        "CheckpointNotCommittedError": errors.CheckpointNotCommittedError(
            errno.ENOENT, f"rank 1: {CAUSE}", "/x/.metadata"
        ),
        "CheckpointLoadError": errors.CheckpointLoadError(
            f"rank 1: {CAUSE}", {3: f"ChecksumMismatchError: {CAUSE}"}
        ),
        "CooperativeLoadError": errors.CooperativeLoadError(
            f"rank 1: {CAUSE}", {2: f"ChecksumMismatchError: {CAUSE}"}
        ),
        "CheckpointSaveError": errors.CheckpointSaveError(
            f"rank 1: {CAUSE}", {1: errors.DataStatesError(CAUSE)}
        ),
        "DataStatesError": errors.DataStatesError(f"rank 1: {CAUSE}"),
        "WriterUsageError": errors.WriterUsageError(f"rank 1: {CAUSE}"),
        "WriterClosedError": errors.WriterClosedError(f"rank 1: {CAUSE}"),
    }


class UserProviderError(Exception):
    """What a user's provider might raise: a keyword-only ``__init__`` cannot be unpickled."""

    def __init__(self, *, item: str) -> None:
        super().__init__(f"{item}: {CAUSE}")


def injected_errors() -> dict[str, BaseException]:
    """Every public error type, and a user error that does not survive pickling."""
    return {**sample_errors(), "UserProviderError": UserProviderError(item="w")}


def _injecting_writer(kind: list[str]) -> Any:
    """A real writer whose data files fail to open with ``injected_errors()[kind[0]]``, so the
    error travels the real path: flush thread, the writer's future, DCP's gather."""
    import contextlib

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.format import DATA_SUFFIX
    from dcp_datastates.storage.base import LocalStorage

    class RaisingStorage(LocalStorage):
        @contextlib.contextmanager
        def open_write(self, name: str, *, sync: bool) -> Any:
            if name.endswith(DATA_SUFFIX):
                raise injected_errors()[kind[0]]
            with super().open_write(name, sync=sync) as f:
                yield f

    class InjectingWriter(DataStatesWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            save = self._save()
            save.storage = RaisingStorage(save.storage.root)
            return super().write_data(plan, planner)

    return InjectingWriter


def _errors(mode: str, rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    kind = [""]
    writer = _injecting_writer(kind)(workdir / "x") if rank == 1 else DataStatesWriter(workdir)
    report: dict[str, Any] = {}
    for name in injected_errors():
        kind[0] = name
        state = _rank_state(world_size)
        path = str(workdir / name)
        start = time.monotonic()
        if mode == "dcp":
            upload = dcp.async_save(state, storage_writer=writer, checkpoint_id=path)
        else:
            upload = async_save(state, writer, checkpoint_id=path).upload_completion
        seen: dict[str, Any] = {"failed": False}
        try:
            upload.result(timeout=FUTURE_TIMEOUT_S)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            failures = getattr(exc, "failures", None) or {}
            causes = {str(r): (e[0] if isinstance(e, tuple) else e) for r, e in failures.items()}
            seen = {
                "failed": True,
                "type": type(exc).__name__,
                "message": str(exc),
                "failed_ranks": sorted(int(r) for r in failures),
                "cause_types": {r: type(e).__name__ for r, e in causes.items()},
                "cause_messages": {r: str(e) for r, e in causes.items()},
            }
        seen["seconds"] = time.monotonic() - start
        report[name] = seen
        print(f"rank {rank}: {name}: {seen}", flush=True)
        dist.barrier()
    writer.close()
    dist.destroy_process_group()
    return report


class Unpicklable:
    """A value ``stage()`` cannot serialize: on one rank, the save fails at the call there."""

    def __reduce__(self) -> Any:
        raise TypeError(f"this value refuses to be pickled ({CAUSE})")


class RaisingStateful:
    """A ``Stateful`` whose ``state_dict()`` raises (on one rank: at that rank's call)."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(f"state_dict() failed ({CAUSE})")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("not loaded")


def _call_error(mode: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_datastates import DataStatesWriter, async_save

    mode, _, kind = mode.partition("-")
    _init(rank, world_size, port)
    writer = DataStatesWriter(workdir)
    report: dict[str, Any] = {}
    for attempt in ("bad", "good"):
        state = _rank_state(world_size)
        if attempt == "bad" and rank == 1:
            state["extra"] = RaisingStateful() if kind == "stateful" else Unpicklable()
        path = str(workdir / attempt)
        seen: dict[str, Any] = {"raised_at_call": None, "failed": False}
        start = time.monotonic()
        try:
            if mode == "dcp":
                upload = dcp.async_save(state, storage_writer=writer, checkpoint_id=path)
            elif mode == "process":
                executor = AsyncCheckpointerType.PROCESS
                upload = async_save(
                    state, writer, checkpoint_id=path, async_checkpointer_type=executor
                ).upload_completion
            elif mode == "path":
                upload = async_save(state, path).upload_completion
            else:
                upload = async_save(state, writer, checkpoint_id=path).upload_completion
        except Exception as exc:
            seen["raised_at_call"] = f"{type(exc).__name__}: {exc}"
            upload = None
        if upload is not None:
            try:
                upload.result(timeout=FUTURE_TIMEOUT_S)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                failures = getattr(exc, "failures", None) or {}
                seen.update(
                    failed=True,
                    type=type(exc).__name__,
                    message=str(exc),
                    failed_ranks=sorted(int(r) for r in failures),
                )
        seen["seconds"] = time.monotonic() - start
        report[attempt] = seen
        print(f"rank {rank}: {attempt}: {seen}", flush=True)
        if seen["raised_at_call"] or seen.get("type") == "TimeoutError":
            return report  # the ranks no longer agree on their collectives: stop here
        dist.barrier()
    writer.close()
    dist.destroy_process_group()
    return report


def _lost_group(mode: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    """A script's last save, then ``dist.destroy_process_group()`` at once (a user sweep: DCP
    then saved each rank as rank 0 of one, and a checkpoint of one rank's state verified OK).
    The save thread is held until the group is gone."""
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save
    from dcp_datastates.save import api

    _init(rank, world_size, port)
    gate = threading.Event()
    writer = DataStatesWriter(workdir / "unused")
    path = str(workdir / "last")
    if mode == "dcp":  # DCP's save thread: its first call into the writer
        reset = writer.reset

        def held_reset(*args: Any, **kwargs: Any) -> None:
            assert gate.wait(FUTURE_TIMEOUT_S)
            reset(*args, **kwargs)

        writer.reset = held_reset  # type: ignore[method-assign]
        upload = dcp.async_save(_rank_state(world_size), storage_writer=writer, checkpoint_id=path)
    else:
        save_staged = api._save_staged

        def held(*args: Any) -> Any:
            assert gate.wait(FUTURE_TIMEOUT_S)
            return save_staged(*args)

        api._save_staged = held
        upload = async_save(_rank_state(world_size), writer, checkpoint_id=path).upload_completion
    dist.destroy_process_group()
    gate.set()
    seen: dict[str, Any] = {"failed": False}
    try:
        upload.result(timeout=FUTURE_TIMEOUT_S)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failures = getattr(exc, "failures", None) or {}
        seen.update(
            failed=True,
            type=type(exc).__name__,
            message=str(exc),
            failure_types=sorted(type(e).__name__ for e in failures.values()),
        )
    writer.close()
    seen["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    print(f"rank {rank}: {seen}", flush=True)
    return seen


def _split_path(mode: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    writer = DataStatesWriter(workdir / "unused")
    report: dict[str, Any] = {}
    for attempt, path in (("split", workdir / f"rank{rank}"), ("same", workdir / "same")):
        seen: dict[str, Any] = {"failed": False}
        try:
            if mode == "sync":
                dcp.save(_rank_state(world_size), storage_writer=writer, checkpoint_id=path)
            elif mode == "dcp":
                dcp.async_save(
                    _rank_state(world_size), storage_writer=writer, checkpoint_id=path
                ).result(timeout=FUTURE_TIMEOUT_S)
            else:
                async_save(
                    _rank_state(world_size), writer, checkpoint_id=path
                ).upload_completion.result(timeout=FUTURE_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException; reported
            failures = getattr(exc, "failures", None) or {}
            causes = [e[0] if isinstance(e, tuple) else e for e in failures.values()]  # DCP's
            seen.update(  # (exception, traceback) pairs
                failed=True,
                type=type(exc).__name__,
                message=str(exc),
                failure_types=sorted(type(e).__name__ for e in causes),
            )
        report[attempt] = seen
        print(f"rank {rank}: {attempt}: {seen}", flush=True)
        dist.barrier()
    writer.close()
    report["files"] = {
        d.name: sorted(os.listdir(d)) for d in sorted(workdir.iterdir()) if d.is_dir()
    }
    dist.destroy_process_group()
    return report


def _node_local(rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    for attempt, node_local in (("split", True), ("mixed", rank == 0)):
        writer = DataStatesWriter(workdir / "unused", node_local=node_local)
        seen: dict[str, Any] = {"failed": False}
        try:
            async_save(
                _rank_state(world_size), writer, checkpoint_id=workdir / f"{attempt}{rank}"
            ).upload_completion.result(timeout=FUTURE_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException; reported
            causes = [e[0] if isinstance(e, tuple) else e for e in exc.failures.values()]
            seen.update(failed=True, message=str(exc), types=[type(e).__name__ for e in causes])
        report[attempt] = seen
        print(f"rank {rank}: {attempt}: {seen}", flush=True)
        writer.close()
        dist.barrier()
    dist.destroy_process_group()
    return report


def _cached_plans(rank: int, world_size: int, port: int, workdir: Path) -> dict:
    """DCP's plan caching hands the coordinator the cached local plans of ranks whose plan did
    not change, ``storage_data`` included: the check that ranks name one checkpoint must not
    read an earlier save's path there. A save refused for ``overwrite=False`` must not leave
    DCP's cache half updated (refused in the global plan, it did: the next save committed
    metadata naming an item no rank wrote)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcp_datastates import DataStatesWriter

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    for step, name in enumerate(("p0", "p0", "p2", "p3")):
        state = {
            "rep": torch.full((1000,), 1.0 * step),
            f"own{rank}": torch.full((10,), 1.0 * rank),
        }
        if step and rank == 0:  # planned first, it makes rank 0's plan the bigger when DCP's
            # dedup places "rep", which then moves to rank 1
            state = {"big0": torch.full((100_000,), float(step)), **state}
        path = workdir / name
        writer = DataStatesWriter(path, overwrite=step != 1)  # a writer per save
        seen: dict[str, Any] = {"failed": False}
        try:
            planner = DefaultSavePlanner(enable_plan_caching=True)
            dcp.save(state, storage_writer=writer, planner=planner)
            loaded = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(loaded, checkpoint_id=path)
            seen["wrong"] = sorted(k for k in state if not torch.equal(loaded[k], state[k]))
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException; reported
            seen.update(failed=True, type=type(exc).__name__, message=str(exc)[-600:])
        report[f"step{step}"] = seen
        print(f"rank {rank}: step {step}: {seen}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return report


def _dtensor_inplace(
    mode: str, rank: int, world_size: int, port: int, workdir: Path, *, cow: bool = False
) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    dt = distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)])
    # cow: copy-on-write sees the write and copies the shard first; else the detection layer.
    writer = DataStatesWriter(workdir / "unused", guard_optimizer_step=False, copy_on_write=cow)
    at_call = dt.full_tensor()
    returning = writer._returning_from_async_save

    def written_as_the_call_returns() -> None:
        with torch.no_grad():
            dt[3].fill_(7.0)  # one row: none of the sampled bytes of rank 0's shard
        returning()

    writer._returning_from_async_save = written_as_the_call_returns  # type: ignore[method-assign]
    if mode == "process":  # stage() starts the copy thread: the write lands before its copy
        import dcp_datastates.save.process_staging as process_staging

        segment = process_staging.shared_bytes

        def written_before_the_copy(nbytes: int) -> torch.Tensor:
            if rank == 1:  # one rank's staging fails: the other's must report it too
                with torch.no_grad():
                    dt.add_(1.0)  # elementwise on the shard: no collective
            return segment(nbytes)

        process_staging.shared_bytes = written_before_the_copy
    path = workdir / "ckpt"
    seen: dict[str, Any] = {"failed": False}
    try:
        if mode == "process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            dcp.async_save(
                {"dt": dt},
                storage_writer=writer,
                checkpoint_id=path,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            ).upload_completion.result(timeout=FUTURE_TIMEOUT_S)
        elif mode == "dcp":
            dcp.async_save({"dt": dt}, storage_writer=writer, checkpoint_id=path).result(
                timeout=FUTURE_TIMEOUT_S
            )
        else:
            async_save({"dt": dt}, writer, checkpoint_id=path).upload_completion.result(
                timeout=FUTURE_TIMEOUT_S
            )
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException; reported
        failures = getattr(exc, "failures", None) or {}
        causes = [e[0] if isinstance(e, tuple) else e for e in failures.values()]
        seen.update(
            failed=True,
            message=str(exc),
            failure_types=sorted(type(e).__name__ for e in causes),
        )
    writer.close()
    seen["committed"] = (path / ".metadata").exists()
    if seen["committed"]:
        loaded = {"dt": distribute_tensor(torch.full((64, 1024), -1.0), mesh, [Shard(0)])}
        dcp.load(loaded, checkpoint_id=path)
        seen["holds_the_call_state"] = torch.equal(loaded["dt"].full_tensor(), at_call)
    print(f"rank {rank}: {seen}", flush=True)
    return seen


def _daemon_figures() -> dict[str, int]:
    """Threads and RSS of DCP's checkpoint daemon (this process's one multiprocessing child)."""
    import multiprocessing

    import psutil

    children = multiprocessing.active_children()  # not psutil's: spawn adds a resource tracker
    if len(children) != 1:
        raise AssertionError(f"expected one checkpoint daemon, found {children}")
    daemon = psutil.Process(children[0].pid)
    return {"pid": daemon.pid, "threads": daemon.num_threads(), "rss": daemon.memory_info().rss}


def _process_dtensor(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    """Saves ``SAVES`` DTensor states through the PROCESS executor; the state is changed as soon
    as staging completes; every checkpoint is loaded back here and compared with its values."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.tensor import DTensor

    from dcp_datastates import DataStatesReader, DataStatesWriter, async_save

    saves = int(os.environ.get("CROSS_RANK_SAVES", "4"))
    _init(rank, world_size, port)
    report: dict[str, Any] = {"daemon": [], "differs": []}
    # A fat extra tensor so that a leaked pool per save shows in the daemon's RSS.
    big = torch.zeros(int(os.environ.get("CROSS_RANK_BIG_MIB", "16")) << 18)
    try:
        for i in range(saves):
            state = _rank_state(world_size)
            state["big"] = big + i
            expected = {
                k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                for k, v in state.items()
                if k != "meta"
            }
            path = workdir / f"save{i}"
            kind = AsyncCheckpointerType.PROCESS
            if i % 2:
                response = async_save(state, path, async_checkpointer_type=kind)
            else:
                response = dcp.async_save(
                    state, storage_writer=DataStatesWriter(path), async_checkpointer_type=kind
                )
            response.staging_completion.result(timeout=FUTURE_TIMEOUT_S)
            _mutate(state)
            response.upload_completion.result(timeout=FUTURE_TIMEOUT_S)
            if rank == 0:
                report["daemon"].append(_daemon_figures())
            target = _rank_state(world_size)
            target["big"] = torch.empty_like(big)
            for v in target.values():
                if isinstance(v, DTensor):
                    v.to_local().zero_()
            dcp.load(target, storage_reader=DataStatesReader(path))
            for k, v in expected.items():
                got = target[k].to_local() if isinstance(target[k], DTensor) else target[k]
                if not torch.equal(got, v):
                    report["differs"].append(f"save{i}:{k}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return report


def _replayed(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, async_save

    _init(rank, world_size, port)
    writer = DataStatesWriter(workdir / "w")
    report: dict[str, Any] = {"reused": [], "differs": []}
    weight = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)  # above eager_copy_bytes
    mine = torch.full((32, 32), float(rank))
    try:
        for i in range(4):
            w = weight.view(32, 128) if i == 2 else weight  # same bytes, another shape
            state = {"w": w, "norm": torch.ones(8) * i, f"rank{rank}": mine, "step": i}
            expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            before = writer._staging.captures._record
            plan_before = None if before is None else before.local_plan
            path = str(workdir / f"save{i}")
            if i % 2:
                dcp.async_save(state, storage_writer=writer, checkpoint_id=path).result(
                    timeout=FUTURE_TIMEOUT_S
                )
            else:
                async_save(state, writer, checkpoint_id=path).upload_completion.result(
                    timeout=FUTURE_TIMEOUT_S
                )
            plan_after = writer._staging.captures._record.local_plan
            report["reused"].append(plan_before is not None and plan_after is plan_before)
            with torch.no_grad():  # what the next step does to the state
                weight.add_(1)
                mine.add_(1)
            target = {k: torch.zeros_like(v) for k, v in expected.items()}
            target["step"] = -1
            dcp.load(target, storage_reader=DataStatesReader(path))
            report["differs"] += [
                f"save{i}:{k}" for k, v in expected.items() if not torch.equal(target[k], v)
            ]
            if target["step"] != i:
                report["differs"].append(f"save{i}:step")
            dist.barrier()
        report["replays"] = writer._staging.captures.replays
    finally:
        writer.close()
        dist.destroy_process_group()
    return report


def _plan_cache(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    writer = DataStatesWriter(workdir / "w")
    report: dict[str, Any] = {"made": [], "served": [], "differs": []}
    weight = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    mine = torch.full((32, 32), float(rank))
    try:
        for i in range(6):
            if i == 5 and rank == 0:  # a new writer on the coordinator only: the others' replay
                writer.close()
                writer = DataStatesWriter(workdir / "w")
            own = mine.view(16, 64) if i >= 4 and rank == 1 else mine  # rank 1's plan changes
            state = {"w": weight, f"rank{rank}": own, "step": i}
            expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            path = str(workdir / f"save{i}")
            async_save(state, writer, checkpoint_id=path).upload_completion.result(
                timeout=FUTURE_TIMEOUT_S
            )
            report["made"].append(writer._global_plans.made)
            report["served"].append(writer._global_plans.served)
            with torch.no_grad():
                weight.add_(1)
                mine.add_(1)
            target = {k: torch.zeros_like(v) for k, v in expected.items()}
            target["step"] = -1
            dcp.load(target, checkpoint_id=path)  # stock's reader
            report["differs"] += [
                f"save{i}:{k}" for k, v in expected.items() if not torch.equal(target[k], v)
            ]
            if target["step"] != i:
                report["differs"].append(f"save{i}:step")
            dist.barrier()
    finally:
        writer.close()
        dist.destroy_process_group()
    return report


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario.startswith("errors-"):
        return _errors(scenario[7:], rank, world_size, port, workdir)
    if scenario.startswith("call-error-"):
        return _call_error(scenario[11:], rank, world_size, port, workdir)
    if scenario.startswith("lost-group-"):
        return _lost_group(scenario[11:], rank, world_size, port, workdir)
    if scenario.startswith("split-path-"):
        return _split_path(scenario[11:], rank, world_size, port, workdir)
    if scenario.startswith("dtensor-inplace-"):
        return _dtensor_inplace(scenario[16:], rank, world_size, port, workdir)
    if scenario.startswith("dtensor-cow-"):
        return _dtensor_inplace(scenario[12:], rank, world_size, port, workdir, cow=True)
    if scenario == "node-local":
        return _node_local(rank, world_size, port, workdir)
    if scenario == "cached-plans":
        return _cached_plans(rank, world_size, port, workdir)
    if scenario == "process-dtensor":
        return _process_dtensor(rank, world_size, port, workdir)
    if scenario == "replayed":
        return _replayed(rank, world_size, port, workdir)
    if scenario == "plan-cache":
        return _plan_cache(rank, world_size, port, workdir)
    raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":  # the guard also keeps DCP's spawned daemon from re-running a scenario
    code = run_worker(sys.argv[1:], _scenario)
    if sys.argv[1] == "process-dtensor":
        sys.exit(code)  # DCP's daemon is torn down at normal exit
    exit_without_teardown(code)
