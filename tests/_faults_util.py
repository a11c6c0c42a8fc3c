"""Shared pieces of the fault campaign (``test_faults_*.py``): a state whose every value follows
from (seed, step), a small real tmpfs, process figures (RSS, open fds) and polling with a
deadline. Import it like ``conftest``: ``from _faults_util import ...``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

MiB = 1 << 20
SEED = 20240611

#: Generous bound for "fails within a bounded time": other engineers share the 2 CPU cores.
BOUNDED_S = 60.0


def base_state(mib: int = 20, *, seed: int = SEED) -> dict[str, Any]:
    """A training-like state of about ``mib`` MiB: model, optimizer moments, objects.

    Every value is a function of ``seed``; :func:`apply_step` moves it to a given step.
    """
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4 // 4  # four float32-sized tensors share the budget
    return {
        "model": {
            "w0": torch.randn(n, generator=g),
            "w1": torch.randn(n // 512, 512, generator=g),
            "emb": torch.randn(n, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 30, (n // 2,), generator=g),
        },
        "optim": {"exp_avg": torch.randn(n // 4, generator=g, dtype=torch.float64), "step": 0},
        "meta": {"step": 0, "tag": "step-0"},
    }


def apply_step(state: dict[str, Any], step: int, base: dict[str, Any] | None = None) -> None:
    """Set ``state`` (in place) to the values of ``step``: ``base + step`` for every tensor."""
    base = base if base is not None else base_state(_mib_of(state))
    with torch.no_grad():
        for group in ("model", "optim"):
            for key, value in state[group].items():
                if isinstance(value, torch.Tensor):
                    value.copy_(base[group][key]).add_(step)
    state["optim"]["step"] = step
    state["meta"] = {"step": step, "tag": f"step-{step}"}


def state_at(step: int, mib: int = 20) -> dict[str, Any]:
    """What a checkpoint of ``step`` must hold, bit for bit."""
    state = base_state(mib)
    apply_step(state, step, base_state(mib))
    return state


def _mib_of(state: dict[str, Any]) -> int:
    return round(state["model"]["w0"].numel() * 4 * 4 / MiB)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.002) -> Any:
    """Poll ``predicate`` until it is truthy; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def mounted_tmpfs(parent: Path, size: str = "32m") -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted under ``parent`` (a file system that fills up),
    unmounted afterwards. Skips the test when this process may not mount (not root, or no
    mount permission in this container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the disk-full tests run as root in CI")
    mnt = parent / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
