#!/bin/bash
cd /work/main
export LLAMA_CPP_BIN=/tmp/llpeers/noamx/bin
for D in bfloat16 int8 int4; do
  echo "== gsm8k $D $(date +%T)"
  .venv/bin/python -m medusa bench --questions ../shared/bench_data/eagle_gsm8k_question.jsonl --limit 12 --engine inductor \
      --threads 2 --dtype $D --methods baseline_compiled,planned,llama_cpp,llama_cpp_lookup --out /tmp/bench43/heldout-gsm8k-$D-native > /tmp/bench43/heldout-gsm8k-$D-native.log 2>&1
  echo "rc $?"
  .venv/bin/python scripts/divergence.py /tmp/bench43/heldout-gsm8k-$D-native --reference baseline_compiled > /tmp/bench43/heldout-gsm8k-$D-native.divergence.txt 2>&1
  grep "^| [pl]" /tmp/bench43/heldout-gsm8k-$D-native.divergence.txt
  grep "^| [bpl]" /tmp/bench43/heldout-gsm8k-$D-native/summary.md | head -4
done
echo "== done $(date +%T)"
