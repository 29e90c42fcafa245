"""Batched decoding beside llama.cpp's at the same weights and precision, one workload for both:
`python peer_batched.py LLAMA_CPP_BIN GGUF_DIR` (GGUF_DIR holds smollm2-F32.gguf and smollm2-BF16.gguf, made from the
shipped Q4_1 file by `llama-quantize --allow-requantize`). B rows of 128 random prompt tokens each (as
llama-batched-bench's prompts: no shared prefix), 64 new tokens per row, no end-of-sequence stop; new tokens per
second over the whole call (prefill included), B = 1, 2, 4, 8, 16, 2 threads. Ours: `generate` laid out by the plan,
plain decoding (`proposer="plain"`) and planned; llama.cpp: `llama-batched-bench -npp 128 -ntg 64 -npl B`
(its T s column: prompt and generation)."""

import re
import subprocess
import sys
import time

import torch

from medusa import MedusaModel

torch.set_num_threads(2)
SIZES, PROMPT, NEW = (1, 2, 4, 8, 16), 128, 64
binaries, ggufs = sys.argv[1], sys.argv[2]


def llama_cpp(kind: str) -> dict[int, float]:
    command = [f"{binaries}/llama-batched-bench", "-m", f"{ggufs}/smollm2-{kind}.gguf", "-t", "2", "-c", "4096"]
    command += ["-b", "2048", "-ub", "512", "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", ",".join(map(str, SIZES))]
    table = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rates = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
            rates[int(cells[2])] = int(cells[2]) * NEW / float(cells[8])
    return rates


for dtype, kind in (("bfloat16", "BF16"), ("float32", "F32")):
    model = MedusaModel.from_pretrained(dtype=dtype, plan="auto")
    vocab = model.base.config.vocab_size
    ours = {}
    for proposer in ("plain", None):
        for rows in SIZES:
            ids = torch.randint(0, vocab, (rows, PROMPT), generator=torch.Generator().manual_seed(rows))
            mask = torch.ones_like(ids)
            model.generate(ids, attention_mask=mask, max_new_tokens=4, proposer=proposer, eos_token_id=[])  # warm
            times = []
            for _ in range(2):
                start = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=NEW, proposer=proposer, eos_token_id=[])
                times.append(time.perf_counter() - start)
            ours[(proposer or "planned", rows)] = rows * NEW / min(times)
    theirs = llama_cpp(kind)
    for rows in SIZES:
        print(
            f"{dtype} batch {rows}: llama.cpp {kind} {theirs[rows]:.1f}, our plain {ours[('plain', rows)]:.1f}, "
            f"planned {ours[('planned', rows)]:.1f} tokens/s",
            flush=True,
        )
