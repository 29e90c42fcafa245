#!/usr/bin/env bash
# llama.cpp's prefill of two prompts at once (llama-batched-bench: -npl 2 sequences of -npp tokens, its prompt
# processing S_PP), flash attention off and on, on the GGUFs of the same weights (medusa bench --methods llama_cpp
# writes them to $MEDUSA_CACHE/peers):
#   bash peers.sh OUT [BIN_DIR]
set -euo pipefail
out=$1 bin=${2:-$HOME/.cache/medusa-peers/llama.cpp/bin}
peers=${MEDUSA_CACHE:-$HOME/.cache/medusa}/peers
mkdir -p "$out"
for gguf in "$peers"/SmolLM2-135M-Instruct.Q4_1-{F32,BF16,Q8_0}.gguf "$peers"/gemma-3-270m-q4_k_m-{F32,BF16,Q8_0}.gguf; do
  for fa in off on; do
    "$bin/llama-batched-bench" -m "$gguf" -c 8300 -b 2048 -ub 512 -npp 1000,2000,4000 -ntg 1 -npl 2 -t 2 -fa "$fa" \
      2>/dev/null | grep '^|' > "$out/$(basename "$gguf" .gguf)-fa-$fa.txt"
  done
done
