"""Replays a fixed option's steps from a `medusa bench` record through the online guard (medusa.guard), on a
simulated clock, to see what its plain stretches cost or save per policy.

    python docs/benchmarks/plan-decoded-taus-session40/guard_sim.py RUN_DIR --method medusa_dynamic@6 \
        [--margins 0 0.1 0.2 0.3] [--noise 0.05] [--plain-ms MS --step-ms MS]

RUN_DIR's raw.jsonl must hold the method (and `baseline_compiled`, unless both costs are given). A plain step
costs the baseline's mean ms per forward, a guessing step the method's (or --plain-ms / --step-ms); a guessing step
at position q accepts what the recorded step covering q accepted beyond q (its own accepted length where a recorded
step starts at q). The guard is the real class; only its clock and its loss margin (a window loses when its ms per
token exceed plain's by more than the margin) are patched.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from pathlib import Path
from types import SimpleNamespace

import torch

import medusa.guard
from medusa.guard import GuardedProposer


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Inner:
    max_nodes = 8

    def propose(self, state):
        return None

    def observe(self, state, tokens):
        pass


def replay(accepted: list[int], total: int, plain_ms: float, step_ms: float, margin: float | None, noise, rng):
    """-> (ms, tokens) decoding `total` tokens; margin None: no guard (every step guesses)."""
    starts = [0]
    for a in accepted:
        starts.append(starts[-1] + a)
    clock = Clock()
    medusa.guard.time.perf_counter = clock
    medusa.guard.LOSS_MARGIN = margin or 0.0
    guard = GuardedProposer(Inner(), plain_ms, torch.device("cpu"), expected_step_ms=step_ms)
    state = SimpleNamespace(root_token=torch.tensor(0))
    position, elapsed = 0, 0.0
    while position < total:
        if margin is not None:
            guard.propose(state)
        guessing = margin is None or guard._guessing
        j = bisect.bisect_right(starts, position) - 1
        j = min(j, len(accepted) - 1)
        tokens = max(1, starts[j] + accepted[j] - position) if guessing else 1
        cost = (step_ms if guessing else plain_ms) * (1 + noise * rng.gauss(0, 1))
        clock.now += cost / 1000
        elapsed += cost
        if margin is not None:
            guard.observe(state, [0] * tokens)
        position += tokens
    return elapsed, position


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--method", default="medusa_dynamic@6")
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    parser.add_argument("--noise", type=float, default=0.05, help="relative sd of each step's time")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--plain-ms", type=float, help="a plain step's ms (default: the baseline's, from the run)")
    parser.add_argument("--step-ms", type=float, help="a guessing step's ms (default: the method's, from the run)")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (Path(args.run_dir) / "raw.jsonl").read_text().splitlines() if line]
    by = {(r["question_id"], r["method"]): r for r in rows}

    def per_forward(method):  # prefill included: a close enough yardstick for both
        turns = [t for (q, m), r in by.items() if m == method for t in r["turns"]]
        return 1000 * sum(t["time_s"] for t in turns) / sum(t["forwards"] for t in turns)

    plain_ms = args.plain_ms or per_forward("baseline_compiled")
    step_ms = args.step_ms or per_forward(args.method)
    turns = [t for (q, m), r in sorted(by.items()) if m == args.method for t in r["turns"]]
    print(f"{args.method}: plain {plain_ms:.2f} ms a forward, guessing {step_ms:.2f} ms, {len(turns)} turns")
    for margin in [None, *args.margins]:
        rates = []
        for seed in range(args.seeds):
            rng = random.Random(seed)
            ms = tokens = 0.0
            for t in turns:
                a, b = replay(t["accepted_lengths"], len(t["output_ids"]), plain_ms, step_ms, margin, args.noise, rng)
                ms, tokens = ms + a, tokens + b
            rates.append(1000 * tokens / ms)
        name = "no guard" if margin is None else f"margin {margin:.2f}"
        print(f"{name:>12}: {sum(rates) / len(rates):7.2f} tokens/s (vs plain {1000 / plain_ms:.2f})")


if __name__ == "__main__":
    main()
