"""The dynamic tree's search on tensors (a checkout of d4e9319, `--old`) against the search on host lists (this
checkout), alternated in one process on the same model: median ms a guessing step's proposal, and whether the
outputs are the same. A w8a8 target, a 4-node dynamic tree, 6 Spec-Bench first turns, 128 new tokens.

    git worktree add /tmp/old d4e9319
    PYTHONPATH=. python docs/benchmarks/cpu-proposal-session35/search_ab.py --old /tmp/old --dtype w8a8
"""

import argparse
import importlib.util
import json
import statistics
import sys

import torch

import medusa.dynamic_tree as dynamic_tree
from medusa import MedusaModel

QUESTIONS = "../shared/bench_data/spec_bench_question.jsonl"
TREE = [[0], [1], [0, 0]]


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="a checkout of d4e9319 (the search on tensors)")
    parser.add_argument("--dtype", default="w8a8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    old_tree = load("old_tree", f"{args.old}/medusa/tree.py")
    old = load("old_dynamic_tree", f"{args.old}/medusa/dynamic_tree.py")
    old.buffers_from_parents = old_tree.buffers_from_parents
    variants = {"tensors": old.DynamicTreeProposer.propose, "host lists": dynamic_tree.DynamicTreeProposer.propose}
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    questions = [json.loads(line) for line in open(QUESTIONS)][:48:8]

    def chat(text):
        message = [{"role": "user", "content": text}]
        return model.tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt")

    model.generate(chat("Hi"), max_new_tokens=8, engine="inductor", tree=TREE, proposer="dynamic")
    propose_ms, outputs = {name: [] for name in variants}, {name: [] for name in variants}
    for round_ in range(args.rounds):
        for question in questions:
            ids = chat(question["turns"][0])
            for name, propose in list(variants.items())[:: 1 if round_ % 2 == 0 else -1]:
                dynamic_tree.DynamicTreeProposer.propose = propose
                out = model.generate(
                    ids, max_new_tokens=128, engine="inductor", tree=TREE, proposer="dynamic", profile=True,
                    return_dict_in_generate=True,
                )  # fmt: skip
                propose_ms[name].append(out.stats.timings["propose"] / out.stats.steps * 1000)
                outputs[name].append(out.sequences.tolist())
    print("same outputs:", outputs["tensors"] == outputs["host lists"])
    for name, ms in propose_ms.items():
        print(f"{name}: median {statistics.median(ms):.2f} ms a step's proposal")
    paired = [a - b for a, b in zip(propose_ms["tensors"], propose_ms["host lists"])]
    print(f"paired difference (tensors - host lists): median {statistics.median(paired):.2f} ms")


if __name__ == "__main__":
    main()
