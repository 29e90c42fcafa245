"""Several prompts in one generate (medusa.batch): tokens/s of transformers' batched greedy generate, our plain
decoding (proposer 'plain') and our speculation, per batch size, on the same prompts, in one run.

    python scripts/batch_speed.py [--dtype float32] [--sizes 1 2 4 8] [--prompts 8] [--max-new-tokens 64]
        [--proposers medusa dynamic planned] [--engine eager|compiled] [--threads 2] [--out FILE.json]

The prompts are Spec-Bench first turns spread through the file (`--questions`, default: $MEDUSA_BENCH_DATA or
../shared/bench_data), chat-templated and left-padded; each batch size decodes all of them, `size` at a time. Tokens
count up to each row's end-of-sequence token; every row's text is checked against transformers' own.
With `--engine`, our methods decode each batch together on that batch engine, batch 1 included, so every column
compares like with like. Without it (with `planned` among the proposers) each batch is laid out as generate lays it
out by default: the plan's choice per batch size (medusa.plan.batch_choice, timed on first use and printed), together
on the faster batch engine or one row at a time as one sequence decodes; batch 1 is one sequence under the plan.
`planned` is generate with neither proposer nor tree named.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from medusa import MedusaModel
from medusa.evaluation import bench_data_dir
from medusa.plan import batch_choice, calibrate_batches
from medusa.questions import load_questions, spread
from medusa.runtime import ENGINES, batch_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=str(bench_data_dir() / "spec_bench_question.jsonl"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--proposers", nargs="+", default=["medusa", "dynamic"])
    parser.add_argument("--engine", choices=ENGINES, help="default: as generate lays the batch out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="JSON file for the table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="auto" if "planned" in args.proposers else "off")
    engine = args.engine or (None if model.plan is not None else batch_engine(model.base))
    tokenizer = model.tokenizer
    tokenizer.padding_side = "left"
    questions = spread(load_questions(args.questions), args.prompts)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    decisions = {}  # method -> [longest prompt, engine, one at a time?, proposer] per batch, for the current size

    def decode_all(method: str, size: int) -> tuple[float, list[list[int]]]:
        seconds, rows = 0.0, []
        for start in range(0, len(texts), size):
            inputs = tokenizer(texts[start : start + size], return_tensors="pt", padding=True, add_special_tokens=False)
            begin = time.perf_counter()
            if method == "transformers":
                out = model.base.generate(
                    **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad
                )
            else:
                if model.plan is not None and engine is None and size > 1:  # how the plan lays out this batch
                    lengths = inputs["attention_mask"].sum(-1).tolist()
                    proposer = "plain" if method == "plain" else None
                    layout = model.batch_layout(lengths, args.max_new_tokens, None, proposer, None)
                    nodes = len(layout.tree) + 1 if layout.tree else None
                    decisions.setdefault(method, []).append([max(lengths), *layout[:3], nodes])
                proposer = None if method == "planned" else method
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, proposer=proposer, engine=engine)
            seconds += time.perf_counter() - begin
            for row in out[:, inputs["input_ids"].shape[1] :].tolist():
                rows.append(row[: next((i + 1 for i, t in enumerate(row) if t == eos), len(row))])
        return seconds, rows

    methods = ["transformers", "plain", *args.proposers]
    decode_all("plain", 2)  # warm-up
    layouts = {}
    if model.plan is not None:  # the plan's choice per batch size is timed on its first use: not inside the timings
        # (every bucket on every engine: a batch whose rows finish asks for a smaller one on its engine)
        calibrate_batches(model, max(args.sizes))
        for size in args.sizes:
            if size > 1:
                model.batch_layout([256] * size, args.max_new_tokens, engine, None, None)
                layouts[size] = batch_choice(model, size, engine=engine)
                print(f"batch {size}: {layouts[size]}", flush=True)
    table = []
    for size in args.sizes:
        rates, identical = {}, {}
        decisions.clear()
        results = {method: decode_all(method, size) for method in methods}
        reference = results["transformers"][1]
        for method, (seconds, rows) in results.items():
            rates[method] = sum(map(len, rows)) / seconds
            identical[method] = sum(row == ref for row, ref in zip(rows, reference))
        entry = {"batch": size, "tokens_per_s": rates, "identical_rows": identical, "rows": len(reference)}
        entry["layout"] = layouts.get(size)
        entry["decisions"] = dict(decisions)
        if model.plan is not None:  # the share of their expected tau the plan's batch trees accepted so far
            entry["acceptance_share"] = round(model.acceptance.share, 3)
        if decisions:
            print(
                f"batch {size} decisions (longest prompt, engine, one at a time, proposer, nodes): {decisions}",
                flush=True,
            )
        entry["vs_plain"] = {m: rates[m] / rates["plain"] for m in args.proposers if m in rates}
        entry["vs_transformers"] = {
            m: rates[m] / rates["transformers"] for m in ["plain", *args.proposers] if m in rates
        }
        table.append(entry)
        print(
            f"{args.dtype} batch {size} ({engine or 'as the plan lays it out'}): "
            + ", ".join(f"{m} {r:.1f}" for m, r in rates.items())
            + " tok/s; vs our batched plain "
            + ", ".join(f"{m} {r:.2f}x" for m, r in entry["vs_plain"].items())
            + f"; rows identical to transformers {identical}",
            flush=True,
        )
    if args.out:
        settings = {**{k: v for k, v in vars(args).items() if k != "out"}, "engine": engine}
        with open(args.out, "w") as f:
            json.dump({"settings": settings, "torch": torch.__version__, "table": table}, f, indent=2)


if __name__ == "__main__":
    main()
