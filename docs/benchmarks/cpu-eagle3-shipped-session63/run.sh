#!/usr/bin/env bash
# The shipped EAGLE-3 draft (embedded:smollm2-135m-instruct-eagle3) with its trees' copy guess (session 63):
# its decoded taus, then Spec-Bench --limit 2 at fp32 and bf16 beside the heads, our plain decoding and llama.cpp.
#     bash docs/benchmarks/cpu-eagle3-shipped-session63/run.sh OUT      (from the repository root, ~15 min)
set -eu
out=${1:?usage: run.sh OUT}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
questions=../shared/bench_data
for copy in 0 4; do  # the draft alone, then with the copy guess (what it ships with); written to OUT only
    $py -m medusa accuracy --taus --eagle3 embedded:smollm2-135m-instruct-eagle3 --copy-ngram $copy --engine inductor \
        --dtype float32 --questions $questions/self_instruct_user_oriented_instructions.jsonl --limit 16 \
        --out "$out/taus-copy$copy.json"
done
for dtype in float32 bfloat16; do
    $py -m medusa bench --questions $questions/spec_bench_question.jsonl --limit 2 --engine inductor --threads 2 \
        --dtype $dtype --methods baseline_compiled,planned,eagle3_planned,llama_cpp --out "$out/$dtype"
done
# OpenVINO GenAI with the same draft (no copy guess there: the export is the network alone), when $OV is a venv as in
# scripts/openvino_eagle3.py's docstring and /tmp/ov holds the exports it names (the draft: medusa export
# embedded:smollm2-135m-instruct-eagle3 /tmp/ov/draft-eagle3 --format eagle3):
if [ -n "${OV:-}" ]; then
    mkdir -p "$out/openvino"
    for cfg in "5 0 1 chain5" "5 3 2 tree325" "8 4 2 tree428" "12 5 2 tree5212" "16 5 3 tree5316"; do
        set -- $cfg
        HF_HUB_OFFLINE=1 $OV/bin/python scripts/openvino_eagle3.py /tmp/ov/target-ov /tmp/ov/draft-ov \
            --questions $questions/spec_bench_question.jsonl --limit 1 --num-assistant-tokens $1 --tree-depth $2 \
            --branching-factor $3 > "$out/openvino/$4.json"
    done
fi
