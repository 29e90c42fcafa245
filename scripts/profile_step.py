"""Where a decoding step's time goes: medusa vs plain `generate`, per phase, for one or more trees.

    python scripts/profile_step.py [--heads untrained|DIR] [--trees '[[0]]' smollm2-135m-cpu] [--max-new-tokens 64]
        [--engine eager|compiled|inductor|inductor_onednn] [--proposers medusa dynamic plain] [--base X.gguf]
        [--device cuda]

Runs plain greedy `generate` (transformers, eager) and each proposer over each tree on the chosen engine, interleaved
on a few prompts (after a warm-up, which compiles the engine). Outputs must be identical on the eager engine; other
engines report how many are. Prints the median speedup, tau and the mean milliseconds per step of prefill
(amortised), propose (heads), verify (target forward), accept and commit (on a GPU each phase is synchronised, so
the phases add up to more than an unprofiled step), and what the proposal spent in the heads' context layer, in the
heads and in their candidate projection (a part of the heads' time). A dynamic tree takes each tree's size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import statistics
import time

import torch

from medusa import MedusaModel, load_tree
from medusa.propose import CandidateProjection, MedusaProposer
from medusa.proposers import PROPOSERS
from medusa.runtime import ENGINES

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "What are the health benefits of green tea?",
]


# parts of a proposal, timed where the proposers call them: (label, class, method)
PROPOSAL_PARTS = (
    ("context read", MedusaProposer, "read"),
    ("heads", MedusaProposer, "path_logits"),
    ("heads", MedusaProposer, "head_logits"),
    ("their projection", CandidateProjection, "head_logits"),
)
PART_LABELS = tuple(dict.fromkeys(label for label, _, _ in PROPOSAL_PARTS))


@contextlib.contextmanager
def timed_parts():
    """Yields a dict of the seconds spent in each of PROPOSAL_PARTS while inside (methods wrapped, then restored)."""
    seconds: dict[str, float] = {}
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in PROPOSAL_PARTS]

    def timed(label, method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

        return run

    for (label, owner, name), (_, _, method) in zip(PROPOSAL_PARTS, originals):
        setattr(owner, name, timed(label, method))
    try:
        yield seconds
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--heads", default=None, help="'untrained' (fresh heads), a heads directory, or the shipped default"
    )
    parser.add_argument("--trees", nargs="+", default=[None], help="tree names, JSON files or JSON path lists")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine", default="eager", choices=ENGINES)
    parser.add_argument("--proposers", nargs="+", default=["medusa"], choices=sorted(PROPOSERS))
    parser.add_argument("--base", default=None, help="base model: directory, .gguf or Hub id (default: the heads')")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: CPU)")
    args = parser.parse_args()

    model = (
        MedusaModel.from_base(args.base, dtype=args.dtype, device=args.device, plan="off")
        if args.heads == "untrained"
        else MedusaModel.from_pretrained(args.heads, base=args.base, dtype=args.dtype, device=args.device, plan="off")
    )
    chat = lambda text: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    ).to(model.device)
    model.generate(chat("Hi"), max_new_tokens=8, engine=args.engine)
    model.base.generate(**chat("Hi"), max_new_tokens=8, do_sample=False)
    for tree, proposer in itertools.product(args.trees, args.proposers):
        paths = model.tree if tree is None else json.loads(tree) if tree.startswith("[") else load_tree(tree)
        ratios, taus, per_step, part_ms, differing = [], [], {}, {}, []
        for text in PROMPTS:
            ids = chat(text)
            start = time.perf_counter()
            plain = model.base.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain_s = time.perf_counter() - start
            start = time.perf_counter()
            with timed_parts() as parts:
                out = model.generate(
                    ids,
                    max_new_tokens=args.max_new_tokens,
                    tree=paths,
                    proposer=proposer,
                    engine=args.engine,
                    profile=True,
                    return_dict_in_generate=True,
                )
            fast_s = time.perf_counter() - start
            if not torch.equal(plain, out.sequences):
                if args.engine == "eager":  # the exact reference: any difference is a bug
                    raise AssertionError(f"medusa output differs from plain generate on {text!r}")
                differing.append(text)  # a compiled forward may round a near-tie the other way
            plain_tokens = plain.shape[1] - ids["input_ids"].shape[1]
            ratios.append((out.stats.new_tokens / fast_s) / (plain_tokens / plain_s))
            taus.append(out.stats.mean_accepted_tokens)
            for phase, seconds in out.stats.timings.items():
                per_step.setdefault(phase, []).append(seconds / out.stats.steps * 1000)
            for label in PART_LABELS:
                part_ms.setdefault(label, []).append(parts.get(label, 0.0) / out.stats.steps * 1000)
        phases = ", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in per_step.items())
        proposal = ", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in part_ms.items())
        print(
            f"{proposer} {args.engine} {len(paths) + 1:>3}-node tree: median speedup {statistics.median(ratios):.2f}x, "
            f"tau {statistics.mean(taus):.2f}; "
            f"ms per step: {phases} (of the proposal: {proposal}); "
            f"plain generate {plain_s / plain_tokens * 1000:.1f} ms/token; "
            f"identical {len(PROMPTS) - len(differing)}/{len(PROMPTS)}"
        )


if __name__ == "__main__":
    main()
