#!/usr/bin/env bash
# The principal comparison on a Zen 4 EPYC, one precision after another: ours (the heads' plan, and the shipped
# EAGLE-3 draft's at fp32 and bf16) against llama.cpp at the same weights, every method of a run interleaved per
# question.      bash docs/benchmarks/cpu-zen4-session68/run.sh OUT      (repository root, ../shared beside it; ~30 min)
set -eu
out=${1:?usage: run.sh OUT}
for d in float32 bfloat16 w8a8 int8; do
  m=baseline_compiled,planned,llama_cpp,llama_cpp_lookup
  case $d in
    float32) m=baseline,$m,eagle3_planned ;;
    bfloat16) m=$m,eagle3_planned ;;
  esac
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
    --threads 2 --dtype "$d" --methods "$m" --out "$out/$d"
done
