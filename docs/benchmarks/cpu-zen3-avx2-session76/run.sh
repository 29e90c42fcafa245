#!/usr/bin/env bash
# Spec-Bench --limit 2 on this AVX2 Zen 3, fp32 and w8a8, llama.cpp beside in the same run.
set -x
cd /work/main && source .venv/bin/activate
for dt in float32 w8a8; do
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor \
    --threads 2 --dtype $dt --methods baseline_compiled,planned,llama_cpp,llama_cpp_lookup --out /tmp/s76/bench-$dt
done
B=~/.cache/medusa-peers/llama.cpp/bin
for q in F32 BF16 Q8_0; do
  f=$(ls ~/.cache/medusa/peers/*$q*.gguf 2>/dev/null | head -1)
  [ -n "$f" ] && $B/llama-bench -m $f -t 2 -p 320 -n 64 -fa 0,1 -o md
done
echo done
