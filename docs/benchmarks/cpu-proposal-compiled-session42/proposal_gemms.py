"""The proposal's GEMMs one at a time, us (median of 5 rounds): aten's weight-only int8 kernel on bf16 activations (what
proposed before session 42) against fbgemm's int8 GEMM rounding its whole input to uint8 (medusa.runtime.Int8Weight),
at the heads' shapes, 1 and 5 rows.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-proposal-compiled-session42/proposal_gemms.py
"""

import time

import torch

from medusa.runtime import Int8Weight, quantize_int8

torch.set_num_threads(2)


def median_us(fn, n=200):
    for _ in range(10):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return sorted(rounds)[2]


# the candidate projection, a head's maps, the context layer's qkv, MLP in and out
for out_features, in_features in [(8192, 576), (576, 576), (1728, 576), (2304, 576), (576, 2304)]:
    weight = torch.randn(out_features, in_features) * 0.02
    quantized, scales = quantize_int8(weight)
    fbgemm = Int8Weight.of(weight)
    for rows in (1, 5):
        x = torch.randn(rows, in_features)
        aten = median_us(
            lambda x=x, q=quantized, s=scales: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, s)
        )
        ours = median_us(lambda x=x, w=fbgemm: w.linear(x))
        print(f"{out_features} x {in_features}, {rows} rows: aten int8 {aten:7.1f} us, fbgemm {ours:7.1f} us")
