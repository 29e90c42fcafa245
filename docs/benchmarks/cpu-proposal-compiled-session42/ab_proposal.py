"""Before and after, side by side in one process: a fixed 6-node dynamic tree (no plan, no guard) over 12 Spec-Bench
questions (two per category), 128 new tokens, on the inductor engine; the proposal as it was (eager, aten's int8
kernel) against as it is (fbgemm, compiled ahead of time), and plain decoding, alternated over three rounds. Prints
tau and tokens/s per round, and each one's median.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-proposal-compiled-session42/ab_proposal.py [w8a8|float32]
"""

import statistics
import sys
import time

import torch
from record_prompts import two_per_category

import medusa.runtime.prepack as prepack
from medusa import MedusaModel

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "w8a8"
model = MedusaModel.from_pretrained(dtype=dtype)
model.plan = None
tree = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1]]
prompts = two_per_category(model.tokenizer)
ways = {}
for name, fbgemm in (("before", False), ("after", True)):
    prepack.fbgemm_available = lambda device="cpu", on=fbgemm: on
    model.refresh_candidate_projection()
    model.generate(prompts[0], max_new_tokens=8, proposer="dynamic", tree=tree, engine="inductor")  # compiles
    ways[name] = (model.proposal_heads, model.candidate_projection, model.compiled_proposal)
ways["before"] = (*ways["before"][:2], False)  # eager, as before


def run(name):
    proposer = "plain" if name == "plain" else "dynamic"
    if name != "plain":
        model.proposal_heads, model.candidate_projection, model.compiled_proposal = ways[name]
    committed = steps = 0
    start = time.perf_counter()
    for ids in prompts:
        out = model.generate(
            ids, max_new_tokens=128, proposer=proposer, tree=tree, engine="inductor", return_dict_in_generate=True
        )
        committed += sum(out.stats.accepted_lengths)
        steps += len(out.stats.accepted_lengths)
    return committed / steps, committed / (time.perf_counter() - start)


results = {name: [] for name in ("plain", "before", "after")}
for _ in range(3):
    for name in results:
        results[name].append(run(name))
for name, rounds in results.items():
    speeds = [speed for _, speed in rounds]
    print(
        f"{dtype} {name:7s} tau {rounds[0][0]:.3f}, tokens/s "
        + " ".join(f"{s:.2f}" for s in speeds)
        + f" (median {statistics.median(speeds):.2f})"
    )
