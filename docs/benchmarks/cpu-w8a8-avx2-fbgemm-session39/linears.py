"""SmolLM2-135M's 211 linear layers (random weights of its shapes, the vocabulary projection included) at 1..16 rows,
ms a pass (median of 7), one kernel after another: fp32, torch._int_mm (oneDNN, int8 x int8), oneDNN's qlinear
(pre-packed), fbgemm's dynamically quantised linear. The activations are already int8 where a kernel takes them.
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-w8a8-avx2-fbgemm-session39/linears.py fp32,intmm,qlinear,fbgemm 1,4,8,16
"""

import statistics
import sys
import time

import torch

torch.manual_seed(0)
torch.set_num_threads(2)
HIDDEN, MLP, VOCAB, LAYERS = 576, 1536, 49152, 30
shapes = [(HIDDEN, HIDDEN), (192, HIDDEN), (192, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
shapes = shapes * LAYERS + [(VOCAB, HIDDEN)]
weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
scales = [w.abs().amax(1) / 127 for w in weights]
levels = [(w / s[:, None]).round().to(torch.int8).contiguous() for w, s in zip(weights, scales)]
zeros = [torch.zeros(o, dtype=torch.long) for o, _ in shapes]
methods, rows = sys.argv[1].split(","), [int(r) for r in sys.argv[2].split(",")]
qlinear = [torch.ops.onednn.qlinear_prepack(q, None) for q in levels] if "qlinear" in methods else []
fbgemm = []
if "fbgemm" in methods:
    for w, s, z in zip(weights, scales, zeros):
        fbgemm.append(
            torch.ops.quantized.linear_prepack(torch.quantize_per_channel(w, s.double(), z, 0, torch.qint8), None)
        )


def one_pass(method, x):
    for k, (_, width) in enumerate(shapes):
        if method == "fp32":
            torch.nn.functional.linear(x["f32"][width], weights[k])
        elif method == "intmm":
            torch._int_mm(x["s8"][width], levels[k].t())
        elif method == "qlinear":
            torch.ops.onednn.qlinear_pointwise(
                x["u8"][width],
                1.0,
                128,
                qlinear[k],
                scales[k],
                zeros[k],
                None,
                1.0,
                0,
                torch.float32,
                "none",
                [None],
                "",
            )
        elif method == "fbgemm":
            torch.ops.quantized.linear_dynamic(x["f32"][width], fbgemm[k], False)


for m in rows:
    x = {
        "f32": {w: torch.randn(m, w) for w in (HIDDEN, MLP)},
        "s8": {w: torch.randint(-127, 128, (m, w), dtype=torch.int8) for w in (HIDDEN, MLP)},
        "u8": {w: torch.randint(0, 256, (m, w), dtype=torch.uint8) for w in (HIDDEN, MLP)},
    }
    for method in methods:
        one_pass(method, x)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            one_pass(method, x)
            times.append(time.perf_counter() - start)
        print(f"rows {m:3d} {method:8s} {statistics.median(times) * 1e3:7.2f} ms", flush=True)
