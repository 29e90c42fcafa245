"""The compiled engine's verify on a GPU through torch.compile's CUDA graphs ("reduce-overhead": dynamo's guard and a
graph tree's launch every call), against the same inductor kernels captured by hand (medusa.runtime.static
VERIFY_GRAPHS: one CUDA graph per cache and node count, the mask and positions built inside it from the past's
length as a tensor). Issue #37. SmolLM2-135M's shape with random weights and the shipped heads (a step's cost does
not depend on the weights; tau does), the step graphs on in both.

    python docs/benchmarks/h100-verify-graphs/verify_graphs.py --out DIR [--dtypes bfloat16,float32]
        [--runs plain,medusa2,medusa6] [--new-tokens 96] [--rounds 2] [--hand-captured-only]

Per dtype: both engines built side by side (two copies of one random model), each run alternated between them for
`--rounds` rounds (tokens/s and ms per step unsynchronised, ms per phase synchronised), then launches per step
(torch.profiler), whether the two give the same tokens, the verify alone (one-token and 7-node calls, synchronised,
median of 100), and the kernels of one uncompiled-graph one-token forward by GPU time (`kernels_<dtype>.txt`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

import medusa.runtime.static
from medusa import MedusaModel
from medusa.decode import prefill
from medusa.runtime import CompiledEngine, engine_for
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from scripts.training_memory import SHAPES

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("step_graphs", HERE.parent / "h100-step-graphs" / "step_graphs.py")
step_graphs_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_graphs_script)
RUNS = step_graphs_script.RUNS
SETTINGS = {False: "torch.compile graphs", True: "hand-captured"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU only to try the script (no graphs there)
sync = step_graphs_script.sync


def build(dtype: torch.dtype, verify_graphs: bool, lazy: bool = False) -> MedusaModel:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES["SmolLM2-135M"])
    config._attn_implementation = "sdpa"
    base = AutoModelForCausalLM.from_config(config, dtype=dtype).to(DEVICE).eval()
    model = MedusaModel.from_pretrained(base=base, dtype=dtype, device=DEVICE, plan="off")
    medusa.runtime.static.VERIFY_GRAPHS = verify_graphs  # read when the engine is built
    start = time.perf_counter()
    if lazy:  # each graph compiled when a call first needs it (a plain run: the one-token graph alone)
        CompiledEngine._compile_graphs = lambda engine, cache, progress: 0.0
    engine = engine_for(base, "compiled")  # builds and warms up
    assert engine.verify_graphs == (verify_graphs and DEVICE == "cuda")
    print(f"{SETTINGS[verify_graphs]}: compiled and captured in {time.perf_counter() - start:.0f} s", flush=True)
    return model


def verify_alone(model, n: int, repeats: int = 100) -> float:
    """Median ms of one synchronised verify of n nodes (a chain) after a 200-token prefill."""
    engine = engine_for(model.base, "compiled")
    prompt = torch.randint(100, 20000, (1, 200), device=DEVICE)
    state = prefill(model.base, prompt, SamplingConfig(), engine=engine, max_length=300)
    tree = build_buffers(TreeSpec(chain(n - 1)), max(n - 1, 1)).to(DEVICE)
    candidates = Candidates(tokens=torch.randint(100, 20000, (n,), device=DEVICE), tree=tree)
    times = []
    for _ in range(repeats + 5):
        sync()
        start = time.perf_counter()
        engine.verify(state.cache, candidates, state.length)
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times[5:]), 3)


def kernel_table(model, out: Path, dtype_name: str) -> None:
    """The hand-captured engine's one-token forward run outside its graph (inductor's kernels launched one by one),
    profiled: which kernels the GPU spends a step's time in."""
    engine = engine_for(model.base, "compiled")
    prompt = torch.randint(100, 20000, (1, 200), device=DEVICE)
    state = prefill(model.base, prompt, SamplingConfig(), engine=engine, max_length=300)
    tree = build_buffers(TreeSpec([]), 1).to(DEVICE)
    args = (state.root_token.reshape(1), tree.depth, tree.attention_bias(model.base.dtype, DEVICE))
    past = torch.tensor(state.length, device=DEVICE)
    with torch.inference_mode():
        for _ in range(3):
            engine.forward_from(state.cache, (), *args, past)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                engine.forward_from(state.cache, (), *args, past)
            sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / f"kernels_{dtype_name}.txt").write_text(table)
    print(table[:4000], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--runs", default="plain,medusa2,medusa6")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nodes", default="1,7", help="node counts of the verify timed alone")
    parser.add_argument("--lazy", action="store_true", help="compile each graph when first used, not ahead")
    parser.add_argument(
        "--hand-captured-only", action="store_true", help="build and time the hand-captured verify alone"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}", flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        settings = (True,) if args.hand_captured_only else (False, True)
        models = {setting: build(dtype, setting, args.lazy) for setting in settings}
        prompts = [torch.randint(100, 20000, (1, n), device=DEVICE) for n in (90, 110)]
        rows = []
        for round_ in range(args.rounds):
            for name in args.runs.split(","):
                for setting in settings if round_ % 2 == 0 else settings[::-1]:
                    row = step_graphs_script.measure(models[setting], prompts, args.new_tokens, name, RUNS[name])
                    row = {"dtype": dtype_name, "verify": SETTINGS[setting], "round": round_, **row}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "sequences"}), flush=True)
        alone = {
            SETTINGS[setting]: {n: verify_alone(models[setting], int(n)) for n in args.nodes.split(",")}
            for setting in settings
        }
        print(f"{dtype_name}: verify alone, ms: {alone}", flush=True)
        for row in rows[
            : len(settings) * len(args.runs.split(","))
        ]:  # profiler sessions last: launches of the first round
            setting = row["verify"] == SETTINGS[True]
            row.update(
                step_graphs_script.launches_per_step(
                    models[setting], prompts[1], args.new_tokens // 2, RUNS[row["run"]]
                )
            )
            print(json.dumps({k: row[k] for k in ("run", "verify", "kernels", "graphs", "memcpy")}), flush=True)
        same = {
            name: len({json.dumps(r["sequences"]) for r in rows if r["run"] == name}) == 1
            for name in args.runs.split(",")
        }
        print(f"{dtype_name}: the same tokens in every row of a run: {same}", flush=True)
        with open(out / f"verify_graphs_{dtype_name}.json", "w") as f:
            json.dump(
                {"device": gpu, "torch": torch.__version__, "identical": same, "verify_alone_ms": alone, "rows": rows},
                f,
            )
        if DEVICE == "cuda":  # the forward outside a graph reads a fixed-size cache: CUDA's
            kernel_table(models[True], out, dtype_name)
        del models
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
