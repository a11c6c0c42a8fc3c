"""Flush threads run at a lower CPU priority (``flush_nice``) so training threads win the cores;
the caller's own priority is never touched."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import load_like

import dcp_datastates.flush as flush_module
from dcp_datastates import DataStatesWriter
from dcp_datastates.snapshot.priority import lower_thread_priority

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only"
)


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

    def spy(value: int) -> bool:
        ok = real(value)
        observed.append((threading.current_thread().name, _nice_of_current_thread()))
        return ok

    monkeypatch.setattr(flush_module, "lower_thread_priority", spy)
    state = {"a": torch.randn(64, 1024), "b": torch.arange(100_000, dtype=torch.int64)}
    writer = DataStatesWriter(tmp_path / "w", flush_nice=nice, flush_workers=2)
    try:
        dcp.async_save(
            state, storage_writer=writer, checkpoint_id=tmp_path / "c", no_dist=True
        ).result()
    finally:
        writer.close()
    assert len(observed) == 2, observed  # one thread per data file
    for name, value in observed:
        assert name.startswith("datastates-flush-")
        assert value == max(base, nice)
    assert _nice_of_current_thread() == base  # the caller keeps its priority
    loaded = load_like(tmp_path / "c", state, "ours")
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
