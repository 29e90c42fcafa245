#!/usr/bin/env bash
# The EAGLE-3 draft's plan (session 62): decode its trees' tokens per step on held-out prompts, then Spec-Bench
# --limit 2 with the draft planned beside the heads planned, plain compiled decoding and llama.cpp, fp32 and bf16.
#   bash docs/benchmarks/cpu-eagle3-plan-session62/run.sh DRAFT_DIR OUT
# (from the repository root, after `make install` and training the draft:
#  accelerate launch --num_processes 1 --cpu train/train.py --config configs/smollm2-135m-eagle3.yaml)
set -euo pipefail
DRAFT=${1:?draft directory}
OUT=${2:?output folder}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
$PY -m medusa accuracy --taus --eagle3 "$DRAFT" --heads-dir --engine inductor --dtype float32 \
  --questions ../shared/bench_data/self_instruct_user_oriented_instructions.jsonl --limit 16 --out "$OUT/taus.json"
for dtype in float32 bfloat16; do
  $PY -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --threads 2 \
    --dtype "$dtype" --methods baseline_compiled,planned,eagle3_planned,llama_cpp --eagle3 "$DRAFT" \
    --out "$OUT/$dtype"
done
