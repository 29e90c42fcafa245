"""Batched plain decoding against llama.cpp's, on this CPU, same weights and precision, alternated in one run.

    python docs/benchmarks/cpu-zen4-batch-peers-session70/peers.py DTYPE [ROUNDS]    (DTYPE: float32, bfloat16, w8a8)

B sequences of 256 cached tokens each decode 64 more, greedy: tokens/s of the decoding alone (prefill left out), for
B in ROWS. Ours: `medusa.batch.time_batch_step` with the plain proposer (the whole step: verify, acceptance, commit)
on every engine a batch layout weighs (`plan._batch_engines`), the median step over the 64; the fastest engine is the
one the layout takes. llama.cpp: `llama-batched-bench -npp 256 -ntg 64 -npl B` (its S_TG column: B x 64 tokens over
the time of the 64 steps) on the GGUF of the same weights (`llama_cpp.gguf_for`). Needs llama-batched-bench beside
the other peer binaries (build_batched_bench.sh here: one more ninja target of ../shared/peers/build_llama_cpp.sh's
build).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from medusa import MedusaModel, llama_cpp
from medusa.batch import time_batch_step
from medusa.loading import base_gguf
from medusa.plan import _batch_engines
from medusa.runtime import engine_for
from medusa.sampling import SamplingConfig

ROWS = (1, 2, 4, 8, 16)
CONTEXT, NEW = 256, 64


def ours(model, rows: int) -> dict[str, float]:
    """{engine: tokens/s} of plain batched decoding at `rows` rows."""
    sampling, result = SamplingConfig(), {}
    for name in _batch_engines(model):
        engine = engine_for(model.base, name)
        make = lambda: model.make_proposer("plain", None, sampling, None)  # noqa: E731
        ms = time_batch_step(engine, make, rows, CONTEXT, NEW, model.feature_layers)
        result[name] = round(1000 * rows / ms, 2)
    return result


def llama(gguf, threads: int) -> dict[int, float]:
    """{rows: tokens/s} of llama.cpp's batched decoding (S_TG)."""
    binary = llama_cpp.binaries_dir() / "llama-batched-bench"
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(max(ROWS) * (CONTEXT + NEW) + 64)]
    command += ["-b", "2048", "-ub", "512", "-npp", str(CONTEXT), "-ntg", str(NEW), "-npl", ",".join(map(str, ROWS))]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            result[int(cells[2])] = float(cells[7])  # B, S_TG t/s
    return result


def main() -> None:
    dtype, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    threads = torch.get_num_threads()
    model = MedusaModel.from_pretrained(dtype=dtype)
    gguf = llama_cpp.gguf_for(base_gguf(model.config.base_model_name_or_path), dtype)
    table = []
    for round_ in range(rounds):
        for rows in ROWS:  # warm every engine's packages for this size before the rounds count
            mine = ours(model, rows)
            table.append(dict(round=round_, rows=rows, ours=mine))
        peer = llama(gguf, threads)
        for row in table[-len(ROWS) :]:
            row["llama_cpp"] = peer[row["rows"]]
            best = max(row["ours"], key=row["ours"].get)
            row["fastest"], row["vs_llama_cpp"] = best, round(row["ours"][best] / row["llama_cpp"], 3)
            print(json.dumps(row), flush=True)
    print(json.dumps(dict(dtype=dtype, gguf=gguf.name, threads=threads, torch=torch.__version__)))


if __name__ == "__main__":
    main()
