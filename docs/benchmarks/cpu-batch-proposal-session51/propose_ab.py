"""Per step of a batch's decoding: the rows' proposals made together (batch.propose_rows) against the same rows proposed
one by one (a shadow proposer per row, fed the same states), alternating which goes first; SmolLM2, inductor engine,
compiled heads, an N-node dynamic tree, 16 Spec-Bench first turns in batches of R, 64 new tokens. Prints the median ms
per step of each. `python propose_ab.py QUESTIONS DTYPE R1,R2,... N`"""

import statistics
import sys
import time

import torch

import medusa.batch
from medusa import MedusaModel
from medusa.questions import load_questions, spread
from medusa.tree_builder import grow_tree

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[2], plan="off")
tokenizer = model.tokenizer
tokenizer.padding_side = "left"
texts = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    for q in spread(load_questions(sys.argv[1]), 16)
]
tree = [list(p) for p in grow_tree(model.accuracy, 8)[: int(sys.argv[4]) - 1]]
together_rows = medusa.batch.propose_rows
for rows in map(int, sys.argv[3].split(",")):
    times = {"together": [], "one by one": []}

    def timed(proposers, states, times=times):
        for proposer in proposers:
            if not hasattr(proposer, "shadow"):
                proposer.shadow = model.make_proposer("dynamic", tree, None, None)
        order = ("together", "one by one") if len(times["together"]) % 2 else ("one by one", "together")
        for which in order:
            start = time.perf_counter()
            if which == "together":
                candidates = together_rows(proposers, states)
            else:
                [proposer.shadow.propose(state) for proposer, state in zip(proposers, states)]
            times[which].append(1000 * (time.perf_counter() - start))
        return candidates

    medusa.batch.propose_rows = timed
    for start in range(0, len(texts), rows):
        inputs = tokenizer(texts[start : start + rows], return_tensors="pt", padding=True, add_special_tokens=False)
        model.generate(**inputs, max_new_tokens=64, engine="inductor", proposer="dynamic", tree=tree)
    medusa.batch.propose_rows = together_rows
    together, alone = (statistics.median(times[k]) for k in ("together", "one by one"))
    print(
        f"rows {rows}: propose per step together {together:.2f} ms, one by one {alone:.2f} ms "
        f"({alone / together:.2f}x), {len(times['together'])} steps",
        flush=True,
    )
