#!/usr/bin/env bash
# One device call for issue #37 (session 37): the GPU tests, the hand-captured verify timed against torch.compile's
# CUDA graphs (SmolLM2's shape, bf16), then the 8B-shaped step cost with the verify captured by hand. Each step has a
# share of BUDGET seconds; logs go to $OUT as they are written, so a step cut short still reports.
#     bash docs/benchmarks/h200-verify-graphs/device.sh   (on the device machine, in the repository root)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
end=$((SECONDS + ${BUDGET:-540}))
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    echo "cpus $(nproc)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 100 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1
tail -3 "$OUT/test_gpu.log"
TORCH_LOGS=recompiles timeout $((end - SECONDS - 150)) python3 docs/benchmarks/h100-verify-graphs/verify_graphs.py \
    --out "$OUT" --dtypes bfloat16 --runs plain,medusa2,medusa6 --rounds 2 > "$OUT/verify_graphs.log" 2>&1
grep -v "^{" "$OUT/verify_graphs.log" | tail -25
timeout $((end - SECONDS)) python3 docs/benchmarks/gpu-step-cost/step_cost.py --engines compiled --out "$OUT" \
    --verify-graphs > "$OUT/step_cost.log" 2>&1
tail -8 "$OUT/step_cost.log"
