#!/usr/bin/env bash
# The EAGLE-3 draft's step compiled ahead of time (medusa.eagle3.compile_draft_step): the shipped draft eager against
# compiled side by side in one process (ab_step.py, a fixed dynamic tree of 6 and of 4 nodes), then Spec-Bench
# --limit 2 at fp32 and bf16: the draft's plan beside the shipped heads' plan, our compiled plain decoding and
# llama.cpp, one run per precision.
#     bash docs/benchmarks/cpu-eagle3-compiled-session66/run.sh OUT      (from the repository root, ~15 min)
set -eu
out=${1:?usage: run.sh OUT}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
here=$(dirname "$0")
for nodes in 6 4; do
    $py "$here/ab_step.py" $nodes 2 3 > "$out/ab_step_$nodes.txt"
done
for dtype in float32 bfloat16; do
    $py -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor --threads 2 \
        --dtype $dtype --methods baseline_compiled,planned,eagle3_planned,llama_cpp --out "$out/$dtype"
done
