"""Milliseconds per target forward over 1, 8 and 16 query tokens with a 300-token cache, on the compiled engine's
packed copy with and without fused sibling projections (q/k/v, gate/up), interleaved in one process.

    python scripts/forward_latency.py [--repeats 12] [--context 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa import MedusaModel
from medusa.runtime import CompiledEngine, prepacked_copy, with_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    base = MedusaModel.from_pretrained(plan="off").base
    runners = {"fused": prepacked_copy(base), "unfused": prepacked_copy(base, fuse=False)}
    engine = CompiledEngine(base)
    cache = engine.new_cache(args.context + 64)
    times = {(q, name): [] for q in (1, 8, 16) for name in runners}
    with torch.inference_mode():
        engine.prefill(cache, torch.randint(0, 40000, (1, args.context)))
        for _ in range(args.repeats):
            for q, name in times:
                tokens = torch.randint(0, 40000, (1, q))
                positions = torch.arange(args.context, args.context + q)[None]
                start = time.perf_counter()
                runners[name](
                    input_ids=tokens,
                    **with_cache(runners[name], cache),
                    position_ids=positions,
                    cache_position=positions[0],
                    use_cache=True,
                )
                times[q, name].append(time.perf_counter() - start)
                engine._set_length(cache, args.context)  # forget the rows just written
    for q in (1, 8, 16):
        unfused, fused = (statistics.median(times[q, name][2:]) * 1000 for name in ("unfused", "fused"))
        print(f"q={q}: unfused {unfused:.1f} ms, fused {fused:.1f} ms, ratio {unfused / fused:.3f}")


if __name__ == "__main__":
    main()
