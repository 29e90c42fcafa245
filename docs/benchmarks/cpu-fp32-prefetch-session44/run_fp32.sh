#!/bin/bash
# fp32 with peers, natively or under AVX2 limits (AVX2=1; LLAMA_CPP_BIN then an AVX2 build), Spec-Bench or held-out
# (QUESTIONS, LIMIT), METHODS to add fixed trees; a llama-bench tg64 check before and after (slow spells of the VM).
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
export LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-/tmp/llpeers/noamx/bin}
if [ -n "$AVX2" ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
fi
OUT=${OUT:-/tmp/bench44}
RUN=${RUN:-float32-native}
QUESTIONS=${QUESTIONS:-../shared/bench_data/spec_bench_question.jsonl}
METHODS=${METHODS:-baseline_compiled,planned,llama_cpp,llama_cpp_lookup}
F32=$HOME/.cache/medusa/peers/SmolLM2-135M-Instruct.Q4_1-F32.gguf
sanity() { echo "== llama-bench $1 $(date +%T)"; $LLAMA_CPP_BIN/llama-bench -m $F32 -t 2 -p 0 -n 64 -r 3 2>/dev/null | grep tg64; }
sanity before
echo "== bench $RUN $(date +%T)"
.venv/bin/python -m medusa bench --questions $QUESTIONS --limit ${LIMIT:-2} --engine inductor --threads 2 \
    --dtype float32 --methods $METHODS --out $OUT/$RUN > $OUT/$RUN.log 2>&1
echo "rc $?"
.venv/bin/python scripts/divergence.py $OUT/$RUN --reference baseline_compiled > $OUT/$RUN/divergence.txt 2>&1
grep -A12 "^| method | outputs" $OUT/$RUN/divergence.txt | grep "^|"
sanity after
