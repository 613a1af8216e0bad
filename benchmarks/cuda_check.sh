#!/usr/bin/env bash
# The CUDA tests (tests/cuda, marker `cuda`) in one device call, with the machine they ran on.
#
#   OUT=/some/dir bash benchmarks/cuda_check.sh      # OUT defaults to ./cuda_check_out
#   PYTHON=.venv/bin/python bash benchmarks/cuda_check.sh
#
# Writes into $OUT: cuda_tests.txt (pytest's output), nvidia-smi.txt (GPU and driver) and
# kiln_env.txt (`python -m kiln env`, the `kiln env` command: versions and hardware). Kiln is taken
# from this checkout (PYTHONPATH=.), installed or not. About a minute or two on an H200.
# Exits with pytest's status.
set -uo pipefail  # no -e: the machine's facts are written even when a step fails

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/cuda_check_out}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/nvidia-smi.txt"
PYTHONPATH=. "$PYTHON" -m kiln env > "$OUT/kiln_env.txt" 2>&1

PYTHONPATH=. "$PYTHON" -m pytest tests/cuda -q -m cuda 2>&1 | tee "$OUT/cuda_tests.txt"
exit "${PIPESTATUS[0]}"
