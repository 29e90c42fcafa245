"""Why did a half-precision (or int8) benchmark run's outputs differ from its reference? Near-ties, or a bug?

    python scripts/divergence.py runs/bench [--reference baseline|baseline_compiled]   # greedy, bf16/fp16/int8

In half precision, verifying several tokens in one forward is not bit-identical to feeding them one at a time, so
two tokens whose logits are nearly equal can swap. For every output that differs from the reference's (transformers'
`generate`, or plain decoding at the run's precision on this library's engine), this finds the first differing
token, rebuilds the context both runs shared up to it, and scores it once in float32 (the arbiter: the run's weights,
int8 ones included, computed in float32) and once in the run's precision. The divergence is a near-tie when the
float32 logits of the two tokens lie within NEAR_TIE_LOGITS of each other (or within twice the half-precision error
measured on them, if larger). The measured error is that of one full forward; the reference decodes token by token
on a KV cache, whose rounding
differs again, so the measured error alone understates the noise. A bug (a wrong mask, position or cache row)
gives a token the target does not want at all: gaps of several logits, reported as suspects.
Writes <run>/divergence.json and prints a table per method.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from medusa.fileio import atomic_write_text
from medusa.loading import load_base
from medusa.precision import load_target
from medusa.questions import answer_message, encode_conversation, load_questions
from medusa.runtime import QUANTIZED, dequantize_target, quantize_target

NEAR_TIE_LOGITS = 0.5  # probabilities within a factor e^0.5 = 1.65 of each other


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(records: list[dict], questions: dict, reference: str = "baseline") -> list[dict]:
    """Each (question, method) whose output differs from the `reference` method's -> its first differing turn and
    position."""
    baseline = {r["question_id"]: r for r in records if r["method"] == reference}
    found = []
    for r in records:
        base = baseline.get(r["question_id"])
        if r["method"] == reference or base is None:
            continue
        for turn, (mine, ref) in enumerate(zip(r["turns"], base["turns"])):
            position = first_difference(mine["output_ids"], ref["output_ids"])
            if position is None:
                continue
            if position >= min(len(mine["output_ids"]), len(ref["output_ids"])):
                break  # one output is a prefix of the other (a stop token kept by one): nothing to score
            found.append(
                {
                    "question_id": r["question_id"],
                    "method": r["method"],
                    "turn": turn,
                    "position": position,
                    "baseline_token": ref["output_ids"][position],
                    "method_token": mine["output_ids"][position],
                    "earlier_turns": [t["output_ids"] for t in base["turns"][:turn]],
                    "prefix": ref["output_ids"][:position],
                    "turns": questions[r["question_id"]]["turns"],
                }
            )
            break  # later turns build on a different conversation
    return found


def context_ids(tokenizer, case: dict) -> list[int]:
    """The prompt of the diverging turn (earlier answers as the baseline gave them) plus the shared output prefix."""
    messages = []
    for text, answer in zip(case["turns"], case["earlier_turns"]):
        messages += [{"role": "user", "content": text}, answer_message(tokenizer, answer)]
    messages.append({"role": "user", "content": case["turns"][case["turn"]]})
    return encode_conversation(tokenizer, messages) + case["prefix"]


@torch.inference_mode()
def last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1].float()


def score(case: dict, exact, half, tokenizer) -> dict:
    ids = context_ids(tokenizer, case)
    reference, rounded = last_logits(exact, ids), last_logits(half, ids)
    b, m = case["baseline_token"], case["method_token"]
    gap = float(reference[b] - reference[m])  # > 0: float32 prefers the baseline's token
    error = float(max(abs(rounded[b] - reference[b]), abs(rounded[m] - reference[m])))
    return {
        "question_id": case["question_id"],
        "method": case["method"],
        "turn": case["turn"],
        "position": case["position"],
        "baseline_token": tokenizer.decode([b]),
        "method_token": tokenizer.decode([m]),
        "float32_gap": gap,
        "half_error": error,
        "float32_prefers": "baseline" if gap > 0 else "method",
        "near_tie": abs(gap) <= max(2 * error, NEAR_TIE_LOGITS),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="medusa bench output folder (settings.json + raw.jsonl)")
    parser.add_argument(
        "--reference",
        default=None,
        help="the method the others are compared with: baseline (transformers' generate; the default when it ran) or "
        "baseline_compiled (plain decoding at the run's precision on this library's engine)",
    )
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / "settings.json").is_file() or not (run / "raw.jsonl").is_file():
        raise SystemExit(f"{run} is not a benchmark output folder (settings.json and raw.jsonl missing)")
    settings = json.loads((run / "settings.json").read_text())
    if settings["temperature"] > 0:
        raise SystemExit(f"{run} sampled (temperature {settings['temperature']}): outputs are not meant to match")
    records = [json.loads(line) for line in (run / "raw.jsonl").read_text().splitlines() if line.strip()]
    questions = {q["question_id"]: q for q in load_questions(settings["questions"])}
    reference = args.reference or ("baseline" if "baseline" in settings["methods"] else "baseline_compiled")
    # the arbiter: the run's weights (quantised ones too, dequantised) computed in float32; load_base reads
    # "embedded:..." too
    exact, tokenizer = load_base(settings["base"], dtype=torch.float32)
    if settings["dtype"] in QUANTIZED:
        dequantize_target(quantize_target(exact, settings["dtype"]))
    half, _ = load_target(settings["base"], dtype=settings["dtype"], tokenizer=tokenizer)
    cases = [score(case, exact, half, tokenizer) for case in divergences(records, questions, reference)]
    outputs = {m: sum(r["method"] == m for r in records) for m in settings["methods"] if m != reference}
    summary = {}
    for m, n in outputs.items():
        mine = [c for c in cases if c["method"] == m]
        summary[m] = {
            "outputs": n,
            "differ": len(mine),
            "near_ties": sum(c["near_tie"] for c in mine),
            "float32_prefers_method": sum(c["float32_prefers"] == "method" for c in mine),
            "max_abs_float32_gap": max((abs(c["float32_gap"]) for c in mine), default=0.0),
        }
    result = {"run": str(run), "dtype": settings["dtype"], "reference": reference, "summary": summary, "cases": cases}
    atomic_write_text(run / "divergence.json", json.dumps(result, indent=2))
    print(
        f"| method | outputs | differ from {reference} | near-ties | suspects | float32 sides with the method | "
        "largest float32 gap |\n|---|---|---|---|---|---|---|"
    )
    for m, s in summary.items():
        print(
            f"| {m} | {s['outputs']} | {s['differ']} | {s['near_ties']} | {s['differ'] - s['near_ties']} | "
            f"{s['float32_prefers_method']} | {s['max_abs_float32_gap']:.3f} |"
        )
    for c in cases:
        if not c["near_tie"]:
            print(
                f"suspect: q{c['question_id']} {c['method']} turn {c['turn']} token {c['position']}: "
                f"{c['baseline_token']!r} vs {c['method_token']!r}, float32 gap {c['float32_gap']:.3f}, "
                f"{settings['dtype']} error {c['half_error']:.3f}"
            )
    return result


if __name__ == "__main__":
    main()
