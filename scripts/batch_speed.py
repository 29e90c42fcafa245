"""Several prompts in one generate (medusa.batch): tokens/s of transformers' batched greedy generate, our batched
plain decoding (proposer 'plain') and our batched speculation, per batch size, on the same prompts, in one run.

    python scripts/batch_speed.py [--dtype float32] [--sizes 1 2 4 8] [--prompts 8] [--max-new-tokens 64]
        [--proposers medusa dynamic planned] [--engine eager|compiled] [--threads 2] [--out FILE.json]

The prompts are Spec-Bench first turns spread through the file (`--questions`, default: $MEDUSA_BENCH_DATA or
../shared/bench_data), chat-templated and left-padded; each batch size decodes all of them, `size` at a time. Tokens
count up to each row's end-of-sequence token. Our methods run on `--engine` (default: the one a batch takes,
medusa.runtime.batch_engine: the pre-packed copy on a CPU that packs weights), batch 1 included, so every column
compares like with like; every row's text is checked against transformers' own.
`planned` is what generate does by default: the plan's choice for each batch size (medusa.plan.batch_choice, timed
on first use; plain decoding where no tree pays); it has no batch-1 column (one sequence takes the plan's engine).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from medusa import MedusaModel
from medusa.evaluation import bench_data_dir
from medusa.questions import load_questions, spread
from medusa.runtime import BATCH_ENGINES, batch_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=str(bench_data_dir() / "spec_bench_question.jsonl"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--proposers", nargs="+", default=["medusa", "dynamic"])
    parser.add_argument("--engine", choices=BATCH_ENGINES, help="default: the engine a batch takes here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="JSON file for the table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="auto" if "planned" in args.proposers else "off")
    engine = args.engine or batch_engine(model.base)
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
                proposer = None if method == "planned" else method
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, proposer=proposer, engine=engine)
            seconds += time.perf_counter() - begin
            for row in out[:, inputs["input_ids"].shape[1] :].tolist():
                rows.append(row[: next((i + 1 for i, t in enumerate(row) if t == eos), len(row))])
        return seconds, rows

    methods = ["transformers", "plain", *args.proposers]
    decode_all("plain", 2)  # warm-up
    if "planned" in methods:  # the plan's choice per batch size is timed on its first use: not inside the timings
        for size in args.sizes:
            if size > 1:
                model.batch_defaults(size, engine)
    table = []
    for size in args.sizes:
        rates, identical = {}, {}
        results = {method: decode_all(method, size) for method in methods if size > 1 or method != "planned"}
        reference = results["transformers"][1]
        for method, (seconds, rows) in results.items():
            rates[method] = sum(map(len, rows)) / seconds
            identical[method] = sum(row == ref for row, ref in zip(rows, reference))
        entry = {"batch": size, "tokens_per_s": rates, "identical_rows": identical, "rows": len(reference)}
        entry["vs_plain"] = {m: rates[m] / rates["plain"] for m in args.proposers if m in rates}
        entry["vs_transformers"] = {
            m: rates[m] / rates["transformers"] for m in ["plain", *args.proposers] if m in rates
        }
        table.append(entry)
        print(
            f"{args.dtype} batch {size} ({engine}): "
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
