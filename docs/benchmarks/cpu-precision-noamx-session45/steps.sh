#!/bin/bash
# The verify curve per precision, AMX held back (NATIVE=1: as the machine is): scripts/step_cost.py, 200 tokens
# written, 512-row cache, ms at 1 / 2 / 4 / 8 / 16 query tokens.
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
[ -z "$NATIVE" ] && export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
for D in ${DTYPES:-float32 bfloat16 int8 int4 w8a8}; do
  .venv/bin/python scripts/step_cost.py --dtype $D --rows 512 --prompt 64 --repeats 15 --queries 1 2 4 8 16 2>&1 \
      | grep "verify after"
done
