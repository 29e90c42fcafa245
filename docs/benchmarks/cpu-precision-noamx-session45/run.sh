#!/bin/bash
# #39's rows on this Xeon with AMX held back, as an AVX-512 CPU without AMX (the AMD EPYC kind) runs them:
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (medusa then compiles without AMX micro-kernels: hardware.amx_held_back), peers
# from the llama.cpp build without AMX. NATIVE=1: no limit (the same machine as it is), for a side-by-side row.
# One medusa bench per precision (DTYPES), Spec-Bench or held-out (QUESTIONS, LIMIT), llama-bench tg64 checks between.
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
export LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-/tmp/llpeers/noamx/bin}
[ -z "$NATIVE" ] && export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
OUT=${OUT:-/tmp/bench45}
TAG=${TAG:-noamx}
QUESTIONS=${QUESTIONS:-../shared/bench_data/spec_bench_question.jsonl}
METHODS=${METHODS:-baseline_compiled,planned,llama_cpp,llama_cpp_lookup}
F32=$HOME/.cache/medusa/peers/SmolLM2-135M-Instruct.Q4_1-F32.gguf
mkdir -p $OUT
sanity() { echo "== llama-bench $1 $(date +%T)"; $LLAMA_CPP_BIN/llama-bench -m $F32 -t 2 -p 0 -n 64 -r 3 2>/dev/null | grep tg64; }
for D in ${DTYPES:-float32 bfloat16 int8 int4 w8a8}; do
  sanity before-$D
  echo "== bench $D $(date +%T)"
  .venv/bin/python -m medusa bench --questions $QUESTIONS --limit ${LIMIT:-2} --engine inductor --threads 2 \
      --dtype $D --methods $METHODS --out $OUT/$D-$TAG > $OUT/$D-$TAG.log 2>&1
  echo "rc $?"
  .venv/bin/python scripts/divergence.py $OUT/$D-$TAG --reference baseline_compiled > $OUT/$D-$TAG/divergence.txt 2>&1
  grep "^|" $OUT/$D-$TAG/divergence.txt | head -8
done
sanity end
echo "== all done $(date +%T)"
