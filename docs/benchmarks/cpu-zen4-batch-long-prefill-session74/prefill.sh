#!/usr/bin/env bash
# A batch's prefill before and after, alternated per precision and model:
#   bash prefill.sh OUT AFTER_CHECKOUT BEFORE_CHECKOUT [GEMMA_GGUF]
set -euo pipefail
out=$1 after=$2 before=$3 gemma=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for dtype in float32 bfloat16 w8a8; do
  for side in after before; do
    checkout=$after; [ "$side" = before ] && checkout=$before
    PYTHONPATH="$checkout" python "$here/prefill.py" "$out/smollm2-$dtype-$side.jsonl" --dtype "$dtype"
    if [ -n "$gemma" ]; then
      PYTHONPATH="$checkout" python "$here/prefill.py" "$out/gemma3-$dtype-$side.jsonl" --dtype "$dtype" --base "$gemma"
    fi
  done
done
