#!/usr/bin/env bash
# #35's own command on this CPU: Spec-Bench --limit 2 in batches of 2 and 4, fp32 and bf16, one run after another.
#   bash docs/benchmarks/cpu-zen4-batch-peers-session70/limit2.sh OUT     (from the repository root, after make install)
set -euo pipefail
out=$1
for dtype in float32 bfloat16; do
  for batch in 2 4; do
    .venv/bin/python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 \
      --methods baseline,baseline_compiled,planned --dtype $dtype --batch-size $batch --out "$out/$dtype-b$batch"
  done
done
