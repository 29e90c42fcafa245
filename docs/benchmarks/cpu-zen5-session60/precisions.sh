#!/usr/bin/env bash
# The principal comparison, one precision after another: ours against llama.cpp at the same weights.
#   bash docs/benchmarks/cpu-zen5-session60/precisions.sh OUT      (from the repository root, ../shared beside it)
for d in float32 bfloat16 w8a8 int8; do
  m=baseline_compiled,planned,llama_cpp,llama_cpp_lookup
  [ "$d" = float32 ] && m=baseline,$m
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
    --threads 2 --dtype "$d" --methods "$m" --out "$1/$d"
done
