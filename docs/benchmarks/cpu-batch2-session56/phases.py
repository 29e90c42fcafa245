"""Where a batch's decoding step goes (batch.BatchDecoding.step), phase by phase: the rows' proposals (of which the
heads' context read, the heads, the copy guesses), the mask, the batched verify, acceptance + commit; for plain
decoding and dynamic trees of N nodes, B rows of Spec-Bench first turns, inductor engine.
    python phases.py QUESTIONS DTYPE ROWS NODES,...   (NODES 1: plain)"""

import statistics
import sys
import time
from collections import defaultdict

import torch

import medusa.batch as batch
import medusa.propose as propose_module
from medusa import MedusaModel
from medusa.questions import load_questions, spread
from medusa.tree_builder import grow_tree

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[2], plan="off")
rows = int(sys.argv[3])
tokenizer = model.tokenizer
tokenizer.padding_side = "left"
texts = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    for q in spread(load_questions(sys.argv[1]), 12)
]
times = defaultdict(list)
original = {name: getattr(batch, name) for name in ("propose_rows", "_mask")}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name].append(1000 * (time.perf_counter() - start))
        return out

    return wrapper


for name, fn in original.items():
    setattr(batch, name, timed(name, fn))
for name in ("read_batch", "path_logits", "step_copies"):
    setattr(propose_module.MedusaProposer, name, timed(name, getattr(propose_module.MedusaProposer, name)))
step = batch.BatchDecoding.step
batch.BatchDecoding.step = timed("step", step)
engine = model.engine("inductor")
engine.warm_up(batches=True)
forward = engine.batch_forward
engine.batch_forward = timed("verify", forward)
for nodes in map(int, sys.argv[4].split(",")):
    tree = [list(p) for p in grow_tree(model.accuracy, 8)[: nodes - 1]]
    kw = dict(proposer="plain") if nodes == 1 else dict(proposer="dynamic", tree=tree)
    for _ in range(2):  # the first warms up
        times.clear()
        tokens = 0
        start = time.perf_counter()
        for first in range(0, len(texts), rows):
            inputs = tokenizer(texts[first : first + rows], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**inputs, max_new_tokens=128, engine="inductor", **kw)
            tokens += sum(int((s != tokenizer.pad_token_id).sum()) for s in out[:, inputs.input_ids.shape[1] :])
        wall = time.perf_counter() - start
    steps = len(times["step"])
    med = {k: statistics.median(v[-steps:]) for k, v in times.items()}
    total = {k: sum(v[-steps:]) for k, v in times.items()}
    print(
        f"rows {rows} nodes {nodes}: {tokens / wall:.1f} tok/s, {steps} steps, tokens/step {tokens / steps:.2f}; "
        f"median ms step {med['step']:.2f} = propose {med['propose_rows']:.2f} + mask {med['_mask']:.2f} + verify "
        f"{med['verify']:.2f} + rest {med['step'] - med['propose_rows'] - med['_mask'] - med['verify']:.2f}; "
        f"(read {med.get('read_batch', 0):.2f}, heads {total.get('path_logits', 0) / steps:.2f}, copies "
        f"{total.get('step_copies', 0) / steps:.2f}); "
        f"wall in steps {sum(times['step'][-steps:]) / 1000:.2f} s of {wall:.2f}",
        flush=True,
    )
