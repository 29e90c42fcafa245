#!/usr/bin/env bash
# Session 65's EAGLE-3 draft (session 64's trained on further with 3,571 more conversations:
# configs/smollm2-135m-eagle3-continued.yaml): session 64's run (its decoded taus on held-out prompts, Spec-Bench
# --limit 2 at fp32 and bf16 beside the shipped heads, our compiled plain decoding and llama.cpp), then the shipped
# heads' taus on the same held-out prompts and, with OV set, OpenVINO GenAI with the draft's eagle3 export.
#     bash docs/benchmarks/cpu-eagle3-continued-session65/run.sh OUT      (from the repository root, ~15 min)
# DRAFT names the draft (default: the shipped one).
set -eu
out=${1:?usage: run.sh OUT}
py=${PYTHON:-.venv/bin/python}
questions=../shared/bench_data
bash "$(dirname "$0")/../cpu-eagle3-cached-session64/run.sh" "$out"
# the shipped heads on the same 16 prompts (their medusa, dynamic and hybrid trees; into OUT only)
$py -m medusa accuracy --taus --engine inductor --dtype float32 \
    --questions $questions/self_instruct_user_oriented_instructions.jsonl --limit 16 --out "$out/taus-heads.json"
# OpenVINO GenAI (no copy guess there: the export is the network alone), when $OV is a venv as in
# scripts/openvino_eagle3.py's docstring and /tmp/ov holds the target and draft IRs it names:
if [ -n "${OV:-}" ]; then
    mkdir -p "$out/openvino"
    for cfg in "5 0 1 chain5" "5 3 2 tree325" "8 4 2 tree428" "16 5 3 tree5316"; do
        set -- $cfg
        HF_HUB_OFFLINE=1 $OV/bin/python scripts/openvino_eagle3.py /tmp/ov/target-ov /tmp/ov/draft-ov \
            --questions $questions/spec_bench_question.jsonl --limit 1 --num-assistant-tokens $1 --tree-depth $2 \
            --branching-factor $3 > "$out/openvino/$4.json"
    done
fi
