#!/usr/bin/env bash
# The shipped EAGLE-3 draft's plan against the heads' on this CPU, fp32 and bf16, again on an idle machine.
#   bash docs/benchmarks/cpu-zen4-session68/draft_vs_heads.sh OUT      (~10 min once compiled and planned)
set -eu
for d in float32 bfloat16; do
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
    --threads 2 --dtype "$d" --methods baseline_compiled,planned,eagle3_planned,llama_cpp --out "${1:?usage: OUT}/$d"
done
