"""What this machine streams: a sum over 64 MB to 2 GB (2 threads), and aten's F.linear over SmolLM2's 211 fp32
weight matrices (540 MB) at 1-16 rows.

    python docs/benchmarks/cpu-fp32-prefetch-session44/bandwidth.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
for mb in (64, 256, 540, 2048):
    x = torch.randn(mb * 2**20 // 4)
    for _ in range(3):
        x.sum()
    start = time.perf_counter()
    for _ in range(10):
        x.sum()
    seconds = (time.perf_counter() - start) / 10
    print(f"{mb} MB sum: {seconds * 1e3:.1f} ms {mb * 2**20 / seconds / 1e9:.1f} GB/s")
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(*s) for s in shapes]
for rows in (1, 2, 4, 8, 16):
    narrow, wide = torch.randn(rows, 576), torch.randn(rows, 1536)

    def model(narrow=narrow, wide=wide):
        for w in weights:
            F.linear(wide if w.shape[1] == 1536 else narrow, w)

    for _ in range(2):
        model()
    start = time.perf_counter()
    for _ in range(5):
        model()
    print(f"F.linear over every weight, {rows} rows: {(time.perf_counter() - start) / 5 * 1e3:.1f} ms")
