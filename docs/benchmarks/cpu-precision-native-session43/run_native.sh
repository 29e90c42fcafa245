#!/bin/bash
# The native rows (#39), one medusa bench per precision, peers from the no-AMX llama.cpp build.
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
export LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-/tmp/llpeers/noamx/bin}
OUT=${OUT:-/tmp/bench43}
TAG=${TAG:-native}
F32=$HOME/.cache/medusa/peers/SmolLM2-135M-Instruct.Q4_1-F32.gguf
sanity() { echo "== llama-bench $1 $(date +%T)"; $LLAMA_CPP_BIN/llama-bench -m $F32 -t 2 -p 0 -n 64 -r 3 2>/dev/null | grep tg64; }
for D in ${DTYPES:-float32 bfloat16 int8 int4 w8a8}; do
  sanity before-$D
  echo "== bench $D $(date +%T)"
  .venv/bin/python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
      --threads 2 --dtype $D --methods baseline_compiled,planned,llama_cpp,llama_cpp_lookup --out $OUT/$D-$TAG > $OUT/$D-$TAG.log 2>&1
  echo "rc $?"
  .venv/bin/python scripts/divergence.py $OUT/$D-$TAG --reference baseline_compiled > $OUT/$D-$TAG.divergence.txt 2>&1
  tail -3 $OUT/$D-$TAG.divergence.txt
done
sanity end
echo "== all done $(date +%T)"
