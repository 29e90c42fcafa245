"""Measure this machine and choose the decoding plan (engine, proposer, tree) that `generate` uses by default.

    medusa calibrate [--heads DIR | --eagle3 DIR] [--base PATH] [--dtype float32|bfloat16|auto] [--device cuda]
                     [--no-compile] [--out plan.json]

The plan is cached under $MEDUSA_CACHE/plans/ (what `MedusaModel.from_pretrained` reads); this command measures anew
and replaces the cached one, then prints the options it compared. See medusa/plan.py. `--eagle3 DIR` calibrates
the plan of an EAGLE-3 draft (what `MedusaModel.from_draft_model(base, DIR)` reads): its engine and tree size.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from medusa import MedusaModel
from medusa.cli import NO_HEADS_HELP, load_model
from medusa.fileio import atomic_write_text
from medusa.runtime import ENGINES


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="medusa calibrate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--heads", default=None, help=f"heads directory (default: the shipped heads); {NO_HEADS_HELP}")
    parser.add_argument(
        "--eagle3",
        default=None,
        help="an EAGLE-3 draft (directory, Hub id or embedded:<name>): calibrate its plan instead of the heads'",
    )
    parser.add_argument("--base", default=None, help="base model (default: the heads' base; with --eagle3: SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        default=None,
        help="leave torch.compile's engine out (default: $MEDUSA_COMPILE != '0' lets the plan time it)",
    )
    parser.add_argument("--out", default=None, help="also write the plan here as JSON")
    args = parser.parse_args(argv)
    if args.eagle3 and args.heads:
        parser.error("--heads and --eagle3 name two proposals: calibrate one at a time")
    if args.eagle3:
        model = MedusaModel.from_draft_model(args.base, args.eagle3, dtype=args.dtype, device=args.device, plan="off")
        if model.decoded_taus is None:
            print(
                "note: this draft has no decoded taus (medusa_accuracy.json): the plan only picks the engine; write "
                "them with `medusa accuracy --taus --eagle3 DIR --heads-dir`"
            )
    else:
        model = load_model(args.heads, base=args.base, dtype=args.dtype, device=args.device, plan="off")
        if not model.heads_trained:
            print("note: no trained heads: the plan chooses the engine, and prompt lookup guesses on it")
        elif model.accuracy is None:
            print(
                "note: these heads have no accuracy table (medusa_accuracy.json): the plan only picks the engine; "
                "write one with `medusa accuracy --heads-dir`"
            )
    plan = model.calibrate(recalibrate=True, compile=args.compile)
    print(plan.describe())
    print(
        f"measured in {plan.calibration_s:.1f} s (compiling {plan.compile_s:.1f} s); engines timed: "
        f"{sorted(plan.latency_ms)} of {list(ENGINES)}"
    )
    if args.out:
        atomic_write_text(Path(args.out), json.dumps(asdict(plan), indent=1))
    return asdict(plan)
