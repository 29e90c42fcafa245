#!/usr/bin/env bash
# Long prompts (about 4,000 tokens) against llama.cpp at the same weights, one precision after another, methods
# interleaved per question; then decoding alone at growing depth: llama-bench's -d against our verify forwards
# (scripts/step_cost.py) at the same numbers of cached tokens.
#     bash docs/benchmarks/cpu-zen4-long-context-session71/run.sh OUT   (repository root, ../shared beside it; ~25 min)
set -eu
out=${1:?usage: run.sh OUT}
here=docs/benchmarks/cpu-zen4-long-context-session71
mkdir -p "$out"
python "$here/long_questions.py" "$out/long.jsonl" --tokens 3500 --count 4
for d in float32 bfloat16 w8a8; do
  python -m medusa bench --questions "$out/long.jsonl" --engine inductor --threads 2 --dtype "$d" \
    --methods baseline_compiled,planned,llama_cpp --out "$out/$d"
done
bin=${MEDUSA_LLAMA_CPP:-$HOME/.cache/medusa-peers/llama.cpp/bin}
gguf=$HOME/.cache/medusa/peers/SmolLM2-135M-Instruct.Q4_1  # the GGUFs `medusa bench` converted for llama_cpp
"$bin/llama-bench" -m "$gguf-F32.gguf" -m "$gguf-BF16.gguf" -m "$gguf-Q8_0.gguf" -t 2 -p 0 -n 64 \
  -d 256,1024,2048,4000 -r 3 -fa 0,1 -o csv > "$out/llama_bench_depth.csv"
for d in float32 bfloat16 w8a8; do
  for c in 256 1024 2048 4000; do
    python scripts/step_cost.py --engine inductor --dtype "$d" --prompt 64 --context "$c" --rows 4096 \
      --queries 1 4 6 8 --repeats 15 2>/dev/null | grep "verify after"
  done
done > "$out/step_cost_depth.txt"
