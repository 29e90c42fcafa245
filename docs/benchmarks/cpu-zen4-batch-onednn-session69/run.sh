#!/usr/bin/env bash
# bf16 batches on the inductor_onednn engine (session 69): one side of the A/B, the library on PYTHONPATH.
#   bash docs/benchmarks/cpu-zen4-batch-onednn-session69/run.sh OUT     (from the repository root, after make install)
set -euo pipefail
out=$1
mkdir -p "$out"
here=docs/benchmarks/cpu-zen4-batch-onednn-session69
py=.venv/bin/python
$py $here/batch_steps.py bfloat16 inductor,inductor_onednn,compiled,eager 1,2,4,8,16,64 > "$out/steps.txt"
$py docs/benchmarks/cpu-datagen-engine-session52/batch_ab.py bfloat16 64 192 planned,plain > "$out/datagen.txt"
$py scripts/batch_speed.py --dtype bfloat16 --sizes 1 2 4 8 16 --prompts 16 --max-new-tokens 64 \
    --proposers planned --out "$out/speed.json" > "$out/speed.txt"
