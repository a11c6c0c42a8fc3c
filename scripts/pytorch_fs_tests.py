"""Run PyTorch's own file-system checkpoint tests with stock's writer and with ours.

    python scripts/pytorch_fs_tests.py PATH/TO/test_file_system_checkpoint_cpu.py [pytest args]

The file comes from a PyTorch checkout (``test/distributed/checkpoint/``; not shipped here), and
needs PyTorch's test helpers' ``expecttest`` package (``pip install expecttest``). It
runs twice with pytest: as it is, and with every ``FileSystemWriter(`` replaced by
``DataStatesWriter(`` (a drop-in is a class-name change). Each run's summary line is printed;
the exit status is 0 when ours passes every test that stock passes. ``docs/compat.md`` keeps the
latest result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(path: Path, args: list[str]) -> tuple[set[str], str]:
    extra = os.environ.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(path), *args],
        capture_output=True,
        text=True,
        cwd=path.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), extra]))},
    )
    passed = set(re.findall(r"^PASSED \S+::(\S+)", done.stdout, re.M))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    return passed, summary


def main(argv: list[str]) -> int:
    source = Path(argv[0]).read_text()
    swapped = source.replace("FileSystemWriter(", "DataStatesWriter(")
    swapped = swapped.replace(
        "import torch\n", "import torch\nfrom dcp_datastates import DataStatesWriter\n", 1
    )
    with tempfile.TemporaryDirectory() as tmp:
        stock_file = Path(tmp, "stock", "test_stock_fs.py")
        ours_file = Path(tmp, "ours", "test_ours_fs.py")
        for file, text in ((stock_file, source), (ours_file, swapped)):
            file.parent.mkdir()
            file.write_text(text)
        stock, stock_summary = _run(stock_file, argv[1:])
        ours, ours_summary = _run(ours_file, argv[1:])
    print(f"stock FileSystemWriter: {stock_summary}")
    print(f"DataStatesWriter:       {ours_summary}")
    missing = sorted(stock - ours)
    if missing:
        print("passed with stock only:", *missing, sep="\n  ")
    return 1 if missing or not stock else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
