#!/bin/bash
# The held-out rows: 12 GSM8K questions from EAGLE's set, one medusa bench per precision, peers from LLAMA_CPP_BIN
# (this session: the no-AMX build). Run as DTYPES="float32 w8a8" then DTYPES="bfloat16 int8 int4".
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
export LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-/tmp/llpeers/noamx/bin}
OUT=${OUT:-/tmp/bench43}
for D in ${DTYPES:-float32 bfloat16 int8 int4 w8a8}; do
  echo "== gsm8k $D $(date +%T)"
  .venv/bin/python -m medusa bench --questions ../shared/bench_data/eagle_gsm8k_question.jsonl --limit 12 --engine inductor \
      --threads 2 --dtype $D --methods baseline_compiled,planned,llama_cpp,llama_cpp_lookup --out $OUT/heldout-gsm8k-$D-native > $OUT/heldout-gsm8k-$D-native.log 2>&1
  echo "rc $?"
  .venv/bin/python scripts/divergence.py $OUT/heldout-gsm8k-$D-native --reference baseline_compiled > $OUT/heldout-gsm8k-$D-native.divergence.txt 2>&1
  grep "^| [pl]" $OUT/heldout-gsm8k-$D-native.divergence.txt
  grep "^| [bpl]" $OUT/heldout-gsm8k-$D-native/summary.md | head -4
done
echo "== done $(date +%T)"
