"""What a speculative step costs beside its verify on a GPU, for a Llama-3-8B-shaped target (random weights, bf16):
issue #37's step-cost model. For each engine and tree size: ms of the heads' proposal, the verify forward and the
greedy acceptance and the KV commit of a two-node path, medians over interleaved repeats, after a prefill that
leaves room for the largest tree in a 512-row cache (432 tokens for 64 nodes; README.md's H200 record: 512 tokens,
1,024 rows). tau aside: random heads. The proposal and the acceptance run as CUDA graphs unless
MEDUSA_STEP_GRAPHS=0; the compiled engine's verify is captured by hand with --verify-graphs
(medusa.runtime.static.VERIFY_GRAPHS).

    python docs/benchmarks/gpu-step-cost/step_cost.py [--engines eager,compiled] [--sizes 1,4,16,64] [--out DIR]
        [--verify-graphs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import medusa.runtime.static
from medusa import MedusaConfig, MedusaHeads, MedusaModel
from medusa.acceptance import greedy
from medusa.decode import prefill
from medusa.sampling import SamplingConfig
from medusa.tree_builder import grow_tree

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
PHASES = ("propose_ms", "verify_ms", "accept_ms", "commit_ms")
ACCURACY = [[0.7, 0.1, 0.05, 0.03], [0.5, 0.1, 0.05, 0.03], [0.4, 0.1, 0.05, 0.03], [0.3, 0.1, 0.05, 0.03]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="eager,compiled")
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=".")
    parser.add_argument("--verify-graphs", action="store_true", help="the compiled engine's verify captured by hand")
    args = parser.parse_args()
    medusa.runtime.static.VERIFY_GRAPHS = args.verify_graphs
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda"):
        config = LlamaConfig(**LLAMA3_8B)
        config._attn_implementation = "sdpa"
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        heads = MedusaHeads(MedusaConfig(hidden_size=4096, vocab_size=128256, num_heads=4, num_layers=1))
    model = MedusaModel(base, heads.to(device="cuda", dtype=torch.bfloat16))
    print(f"built in {time.perf_counter() - start:.1f} s on {torch.cuda.get_device_name()}", flush=True)
    sampling = SamplingConfig()
    sizes = [int(n) for n in args.sizes.split(",")]
    # the prompt, the largest tree and a margin inside the compiled engine's first cache (512 rows): one to compile
    prompt = torch.randint(0, 128256, (1, 512 - max(sizes) - 16), device="cuda")
    order = grow_tree(ACCURACY, max(sizes))
    results = {}
    for name in args.engines.split(","):
        start = time.perf_counter()
        engine = model.engine(name)
        state = prefill(base, prompt, sampling, engine=engine, max_length=prompt.shape[1] + max(sizes) + 8)
        proposers = {
            n: model.make_proposer(
                "plain" if n == 1 else "medusa", [list(p) for p in order[: n - 1]] or None, sampling, None
            )
            for n in sizes
        }
        for n in sizes:  # warm up (and compile, for the compiled engine) every size
            time_step(model, engine, proposers[n], state, sampling)
            time_step(model, engine, proposers[n], state, sampling)
        print(f"{name}: built and warmed up in {time.perf_counter() - start:.1f} s", flush=True)
        samples = {n: [] for n in sizes}
        for _ in range(args.repeats):
            for n in sizes:
                samples[n].append(time_step(model, engine, proposers[n], state, sampling))
        results[name] = {
            n: dict(zip(PHASES, (statistics.median(s[i] for s in rows) for i in range(len(PHASES)))))
            for n, rows in samples.items()
        }
        for n, r in results[name].items():
            share = (r["propose_ms"] + r["accept_ms"] + r["commit_ms"]) / r["verify_ms"]
            print(
                f"{name:>8} {n:>3} nodes: propose {r['propose_ms']:6.2f} ms, verify {r['verify_ms']:6.2f}, "
                f"accept {r['accept_ms']:5.2f}, commit {r['commit_ms']:5.2f}; propose + accept + commit = "
                f"{share:.0%} of the verify",
                flush=True,
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "verify_graphs": args.verify_graphs}
    name = "step_cost_verify_graphs.json" if args.verify_graphs else "step_cost.json"
    (Path(args.out) / name).write_text(json.dumps({**record, **results}, indent=1))


def time_step(model, engine, proposer, state, sampling) -> tuple[float, ...]:
    """ms of one step's propose, verify, greedy accept and commit, each synchronised; the cache is set back after
    it, so every step sees the same KV length. The commit keeps the root and the last node (a random target accepts
    nothing): rows moved as an accepted path that is not a prefix of the tree moves them."""
    marks = []

    def mark():
        torch.cuda.synchronize()
        marks.append(time.perf_counter())

    mark()
    candidates = proposer.propose(state)
    mark()
    verified = engine.verify(state.cache, candidates, state.length, model.config.feature_layers)
    mark()
    greedy(candidates, verified, sampling)
    mark()
    n = candidates.tokens.numel()
    engine.commit(state.cache, state.length, torch.tensor([0, n - 1] if n > 1 else [0], device=model.device))
    mark()
    engine.truncate(state.cache, state.length)
    return tuple(1000 * (b - a) for a, b in zip(marks, marks[1:]))


if __name__ == "__main__":
    main()
