"""Whether proposing on fbgemm (its input rounded to uint8 as a whole, weights at 7 bits) costs tau: one process, a
fixed 6-node dynamic tree (no plan, no guard), 12 Spec-Bench questions (two per category), 128 new tokens, w8a8
target on the inductor engine, the proposal eager; aten's int8 kernel and fbgemm for the heads and the projection,
together and apart, alternated over two rounds. Prints tau and ms per token of each round.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-proposal-compiled-session42/ab_tau.py
"""

import time

import torch
from record_prompts import two_per_category

import medusa.runtime.prepack as prepack
from medusa import MedusaModel

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="w8a8")
tree = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1]]
prompts = two_per_category(model.tokenizer)
model.plan = None
variants = {}
for fbgemm in (False, True):
    prepack.fbgemm_available = lambda device="cpu", on=fbgemm: on
    model.refresh_candidate_projection()
    variants[fbgemm] = (model.proposal_heads, model.candidate_projection)
model.compiled_proposal = False  # eager: the kernels alone
combos = {
    "aten": (False, False),
    "fbgemm": (True, True),
    "heads fbgemm": (True, False),
    "projection fbgemm": (False, True),
}


def run(name):
    heads, projection = combos[name]
    model.proposal_heads, model.candidate_projection = variants[heads][0], variants[projection][1]
    committed = steps = 0
    start = time.perf_counter()
    for ids in prompts:
        out = model.generate(
            ids, max_new_tokens=128, proposer="dynamic", tree=tree, engine="inductor", return_dict_in_generate=True
        )
        committed += sum(out.stats.accepted_lengths)
        steps += len(out.stats.accepted_lengths)
    return committed / steps, (time.perf_counter() - start) / committed * 1000, committed


run("aten")  # warm-up
results = {name: [] for name in combos}
for _ in range(2):
    for name in combos:
        results[name].append(run(name))
for name, rounds in results.items():
    times = " ".join(f"{r[1]:.2f}" for r in rounds)
    print(f"{name:18s} tau {rounds[0][0]:.3f} ms/token {times} tokens {rounds[0][2]}")
