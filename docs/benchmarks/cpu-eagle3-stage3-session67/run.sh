#!/usr/bin/env bash
# The EAGLE-3 draft's third stage (configs/smollm2-135m-eagle3-stage3.yaml): its decoded taus on 16 held-out
# self-instruct prompts (with and without the copy guess; the copy-guess run writes the draft's medusa_accuracy.json,
# which its plan weighs), then Spec-Bench --limit 2 at fp32 and bf16 beside the shipped heads' plan, our compiled
# plain decoding and llama.cpp, one run per precision (session 64's script).
#     DRAFT=runs/eagle3-smollm2-stage3 bash docs/benchmarks/cpu-eagle3-stage3-session67/run.sh OUT   (~10 min)
# DRAFT names the draft (default: the shipped one, whose files are that run's output).
set -eu
bash "$(dirname "$0")/../cpu-eagle3-cached-session64/run.sh" "${1:?usage: run.sh OUT}"
