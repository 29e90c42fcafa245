#!/bin/bash
# session 45 probes, one after another (run when nothing else runs)
cd /work/main
D=docs/benchmarks
P=/work/main/.venv/bin/python
cache() { mkdir -p /tmp/probe-$1 && ln -sfn ~/.cache/medusa/gguf /tmp/probe-$1/gguf; echo /tmp/probe-$1; }
run() { local name=$1; shift; echo "===== $name $(date +%T)"; "$@" 2>&1 | grep -E "^\s*(query|prompt|[0-9]|verify|rows)|ms|Error|error" | grep -v Warn | tail -14; }
export -f run
NOAMX="env ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
run "bf16 noamx main (gemv one-token, oneDNN trees)" $NOAMX $P scripts/step_cost.py --dtype bfloat16 --rows 512 --prompt 64 --repeats 15 --queries 1 2 4 8 16
run "bf16 noamx template, no bf16 prefetch" $NOAMX MEDUSA_CACHE=$(cache bf16c) $P $D/cpu-precision-noamx-session45/bf16_template.py
run "bf16 noamx template, bf16 prefetch 256 (worktree)" $NOAMX MEDUSA_CACHE=$(cache bf16b) PYTHONPATH=/tmp/wt45 $P $D/cpu-precision-noamx-session45/bf16_template.py
run "int4 native stock" $P $D/cpu-amx-prefetch-session45/amx_prefetch.py int4
run "int4 native INT4_ROWS=512 INT4_VEC_ROWS=256" env INT4_ROWS=512 INT4_VEC_ROWS=256 MEDUSA_CACHE=$(cache int4a) $P $D/cpu-amx-prefetch-session45/amx_prefetch.py int4
run "bf16 native stock" $P $D/cpu-amx-prefetch-session45/amx_prefetch.py bfloat16
run "bf16 native TILE_ROWS=128" env TILE_ROWS=128 MEDUSA_CACHE=$(cache bf16t) $P $D/cpu-amx-prefetch-session45/amx_prefetch.py bfloat16
run "int8 native stock" $P $D/cpu-amx-prefetch-session45/amx_prefetch.py int8
run "int8 native INT8_ROWS=256" env INT8_ROWS=256 MEDUSA_CACHE=$(cache int8a) $P $D/cpu-amx-prefetch-session45/amx_prefetch.py int8
run "w8a8 native stock" $P $D/cpu-amx-prefetch-session45/amx_prefetch.py w8a8
run "w8a8 native TILE_ROWS=256" env TILE_ROWS=256 MEDUSA_CACHE=$(cache w8a8t) $P $D/cpu-amx-prefetch-session45/amx_prefetch.py w8a8
echo "===== done $(date +%T)"
