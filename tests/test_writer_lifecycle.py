"""The writer's life: misuse refused at the call, writers dropped without ``close()``, ``close()``
during a save, options checked at construction, automatic pool size, and per-save bookkeeping."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    EVENT_TIMEOUT_S,
    GatedTensorProvider,
    MiB,
    assert_same_state,
    failure_of,
    load_like,
    pool_drains,
)
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import (
    CheckpointSaveError,
    DataStatesWriter,
    SnapshotMutationError,
    WriterClosedError,
    WriterOptions,
    WriterUsageError,
    async_save,
)
from dcp_datastates.errors import SnapshotAbortedError
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.save import handoff, resources
from dcp_datastates.snapshot import guard
from dcp_datastates.snapshot.pool import block_slack, live_pools

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


def wait_for(predicate, what: str, timeout: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def our_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("datastates-", "AsyncCheckpointExecutor"))
    )


@pytest.fixture
def gated_tensors(registered_providers):
    gate = threading.Event()
    registered_providers(torch.Tensor, lambda fqn, value: GatedTensorProvider(fqn, value, gate))
    yield gate
    gate.set()


def state(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"w": [torch.randn(256, 256, generator=g) for _ in range(n)], "step": n}


# -- item 3: another writer's stager ------------------------------------------------------------
def test_as_another_writers_stager_the_call_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    stager = DataStatesWriter(tmp_path / "ours", **SMALL_POOL)
    with pytest.raises(WriterUsageError) as raised:
        dcp.async_save(
            state(),
            storage_writer=FileSystemWriter(str(tmp_path / "stock")),
            async_stager=stager,
            no_dist=True,
        )
    message = str(raised.value)
    assert "storage_writer=FileSystemWriter" in message
    assert "no async_stager" in message and "dcp_datastates.async_save" in message
    assert stager._runtime.pool is None  # nothing was staged, nothing is held
    assert guard.pending_snapshots() == 0
    stager.close()


def test_as_a_stager_with_no_storage_writer_the_call_is_refused(tmp_path: Path) -> None:
    stager = DataStatesWriter(tmp_path / "ours")
    with pytest.raises(WriterUsageError, match="storage_writer=none"):
        dcp.async_save(
            state(), checkpoint_id=str(tmp_path / "x"), async_stager=stager, no_dist=True
        )
    stager.close()


def test_as_both_stager_and_writer_it_saves(tmp_path: Path) -> None:
    writer = DataStatesWriter(tmp_path)
    sd = state()
    dcp.async_save(sd, storage_writer=writer, async_stager=writer, no_dist=True).result(
        timeout=EVENT_TIMEOUT_S
    )
    writer.close()
    assert_same_state(sd, load_like(tmp_path, sd, "stock"))


# -- item 4: writers dropped without close() --------------------------------------------------
@pytest.mark.parametrize("how", ["dcp.async_save", "dcp.save", "async_save"])
def test_writers_used_once_and_dropped_give_back_threads_and_pools(
    tmp_path: Path, how: str
) -> None:
    sd = state()
    gc.collect()
    wait_for(lambda: gc.collect() >= 0 and not our_threads(), "earlier tests' threads to end")
    pools = len(live_pools())
    for i in range(3):
        writer = DataStatesWriter(tmp_path / f"c{i}", **SMALL_POOL)
        if how == "dcp.save":
            dcp.save(sd, storage_writer=writer, no_dist=True)
        elif how == "async_save":  # a writer passed in: its own save threads, kept between saves
            async_save(sd, writer, no_dist=True).upload_completion.result(timeout=EVENT_TIMEOUT_S)
            assert any(name.startswith("datastates-save") for name in our_threads())
        else:
            dcp.async_save(sd, storage_writer=writer, no_dist=True).result(timeout=EVENT_TIMEOUT_S)
        assert len(live_pools()) >= pools + 1 or i > 0
    del writer

    def back_to_baseline() -> bool:
        gc.collect()
        return not our_threads() and len(live_pools()) == pools

    wait_for(back_to_baseline, f"threads {our_threads()} and pools to be given back")
    for i in range(3):
        assert_same_state(sd, load_like(tmp_path / f"c{i}", sd, "stock"))


@pytest.mark.parametrize("how", ["dcp.async_save", "dcp.save", "async_save"])
def test_a_dropped_writer_gives_back_its_pool_without_the_cyclic_gc(
    tmp_path: Path, how: str
) -> None:
    """With the cyclic GC off, dropping the last reference frees the pool: a reference cycle
    (runtime -> session -> retirement callback -> runtime) once left each dropped writer's pool
    mapped until a full collection, which in a training process can be many saves away (a
    writer per save of a 200 MB state grew RSS by 200 MB a save)."""
    sd = state()
    gc.collect()
    gc.disable()
    try:
        for i in range(2):
            writer = DataStatesWriter(tmp_path / f"c{i}", **SMALL_POOL)
            if how == "dcp.save":
                dcp.save(sd, storage_writer=writer, no_dist=True)
            elif how == "async_save":
                async_save(sd, writer, no_dist=True).upload_completion.result(
                    timeout=EVENT_TIMEOUT_S
                )
            else:
                dcp.async_save(sd, storage_writer=writer, no_dist=True).result(
                    timeout=EVENT_TIMEOUT_S
                )
            pool = weakref.ref(writer._runtime.pool)
            del writer
            wait_for(
                lambda p=pool: p() is None, f"save {i}'s pool to be freed by its last reference"
            )
    finally:
        gc.enable()
    for i in range(2):
        assert_same_state(sd, load_like(tmp_path / f"c{i}", sd, "stock"))


@pytest.mark.parametrize(
    ("how", "when"),
    [
        ("dcp.async_save", "before the local plan"),
        ("dcp.async_save", "before write_data"),
        ("dcp.async_save", "while it flushes"),
        ("dcp.save", "while it snapshots"),
    ],
)
def test_a_writer_dropped_after_a_failed_save_gives_back_its_pool(
    tmp_path: Path, registered_providers, monkeypatch, how: str, when: str
) -> None:
    """DCP raises a failed write from the ``torch.futures.Future`` ``write_data`` returns, in a
    frame that holds it and the writer. A plain torch future holds its error in C++, out of the
    cyclic GC's sight, so error -> traceback -> frame -> future was never collected and the
    writer of a failed save, dropped, kept its threads and pool for good (``dcp_future.py``).

    A snapshot that failed before DCP's save thread reached ``write_data`` (a busy machine's
    timing: the copy saw the change first) was kept in the runtime's sessions, and its error's
    traceback held DCP's frames and so the writer, out of reach of the collector: one CI run
    in three timed out here. Each moment of the failure is made here on purpose."""
    gate, made, flushing = threading.Event(), threading.Event(), threading.Event()
    providers: list[GatedTensorProvider] = []

    def gated(fqn: str, value: torch.Tensor) -> GatedTensorProvider:
        providers.append(GatedTensorProvider(fqn, value, gate))
        made.set()
        return providers[-1]

    real_write_data = DataStatesWriter.write_data

    def write_data(self: DataStatesWriter, plan, planner):  # type: ignore[no-untyped-def]
        if when == "before write_data":  # on DCP's save thread: let the snapshot fail first
            session = self._save().session
            session.staged.result(timeout=EVENT_TIMEOUT_S)
            assert session.error is not None
        written = real_write_data(self, plan, planner)
        flushing.set()
        return written

    real_local_plan = DataStatesWriter.prepare_local_plan

    def prepare_local_plan(self: DataStatesWriter, plan):  # type: ignore[no-untyped-def]
        if when == "before the local plan":  # raised there since the snapshot failed: the
            # session stayed in the runtime's list, and its error's traceback held the writer
            session = self._save().session
            session.staged.result(timeout=EVENT_TIMEOUT_S)
            assert session.error is not None
        return real_local_plan(self, plan)

    monkeypatch.setattr(DataStatesWriter, "write_data", write_data)
    monkeypatch.setattr(DataStatesWriter, "prepare_local_plan", prepare_local_plan)
    registered_providers(torch.Tensor, gated)
    tensor = torch.randn(256, 256)
    writer = DataStatesWriter(tmp_path / "c", **SMALL_POOL)

    def change_while_copying() -> None:  # the copy waits at the gate: the save fails
        copying = made.wait(EVENT_TIMEOUT_S) and providers[0].copy_started.wait(EVENT_TIMEOUT_S)
        if copying and (when != "while it flushes" or flushing.wait(EVENT_TIMEOUT_S)):
            tensor.add_(1)
        gate.set()

    changer = threading.Thread(target=change_while_copying, daemon=True)
    changer.start()
    try:
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is one
            if how == "dcp.save":
                dcp.save({"t": tensor}, storage_writer=writer, no_dist=True)
            else:
                future = dcp.async_save({"t": tensor}, storage_writer=writer, no_dist=True)
                future.result(timeout=EVENT_TIMEOUT_S)
    finally:
        gate.set()
        changer.join(EVENT_TIMEOUT_S)
    assert failure_of(raised.value, SnapshotMutationError) is not None
    assert flushing.is_set() == (when not in ("before write_data", "before the local plan"))
    # This writer's pool, not a count of all pools: a collection here may free earlier tests'.
    pool = weakref.ref(writer._runtime.pool)
    del writer, raised
    if how != "dcp.save":
        del future
    wait_for(
        lambda: gc.collect() >= 0 and pool() is None,
        "the failed save's writer to give back its pool",
    )


def test_a_script_that_drops_a_writer_and_exits_at_once_exits_cleanly(tmp_path: Path) -> None:
    """A dropped writer frees its pool on its daemon scheduler thread; the interpreter's exit
    waits for that (``scheduler._stop_at_exit``). Without it a daemon thread freeing the pool
    during finalization ended in ``std::terminate`` (exit status 134) in about half the runs."""
    script = tmp_path / "drop_and_exit.py"
    script.write_text(
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from dcp_datastates import DataStatesWriter\n"
        "w = DataStatesWriter(sys.argv[1])\n"
        "dcp.async_save({'w': torch.randn(4_000_000), 's': 1}, storage_writer=w,\n"
        "               no_dist=True).result()\n"
        "del w\n"
    )
    for i in range(6):
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"c{i}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "terminate" not in done.stderr, (
            f"run {i}: exit status {done.returncode}: {done.stderr[-2000:]}"
        )
        assert (tmp_path / f"c{i}" / METADATA_NAME).is_file()


def _cyclic_garbage_of(save) -> dict[str, int]:
    """Objects of this library or of DCP that ``save()`` left in reference cycles: freed only
    by the cyclic GC, they survive its young collections and pile into the oldest generation."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        save()
        gc.collect()
        found: dict[str, int] = {}
        for obj in gc.garbage:
            kind = type(obj)
            if kind.__module__.startswith(("dcp_datastates", "torch.distributed.checkpoint")):
                name = f"{kind.__module__}.{kind.__qualname__}"
                found[name] = found.get(name, 0) + 1
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("how", ["async_save", "dcp.async_save", "dcp.save", "a writer per save"])
def test_a_save_leaves_no_reference_cycle_behind(tmp_path: Path, how: str) -> None:
    """Everything a save made is freed by reference counting when it ends. A cycle through
    each session (its staging future's callback held it) once left 5,000 objects per save
    of the train benchmark's state to the cyclic GC, and a full collection (0.2 s in a
    training process) every few saves. A BatchNorm model, so the forward gate holds buffers."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters())
    kept = DataStatesWriter(tmp_path / "kept", **SMALL_POOL)

    def save(i: int) -> None:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
        path = tmp_path / f"c{i}"
        if how == "async_save":
            response = async_save(sd, kept, checkpoint_id=path, no_dist=True)
            model(torch.randn(4, 16))  # the forward gate's first forward
            response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
        elif how == "dcp.save":
            dcp.save(sd, storage_writer=kept, checkpoint_id=path, no_dist=True)
        else:
            writer = kept if how == "dcp.async_save" else DataStatesWriter(path, **SMALL_POOL)
            future = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, no_dist=True)
            model(torch.randn(4, 16))
            future.result(timeout=EVENT_TIMEOUT_S)

    save(0)  # threads, the pool and the replay's record made outside the check
    assert _cyclic_garbage_of(lambda: save(1)) == {}
    kept.close()


@pytest.mark.parametrize("how", ["async_save", "dcp.save"])
def test_a_finished_save_holds_no_reference_to_the_saved_tensors(
    tmp_path: Path, make_writer, how: str
) -> None:
    writer = make_writer(tmp_path, **SMALL_POOL)
    tensor = torch.randn(300, 300)
    small = torch.randn(4)  # copied eagerly during stage()
    ref, small_ref = weakref.ref(tensor), weakref.ref(small)
    sd = {"t": tensor, "s": small}
    if how == "dcp.save":
        dcp.save(sd, storage_writer=writer, no_dist=True)
    else:
        async_save(sd, writer, no_dist=True).upload_completion.result(timeout=EVENT_TIMEOUT_S)
    del sd, tensor, small
    gc.collect()
    assert ref() is None and small_ref() is None
    assert writer._runtime.pool is not None  # the writer itself lives on, pool included


class _ThreadRecordingWriter(DataStatesWriter):
    """Records the thread each save's ``finish`` ran on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.finished_on: list[threading.Thread] = []

    def finish(self, metadata, results) -> None:
        self.finished_on.append(threading.current_thread())
        super().finish(metadata, results)


class _Counter:
    """A ``Stateful`` whose ``state_dict()`` records the thread that called it."""

    def __init__(self) -> None:
        self.n = 0
        self.called_on: list[threading.Thread] = []

    def state_dict(self) -> dict:
        self.called_on.append(threading.current_thread())
        return {"n": self.n, "t": torch.full((8,), float(self.n))}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def test_async_save_with_a_writer_runs_its_saves_on_reused_threads_that_close_ends(
    tmp_path: Path,
) -> None:
    writer = _ThreadRecordingWriter(tmp_path / "w", **SMALL_POOL)
    counter = _Counter()
    for i in range(3):
        counter.n = i
        sd = {"w": torch.full((64, 64), float(i)), "counter": counter}
        response = async_save(sd, writer, checkpoint_id=tmp_path / f"c{i}", no_dist=True)
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    # Stateful values are turned into state dicts on the caller, as dcp.async_save does.
    assert counter.called_on == [threading.current_thread()] * 3
    threads = writer.finished_on
    # The writer's own threads, not one DCP starts per save. (Which kept thread runs a save is
    # the executor's: one that has just resolved a save's future is idle a moment later.)
    assert len(threads) == 3 and all(t.name.startswith("datastates-save") for t in threads)
    for i in range(3):
        target = {"w": torch.zeros(64, 64), "counter": _Counter()}
        dcp.load(target, checkpoint_id=tmp_path / f"c{i}", no_dist=True)
        assert torch.equal(target["w"], torch.full((64, 64), float(i)))
        assert target["counter"].n == i
    writer.close()
    for thread in set(threads):
        thread.join(timeout=EVENT_TIMEOUT_S)
        assert not thread.is_alive()


@pytest.mark.parametrize("how", ["close", "drop"])
def test_threads_warm_up_started_end_with_the_writer_even_without_a_save(
    tmp_path: Path, how: str
) -> None:
    before = set(threading.enumerate())
    writer = DataStatesWriter(tmp_path / "w")
    writer.warm_up(state(), wait=True)
    started = [t for t in threading.enumerate() if t not in before]
    names = [t.name for t in started]
    for kind in ("datastates-plan", "datastates-save", "datastates-copy"):
        assert any(n.startswith(kind) for n in names), names
    if how == "close":
        writer.close()
    else:  # a writer made, warmed up and dropped
        del writer
        gc.collect()
    for thread in started:
        thread.join(timeout=EVENT_TIMEOUT_S)
    assert [t.name for t in started if t.is_alive()] == []


def test_a_save_failing_while_planning_on_a_reused_save_thread_drops_its_snapshot(
    tmp_path: Path,
) -> None:
    # DCP's save thread exits after a failed save, and the runtime reaps the snapshot it
    # claimed; a writer save thread lives on, so it must say that its save ended.
    writer = DataStatesWriter(tmp_path / "w", overwrite=False, **SMALL_POOL)
    sd = state()
    async_save(sd, writer, checkpoint_id=tmp_path / "c", no_dist=True).upload_completion.result(
        timeout=EVENT_TIMEOUT_S
    )
    again = async_save(sd, writer, checkpoint_id=tmp_path / "c", no_dist=True)
    with pytest.raises(CheckpointSaveError, match="overwrite=False"):
        again.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert pool_drains(writer)
    wait_for(lambda: not writer._runtime._live.busy(), "the failed save's snapshot to be dropped")
    done = threading.Thread(target=writer.close)  # returns at once: nothing left to wait for
    done.start()
    done.join(timeout=EVENT_TIMEOUT_S)
    assert not done.is_alive(), "close() waited for a snapshot no save will write"
    assert_same_state(sd, load_like(tmp_path / "c", sd, "stock"))


def test_async_save_refuses_an_argument_dcp_would_refuse_and_saves_after(
    tmp_path: Path, make_writer
) -> None:
    writer = make_writer(tmp_path / "w", **SMALL_POOL)
    sd = state()
    with pytest.raises(TypeError, match="compression"):
        async_save(sd, writer, checkpoint_id=tmp_path / "bad", no_dist=True, compression=True)
    assert not (tmp_path / "bad").exists()
    response = async_save(sd, writer, checkpoint_id=tmp_path / "good", no_dist=True)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert_same_state(sd, load_like(tmp_path / "good", sd, "stock"))


# -- item 5: close() during a save ---------------------------------------------------------------
def test_close_during_a_save_waits_for_it_and_the_checkpoint_holds_the_call_state(
    tmp_path: Path, gated_tensors
) -> None:
    weight = torch.nn.Parameter(torch.randn(256, 256))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    sd = {"w": weight, "other": torch.randn(512, 512)}
    expected = {"w": weight.detach().clone(), "other": sd["other"].clone()}
    writer = DataStatesWriter(tmp_path, **SMALL_POOL)

    response = async_save(sd, writer, no_dist=True)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (writer.close(), closed.set()))
    closer.start()
    time.sleep(0.2)
    assert not closed.is_set(), "close() returned while the save was still in flight"
    with pytest.raises(WriterClosedError):
        async_save(sd, writer, no_dist=True)  # refused at once, even while closing
    gated_tensors.set()
    optimizer.step()  # waits for the snapshot, then changes the weight
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    closer.join(EVENT_TIMEOUT_S)
    assert closed.is_set()
    assert_same_state(expected, load_like(tmp_path, expected, "stock"))
    assert writer._runtime.pool is None


@pytest.mark.parametrize("how", ["async_save", "dcp.async_save"])
@pytest.mark.parametrize("kind", ["tensors", "with an object"])  # recorded / planned in stage()
def test_close_right_after_a_fresh_writers_first_save_waits_for_it(
    tmp_path: Path, how: str, kind: str
) -> None:
    """The last checkpoint of a run, then ``close()``: on a writer that never saved (no pool
    yet), the save's planning makes the pool after close() began, and must (it failed with
    WriterClosedError, nothing committed)."""
    sd: dict = {"a": torch.randn(1000), "b": torch.randn(64, 64)}
    if kind == "with an object":
        sd["shape"] = torch.Size([3, 4])  # not a scalar: the state is planned in stage()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    writer = DataStatesWriter(tmp_path / "w")
    path = tmp_path / "final"
    if how == "async_save":
        future = async_save(sd, writer, checkpoint_id=path, no_dist=True).upload_completion
    else:
        future = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, no_dist=True)
    writer.close()
    future.result(timeout=EVENT_TIMEOUT_S)
    assert (path / METADATA_NAME).exists()
    assert_same_state(expected, load_like(path, expected, "stock"))
    assert writer._runtime.pool is None  # and close() still gave the pool back


def test_close_with_a_timeout_fails_a_stuck_save_cleanly(tmp_path: Path, gated_tensors) -> None:
    sd = state()
    writer = DataStatesWriter(tmp_path, guard_optimizer_step=False, **SMALL_POOL)
    response = async_save(sd, writer, no_dist=True)
    threading.Timer(1.0, gated_tensors.set).start()  # the copy in flight ends after 1 s
    start = time.monotonic()
    writer.close(timeout=0.3)
    assert time.monotonic() - start < 10
    sd["w"][0].add_(1.0)  # changed after close: must never reach a checkpoint
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert failure_of(raised.value, SnapshotAbortedError) is not None, raised.value
    assert "closed" in str(raised.value)
    assert not (tmp_path / METADATA_NAME).exists()


def test_close_with_a_timeout_before_the_save_thread_claims_fails_that_save_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close(timeout=0)`` right after ``async_save``, before the writer's save thread took the
    snapshot (a user sweep): that save fails as a dropped snapshot, ``CheckpointSaveError``
    with ``SnapshotAbortedError``, not with a bare ``WriterClosedError`` saying to make a new
    writer; its stats name the checkpoint. The save thread is held until close() returned."""
    from dcp_datastates.save import api

    gate = threading.Event()
    save_staged = api._save_staged

    def held(*args):
        assert gate.wait(EVENT_TIMEOUT_S)
        return save_staged(*args)

    monkeypatch.setattr(api, "_save_staged", held)
    writer = DataStatesWriter(tmp_path / "w")
    path = tmp_path / "c"
    response = async_save(state(), writer, checkpoint_id=path, no_dist=True)
    writer.close(timeout=0)
    gate.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert set(raised.value.failures) == {0}
    assert isinstance(raised.value.failures[0], SnapshotAbortedError), raised.value
    assert "was closed before this snapshot was written" in str(raised.value)
    assert not (path / METADATA_NAME).exists()
    assert writer.last_failed_stats.checkpoint_id == str(path)
    with pytest.raises(WriterClosedError):  # the next save is refused as a closed writer's
        async_save(state(), writer, no_dist=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX")
def test_a_child_forked_during_a_save_trains_saves_with_its_own_writer_and_exits(
    tmp_path: Path,
) -> None:
    """``os.fork()`` while a save is in flight (a user sweep: the child hung in its forward,
    in its save, or at exit in the inherited writer's finalizer, on locks and snapshots that
    are the parent's). In a fresh interpreter (``_fork_worker.py``): the child trains a step,
    is refused the inherited writer with a clear error, saves through its own, closes both and
    exits; the parent's save then commits the state at its call."""
    worker = Path(__file__).with_name("_fork_worker.py")
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(worker), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK child exit status 0" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("how", ["stage", "async_save", "dcp.async_save", "dcp.save"])
def test_a_closed_writer_refuses_new_work_with_a_clear_error(tmp_path: Path, how: str) -> None:
    writer = DataStatesWriter(tmp_path)
    writer.close()
    writer.close()  # twice is fine
    assert writer.closed
    with pytest.raises(BaseException) as raised:
        if how == "stage":
            writer.stage(state())
        elif how == "async_save":
            async_save(state(), writer, no_dist=True)
        elif how == "dcp.async_save":
            dcp.async_save(state(), storage_writer=writer, no_dist=True).result()
        else:
            dcp.save(state(), storage_writer=writer, no_dist=True)
    closed = failure_of(raised.value, WriterClosedError)
    assert closed is not None, raised.value
    assert "is closed; make a new writer" in str(closed)
    assert writer._runtime.pool is None


@pytest.mark.filterwarnings("ignore:DataStatesWriter.stage.. was not called:RuntimeWarning")
def test_a_direct_stage_never_saved_is_dropped_by_the_next_stage_which_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stage() called directly leaves a snapshot that no save claims; the next stage() waits for
    the claim timeout, then drops it. It dropped it under the runtime's lock, and a snapshot with
    no copy in flight retires at once, in a callback that takes that same lock: the second
    stage() hung for good, and so did close() and the writer's finalizer."""
    monkeypatch.setattr(handoff, "CLAIM_TIMEOUT_S", 0.05)
    writer = DataStatesWriter(tmp_path)
    writer.stage(state())
    first = writer._runtime._handoff._unclaimed.session
    writer.staging_future.result(timeout=EVENT_TIMEOUT_S)  # every copy landed: none in flight
    second: list = []
    stager = threading.Thread(target=lambda: second.append(writer.stage(state(2))), daemon=True)
    stager.start()
    stager.join(EVENT_TIMEOUT_S)
    if stager.is_alive():
        writer._finalizer.detach()  # it would wait on the lock the stuck thread holds
        pytest.fail("the second stage() deadlocked dropping the snapshot nobody claimed")
    assert len(second) == 1
    assert isinstance(first.error, SnapshotAbortedError)
    assert "was never picked up by a save" in str(first.error)
    assert first.retired  # its pool blocks are back
    writer.close()


# -- item 6: automatic pool size ---------------------------------------------------------------
def test_the_automatic_pool_is_this_ranks_share_of_the_node(
    tmp_path: Path, make_writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resources, "physical_memory", lambda: 256 * MiB)  # 64 MiB at 0.25
    monkeypatch.setattr(resources, "MIN_AUTO_POOL", MiB)
    sd = {"w": torch.randn(6 * MiB)}  # 24 MiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = make_writer(tmp_path / "a")
    dcp.save(sd, storage_writer=alone, no_dist=True)
    # The state and its blocks' rounding (pool.block_slack), under the cap.
    assert alone.last_stats.pool_bytes == 24 * MiB + block_slack(
        24 * MiB, alone.options.coalesce_bytes
    )

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    shared = make_writer(tmp_path / "b")
    dcp.save(sd, storage_writer=shared, no_dist=True)
    assert shared.last_stats.pool_bytes == 8 * MiB  # 64 MiB / 8 ranks
    assert_same_state(sd, load_like(tmp_path / "b", sd, "datastates"))


def test_the_automatic_pool_counts_what_this_rank_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_datastates._dcp_private import AsyncSaveCall
    from dcp_datastates.save.planner import plan_providers
    from dcp_datastates.save.staging import _expected_write_bytes

    items = plan_providers({"replicated": torch.zeros(MiB), "obj": {"a": 1}})
    call = AsyncSaveCall(found=True)
    assert _expected_write_bytes(items, call) == 4 * MiB
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    assert _expected_write_bytes(items, call) == MiB  # DCP spreads replicated items over ranks
    assert _expected_write_bytes(items, AsyncSaveCall(found=True, no_dist=True)) == 4 * MiB


# -- item 7: options ----------------------------------------------------------------------------
BAD_OPTIONS = [
    ("host_pool_bytes", 64e6, "is a float; it must be an int; write host_pool_bytes=int("),
    ("host_pool_bytes", True, "is a bool"),
    ("host_pool_bytes", 1000, "must be at least"),
    ("chunk_bytes", 1.5e6, "is a float"),
    ("chunk_bytes", 100, "must be at least 4096"),
    ("coalesce_bytes", "1MiB", "is a str"),
    ("coalesce_bytes", 64 * MiB, "must not exceed chunk_bytes"),
    ("copy_workers", 0, "between 1 and 64"),
    ("copy_workers", 2.0, "is a float"),
    ("flush_workers", 65, "between 1 and 64"),
    ("flush_workers", None, "is a NoneType"),
    ("flush_nice", 20, "between 0 and 19"),
    ("flush_nice", -1, "between 0 and 19"),
    ("max_pool_fraction", 0.0, "in (0, 0.9]"),
    ("max_pool_fraction", 1.5, "in (0, 0.9]"),
    ("max_pool_fraction", "0.5", "in (0, 0.9]"),
    ("max_pool_fraction", True, "in (0, 0.9]"),
    ("eager_copy_bytes", -1, "between 0 and"),
    ("eager_copy_bytes", 4096.0, "is a float"),
    ("guard_optimizer_step", 1, "must be True or False"),
    ("guard_forward", "yes", "must be True or False"),
    ("copy_on_write", 1, "must be True or False"),
    ("guard_on_device", 1, "must be True or False"),
    ("sync_files", None, "must be True or False"),
    ("direct_writes", "yes", "must be True or False"),
    ("live_flush", 1, "must be True, False or None"),
    ("overwrite", 0, "must be True or False"),
    ("node_local", "yes", "must be True or False"),
    ("incremental", 1, "must be True or False"),
    ("storage_options", "http://127.0.0.1:9000", "must be a mapping"),
]


def test_a_small_chunk_bytes_alone_says_to_lower_coalesce_bytes_too(tmp_path: Path) -> None:
    # A user sweep: chunk_bytes below coalesce_bytes' default (1 MiB) failed naming an option
    # the caller never passed, with no fix.
    with pytest.raises(ValueError, match=r"pass coalesce_bytes=262144 or less"):
        DataStatesWriter(tmp_path, chunk_bytes=256 * 1024)
    DataStatesWriter(tmp_path, chunk_bytes=256 * 1024, coalesce_bytes=256 * 1024).close()  # fine


@pytest.mark.parametrize(("name", "value", "message"), BAD_OPTIONS)
def test_every_bad_option_fails_at_construction_naming_it(
    tmp_path: Path, name: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        DataStatesWriter(tmp_path, **{name: value})
    assert f"{name}=" in str(raised.value) and message in str(raised.value)


def test_every_option_is_covered_by_the_bad_option_table() -> None:
    assert {name for name, _, _ in BAD_OPTIONS} == set(WriterOptions.names())


def test_an_unknown_option_lists_the_real_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown option.*host_pol_bytes.*host_pool_bytes"):
        DataStatesWriter(tmp_path, host_pol_bytes=MiB)


def test_good_options_are_accepted(tmp_path: Path) -> None:
    writer = DataStatesWriter(
        tmp_path,
        host_pool_bytes=64 * MiB,
        max_pool_fraction=0.5,
        eager_copy_bytes=0,
        guard_forward=False,
    )
    assert writer.options.host_pool_bytes == 64 * MiB
    writer.close()


# -- item 10: bookkeeping ---------------------------------------------------------------------
def test_a_failed_save_keeps_its_own_record_and_last_stats_the_last_good_one(
    tmp_path: Path, make_writer, gated_tensors
) -> None:
    writer = make_writer(
        tmp_path / "unused", guard_optimizer_step=False, copy_on_write=False, **SMALL_POOL
    )
    sd = state()
    gated_tensors.set()
    async_save(
        sd, writer, checkpoint_id=str(tmp_path / "good"), no_dist=True
    ).upload_completion.result(timeout=EVENT_TIMEOUT_S)
    good = writer.last_stats
    figures = (good.blocked_s, good.durable_s, good.bytes_written)
    assert good.ok

    gated_tensors.clear()
    failed = async_save(sd, writer, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    sd["w"][0].add_(1.0)  # torn: the save fails
    gated_tensors.set()
    with pytest.raises(CheckpointSaveError):
        failed.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    assert writer.last_stats is good
    assert (good.blocked_s, good.durable_s, good.bytes_written) == figures
    bad = writer.last_failed_stats
    assert bad is not None and bad is not good and not bad.ok
    assert "SnapshotMutationError" in bad.error and "failed" in bad.summary()
    assert bad.blocked_s > 0
    assert pool_drains(writer)


def test_optimizer_wait_counts_only_this_writers_snapshots(
    tmp_path: Path, make_writer, registered_providers
) -> None:
    """Two writers; only the second one's snapshot holds the step back."""
    gate = threading.Event()
    weight = torch.nn.Parameter(torch.randn(64, 64))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    quick = make_writer(tmp_path / "quick")
    async_save({"x": torch.randn(64)}, quick, no_dist=True).upload_completion.result(
        timeout=EVENT_TIMEOUT_S
    )
    registered_providers(
        torch.nn.Parameter, lambda fqn, value: GatedTensorProvider(fqn, value, gate)
    )
    slow = make_writer(tmp_path / "slow")
    response = async_save({"w": weight}, slow, no_dist=True)
    threading.Timer(0.2, gate.set).start()
    optimizer.step()  # waits about 0.2 s, for the slow writer's snapshot only
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert slow.last_stats.optimizer_wait_s >= 0.1
    assert quick.last_stats.optimizer_wait_s == 0.0


def test_a_mutation_error_still_names_the_tensor(tmp_path: Path, make_writer, gated_tensors):
    writer = make_writer(tmp_path, guard_optimizer_step=False, copy_on_write=False, **SMALL_POOL)
    sd = state()
    response = async_save(sd, writer, no_dist=True)
    sd["w"][1].mul_(2)
    gated_tensors.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert failure_of(raised.value, SnapshotMutationError).fqn == "w.1"
