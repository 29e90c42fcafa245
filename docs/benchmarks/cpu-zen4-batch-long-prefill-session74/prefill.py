"""A batch's prefill: seconds to build a BatchDecoding (its prompts' prefill and first tokens) over prompt sets of
random tokens, one sequence's prefill of the longest prompt beside it, on the compiled engine (a batch's prefill runs
uncompiled on every engine).

    python prefill.py OUT.jsonl --dtype float32 [--base GGUF] [--repeats 2] [--sets "2 x 4000" ...]

Run it from a checkout of each version, one after the other (prefill.sh alternates them)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from medusa import MedusaModel
from medusa.acceptance import get_rule
from medusa.batch import BatchDecoding
from medusa.propose import PlainProposer
from medusa.sampling import SamplingConfig

SETS = {
    "2 x 1000": [1000, 1000],
    "2 x 2000": [2000, 2000],
    "2 x 4000": [4000, 4000],
    "4000 + 3 x 200": [4000, 200, 200, 200],
    "4 x 300": [300] * 4,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--base", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sets", nargs="*", default=list(SETS), help="which prompt sets (default: all)")
    args = parser.parse_args()
    if args.base:
        model = MedusaModel.from_base(args.base, dtype=args.dtype, plan="off")
    else:
        model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    engine = model.engine("compiled")
    vocab = model.base.get_output_embeddings().weight.shape[0]
    rows = []
    for name in args.sets:
        lengths = SETS[name]
        prompts = [
            torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n + b))
            for b, n in enumerate(lengths)
        ]
        times, firsts = [], None
        for _ in range(args.repeats + 1):  # the first warms up
            start = time.perf_counter()
            batch = BatchDecoding(
                engine,
                lambda: PlainProposer(model.device),
                get_rule("greedy"),
                prompts,
                max_new_tokens=2,
                sampling=SamplingConfig(),
                stop_ids=set(),
                feature_layers=model.feature_layers,
                pad_token_id=0,
            )
            times.append(time.perf_counter() - start)
            firsts = [int(row.state.root_token) for row in batch.rows]
            del batch
        seconds = statistics.median(times[1:])
        row = dict(
            set=name,
            dtype=args.dtype,
            base=args.base,
            seconds=round(seconds, 3),
            tokens_per_s=round(sum(lengths) / seconds, 1),
            first_tokens=firsts,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
