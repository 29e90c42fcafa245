"""What one fbgemm int8 GEMM costs by the way it is called: SmolLM2-135M's 211 linear layers (random int8 weights of
its shapes, the vocabulary projection included) one after another from Python, median ms of a pass over 1 and 4 rows
(plus fbgemm's pinning row):

- custom_op: a torch.library.custom_op around quantized::linear_dynamic (session 39's int8_sums)
- dynamic: quantized::linear_dynamic called directly
- library: medusa::fbgemm_sums (a Library op, one CPU kernel: torch.fbgemm_linear_int8_weight_fp32_activation)
- direct: torch.fbgemm_linear_int8_weight_fp32_activation called directly

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-w8a8-avx2-libop-session41/calls.py
"""

import statistics
import time
import warnings

import torch

from medusa.runtime.prepack import fbgemm_weight

warnings.simplefilter("ignore")
torch.manual_seed(0)
torch.set_num_threads(2)
HIDDEN, MLP, VOCAB, LAYERS = 576, 1536, 49152, 30
shapes = [(HIDDEN, HIDDEN), (192, HIDDEN), (192, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
shapes = shapes * LAYERS + [(VOCAB, HIDDEN)]
weights = [torch.randint(-63, 64, (out, width), dtype=torch.int8) for out, width in shapes]
dynamic = [
    torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(
            w.float(), torch.ones(len(w), dtype=torch.double), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8
        ),
        None,
    )
    for w in weights
]


@torch.library.custom_op("calls::linear_dynamic", mutates_args=())
def custom(pinned: torch.Tensor, index: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(pinned, dynamic[index], False)


def one_pass(method, x):
    for k, (_, width) in enumerate(shapes):
        if method == "custom_op":
            custom(x[width], k)
        elif method == "dynamic":
            torch.ops.quantized.linear_dynamic(x[width], dynamic[k], False)
        elif method == "library":
            torch.ops.medusa.fbgemm_sums(x[width], weights[k])
        else:
            packed, row_sums, zero = fbgemm_weight(weights[k])
            torch.fbgemm_linear_int8_weight_fp32_activation(x[width], weights[k], packed, row_sums, 1.0, 0, zero)


for rows in (1, 4):
    x = {}
    for width in (HIDDEN, MLP):
        pin = torch.zeros(1, width)
        pin[0, :2] = torch.tensor([-128.0, 127.0])
        x[width] = torch.cat([torch.randint(-127, 128, (rows, width)).float(), pin])
    for method in ("custom_op", "dynamic", "library", "direct") * 2:
        one_pass(method, x)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            one_pass(method, x)
            times.append(time.perf_counter() - start)
        print(f"rows {rows} {method:9s} {statistics.median(times) * 1e3:6.2f} ms", flush=True)
