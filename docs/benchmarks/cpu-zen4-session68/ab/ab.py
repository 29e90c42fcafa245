"""Spec-Bench --limit 2 in bf16 with the heads' plan as it is now (`onednn`: the plan may take `inductor_onednn`) or
as it was (`template`: the plan times `inductor` alone), beside our plain decoding and llama.cpp BF16. Each side
keeps its own cached plan (the engines timed are in its key).

    python docs/benchmarks/cpu-zen4-session68/ab/ab.py onednn|template OUT
"""

import sys

import medusa.plan
from medusa.cli import bench

side, out = sys.argv[1], sys.argv[2]
if side == "template":
    medusa.plan.onednn_trees_may_pay = lambda base: False
elif side != "onednn":
    raise SystemExit(f"side must be onednn or template, not {side!r}")
bench.main(
    [
        "--questions", "../shared/bench_data/spec_bench_question.jsonl", "--limit", "2", "--engine", "inductor",
        "--threads", "2", "--dtype", "bfloat16", "--methods", "baseline_compiled,planned,llama_cpp", "--out", out,
    ]
)  # fmt: skip
