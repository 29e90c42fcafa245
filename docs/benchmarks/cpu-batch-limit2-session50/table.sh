cd "$(git rev-parse --show-toplevel)" && mkdir -p runs/batch-limit2
for dt in float32 bfloat16; do for bs in 1 2 4 8 16; do
  out=runs/batch-limit2/$dt-b$bs; rm -rf $out
  timeout 1500 .venv/bin/python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 --methods baseline,baseline_compiled,planned --dtype $dt --batch-size $bs --out $out > $out.log 2>&1
  echo "$dt $bs $(grep -A6 '^## Overall' $out/summary.md | tail -3 | awk -F'|' '{printf "%s %s ", $2, $6}')"
done; done
date
