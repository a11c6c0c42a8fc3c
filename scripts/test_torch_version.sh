#!/usr/bin/env bash
# Run the DCP-facing tests against another torch release, in a throwaway virtual environment
# with its own torch and this project's test requirements (a venv made by a venv's python sees
# the base interpreter's packages, not that venv's: pytest and crc32c were missing).
#
#   scripts/test_torch_version.sh 2.14.1 [pip args...]
#
# Extra arguments go to pip (e.g. --find-links /dir/with/wheels). PyPI's Linux torch wheels are
# CUDA builds (several GB with their nvidia-* libraries); they run these tests on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$1"
shift
venv="${TMPDIR:-/tmp}/dcp-datastates-torch-${version}"
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
  2>/dev/null || "$venv/bin/pip" install "torch==${version}" "$@"
# The core and test requirements, and psutil for the multi-rank workers; torch stays as it is.
"$venv/bin/pip" install -q -e ".[test]" psutil "torch==${version}" "$@"
PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_conformance.py tests/test_roundtrip.py tests/test_distributed.py \
  tests/test_reader_paths.py tests/test_process_executor.py tests/test_format_golden.py \
  tests/test_guard_and_mutation.py
