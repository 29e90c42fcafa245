"""Which dynamic tree a long call takes at each context (Plan.at_context), its growth measured from the same fitted
curve at 256 cached tokens (PLAN_VERSION 24) or from the static tree's raw medians there (23): one plan, one set of
timings, so only the estimate differs. Calibrates where no plan is cached.

    python docs/benchmarks/cpu-zen4-long-trees-session72/at_context.py float32 bfloat16 w8a8
"""

import dataclasses
import sys

from medusa import MedusaModel

for dtype in sys.argv[1:]:
    plan = MedusaModel.from_pretrained(dtype=dtype).plan
    print(dtype, plan.engine, plan.proposer, len(plan.tree) + 1, "nodes")
    print(" short raw (latency_ms):", plan.latency_ms[plan.engine])
    print(" short fitted          :", plan.short_latency_ms)
    print(" long fitted           :", plan.long_latency_ms)
    before = dataclasses.replace(plan, short_latency_ms=plan.latency_ms[plan.engine])
    for context in (300, 512, 1024, 2048, 3000, 4100):
        new, old = plan.at_context(context), before.at_context(context)
        print(
            f"  context {context}: after {new[0]} nodes ({new[1]:.2f} ms, plain {new[2]:.2f}); "
            f"before {old[0]} nodes ({old[1]:.2f} ms)"
        )
