"""The main job on the embedded default: load SmolLM2-135M-Instruct + its shipped heads, calibrate a decoding plan
for this machine (once; cached), then generate for a few prompts with transformers' plain `generate`, with plain
decoding on the plan's fastest plain engine and with the plan, and print tokens/s side by side, tau and whether
outputs match.

    python scripts/demo.py [--heads DIR] [--max-new-tokens 128] [--dtype float32|bfloat16|auto] [--prompts N]
                           [--plan auto|off] [--recalibrate]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa import MedusaModel
from medusa.plan import planned_engines

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Give me a three-day itinerary for a trip to Rome.",
    "Summarise the water cycle for a ten-year-old.",
    "Rewrite this sentence in a formal tone: 'hey, can u send me the report asap?'",
]
NEAR_TIE_LOGITS = 0.5  # as scripts/divergence.py: probabilities within a factor e^0.5 of each other


@torch.inference_mode()
def logit_gap(base, context: torch.Tensor, wanted: int, got: int) -> float:
    """How much more the target (eager, its own dtype) prefers `wanted` over `got` after `context` (1, T)."""
    logits = base(input_ids=context).logits[0, -1].float()
    return float(logits[wanted] - logits[got])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped SmolLM2 heads)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="float32 (default: exact), bfloat16, or auto")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--plan", default="auto", choices=["auto", "off"])
    parser.add_argument("--recalibrate", action="store_true", help="measure again instead of using the cached plan")
    args = parser.parse_args()

    start = time.perf_counter()
    model = MedusaModel.from_pretrained(args.heads, dtype=args.dtype, plan="off")
    print(
        f"loaded {model.config.base_model_name_or_path} + {model.config.num_heads} heads "
        f"({str(model.base.dtype).replace('torch.', '')}) in {time.perf_counter() - start:.1f} s"
    )
    if args.plan == "auto":
        for name in planned_engines(model.device):  # built first: compiling is the engine's, once per machine
            built = model.engine(name)
            if built.compile_seconds:
                print(f"compiled the {name} engine in {built.compile_seconds:.1f} s (once on this machine)")
        start = time.perf_counter()
        plan = model.calibrate(recalibrate=args.recalibrate)
        took = time.perf_counter() - start
        print(
            f"{'calibrated' if plan.calibration_s and took > 1 else 'cached plan loaded'} in {took:.1f} s "
            f"(timing {plan.calibration_s:.1f} s"
            + (f", compiling {plan.compile_s:.1f} s" if plan.compile_s else "")
            + f")\n{plan.describe()}"
        )
    plain_engine = model.best_plain_engine
    engine = model.engine(plain_engine)  # compiles first where it has to (torch.compile: minutes, in each process)
    print(
        f"plain decoding runs on the {plain_engine} engine: set up in {engine.setup_seconds:.1f} s"
        # with a plan, every planned engine was built (and its compile printed) before calibrating
        + (f", compiled in {engine.compile_seconds:.1f} s" if engine.compile_seconds and args.plan == "off" else "")
    )
    chat = lambda text: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    warm = chat("Hi")
    model.base.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False)
    model.generate(warm, max_new_tokens=8, proposer="plain", engine=plain_engine)
    model.generate(warm, max_new_tokens=8)

    ratios, over_engine, taus, identical, near_ties = [], [], [], [], 0
    print(
        f"\n{'prompt':<40} {'transformers':>12} {'engine plain':>12} {'medusa':>7} {'speedup':>7} "
        f"{'vs plain':>8} {'tau':>5} same"
    )
    for text in PROMPTS[: args.prompts]:
        ids = chat(text)
        t0 = time.perf_counter()
        plain = model.base.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False
        )
        t1 = time.perf_counter()
        engine_plain = model.generate(ids, max_new_tokens=args.max_new_tokens, proposer="plain", engine=plain_engine)
        t2 = time.perf_counter()
        fast = model.generate(ids, max_new_tokens=args.max_new_tokens)
        t3 = time.perf_counter()
        rates = [
            (plain.shape[1] - ids.shape[1]) / (t1 - t0),
            engine_plain.stats.new_tokens / (t2 - t1),
            fast.stats.new_tokens / (t3 - t2),
        ]
        same = torch.equal(plain, fast.sequences)
        if not same:  # where did they part, and was it a near-tie for the target itself?
            a, b = plain[0].tolist(), fast.sequences[0].tolist()
            at = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-1])) if x != y)
            if at < min(len(a), len(b)):
                near_ties += abs(logit_gap(model.base, plain[:, :at], a[at], b[at])) <= NEAR_TIE_LOGITS
        ratios.append(rates[2] / rates[0])
        over_engine.append(rates[2] / rates[1])
        taus.append(fast.stats.mean_accepted_tokens)
        identical.append(same)
        print(
            f"{text[:39]:<40} {rates[0]:>9.1f}t/s {rates[1]:>9.1f}t/s {rates[2]:>6.1f} {ratios[-1]:>6.2f}x "
            f"{over_engine[-1]:>7.2f}x {taus[-1]:>5.2f} {same}"
        )
    print(
        f"\nmedian speedup {statistics.median(ratios):.2f}x over transformers' generate (lowest "
        f"{min(ratios):.2f}x), {statistics.median(over_engine):.2f}x over plain decoding on the {plain_engine} engine; "
        f"mean tau {statistics.mean(taus):.2f}; identical outputs {sum(identical)}/{len(identical)}"
        + (
            f" (the others part at a near-tie: {near_ties}/{len(identical) - sum(identical)})"
            if not all(identical)
            else ""
        )
    )
    print("\nsample output:\n" + model.tokenizer.decode(fast.sequences[0, ids.shape[1] :], skip_special_tokens=True))


if __name__ == "__main__":
    main()
