"""What a prompt and a verify step cost on one engine at one precision: the target alone, no heads.

    python scripts/step_cost.py [--dtype float32|bfloat16|int8|int4] [--engine inductor] [--prompt 64 769]
        [--context 200] [--rows 512 1024 2048] [--queries 1 2 4 8] [--repeats 30] [--base PATH]

Prints the median milliseconds of a prefill over each prompt length, then of a verify forward over each number of
query tokens (a chain) after `--context` cached tokens, in caches of each size (the inductor engine compiles one
package per size, once per machine). Compare two versions of the library by running this from a worktree of each,
one after the other, on an otherwise idle machine. `--base`: another target (a Hub id, directory or GGUF file, as
`MedusaModel.from_base` takes it) instead of the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from medusa import MedusaModel
from medusa.runtime import ENGINES
from medusa.tree import Candidates, TreeSpec, build_buffers, chain


def median_ms(run, repeats: int) -> float:
    run()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    # the static-cache engines: a verify is timed again and again at one length, over rows it overwrites in place
    # (the eager engine's DynamicCache would grow by each verify's rows)
    parser.add_argument("--engine", default="inductor", choices=[name for name in ENGINES if name != "eager"])
    parser.add_argument("--prompt", type=int, nargs="+", default=[64, 769])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--base", default=None, help="another target (default: the embedded SmolLM2)")
    args = parser.parse_args()
    if args.base:
        model = MedusaModel.from_base(args.base, dtype=args.dtype, plan="off")
    else:
        model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    engine = model.engine(args.engine)
    tokens = lambda n: torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(n))  # noqa: E731
    label = f"{args.base + ' ' if args.base else ''}{args.dtype} {args.engine}"
    with torch.inference_mode():
        for length in args.prompt:
            cache = engine.new_cache(length + 128, progress=False)
            prompt = tokens(length)
            prefill = functools.partial(engine.prefill, cache, prompt, model.feature_layers)
            ms = median_ms(prefill, max(3, args.repeats // 10))
            print(f"{label}: prefill over {length} tokens {ms:.1f} ms ({length / ms * 1000:.0f} tokens/s)")
        for rows in args.rows:
            cache = engine.new_cache(rows - 64, progress=False)  # rounded up to `rows`
            engine.prefill(cache, tokens(args.context), model.feature_layers)
            steps = []
            for query in args.queries:
                tree = build_buffers(TreeSpec(chain(query - 1)), max(query - 1, 1))  # query = 1: the root alone
                candidates = Candidates(tokens=tokens(query)[0], tree=tree)
                step = functools.partial(engine.verify, cache, candidates, args.context, model.feature_layers)
                ms = median_ms(step, args.repeats)
                steps.append(f"{query}: {ms:.2f}")
            print(
                f"{label}: verify after {args.context} tokens, {cache.layers[0].max_cache_len}-row cache, ms at "
                f"query tokens {', '.join(steps)}"
            )


if __name__ == "__main__":
    main()
