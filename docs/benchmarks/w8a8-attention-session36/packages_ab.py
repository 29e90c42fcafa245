"""w8a8 verify ms through two ahead-of-time packages of the embedded SmolLM2 in one process, alternated: the one
session 35's code compiled (attention.reduction_sdpa summing the weights in a column of ones appended to the values:
a copy of every head's values each call) and this code's (values read where they lie, the weights' sum a scan).
Both packages must be on disk: run session 35's code once (a worktree of 5ed1278) to compile its own.

    PYTHONPATH=. python docs/benchmarks/w8a8-attention-session36/packages_ab.py 64 512 900
"""

import hashlib
import json
import statistics
import sys
import time

import torch
import transformers

from medusa import MedusaModel
from medusa.hardware import describe
from medusa.runtime import aot
from medusa.runtime.inductor import InductorEngine
from medusa.tree import Candidates, buffers_from_parents

torch.set_num_threads(2)
current_path = aot.package_path


def session35_path(model, rows, options, weights, one_token=False):
    """package_path as session 35 keyed it (no attention_format)."""
    key = {
        "format": aot.AOT_FORMAT,
        "weights": weights,
        "dtype": str(model.dtype),
        "rows": rows,
        "inductor": options,
        "transformers": transformers.__version__,
        **describe(model.device),
        "attention": aot.ROW_INVARIANT_SDPA,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return aot.cache_root() / "aoti" / f"{rows}-{digest}.pt2"


model = MedusaModel.from_pretrained(dtype="w8a8", plan="off")
engines = {"session35": InductorEngine(model.base), "this": InductorEngine(model.base)}
paths = {"session35": session35_path, "this": current_path}
with torch.inference_mode():
    for context in [int(c) for c in sys.argv[1:]] or [64, 512, 900]:
        caches = {}
        for name, engine in engines.items():
            aot.package_path = paths[name]
            caches[name] = engine.new_cache(context + 40)
            prompt = torch.randint(0, 49152, (1, context), generator=torch.Generator().manual_seed(0))
            engine.prefill(caches[name], prompt)
        times = {}
        for repeat in range(21):
            for rows in (1, 4, 6):
                chain = buffers_from_parents([0] + list(range(rows - 1)))
                candidates = Candidates(tokens=torch.randint(0, 49152, (rows,)), tree=chain)
                for name, engine in engines.items():
                    start = time.perf_counter()
                    engine.verify(caches[name], candidates, context)
                    if repeat:  # the first round warms up
                        times.setdefault((name, rows), []).append((time.perf_counter() - start) * 1e3)
        medians = {key: statistics.median(value) for key, value in times.items()}
        print(
            f"context {context}: "
            + "; ".join(
                f"{rows} rows {medians[('session35', rows)]:.2f} -> {medians[('this', rows)]:.2f} ms"
                for rows in (1, 4, 6)
            ),
            flush=True,
        )
