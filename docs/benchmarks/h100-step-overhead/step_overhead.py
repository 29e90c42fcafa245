"""Where a decoding step's time goes on a GPU, per proposer (record of 2026-11-25, H100, fp32).

    python step_overhead.py MODEL_DIR [float32|bfloat16] [new_tokens]

MODEL_DIR holds SmolLM2-135M-Instruct's config.json and tokenizer (the folder `medusa` converts the GGUF into, under
$MEDUSA_CACHE/gguf/): the target gets that shape with random weights (a step's overhead does not depend on them, and
the weights need not travel), the shipped heads propose. Prints tokens/s and ms per step unsynchronised, then ms per
phase synchronised, then the host-side operators of a plain and a dynamic-tree call (torch.profiler).
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

from medusa import MedusaModel
from medusa.runtime import engine_for

MODEL_DIR = sys.argv[1]
DTYPE = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
NEW_TOKENS = int(sys.argv[3]) if len(sys.argv) > 3 else 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = {
    "plain": dict(proposer="plain"),
    "medusa2": dict(proposer="medusa"),
    "medusa6": dict(proposer="medusa", tree=[[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": dict(proposer="dynamic"),
    "hybrid": dict(proposer="hybrid"),
}


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL_DIR), dtype=DTYPE).to(DEVICE).eval()
base.config.name_or_path = MODEL_DIR  # where the tokenizer is
model = MedusaModel.from_pretrained(base=base, dtype=DTYPE, device=DEVICE, plan="off")
prompts = [torch.randint(100, 20000, (1, n), device=DEVICE) for n in (90, 110)]
engine_for(base, "compiled").warm_up(max_length=512)
for name, options in RUNS.items():
    model.generate(prompts[0], max_new_tokens=16, engine="compiled", **options)  # graphs for its sizes
    sync()
    start, steps, tokens = time.perf_counter(), 0, 0
    for prompt in prompts:
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, engine="compiled", **options)
        steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens
    sync()
    seconds = time.perf_counter() - start
    stats = model.generate(prompts[0], max_new_tokens=NEW_TOKENS, engine="compiled", profile=True, **options).stats
    phases = {k: round(v / stats.steps * 1000, 2) for k, v in stats.timings.items()}
    print(
        f"{name:8s} {tokens / seconds:7.1f} tok/s  {seconds / steps * 1000:6.2f} ms/step  tau {tokens / steps:.2f}  "
        f"synced ms/step {phases}",
        flush=True,
    )
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
for name in ("plain", "dynamic"):
    with profile(activities=activities) as prof:
        out = model.generate(prompts[1], max_new_tokens=NEW_TOKENS // 2, engine="compiled", **RUNS[name])
    print(f"--- {name}: {out.stats.steps} steps; host ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
