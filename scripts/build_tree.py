"""Build a static tree from head accuracies and this machine's measured step latency.

    python scripts/build_tree.py --accuracy acc.json --out medusa/trees/smollm2-135m-cpu.json \
        [--max-nodes 64] [--dtype float32] [--heads DIR] [--base PATH] [--kv-length 512] [--repeats 10] [--threads N]

`acc.json` comes from `medusa accuracy`: {"acc_given_prefix": [[p(rank r of head k is right | heads before
it right) for r] for k], "acc": [[marginal p] ...], ...}. A path's value multiplies the conditional shares (the
marginal "acc" of older files, which undervalues deep paths, when there are none).
The tree is grown greedily by path value; for each candidate size the script times one decoding step (heads +
verify forward + acceptance) at a realistic KV length and keeps the size with the most expected tokens per second.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

from medusa import MedusaModel, TreeSpec
from medusa.fileio import atomic_write_text
from medusa.tree_builder import DEFAULT_SIZES, best_size, expected_tau, grow_tree, measure_step_latency


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accuracy", required=True, help="JSON from `medusa accuracy` (key 'acc')")
    parser.add_argument("--out", required=True, help="tree JSON to write, e.g. medusa/trees/smollm2-135m-cpu.json")
    parser.add_argument("--max-nodes", type=int, default=64, help="largest tree to consider, root included")
    parser.add_argument(
        "--sizes", default=None, help="comma-separated node counts to time (default: a ladder up to --max-nodes)"
    )
    parser.add_argument(
        "--heads", default=None, help="heads directory (default: the shipped heads); only their cost matters"
    )
    parser.add_argument("--base", default=None, help="base model (default: the heads' base)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="e.g. cuda; default: CPU")
    parser.add_argument("--kv-length", type=int, default=512, help="tokens in the cache while timing")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per size (medians are reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return parser.parse_args(argv)


def load_accuracy(path: str) -> list[list[float]]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "acc" not in data:
        raise ValueError(f"{path} has no 'acc' key: expected the JSON written by `medusa accuracy`")
    return data.get("acc_given_prefix", data["acc"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = load_accuracy(args.accuracy)
    model = MedusaModel.from_pretrained(args.heads, base=args.base, dtype=args.dtype, device=args.device, plan="off")
    if len(acc) > model.config.num_heads:
        print(
            f"note: {args.accuracy} covers {len(acc)} heads, the model has {model.config.num_heads}; using the first "
            f"{model.config.num_heads}",
            file=sys.stderr,
        )
        acc = acc[: model.config.num_heads]

    order = grow_tree(acc, args.max_nodes)  # paths, best first
    wanted = [int(s) for s in args.sizes.split(",")] if args.sizes else list(DEFAULT_SIZES)
    sizes = sorted({n for n in wanted + [1] if 1 <= n <= min(args.max_nodes, len(order) + 1)})
    trees = {n: order[: n - 1] for n in sizes}
    taus = {n: expected_tau(trees[n], acc) for n in sizes}
    latency = measure_step_latency(model, trees, kv_length=args.kv_length, repeats=args.repeats)
    step_ms = {n: latency[n].step_ms for n in sizes}
    best = best_size(taus, step_ms)

    print(
        f"{'nodes':>5} {'depth':>5} {'exp. tau':>8} {'heads ms':>8} {'verify ms':>9} {'step ms':>8} {'exp. tok/s':>10}"
    )
    for n in sizes:
        lat = latency[n]
        depth = max((len(p) for p in trees[n]), default=0)
        mark = "  <- best" if n == best else ("  (plain decoding)" if n == 1 else "")
        print(
            f"{n:5d} {depth:5d} {taus[n]:8.3f} {lat.heads_ms:8.2f} {lat.verify_ms:9.2f} {lat.step_ms:8.2f} "
            f"{1000 * taus[n] / lat.step_ms:10.2f}{mark}"
        )
    plain = 1000 / step_ms[1]
    predicted = 1000 * taus[best] / step_ms[best]
    if predicted <= plain:
        print(
            f"warning: no tree beats plain decoding on this machine by this model ({predicted:.2f} vs {plain:.2f} "
            "tok/s): better heads (higher accuracies) or a cheaper head projection are needed",
            file=sys.stderr,
        )

    result = {
        "paths": TreeSpec(trees[best]).to_list(),
        "expected_tau": taus[best],
        "num_nodes": best,
        "latency_ms": {str(n): step_ms[n] for n in sizes},
        "verify_ms": {str(n): latency[n].verify_ms for n in sizes},
        "heads_ms": {str(n): latency[n].heads_ms for n in sizes},
        "expected_tau_by_size": {str(n): taus[n] for n in sizes},
        "expected_tokens_per_s": {str(n): 1000 * taus[n] / step_ms[n] for n in sizes},
        "settings": {
            "accuracy": str(args.accuracy),
            "heads": args.heads,
            "base": model.config.base_model_name_or_path if args.base is None else str(args.base),
            "dtype": args.dtype,
            "device": str(model.device),
            "threads": torch.get_num_threads(),
            "kv_length": args.kv_length,
            "repeats": args.repeats,
            "max_nodes": args.max_nodes,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    atomic_write_text(Path(args.out), json.dumps(result, indent=2))
    print(
        f"wrote {args.out}: {best} nodes, expected tau {taus[best]:.3f}, {predicted:.2f} expected tok/s "
        f"(plain decoding {plain:.2f})"
    )
    return result


if __name__ == "__main__":
    main()
