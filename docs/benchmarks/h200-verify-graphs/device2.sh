#!/usr/bin/env bash
# The second device call of session 37, after the KV commit became a CUDA graph and plain decoding's acceptance its
# argmax: the GPU tests beside the 8B-shaped step cost (tests are light on the GPU; the step cost compiles first),
# then the hand-captured verify on SmolLM2's shape alone. Logs go to $OUT as they are written.
#     bash docs/benchmarks/h200-verify-graphs/device2.sh   (on the device machine, in the repository root)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
end=$((SECONDS + ${BUDGET:-280}))
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1 &
tests=$!
timeout 150 python3 docs/benchmarks/gpu-step-cost/step_cost.py --engines compiled --out "$OUT" --verify-graphs \
    > "$OUT/step_cost.log" 2>&1
wait $tests
tail -3 "$OUT/test_gpu.log"
tail -5 "$OUT/step_cost.log"
timeout $((end - SECONDS)) python3 docs/benchmarks/h100-verify-graphs/verify_graphs.py --out "$OUT" --dtypes bfloat16 \
    --runs plain,medusa6 --rounds 2 --hand-captured-only > "$OUT/verify_graphs.log" 2>&1
grep -v "^{\|profiler_st" "$OUT/verify_graphs.log" | tail -6
grep "^{" "$OUT/verify_graphs.log" | head -4
