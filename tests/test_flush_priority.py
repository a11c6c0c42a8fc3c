"""Flush threads yield to training and to the snapshot: they run at a lower CPU priority
(``flush_nice``), never touching the caller's, and for host state they start writing once the
snapshot is staged, unless it needs pool space only a flush can free."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import load_like

import dcp_datastates.save.flush as flush_module
from dcp_datastates import DataStatesWriter
from dcp_datastates._concurrency.priority import lower_thread_priority

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only"
)


def _save_once(state: dict, tmp_path: Path, **options: object) -> None:
    """One dcp.async_save to ``tmp_path / "c"`` through a writer made for it, closed after."""
    writer = DataStatesWriter(tmp_path / "w", **options)
    try:
        dcp.async_save(
            state, storage_writer=writer, checkpoint_id=tmp_path / "c", no_dist=True
        ).result()
    finally:
        writer.close()


def _nice_of_current_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_lowering_a_thread_priority_leaves_the_other_threads_alone() -> None:
    before = _nice_of_current_thread()
    seen: list[tuple[bool, int]] = []

    def worker() -> None:
        seen.append((lower_thread_priority(before + 3), _nice_of_current_thread()))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(True, before + 3)]
    assert _nice_of_current_thread() == before


@linux_only
def test_a_thread_already_at_a_lower_priority_is_not_raised_back() -> None:
    seen: list[int] = []

    def worker() -> None:
        base = _nice_of_current_thread()
        lower_thread_priority(base + 5)
        assert lower_thread_priority(base + 2)  # asks for less: nothing to do, still True
        seen.append(_nice_of_current_thread() - base)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [5]


@linux_only
@pytest.mark.parametrize("nice", [0, 7])
def test_flush_threads_write_at_the_configured_nice_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nice: int
) -> None:
    base = _nice_of_current_thread()
    observed: list[tuple[str, int]] = []
    real = flush_module.lower_thread_priority

    def spy(value: int, tid: int | None = None) -> bool:
        ok = real(value, tid)
        tid = threading.get_native_id() if tid is None else tid
        name = next(t.name for t in threading.enumerate() if t.native_id == tid)
        observed.append((name, os.getpriority(os.PRIO_PROCESS, tid)))
        return ok

    monkeypatch.setattr(flush_module, "lower_thread_priority", spy)
    state = {"a": torch.randn(64, 1024), "b": torch.arange(100_000, dtype=torch.int64)}
    _save_once(state, tmp_path, flush_nice=nice, flush_workers=2)
    assert len(observed) == 2, observed  # one thread per data file
    for name, value in observed:
        assert name.startswith("datastates-flush-")
        assert value == max(base, nice)
    assert _nice_of_current_thread() == base  # the caller keeps its priority
    loaded = load_like(tmp_path / "c", state, "ours")
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


def _first_writes_after_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: int | bool
):
    seen: list[bool] = []
    real = flush_module._flush_file

    def spy(storage, name, items, session, **kw):  # type: ignore[no-untyped-def]
        seen.append(session.staged.done())
        return real(storage, name, items, session, **kw)

    monkeypatch.setattr(flush_module, "_flush_file", spy)
    state = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    writer = DataStatesWriter(tmp_path / "w", flush_workers=2, **options)
    try:
        for step in range(2):
            path = tmp_path / f"c{step}"
            dcp.async_save(state, storage_writer=writer, checkpoint_id=path, no_dist=True).result()
            loaded = load_like(path, state, "ours")
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
    finally:
        writer.close()
    return seen


def test_host_flush_starts_writing_once_the_snapshot_is_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool holds the whole state; with live_flush (on by default where the cores outnumber
    # the copy workers) the flush starts at once, to write what the copies have not reached
    # from the live tensors (test_live_flush.py).
    seen = _first_writes_after_staged(tmp_path, monkeypatch, live_flush=False)
    assert seen == [True] * 4  # 2 files per save, 2 saves


def test_a_state_larger_than_the_pool_still_streams_through_the_held_back_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _first_writes_after_staged(
        tmp_path,
        monkeypatch,
        host_pool_bytes=2 << 20,
        chunk_bytes=512 << 10,
        coalesce_bytes=64 << 10,
    )
    # The snapshot needed space only the flush frees: the flush started before it was staged.
    assert len(seen) == 4 and not all(seen)


@linux_only
def test_a_flush_the_snapshot_waits_for_keeps_its_priority_until_the_snapshot_is_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a pool smaller than the state the snapshot waits for the space the flush frees: a
    niced flush would hold back the caller's time to safe. Its threads drop to ``flush_nice``
    only once the snapshot is staged."""
    base = _nice_of_current_thread()
    writes: list[tuple[bool, int]] = []  # (staged yet, nice of the writing thread)
    real_flush_file = flush_module._flush_file

    def watching(storage, name, group, session, **kw):  # noqa: ANN001, ANN202
        class Watch:
            def __init__(self, inner: object) -> None:
                self.inner = inner

            def __getattr__(self, attr: str) -> object:
                return getattr(self.inner, attr)

            def wait(self, slice_):  # noqa: ANN001, ANN202
                data = self.inner.wait(slice_)
                writes.append((self.inner.staged.done(), _nice_of_current_thread()))
                return data

        return real_flush_file(storage, name, group, Watch(session), **kw)

    monkeypatch.setattr(flush_module, "_flush_file", watching)
    state = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 8 MiB
    _save_once(
        state,
        tmp_path,
        flush_nice=9,
        flush_workers=2,
        host_pool_bytes=2 << 20,
        chunk_bytes=512 << 10,
        coalesce_bytes=64 << 10,
    )
    before = [nice for staged, nice in writes if not staged]
    after = [nice for staged, nice in writes if staged]
    assert before, "the flush should have written while the snapshot still needed space"
    assert set(before) == {base}, writes
    assert after and set(after) == {max(base, 9)}, writes
    back = load_like(tmp_path / "c", state, "ours")
    assert all(torch.equal(back[k], v) for k, v in state.items())
