"""Per-head, per-rank accuracy of Medusa heads on the target's own greedy answers to a question file.

    medusa accuracy --questions ../shared/bench_data/spec_bench_question.jsonl --limit 80 \\
        --out runs/acc.json [--heads DIR] [--max-new-tokens 128] [--dtype float32] [--ranks 10]

The target answers the first turn of each question through its chat template, greedily, exactly as
train/generate_data.py answers training prompts (medusa/answers.py); then acc[k][r] is the share of response
positions where rank r (0-based) of head k, ranked as the proposer ranks candidates, is the token the target emitted
(see medusa/evaluation.py). Path heads (`condition_on_path`) read the target's own tokens as their path, so for them
acc[k][r] is the accuracy given that the path's tokens are right. acc_given_prefix[k][r] counts only the positions
where heads 0..k-1 were also right at rank 0, the positions a step that reached depth k really sees (they are easier
than average). Top-1 is also reported per question category and per bin of the target's own probability of the token
it emitted (misses on tokens the target was sure of are the heads' to win). scripts/build_tree.py reads the JSON:
{"acc": [[...]], "acc_given_prefix": [[...]], "chain", "top1", "top5", "positions", "questions", "counts",
"by_category", "by_target_confidence", "copy", "settings"}. Heads with `copy_ngram` rank their copy guess (the token
that followed the last few tokens' most recent earlier occurrence, medusa/ngram.py) first, as the proposer does;
`--copy-ngram 0` scores the network's guesses alone.

`--taus` decodes instead of scoring: each option the plan weighs (medusa, dynamic and hybrid trees of each size it
times, grown from the heads' accuracy table) answers the questions greedily, and the tokens committed and nodes
verified per step are recorded ({"decoded": {"tau", "nodes", "source"}, "settings"}); with `--heads-dir` they go
beside the table, where the plan takes them over its accuracy model (medusa/plan.py). Use prompts held out from the
heads' training and from the benchmarks you will report. `--taus --eagle3 DIR` decodes an EAGLE-3 draft's dynamic
trees of each size instead (`--gamma` deep); with `--heads-dir` the taus go into DIR, where its plan reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from medusa import MedusaModel
from medusa.answers import answer_prompts, stop_and_pad_ids, tokenize_prompts
from medusa.eagle3_io import resolve_draft
from medusa.evaluation import (
    CONFIDENCE_EDGES,
    RankAccuracy,
    bench_data_dir,
    head_rank_accuracy_by_group,
)
from medusa.fileio import atomic_write_text
from medusa.heads import head_target_offset
from medusa.heads_io import resolve_heads
from medusa.loading import DTYPES
from medusa.model import DEFAULT_HEADS_DIR
from medusa.plan import ACCURACY_NAME, decode_options, save_accuracy, save_draft_taus
from medusa.questions import load_questions, spread
from medusa.runtime import ENGINES


def first_turn_prompts(model: MedusaModel, questions: list[dict], max_new_tokens: int) -> list[dict]:
    """Each question's first turn through the chat template, those that leave room for `max_new_tokens` in the
    context window (tokenize_prompts: `source` is the question's index)."""
    window = model.base.config.get_text_config().max_position_embeddings
    turns = [(i, q["turns"][0]) for i, q in enumerate(questions)]
    return tokenize_prompts(model.tokenizer, turns, window - max_new_tokens)


def answer_questions(model: MedusaModel, questions: list[dict], max_new_tokens: int, batch_size: int):
    """Greedy self-distilled answers to each question's first turn -> (sequences, response_starts, answered): the
    base's own, decoded plainly by `model`'s batched generate (its heads, perhaps untrained, do not guess)."""
    tokenizer = model.tokenizer
    items = first_turn_prompts(model, questions, max_new_tokens)
    eos_ids, pad_id = stop_and_pad_ids(model.base, tokenizer)
    prompts = [x["prompt_ids"] for x in items]
    sequences, starts, answered = [], [], []
    for i, response in answer_prompts(
        model, prompts, pad_id, eos_ids, batch_size, max_new_tokens=max_new_tokens, proposer="plain"
    ):
        sequences.append(prompts[i] + response)
        starts.append(len(prompts[i]))
        answered.append(questions[items[i]["source"]])
        if len(sequences) % batch_size == 0 or len(sequences) == len(items):
            print(f"answered {len(sequences)}/{len(items)} questions", file=sys.stderr)
    return sequences, starts, answered


def print_table(result: RankAccuracy, shown: int = 5) -> None:
    acc = result.acc
    shown = min(shown, acc.shape[1])
    ranks = " ".join(f"{'r' + str(r):>6}" for r in range(shown))
    given, chain = result.acc_given_prefix, result.chain
    print(f"{'head':>4} {'offset':>6} {'scored':>7} {'top1':>6} {'top5':>6}  {ranks}  {'top1|prefix':>11} {'chain':>6}")
    for k in range(acc.shape[0]):
        print(
            f"{k:>4} {'+' + str(head_target_offset(k)):>6} {int(result.counts[k]):>7} {float(acc[k, 0]):6.3f} "
            f"{float(result.top(5)[k]):6.3f}  "
            + " ".join(f"{float(a):6.3f}" for a in acc[k, :shown])
            + f"  {float(given[k, 0]):11.3f} {float(chain[k]):6.3f}"
        )
    print(
        "top1|prefix: top-1 accuracy where heads 0..k-1 were right (what a step that reached head k sees); "
        "chain: share of positions where heads 0..k all were right"
    )


def print_categories(by_category: dict[str, RankAccuracy], categories: list[str]) -> None:
    print(f"{'category':>14} {'questions':>9} {'scored':>7}  top-1 per head")
    for cat, part in sorted(by_category.items()):
        print(
            f"{cat:>14} {categories.count(cat):>9} {int(part.counts[0]):>7}  "
            + " ".join(f"{float(a):6.3f}" for a in part.top(1))
        )


def confidence_bins() -> list[str]:
    edges = (0.0, *CONFIDENCE_EDGES, 1.0)
    return [f"{lo:.1f}-{hi:.1f}" for lo, hi in zip(edges, edges[1:])]


def print_copy(result: RankAccuracy, ngram: int) -> None:
    print(
        f"\ncopy guesses (last {ngram}..2 tokens seen before; ranked first where they exist): share of positions "
        + " ".join(f"{float(x):.3f}" for x in result.copy_share)
        + ", right "
        + " ".join(f"{float(x):.3f}" for x in result.copy_precision)
    )


def print_confidence(result: RankAccuracy) -> None:
    """Top-1 per head split by the target's own probability of the token it emitted."""
    print(f"{'target p':>10} {'share':>6}  top-1 per head")
    for b, name in enumerate(confidence_bins()):
        print(
            f"{name:>10} {float(result.confidence_share[0, b]):6.3f}  "
            + " ".join(f"{float(a):6.3f}" for a in result.by_confidence[:, b])
        )


def heads_directory(args) -> Path:
    return resolve_heads(args.heads) if args.heads else DEFAULT_HEADS_DIR


def decode_taus(model, questions: list[dict], args, started: float) -> None:
    """--taus: each option the plan weighs decodes the questions' first turns (medusa.plan.decode_options)."""
    if not args.eagle3 and model.accuracy is None:
        sys.exit("error: --taus grows the plan's trees from the heads' accuracy table: write one first (--heads-dir)")
    items = first_turn_prompts(model, questions, args.max_new_tokens)
    decoded = decode_options(model, [x["prompt_ids"] for x in items], args.max_new_tokens, engine=args.engine)
    draft = ""
    if args.eagle3:  # the taus hold for this setting only (from_draft_model checks it)
        decoded["copy_ngram"] = model.copy_ngram
        draft = f" --eagle3 {args.eagle3} --gamma {args.gamma} --copy-ngram {model.copy_ngram}"
    decoded["source"] = (
        f"medusa accuracy --taus{draft} --questions {args.questions} --limit {args.limit} --dtype {args.dtype}: "
        f"{len(items)} questions, {args.max_new_tokens} new tokens at most, greedy"
    )
    print(f"{'nodes':>5} " + " ".join(f"{p + ' tau':>12} {'nodes':>6}" for p in decoded["tau"]))
    for n in next(iter(decoded["tau"].values())):
        print(
            f"{n:>5} "
            + " ".join(f"{decoded['tau'][p][n]:>12.3f} {decoded['nodes'][p][n]:>6.2f}" for p in decoded["tau"])
        )
    settings = {
        "heads": args.heads or "default",
        "eagle3": args.eagle3,
        "questions_file": args.questions,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "engine": args.engine,
        "question_ids": [questions[x["source"]]["question_id"] for x in items],
        "torch": torch.__version__,
        "seconds": round(time.time() - started, 1),
    }
    atomic_write_text(Path(args.out), json.dumps({"decoded": decoded, "settings": settings}, indent=2))
    print(f"{len(items)} questions -> {args.out}")
    model.decoded_taus = decoded
    if args.heads_dir and args.eagle3:
        draft_dir = resolve_draft(args.eagle3)
        save_draft_taus(draft_dir, decoded)
        print(f"decoded taus -> {draft_dir / ACCURACY_NAME}")
    elif args.heads_dir:
        directory = heads_directory(args)
        data = json.loads((directory / ACCURACY_NAME).read_text())
        save_accuracy(directory, model.accuracy, source=data.get("source", ""), decoded=decoded)
        print(f"decoded taus -> {directory / ACCURACY_NAME}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="medusa accuracy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--questions",
        help="JSONL of {question_id, category, turns} (default: Spec-Bench in $MEDUSA_BENCH_DATA, or in "
        "../shared/bench_data beside a source checkout)",
    )
    parser.add_argument("--limit", type=int, help="questions to use, evenly spread through the file (default: all)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--heads", help="heads directory (default: the shipped heads)")
    parser.add_argument("--base", help="base model (default: the one the heads name)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", help="e.g. cuda (default: cpu)")
    parser.add_argument("--ranks", type=int, default=10, help="ranks per head to score")
    parser.add_argument("--batch-size", type=int, default=8, help="questions answered per generate call")
    parser.add_argument(
        "--copy-ngram",
        type=int,
        help="override the heads' copy_ngram (0: score the network's own guesses alone, without the copy guess ranked "
        "first); with --eagle3, its trees' copy guess (default medusa.eagle3.COPY_NGRAM; the plan weighs the taus "
        "only with the setting they were decoded with)",
    )
    parser.add_argument(
        "--heads-dir",
        action="store_true",
        help="also write the conditional accuracy table into the heads directory as "
        "medusa_accuracy.json, where the calibrated plan (medusa.plan) reads it",
    )
    parser.add_argument(
        "--taus",
        action="store_true",
        help="decode instead of scoring: every option the plan weighs answers the questions, and its tokens and "
        "nodes per step are recorded (with --heads-dir: beside the table, for the plan)",
    )
    parser.add_argument(
        "--engine", choices=ENGINES, default="eager", help="the engine --taus decodes on (outputs are the same)"
    )
    parser.add_argument(
        "--eagle3",
        help="with --taus: decode an EAGLE-3 draft's trees (a directory or Hub id in the speculators or EAGLE-3 "
        "layout, or embedded:<name>) "
        "instead of the heads' options; with --heads-dir the taus go into that directory",
    )
    parser.add_argument("--gamma", type=int, default=5, help="with --eagle3: how deep its trees grow")
    args = parser.parse_args(argv)
    if args.questions is None:
        args.questions = str(bench_data_dir() / "spec_bench_question.jsonl")
        if not Path(args.questions).is_file():  # an installed wheel has no checkout beside it
            parser.error(
                f"no questions at {args.questions}: pass --questions FILE (JSONL of question_id, category, turns), "
                "or point $MEDUSA_BENCH_DATA at a folder holding spec_bench_question.jsonl"
            )

    if args.eagle3 and not args.taus:
        parser.error("--eagle3 decodes a draft's tokens per step: add --taus (per-head scoring is for Medusa heads)")
    started = time.time()
    questions = spread(load_questions(args.questions), args.limit)
    if args.eagle3:
        model = MedusaModel.from_draft_model(
            args.base,
            args.eagle3,
            dtype=args.dtype,
            device=args.device,
            num_speculative_tokens=args.gamma,
            copy_ngram=args.copy_ngram,
            plan="off",
        )
        decode_taus(model, questions, args, started)
        return
    model = MedusaModel.from_pretrained(args.heads, base=args.base, dtype=args.dtype, device=args.device, plan="off")
    if args.copy_ngram is not None:
        model.heads.config = dataclasses.replace(model.config, copy_ngram=args.copy_ngram)  # validated again
    if args.taus:
        decode_taus(model, questions, args, started)
        return
    sequences, starts, answered = answer_questions(model, questions, args.max_new_tokens, args.batch_size)
    if not sequences:
        parser.exit(
            1, f"error: no question of {args.questions} fits the context window with {args.max_new_tokens} new tokens\n"
        )
    categories = [q["category"] or "none" for q in answered]  # load_questions gives None where a row has none
    result, by_category = head_rank_accuracy_by_group(model, sequences, starts, categories, ranks=args.ranks)
    print_table(result)
    print_categories(by_category, categories)
    print_confidence(result)
    if model.config.copy_ngram:
        print_copy(result, model.config.copy_ngram)

    positions = sum(len(s) - start for s, start in zip(sequences, starts))
    report = {
        "acc": result.acc.tolist(),
        "acc_given_prefix": result.acc_given_prefix.tolist(),  # what scripts/build_tree.py multiplies
        "chain": result.chain.tolist(),
        "top1": result.top(1).tolist(),
        "top5": result.top(5).tolist(),
        "positions": positions,  # response tokens generated
        "counts": result.counts.tolist(),  # positions scored per head
        "questions": len(answered),
        # where the heads miss: top-1 per head and scored positions for each question category
        "by_category": {
            cat: {"questions": categories.count(cat), "top1": part.top(1).tolist(), "counts": part.counts.tolist()}
            for cat, part in sorted(by_category.items())
        },
        # where the heads miss, by how sure the target was of the token: its probability bins, the share of head 0's
        # scored positions in each, top-1 per head in each (greedy answers: the target's top probability)
        "by_target_confidence": {
            "bins": confidence_bins(),
            "share": result.confidence_share[0].tolist(),
            "top1": result.by_confidence.T.tolist(),
            "counts": result.confidence_counts.T.tolist(),
        },
        # copy guesses (heads with copy_ngram): share of each head's positions with one, and how often it was right
        "copy": {"share": result.copy_share.tolist(), "precision": result.copy_precision.tolist()},
        "settings": {
            "heads": args.heads or "default",
            "base": model.config.base_model_name_or_path,
            "questions_file": args.questions,
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "ranks": args.ranks,
            "greedy": True,
            "num_heads": model.config.num_heads,
            "copy_ngram": model.config.copy_ngram,
            "projection": model.config.projection,
            "vocab_subset_size": model.config.vocab_subset_size,
            "candidate_dtype": str(model.candidate_projection.weight.dtype).removeprefix("torch."),
            "head_target_offsets": [head_target_offset(k) for k in range(model.config.num_heads)],
            "question_ids": [q["question_id"] for q in answered],
            "torch": torch.__version__,
            "seconds": round(time.time() - started, 1),
        },
    }
    atomic_write_text(Path(args.out), json.dumps(report, indent=2))
    print(f"{len(answered)} questions, {positions} response tokens -> {args.out}")
    if args.heads_dir:
        directory = heads_directory(args)
        save_accuracy(
            directory,
            report["acc_given_prefix"],
            source=f"medusa accuracy --questions {args.questions} --limit {args.limit}: "
            f"{len(answered)} questions, {positions} tokens",
        )
        print(f"accuracy table -> {directory / ACCURACY_NAME}")
