set -eu
out=/tmp/s71/after
mkdir -p $out
cd /tmp/wt71
export PYTHONPATH=/tmp/wt71 PATH=/tmp/wt71/.venv/bin:$PATH
for d in w8a8 float32 bfloat16; do
  python -m medusa bench --questions /tmp/s71/long/long.jsonl --engine inductor --threads 2 --dtype "$d" \
    --methods baseline_compiled,planned,llama_cpp --out "$out/long/$d"
done
for d in w8a8 float32; do
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --engine inductor --threads 2 --dtype "$d" \
    --methods baseline_compiled,planned --out "$out/specbench/$d"
done
