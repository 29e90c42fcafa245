#!/bin/bash
# fp32 natively: the change (16 x 16 blocks, /work/main) and main's head (a worktree of f752c5c at /tmp/wt-head),
# one after the other, each with its llama.cpp peers. Paths as they were this session.
export LLAMA_CPP_BIN=/tmp/llpeers/noamx/bin
F32=$HOME/.cache/medusa/peers/SmolLM2-135M-Instruct.Q4_1-F32.gguf
sanity() { echo "== llama-bench $1 $(date +%T)"; $LLAMA_CPP_BIN/llama-bench -m $F32 -t 2 -p 0 -n 64 -r 3 2>/dev/null | grep tg64; }
for v in ${ORDER:-new head}; do
  if [ $v = head ]; then cd /tmp/wt-head; else cd /work/main; fi
  sanity before-$v
  echo "== bench fp32 $v $(date +%T)"
  PYTHONPATH=$PWD /work/main/.venv/bin/python -m medusa bench --questions /work/shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
      --threads 2 --dtype float32 --methods baseline_compiled,planned,llama_cpp,llama_cpp_lookup --out /tmp/bench43/float32-native-$v${SUFFIX} > /tmp/bench43/float32-native-$v${SUFFIX}.log 2>&1
  echo "rc $?"
  PYTHONPATH=$PWD /work/main/.venv/bin/python scripts/divergence.py /tmp/bench43/float32-native-$v${SUFFIX} --reference baseline_compiled > /tmp/bench43/float32-native-$v${SUFFIX}.divergence.txt 2>&1
  grep "^| [pl]" /tmp/bench43/float32-native-$v${SUFFIX}.divergence.txt
  grep "^| [bpl]" /tmp/bench43/float32-native-$v${SUFFIX}/summary.md | head -4
done
sanity end
