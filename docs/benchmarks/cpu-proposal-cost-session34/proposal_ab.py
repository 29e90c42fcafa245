"""What the heads propose with on a CPU, compared in one process, interleaved: int8 weights (what ships,
medusa.runtime.int8_copy), bf16 weights packed for oneDNN, and float32 weights with the context layer's read compiled
by torch.compile. Median ms a step of the proposal and of the verify, dynamic 4-node tree, first 4 Spec-Bench
questions, 128 new tokens, the first round dropped (it compiles).

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-cost-session34/proposal_ab.py --dtype w8a8
"""

import argparse
import json
import statistics

import torch
from torch import nn

from medusa import MedusaModel
from medusa.propose import CandidateProjection, MedusaProposer
from medusa.runtime import prepack

QUESTIONS = "../shared/bench_data/spec_bench_question.jsonl"


class Bf16PackedLinear(prepack.PreparedLinear):
    def prepare(self) -> None:
        self.packed = prepack.pack(self.weight.detach().to(torch.bfloat16))
        self.bias16 = None if self.bias is None else self.bias.detach().to(torch.bfloat16)
        super().prepare()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return prepack.packed_linear(x.to(torch.bfloat16), self.packed, self.out_features, self.bias16).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="w8a8")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    copy, skipped = prepack._copy_sharing(model.heads, ("projections",))
    bf16_heads = prepack.replace_children(
        copy, lambda c: Bf16PackedLinear(c) if type(c) is nn.Linear and id(c) not in skipped else None
    )
    lm_head = model.base.get_output_embeddings()
    variants = {  # name -> (heads, projection, compile the read)
        "int8 (shipped)": (model.proposal_heads, model.candidate_projection, False),
        "bf16 packed": (bf16_heads, CandidateProjection.build(model.heads, lm_head, torch.bfloat16), False),
        "fp32, read compiled": (model.heads, model.candidate_projection, True),
    }
    compiled_read, compile_now = {}, {"read": False}
    build = MedusaProposer.__init__

    def init(self, *a, **k):
        build(self, *a, **k)
        if compile_now["read"]:
            compiled_read.setdefault("read", torch.compile(self.read_rows))
            self._read_graph.fn = compiled_read["read"]

    MedusaProposer.__init__ = init
    prompts = []
    with open(QUESTIONS) as f:
        for line in list(f)[:4]:
            messages = [{"role": "user", "content": json.loads(line)["turns"][0]}]
            prompts.append(
                model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            )
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    steps = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, (heads, projection, compile_read) in variants.items():
            model.proposal_heads, model.candidate_projection = heads, projection
            compile_now["read"] = compile_read
            for ids in prompts:
                out = model.generate(
                    ids, max_new_tokens=128, engine="inductor", proposer="dynamic", tree=[[0], [1], [0, 0]],
                    profile=True, return_dict_in_generate=True,
                )  # fmt: skip
                if round_:
                    timings, count = out.stats.timings, out.stats.steps
                    steps[name].append((timings["propose"] / count * 1000, timings["verify"] / count * 1000))
    for name, rows in steps.items():
        propose, verify = (statistics.median(r[i] for r in rows) for i in (0, 1))
        print(f"{name}: propose {propose:.2f} ms a step, verify {verify:.2f}")


if __name__ == "__main__":
    main()
