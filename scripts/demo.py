"""The main job on the embedded default: load SmolLM2-135M-Instruct + its shipped heads, generate for a few
prompts with Medusa and with plain `generate`, print tokens/s side by side, tau and whether outputs are identical.

    python scripts/demo.py [--heads DIR] [--max-new-tokens 128] [--dtype float32|bfloat16] [--prompts N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from medusa import MedusaModel  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Give me a three-day itinerary for a trip to Rome.",
    "Summarise the water cycle for a ten-year-old.",
    "Rewrite this sentence in a formal tone: 'hey, can u send me the report asap?'",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped SmolLM2 heads)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = parser.parse_args()

    start = time.perf_counter()
    model = MedusaModel.from_pretrained(args.heads, dtype=args.dtype)
    print(f"loaded {model.config.base_model_name_or_path} + {model.config.num_heads} heads "
          f"({len(model.tree) + 1}-node tree) in {time.perf_counter() - start:.1f} s")
    chat = lambda text: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    warm = chat("Hi")
    model.base.generate(**warm, max_new_tokens=8, do_sample=False)
    model.generate(warm, max_new_tokens=8)

    ratios, taus, identical = [], [], []
    print(f"\n{'prompt':<44} {'plain tok/s':>11} {'medusa tok/s':>12} {'speedup':>7} {'tau':>5} same")
    for text in PROMPTS[: args.prompts]:
        ids = chat(text)
        t0 = time.perf_counter()
        plain = model.base.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        t1 = time.perf_counter()
        fast = model.generate(ids, max_new_tokens=args.max_new_tokens)
        t2 = time.perf_counter()
        n_plain, n_fast = plain.shape[1] - ids["input_ids"].shape[1], fast.stats.new_tokens
        plain_rate, fast_rate = n_plain / (t1 - t0), n_fast / (t2 - t1)
        same = torch.equal(plain, fast.sequences)
        ratios.append(fast_rate / plain_rate)
        taus.append(fast.stats.mean_accepted_tokens)
        identical.append(same)
        print(f"{text[:43]:<44} {plain_rate:>11.1f} {fast_rate:>12.1f} {ratios[-1]:>6.2f}x {taus[-1]:>5.2f} {same}")
    print(f"\nmedian speedup {statistics.median(ratios):.2f}x, mean tau {statistics.mean(taus):.2f}, "
          f"identical outputs {sum(identical)}/{len(identical)}")
    print("\nsample output:\n" + model.tokenizer.decode(fast.sequences[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
