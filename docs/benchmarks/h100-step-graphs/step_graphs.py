"""A decoding step on a GPU with its small functions run eagerly, then as CUDA graphs (medusa.runtime.StepGraph,
issue #37). SmolLM2-135M's shape with random weights (what a step costs does not depend on them, and no weights need
travel) and the shipped heads, the compiled engine (StaticCache, torch.compile with CUDA graphs for the verify).

    python docs/benchmarks/h100-step-graphs/step_graphs.py --out DIR [--dtypes bfloat16,float32] [--runs plain,medusa2]
        [--new-tokens 128] [--budget-s 300]

Per dtype, proposer and setting: tokens/s and ms per step unsynchronised, ms per phase synchronised
(generate(profile=True)), and kernel launches and CUDA graph launches per step (torch.profiler). Greedy outputs with
and without the step graphs must be identical (the target verifies every guess either way). Random weights make tau
about 1: the figures are a step's cost, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa import MedusaModel
from medusa.runtime import engine_for
from medusa.runtime import graphs as step_graphs
from scripts.training_memory import SHAPES

SMOLLM2_135M = SHAPES["SmolLM2-135M"]  # the published config's sizes
RUNS = {
    "plain": dict(proposer="plain"),
    "medusa2": dict(proposer="medusa"),  # the heads' own tree: [[0], [0, 0]]
    "medusa6": dict(proposer="medusa", tree=[[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": dict(proposer="dynamic"),
}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def launches_per_step(model, prompt, new_tokens: int, options: dict) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = model.generate(
            prompt, max_new_tokens=new_tokens, engine="compiled", return_dict_in_generate=True, **options
        )
    counts = {event.key: event.count for event in prof.key_averages()}
    steps = out.stats.steps
    return {
        "kernels": round(sum(counts.get(name, 0) for name in LAUNCHES) / steps, 1),
        "graphs": round(counts.get("cudaGraphLaunch", 0) / steps, 2),
        "memcpy": round(counts.get("cudaMemcpyAsync", 0) / steps, 1),
    }


def measure(model, prompts, new_tokens: int, name: str, options: dict) -> dict:
    model.generate(prompts[0], max_new_tokens=16, engine="compiled", **options)  # captures its graphs
    sync()
    start, steps, tokens, sequences = time.perf_counter(), 0, 0, []
    for prompt in prompts:
        out = model.generate(
            prompt, max_new_tokens=new_tokens, engine="compiled", return_dict_in_generate=True, **options
        )
        steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens
        sequences.append(out.sequences[0].tolist())
    sync()
    seconds = time.perf_counter() - start
    stats = model.generate(
        prompts[0], max_new_tokens=new_tokens, engine="compiled", profile=True, return_dict_in_generate=True, **options
    ).stats
    return {
        "run": name,
        "tok_s": round(tokens / seconds, 1),
        "ms_step": round(seconds / steps * 1000, 3),
        "tau": round(tokens / steps, 3),
        "synced_ms": {k: round(v / stats.steps * 1000, 3) for k, v in stats.timings.items()},
        "sequences": sequences,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"from {', '.join(RUNS)}")
    parser.add_argument("--budget-s", type=float, default=300, help="start no further dtype after this many seconds")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU only to try the script
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}", flush=True)
    for dtype_name in args.dtypes.split(","):
        if time.perf_counter() - began > args.budget_s:
            print(f"skipping {dtype_name}: past the budget", flush=True)
            continue
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        config = LlamaConfig(**SMOLLM2_135M)
        config._attn_implementation = "sdpa"
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        model = MedusaModel.from_pretrained(base=base, dtype=dtype, device=device, plan="off")
        prompts = [torch.randint(100, 20000, (1, n), device=device) for n in (90, 110)]
        start = time.perf_counter()
        engine_for(base, "compiled").warm_up(max_length=512)
        print(f"{dtype_name}: verify graphs compiled in {time.perf_counter() - start:.0f} s", flush=True)
        rows = []
        for name in args.runs.split(","):  # each proposer without, then with, the step graphs, side by side
            for graphs in (False, True):
                step_graphs.STEP_GRAPHS = graphs
                row = {
                    "dtype": dtype_name,
                    "step_graphs": graphs,
                    **measure(model, prompts, args.new_tokens, name, RUNS[name]),
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "sequences"}), flush=True)
        # launches last, so that no profiler session comes before a timing (in the first record's order, all but
        # the first row ran after one)
        for row in rows:
            step_graphs.STEP_GRAPHS = row["step_graphs"]
            row.update(launches_per_step(model, prompts[1], args.new_tokens // 2, RUNS[row["run"]]))
            print(json.dumps({k: row[k] for k in ("run", "step_graphs", "kernels", "graphs", "memcpy")}), flush=True)
        eager = {r["run"]: r["sequences"] for r in rows if not r["step_graphs"]}
        same = {r["run"]: r["sequences"] == eager[r["run"]] for r in rows if r["step_graphs"]}
        print(f"{dtype_name}: outputs identical with and without step graphs: {same}; failed: {step_graphs._FAILED}")
        # is the same call's output the same on this GPU (the first record's plain rows differed without a cause)?
        step_graphs.STEP_GRAPHS = False
        first = rows[0]
        again = [
            model.generate(p, max_new_tokens=args.new_tokens, engine="compiled", **RUNS[first["run"]])[0].tolist()
            for p in prompts
        ]
        same[f"{first['run']} repeated"] = again == first["sequences"]
        print(f"{dtype_name}: {first['run']} without step graphs, repeated: identical {again == first['sequences']}")
        with open(out / f"step_graphs_{dtype_name}.json", "w") as f:
            json.dump(
                {
                    "device": gpu,
                    "torch": torch.__version__,
                    "identical": same,
                    "failed": sorted(step_graphs._FAILED),
                    "rows": rows,
                },
                f,
            )
        del model, base
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
