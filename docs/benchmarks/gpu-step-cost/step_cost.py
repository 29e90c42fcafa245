"""What a speculative step costs beside its verify on a GPU, for a Llama-3-8B-shaped target (random weights, bf16):
issue #37's step-cost model. For each engine and tree size: ms of the heads' proposal, the verify forward and the
greedy acceptance, medians over interleaved repeats, after a 512-token prefill. tau aside: random heads.

    python docs/benchmarks/gpu-step-cost/step_cost.py [--engines eager,compiled] [--sizes 1,4,16,64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa import MedusaConfig, MedusaHeads, MedusaModel
from medusa.decode import prefill
from medusa.sampling import SamplingConfig
from medusa.tree_builder import grow_tree, time_step

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
ACCURACY = [[0.7, 0.1, 0.05, 0.03], [0.5, 0.1, 0.05, 0.03], [0.4, 0.1, 0.05, 0.03], [0.3, 0.1, 0.05, 0.03]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="eager,compiled")
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
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
    prompt = torch.randint(0, 128256, (1, 512), device="cuda")
    sizes = [int(n) for n in args.sizes.split(",")]
    order = grow_tree(ACCURACY, max(sizes))
    results = {}
    for name in args.engines.split(","):
        start = time.perf_counter()
        engine = model.engine(name)
        state = prefill(base, prompt, sampling, engine=engine, max_length=512 + max(sizes) + 8)
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
            n: dict(
                zip(("propose_ms", "verify_ms", "accept_ms"), (statistics.median(s[i] for s in rows) for i in range(3)))
            )
            for n, rows in samples.items()
        }
        for n, r in results[name].items():
            share = (r["propose_ms"] + r["accept_ms"]) / r["verify_ms"]
            print(
                f"{name:>8} {n:>3} nodes: propose {r['propose_ms']:6.2f} ms, verify {r['verify_ms']:6.2f}, "
                f"accept {r['accept_ms']:5.2f}; propose + accept = {share:.0%} of the verify",
                flush=True,
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_cost.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), **results}, indent=1)
    )


if __name__ == "__main__":
    main()
