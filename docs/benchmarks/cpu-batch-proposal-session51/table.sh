# The table of README.md: one `medusa bench` per dtype and batch size, one after another on an idle machine
cd "$(git rev-parse --show-toplevel)" && mkdir -p runs/batch-proposal
for dt in float32 bfloat16; do for bs in 1 2 4 8 16; do
  out=runs/batch-proposal/$dt-b$bs; rm -rf $out
  timeout 1500 .venv/bin/python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --methods baseline,baseline_compiled,planned --dtype $dt --batch-size $bs --out $out > $out.log 2>&1
  python docs/benchmarks/cpu-batch-proposal-session51/rows.py $out
done; done
