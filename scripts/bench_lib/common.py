"""What every scenario shares: the JSON-lines recorder, the machine, statistics, page cache, RSS."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

GB = 1e9
#: Prefix of the lines a worker subprocess prints for its parent to parse.
RESULT_PREFIX = "@@bench-result "

now = time.perf_counter


def machine(target_dir: Path | None = None) -> dict[str, Any]:
    """The machine in a few fields, written into every JSON line so runs can be compared."""
    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu_model
            )
    except OSError:
        pass
    out: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_gb": round(psutil.virtual_memory().total / GB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if target_dir is not None:
        out["disk"] = _disk_of(target_dir)
    return out


def _disk_of(path: Path) -> str:
    """Device and file system type of the mount holding ``path``."""
    path = path.resolve()
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = Path(part.mountpoint)
        if (path == mount or mount in path.parents) and (
            best is None or len(str(mount)) > len(str(best.mountpoint))
        ):
            best = part
    return f"{best.device} ({best.fstype}) on {best.mountpoint}" if best else "unknown"


@dataclass
class Recorder:
    """Collects one record per measurement and prints it at once as a JSON line.

    Every record carries ``scenario``, ``system``, ``figures`` (positive numbers: seconds, GB/s),
    the torch version and the machine; scenario-specific fields ride alongside.
    """

    jsonl: Path | None
    quick: bool
    target_dir: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.machine = machine(self.target_dir)
        self.run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl.write_text("")

    def emit(self, scenario: str, system: str, figures: dict[str, float], **extra: Any) -> None:
        record = {
            "scenario": scenario,
            "system": system,
            "figures": {k: float(v) for k, v in figures.items()},
            **extra,
            "quick": self.quick,
            "run_id": self.run_id,
            "torch": torch.__version__,
            "machine": self.machine,
        }
        self.records.append(record)
        line = json.dumps(record, sort_keys=False)
        print(line, flush=True)
        if self.jsonl is not None:
            with self.jsonl.open("a") as f:
                f.write(line + "\n")

    def note(self, text: str) -> None:
        """A remark that belongs under the summary (for example: the page cache was not dropped)."""
        if text not in self.notes:
            self.notes.append(text)
            print(f"# note: {text}", flush=True)

    def select(self, scenario: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records
            if r["scenario"] == scenario and all(r.get(k) == v for k, v in match.items())
        ]


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements of one figure."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return None
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))

    def fmt(self, digits: int = 3) -> str:
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


def alternate(items: Sequence[Any], round_index: int) -> list[Any]:
    """The order of ``items`` in one round: forward on even rounds, backward on odd ones, so no
    system always runs first (or right after the same neighbour) while the disk's speed drifts."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


# -- page cache ----------------------------------------------------------------------------------
def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False where that is not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def go_cold(rec: Recorder, enabled: bool) -> bool:
    """Drop the page cache before a cold measurement; say so once where it was not done."""
    if not enabled:
        rec.note("page cache not dropped (--drop-caches no): 'cold' figures are warm-ish")
        return False
    if drop_caches():
        return True
    rec.note("could not drop the page cache (not root?): 'cold' figures are marked so")
    return False


# -- memory --------------------------------------------------------------------------------------
def rss() -> int:
    return psutil.Process().memory_info().rss


class PeakRSS:
    """Samples this process's RSS on a background thread while the ``with`` block runs."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak = rss()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


# -- files ---------------------------------------------------------------------------------------
def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def log(text: str) -> None:
    """Progress for the person watching; stderr, so stdout stays JSON lines and tables."""
    print(text, file=sys.stderr, flush=True)
