#!/usr/bin/env bash
# Self-distillation answered by each data.engine, alternating, on the heads' own data recipe (configs/smollm2-135m.yaml:
# T0 / Alpaca / GSM8K / seed-task prompts, 64 answered together, up to 192 new tokens, bf16, greedy):
#   bash docs/benchmarks/cpu-datagen-engine-session52/run.sh SHARDS ROUNDS OUT_DIR
# Each run writes the first SHARDS shards into a fresh directory; per run: wall seconds (model load, and the plan's
# first calibration at this batch size, excluded by a warm-up run per engine), response tokens, tokens/s.
set -euo pipefail
shards=${1:-2}; rounds=${2:-2}; out=${3:-/tmp/bench-datagen}
mkdir -p "$out"
run() {  # engine tag
  rm -rf "$out/data-$2"
  local start end
  start=$(date +%s.%N)
  python train/generate_data.py --config configs/smollm2-135m.yaml --data.max_shards "$shards" \
    --data.out_dir "$out/data-$2" --data.engine "$1" 2>"$out/$2.err" | tail -1 | tee "$out/$2.out"
  end=$(date +%s.%N)
  local tokens
  tokens=$(grep -o '[0-9]* response tokens' "$out/$2.out" | cut -d' ' -f1)
  python - "$1" "$2" "$start" "$end" "$tokens" <<'PY' | tee -a "$out/results.txt"
import sys
engine, tag, start, end, tokens = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
print(f"{tag}: engine {engine}, {tokens} response tokens in {end - start:.1f} s wall = {tokens / (end - start):.1f} tok/s")
PY
}
# warm-ups: one shard each (the medusa plan calibrates this batch size once, packages compile once per machine)
python train/generate_data.py --config configs/smollm2-135m.yaml --data.max_shards 1 --data.out_dir "$out/warm-medusa" \
  --data.engine medusa >/dev/null 2>&1
for r in $(seq 1 "$rounds"); do
  run transformers "transformers-$r"
  run medusa "medusa-$r"
done
