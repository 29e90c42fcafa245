#!/usr/bin/env bash
# Session 64's EAGLE-3 draft (bf16 autocast, cached target features, 3,600 steps on 4,096 conversations): its decoded
# taus on held-out prompts, then Spec-Bench --limit 2 at fp32 and bf16 beside the shipped heads, our compiled plain
# decoding and llama.cpp, one run per precision.
#     bash docs/benchmarks/cpu-eagle3-cached-session64/run.sh OUT      (from the repository root, ~10 min)
# DRAFT names the draft (default: the shipped one). Its taus with the copy guess are decoded into its directory
# (--heads-dir: its medusa_accuracy.json, which its plan reads), the network's alone into OUT only.
set -eu
out=${1:?usage: run.sh OUT}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
draft=${DRAFT:-embedded:smollm2-135m-instruct-eagle3}
questions=../shared/bench_data
for copy in 0 4; do
    keep=$([ $copy = 4 ] && echo --heads-dir || true)
    $py -m medusa accuracy --taus --eagle3 "$draft" $keep --copy-ngram $copy --engine inductor --dtype float32 \
        --questions $questions/self_instruct_user_oriented_instructions.jsonl --limit 16 --out "$out/taus-copy$copy.json"
done
for dtype in float32 bfloat16; do
    $py -m medusa bench --questions $questions/spec_bench_question.jsonl --limit 2 --engine inductor --threads 2 \
        --dtype $dtype --methods baseline_compiled,planned,eagle3_planned,llama_cpp --eagle3 "$draft" --out "$out/$dtype"
done
