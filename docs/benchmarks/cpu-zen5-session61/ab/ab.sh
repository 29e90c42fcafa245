#!/usr/bin/env bash
# Two checkouts of medusa run alternately, twice, at fp32 and bf16 (the before/after of a change):
#   bash ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT     (each checkout with ../shared beside it and the venv's python on PATH)
# Session 61: BEFORE a worktree of 34dfee8 (prompts on aten's linears), AFTER one of c32bf01 (prompts on oneDNN).
for round in 1 2; do
  for d in float32 bfloat16; do
    for side in before after; do
      root=$1; [ "$side" = after ] && root=$2
      (cd "$root" && PYTHONPATH="$root" python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl \
        --limit 2 --engine inductor --threads 2 --dtype "$d" --methods baseline_compiled,planned,llama_cpp \
        --out "$3/$d-$side-$round")
    done
  done
done
