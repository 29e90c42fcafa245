"""The main job on the embedded default: load SmolLM2-135M-Instruct + its shipped heads, calibrate a decoding plan
for this machine (once; cached), then generate for a few prompts and print tokens/s side by side, tau and whether
outputs match, at two precisions:

- float32, the exact one: transformers' plain `generate`, plain decoding on the plan's fastest plain engine, and the
  plan (identical to transformers, token for token);
- the fastest precision this machine runs well (w8a8 on a CPU, int8 weights where it has AMX, bf16 on a GPU): plain
  decoding on our engine and the plan at that precision (identical to that plain decoding, or parting at a near-tie).
Each next to llama.cpp at the same precision (F32, Q8_0/BF16) when its binaries are present
(../shared/peers/build_llama_cpp.sh; $LLAMA_CPP_BIN). It ends saying which to pick.

    python scripts/demo.py [--heads DIR] [--max-new-tokens 128] [--dtype float32|bfloat16|auto] [--prompts N]
                           [--fast-dtype auto|int8|w8a8|bfloat16|none] [--plan auto|off] [--recalibrate]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa import MedusaModel, llama_cpp
from medusa.loading import base_gguf
from medusa.plan import planned_engines
from medusa.precision import fastest_quantized_cpu

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
    """How much more the target (eager, its own precision) prefers `wanted` over `got` after `context` (1, T)."""
    logits = base(input_ids=context).logits[0, -1].float()
    return float(logits[wanted] - logits[got])


def parts_at_near_tie(base, reference: torch.Tensor, other: torch.Tensor) -> bool | None:
    """None when the outputs are identical; else whether they part where the target's two choices nearly tie."""
    if torch.equal(reference, other):
        return None
    a, b = reference[0].tolist(), other[0].tolist()
    at = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-1])) if x != y)
    if at >= min(len(a), len(b)):
        return False
    return abs(logit_gap(base, reference[:, :at], a[at], b[at])) <= NEAR_TIE_LOGITS


def load_planned(args, dtype: str) -> MedusaModel:
    start = time.perf_counter()
    model = MedusaModel.from_pretrained(args.heads, dtype=dtype, plan="off")
    print(
        f"\n== {dtype}: loaded {model.config.base_model_name_or_path} + {model.config.num_heads} heads "
        f"in {time.perf_counter() - start:.1f} s"
    )
    if args.plan == "auto":
        engines = planned_engines(model.device, base=model.base)
        for name in engines:  # built first: compiling is the engine's, once per machine
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
            + ")"
        )
        print(plan.describe())
    engine = model.engine(model.best_plain_engine)
    print(
        f"plain decoding runs on the {model.best_plain_engine} engine: set up in {engine.setup_seconds:.1f} s"
        + (f", compiled in {engine.compile_seconds:.1f} s" if engine.compile_seconds and args.plan == "off" else "")
    )
    return model


def peer_file(dtype: str) -> tuple:
    """(the GGUF llama.cpp runs at `dtype`, None) or (None, why it does not run)."""
    missing = llama_cpp.missing_reason(("plain", "quantize"))
    if missing or dtype not in llama_cpp.PRECISIONS:
        return None, missing or f"no llama.cpp type for {dtype}"
    return llama_cpp.gguf_for(base_gguf(None), dtype), None


def run_precision(args, model: MedusaModel, dtype: str, with_transformers: bool) -> dict:
    """Every prompt with plain decoding on our engine, the plan, llama.cpp (when present) and, for the exact
    precision, transformers' generate. -> the medians."""
    gguf, why = peer_file(dtype)
    if why:
        print(f"llama.cpp: not run ({why})")
    chat = lambda text: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    plain_engine, threads = model.best_plain_engine, torch.get_num_threads()
    warm = chat("Hi")
    if with_transformers:
        model.base.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False)
    model.generate(warm, max_new_tokens=8, proposer="plain", engine=plain_engine)
    model.generate(warm, max_new_tokens=8)
    columns = (
        (["transformers"] if with_transformers else []) + ["engine plain", "medusa"] + (["llama.cpp"] if gguf else [])
    )
    print(f"\n{'prompt':<40} " + " ".join(f"{c:>12}" for c in columns) + f" {'vs plain':>8} {'tau':>5} same")
    rows = []
    for text in PROMPTS[: args.prompts]:
        ids, rates = chat(text), {}
        if with_transformers:
            start = time.perf_counter()
            reference = model.base.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False
            )
            rates["transformers"] = (reference.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
        start = time.perf_counter()
        plain = model.generate(
            ids, max_new_tokens=args.max_new_tokens, proposer="plain", engine=plain_engine, return_dict_in_generate=True
        )
        rates["engine plain"] = plain.stats.new_tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        fast = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
        rates["medusa"] = fast.stats.new_tokens / (time.perf_counter() - start)
        if gguf:
            prompt = model.tokenizer.decode(ids[0].tolist(), skip_special_tokens=False)
            rates["llama.cpp"] = llama_cpp.generate(gguf, prompt, args.max_new_tokens, threads).tokens_per_second
        # exact: against transformers (fp32); otherwise against plain decoding of the same target on our engine
        near_tie = parts_at_near_tie(model.base, reference if with_transformers else plain.sequences, fast.sequences)
        rows.append({**rates, "tau": fast.stats.mean_accepted_tokens, "near_tie": near_tie})
        same = "yes" if near_tie is None else ("near-tie" if near_tie else "NO")
        print(
            f"{text[:39]:<40} "
            + " ".join(f"{rates[c]:>8.1f}t/s" for c in columns)
            + f" {rates['medusa'] / rates['engine plain']:>7.2f}x {rows[-1]['tau']:>5.2f} {same}"
        )
    medians = {c: statistics.median(r[c] for r in rows) for c in columns}
    identical = sum(r["near_tie"] is None for r in rows)
    ties = sum(bool(r["near_tie"]) for r in rows)
    reference_name = "transformers' generate" if with_transformers else f"plain {dtype} decoding on our engine"
    ratio = lambda column: statistics.median(r["medusa"] / r[column] for r in rows)  # noqa: E731
    parts = [f"median {medians['medusa']:.1f} tok/s", f"{ratio('engine plain'):.2f}x plain decoding on {plain_engine}"]
    parts += [f"{ratio('transformers'):.2f}x transformers' generate"] if with_transformers else []
    parts += [f"{ratio('llama.cpp'):.2f}x llama.cpp's plain decoding"] if gguf else []
    parts += [f"mean tau {statistics.mean(r['tau'] for r in rows):.2f}"]
    parts += [f"identical to {reference_name} {identical}/{len(rows)}"]
    parts += [f"the others part at a near-tie {ties}/{len(rows) - identical}"] if identical < len(rows) else []
    print(f"\n{dtype}: " + ", ".join(parts))
    return {"dtype": dtype, "medians": medians, "vs_peer": ratio("llama.cpp") if gguf else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped SmolLM2 heads)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype", default="float32", help="the exact run's precision: float32 (default), bfloat16, auto"
    )
    parser.add_argument(
        "--fast-dtype",
        default="auto",
        help="the second run's precision: auto (w8a8 on a CPU, int8 where it has AMX, bfloat16 on a GPU), int8, w8a8 "
        "(int8 activations too), bfloat16, or none",
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--plan", default="auto", choices=["auto", "off"])
    parser.add_argument("--recalibrate", action="store_true", help="measure again instead of using the cached plan")
    args = parser.parse_args()

    exact = run_precision(args, load_planned(args, args.dtype), args.dtype, with_transformers=True)
    fast_dtype = args.fast_dtype
    if fast_dtype == "auto":
        fast_dtype = "bfloat16" if torch.cuda.is_available() else fastest_quantized_cpu()
    results = [exact]
    if fast_dtype != "none" and fast_dtype != args.dtype:
        results.append(run_precision(args, load_planned(args, fast_dtype), fast_dtype, with_transformers=False))
    best = max(results, key=lambda r: r["medians"]["medusa"])
    print("\nwhich to pick:")
    for r in results:
        print(
            f"  {r['dtype']:<9} {r['medians']['medusa']:6.1f} tok/s"
            + (f" ({r['vs_peer']:.2f}x llama.cpp at {llama_cpp.PRECISIONS[r['dtype']]})" if r["vs_peer"] else "")
            + (
                ": says what transformers' fp32 generate says"
                if r is exact
                else ": another model (its weights rounded)"
            )
        )
    print(
        f"  -> {best['dtype']} for speed"
        + (f"; {exact['dtype']} when the output must be transformers' own" if best is not exact else "")
    )


if __name__ == "__main__":
    main()
