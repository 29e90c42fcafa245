"""One call of the shipped EAGLE-3 draft's step (int8 weights, as it proposes on a CPU), eager against compiled ahead
of time, at a few (new rows, cached rows) shapes: mean microseconds over 300 calls, warm (its weights stay in cache,
which in decoding the target's verify evicts).

    python docs/benchmarks/cpu-eagle3-compiled-session66/step_calls.py [THREADS]
"""

import sys
import time

import torch

from medusa import MedusaModel
from medusa.eagle3 import DraftStep, compile_draft_step, kv_shape

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
draft = MedusaModel.from_draft_model(draft="embedded:smollm2-135m-instruct-eagle3", plan="off").proposal_draft
compiled, eager = compile_draft_step(draft), DraftStep(draft)


def microseconds(step, inputs, calls: int = 300) -> float:
    for _ in range(20):
        step(*inputs)
    start = time.perf_counter()
    for _ in range(calls):
        step(*inputs)
    return (time.perf_counter() - start) / calls * 1e6


size = draft.config.hidden_size
with torch.inference_mode():
    for rows, past in ((1, 300), (3, 300), (3, 800)):
        kv = (past, *kv_shape(draft))
        inputs = (
            torch.randn(rows, size),
            torch.randn(rows, size),
            torch.arange(past, past + rows),
            torch.ones(rows, past, dtype=torch.bool),
            torch.eye(rows, dtype=torch.bool),
            torch.randn(kv),
            torch.randn(kv),
        )
        print(
            f"{rows} new rows after {past}: eager {microseconds(eager, inputs):.0f} us, "
            f"compiled {microseconds(compiled, inputs):.0f} us"
        )
