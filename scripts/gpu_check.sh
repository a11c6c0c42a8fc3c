#!/usr/bin/env bash
# The CUDA path on one GPU, in one command (at most ~7 minutes):
#
#     pip install -e '.[dev,cuda]' && bash scripts/gpu_check.sh
#
# Runs the `gpu` tests (tests/test_gpu.py) and prints the figures they record (one JSON line each:
# fenced and host-waited steps per training loop, load times behind the caller's streams), then
# scripts/gpu_bench.py, which prints one JSON line per figure (device-to-host GB/s against a plain
# pinned copy and stock DefaultStager, blocked and safe-to-mutate times against stock async_save,
# the training step-time dip). The test figures are printed even when a test fails; the script
# then exits with pytest's status after the benchmark. Extra arguments go to the benchmark (e.g.
# --quick, --dir /mnt/nvme). Without a CUDA device it says so and exits 0.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: torch is not importable by $PYTHON; install the package first" >&2
    exit 1
fi
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False):" \
        "the CUDA path cannot be checked here; nothing to do"
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" -c "import cuda_ext, torch; print('gpu_check:', torch.cuda.get_device_name(0),
      '| torch', torch.__version__, '| cuda-python pinned pool:', cuda_ext.host_memory.available())"
figures="$(mktemp)"
trap 'rm -f "$figures"' EXIT
echo "gpu_check: gpu tests"
tests=0
GPU_CHECK_FIGURES="$figures" timeout 240 "$PYTHON" -m pytest -q -rs -m gpu tests/test_gpu.py \
    -p no:cacheprovider || tests=$?
echo "gpu_check: figures from tests/test_gpu.py (JSON lines)"
cat "$figures"
echo "gpu_check: benchmark (JSON lines)"
timeout 150 "$PYTHON" scripts/gpu_bench.py "$@"
exit "$tests"
