#!/usr/bin/env bash
# The compile benchmark on one GPU in about 8 minutes: `kiln bench --plan gpu` under a time budget.
#
#   bash benchmarks/gpu_bench.sh                       # H200: 1B rows for the targets, then 8B, 3B
#   OUT=/some/dir bash benchmarks/gpu_bench.sh         # results under $OUT instead of benchmarks/results
#   bash benchmarks/gpu_bench.sh --device cpu --plan tiny --backend aot_eager   # the same path on a CPU
#
# Needs torch (2.7 or later; DESIGN.md's table used 2.11), transformers, and accelerate for the
# Accelerate rows; torchao for the fp8 row (regional-fp8: torchao's float8 linear layers, compiled per
# block; an error row without it); matplotlib for the plots (skipped with a note without it). Kiln is taken from this
# checkout, installed or not. Flags after the script's name are passed to `kiln bench` and win over
# the ones set here (argparse keeps the last). Files are named kiln_bench_<plan>.*. Rows run in the order of the plan (kiln/bench/plan.py):
# the target rows first, so the budget cuts the least needed rows. Budget: 420 s of rows, plus
# process start and the final table, leaves margin within 8 minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/benchmarks/results}"
PYTHON="${PYTHON:-python}"
BUDGET_S="${KILN_BENCH_BUDGET_S:-420}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT_DIR"
# The machine beside the numbers: versions, GPU, driver.
"$PYTHON" -m kiln env > "$OUT_DIR/kiln_bench_env.txt" 2>&1 || true
if command -v nvidia-smi > /dev/null; then nvidia-smi >> "$OUT_DIR/kiln_bench_env.txt" 2>&1 || true; fi

exec "$PYTHON" -m kiln bench --plan gpu --device cuda --budget "$BUDGET_S" --row-timeout 300 \
    --out "$OUT_DIR" "$@"
