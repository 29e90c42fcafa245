"""Where a batch's time goes, prefill against decoding, beside llama-batched-bench's PP / TG split: B rows of 128
random prompt tokens (llama-batched-bench's workload: no shared prefix, no stop), 64 new tokens each; `generate` of 1
new token (the prefill and its first token) and of 64, median of 3 after a warm-up, plain and planned:
    python docs/benchmarks/cpu-batch-phases-session52/phases.py DTYPE ROWS   (e.g. float32 8,16; the repository root)"""

import sys
import time

import torch

from medusa import MedusaModel

torch.set_num_threads(2)
dtype, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
PROMPT, NEW = 128, 64
model = MedusaModel.from_pretrained(dtype=dtype, plan="auto")
vocab = model.base.config.vocab_size
for rows in sizes:
    ids = torch.randint(0, vocab, (rows, PROMPT), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones_like(ids)
    for proposer in ("plain", None):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, proposer=proposer, eos_token_id=[])
        seconds = {}
        for new in (1, NEW):
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=new, proposer=proposer, eos_token_id=[])
                runs.append(time.perf_counter() - start)
            seconds[new] = sorted(runs)[1]
        prefill, whole = seconds[1], seconds[NEW]
        decode = whole - prefill
        print(
            f"{dtype} rows {rows} {proposer or 'planned'}: prefill {prefill * 1000:.0f} ms "
            f"({rows * PROMPT / prefill:.0f} tok/s), decode {decode * 1000:.0f} ms ({rows * (NEW - 1) / decode:.1f} "
            f"tok/s), total {rows * NEW / whole:.1f} tok/s",
            flush=True,
        )
