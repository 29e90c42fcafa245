#!/bin/bash
# #35's table: `bash docs/benchmarks/cpu-batch2-session56/table.sh OUT "SIZES" DTYPE` from the repository root, one
# `medusa bench` per batch size, one after another (e.g. OUT "2 4 8 16" float32)
for n in $2; do
  python -m medusa bench --questions ../shared/bench_data/spec_bench_question.jsonl --limit 2 \
    --methods baseline,baseline_compiled,planned --dtype "$3" --batch-size "$n" --out "$1/$3-b$n"
done
