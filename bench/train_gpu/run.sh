#!/usr/bin/env bash
# Benchmark the training stage on one GPU at the Kimi-K2.5 example's dimensions.
#
#   bash bench/train_gpu/run.sh [OUT_DIR] [RUNS]
#
# Needs a Python with torch (CUDA), speculators 0.9.0 and datasets (the training stage's
# environment), ~20 GB free under $BENCH_DATA (default /tmp/train_bench) and one idle GPU.
# RUNS: comma-separated names from CONFIGS in bench.py (repeat names to interleave
# repetitions). BENCH_DEADLINE (epoch seconds) or BENCH_BUDGET_S stops launching runs that
# would not finish in time.
# Then: python bench/train_gpu/bench.py summarize OUT_DIR/results.jsonl \
#           --json bench/results/train_gpu.json --md bench/results/train_gpu.md
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/train_gpu/out}
data=${BENCH_DATA:-/tmp/train_bench}
export PYTHONPATH="$PWD/workflow${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 bench/train_gpu/make_synthetic.py --out "$data"
budget=${BENCH_BUDGET_S:-3600}
[ -n "${BENCH_DEADLINE:-}" ] && budget=$((BENCH_DEADLINE - $(date +%s)))
python3 bench/train_gpu/bench.py run --data "$data" --out "$out" --budget-s "$budget" ${2:+--runs "$2"}
