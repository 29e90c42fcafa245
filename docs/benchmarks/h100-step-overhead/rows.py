"""A compiled step's cost against the static cache's size on a GPU (record of 2026-11-25, H100, fp32).

    python rows.py MODEL_DIR

Same random-weight SmolLM2 shape as step_overhead.py. Times plain and medusa decoding of one 100-token prompt on a
512-row cache, then again once the engine has a 2,048-row one. Written before the compiled engine kept a cache per
size on CUDA: it then ran every call on its one, largest cache (now each call takes the smallest that fits, so this
script measures 512 rows twice).
"""

import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from medusa import MedusaModel
from medusa.runtime import engine_for

MODEL_DIR = sys.argv[1]
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL_DIR), dtype=torch.float32).cuda().eval()
base.config.name_or_path = MODEL_DIR
model = MedusaModel.from_pretrained(base=base, device="cuda", plan="off")
prompt = torch.randint(100, 20000, (1, 100), device="cuda")
engine = engine_for(base, "compiled")
for rows in (512, 2048):
    engine.warm_up(max_length=rows)
    for proposer in ("plain", "medusa"):
        model.generate(prompt, max_new_tokens=16, engine="compiled", proposer=proposer)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=128, engine="compiled", proposer=proposer)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        stats = model.generate(prompt, max_new_tokens=128, engine="compiled", proposer=proposer, profile=True).stats
        phases = {k: round(v / stats.steps * 1000, 2) for k, v in stats.timings.items()}
        print(
            f"rows {engine._cache.layers[0].max_cache_len} {proposer}: {seconds / out.stats.steps * 1000:.2f} ms/step, "
            f"synced {phases}",
            flush=True,
        )
