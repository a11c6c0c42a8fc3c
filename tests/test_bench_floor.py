"""The training target's floor (``scripts/bench_lib/floor.py``) and its live variant
(``live_floor.py``) do the work it stands for: a
floor that skipped a copy, a checksum or a write would make every checkpoint look slow beside it.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_lib import floor as floor_mod  # noqa: E402
from bench_lib import live_floor  # noqa: E402
from bench_lib.state import tensors_of  # noqa: E402


def _state() -> tuple[dict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Linear(700, 5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}, opt


def test_the_floor_writes_every_tensor_of_the_state_durably(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(floor_mod, "CHUNK", 64 << 10)  # several checksummed writes, not one
    state, opt = _state()
    expected = [t.clone() for t in tensors_of(state) if t.numel()]
    floor = floor_mod.LazyFloor()
    try:
        future, hook = floor.save(state, tmp_path / "f.bin", opt)
        future.result(timeout=60)
        hook.remove()
        data = (tmp_path / "f.bin").read_bytes()
    finally:
        floor.close()
    offsets, total = floor_mod.LazyFloor._layout(expected)
    assert len(data) >= total > 4 * (64 << 10)
    for t, at in zip(expected, offsets, strict=True):
        n = t.numel() * t.element_size()
        assert data[at : at + n] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_next_optimizer_step_waits_for_the_floors_copy(tmp_path: Path, monkeypatch) -> None:
    state, opt = _state()
    release = threading.Event()
    copying = threading.Event()
    real = floor_mod.ctypes.memmove

    def held_memmove(dst: int, src: int, n: int) -> int:
        copying.set()
        release.wait(60)
        return real(dst, src, n)

    monkeypatch.setattr(floor_mod.ctypes, "memmove", held_memmove)
    floor = floor_mod.LazyFloor()
    try:
        future, hook = floor.save(state, tmp_path / "f.bin", opt)
        assert copying.wait(60)
        stepped = threading.Event()
        stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
        stepper.start()
        assert not stepped.wait(0.2)  # held back by the copy in flight
        release.set()
        stepper.join(60)
        assert stepped.is_set()
        future.result(timeout=60)
        hook.remove()
    finally:
        release.set()
        floor.close()


def test_the_live_floor_writes_the_state_from_live_memory_and_from_its_copy(
    tmp_path: Path, monkeypatch
) -> None:
    """Both of its paths write the state's bytes: the copier is held on its first tensor (the
    state's last) until the flusher has written the others from live memory."""
    monkeypatch.setattr(floor_mod, "CHUNK", 64 << 10)  # several direct writes per tensor
    state, opt = _state()
    expected = [t.clone() for t in tensors_of(state) if t.numel()]
    floor = live_floor.LiveFloor(0)
    real = floor_mod.ctypes.memmove
    live_written = threading.Event()

    def held_memmove(dst: int, src: int, n: int) -> int:
        assert live_written.wait(60)
        return real(dst, src, n)

    real_pwrite = os.pwrite

    def pwrite(fd: int, data, at: int) -> int:
        done = real_pwrite(fd, data, at)
        live_written.set()  # the copier holds the last tensor: this write was live
        return done

    monkeypatch.setattr(floor_mod.ctypes, "memmove", held_memmove)
    monkeypatch.setattr(live_floor.os, "pwrite", pwrite)
    try:
        future, hook = floor.save(state, tmp_path / "f.bin", opt)
        future.result(timeout=60)
        opt.step()  # settled: the step does not wait
        hook.remove()
        data = (tmp_path / "f.bin").read_bytes()
    finally:
        live_written.set()
        floor.close()
    offsets, _ = live_floor.LiveFloor._layout(tensors_of(state))
    sizes = [t.numel() * t.element_size() for t in expected]
    assert 0 < floor.live_bytes[0] <= sum(sizes[:-1])  # both paths were taken
    assert any(n - (-off) % 4096 >= 4096 for n, off in zip(sizes, offsets, strict=True))
    for t, at, n in zip(expected, offsets, sizes, strict=True):
        assert data[at : at + n] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
