"""SmolLM2's 30 layers of linears (q/k/v, o, gate/up, down; no attention) compiled by inductor (frozen weights, C++
GEMM templates), caches flushed before each call: W8A8 written as the quantized pattern (inductor's AVX512-VNNI int8
GEMM template) against int8 weight-only (`_weight_int8pack_mm`, as shipped), ms at 1-16 rows. From the root:
    PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-w8a8-session32/linear_stack.py 30
"""

import statistics
import sys
import time

import torch
import torch._inductor.config as ic
import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed
import torch.nn as nn

from medusa.runtime.prepack import quantize_int8  # the library's int8 weights, one bf16 scale per row

torch.set_num_threads(2)

qd = torch.ops.quantized_decomposed
H, INTER, L = 576, 1536, int(sys.argv[1]) if len(sys.argv) > 1 else 30


class QLin(nn.Module):
    def __init__(self, o, i):
        super().__init__()
        wq, ws = quantize_int8(torch.randn(o, i) * 0.05)
        self.register_buffer("wq", wq)
        self.register_buffer("ws", ws.float())
        self.register_buffer("wz", torch.zeros(o, dtype=torch.int64))

    def forward(self, x):
        r = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-8) / 127
        xq = (x.float() / r).round().clamp(-127, 127).add(128).to(torch.uint8)
        xd = qd.dequantize_per_tensor.default(xq, 1.0, 128, 0, 255, torch.uint8)
        wd = qd.dequantize_per_channel.default(self.wq, self.ws, self.wz, 0, -128, 127, torch.int8)
        return (torch.nn.functional.linear(xd, wd) * r).to(x.dtype)


class WLin(nn.Module):  # weight-only int8 as the engine does it
    def __init__(self, o, i):
        super().__init__()
        wq, ws = quantize_int8(torch.randn(o, i) * 0.05)
        self.register_buffer("wq", wq)
        self.register_buffer("ws", ws)

    def forward(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.wq, self.ws).to(x.dtype)


class Stack(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.ModuleList([cls(960, H), cls(H, H), cls(2 * INTER, H), cls(H, INTER)]) for _ in range(L)]
        )

    def forward(self, x):
        for qkv, o, gu, d in self.layers:
            a = qkv(torch.nn.functional.rms_norm(x, (H,)))[:, :H]
            x = x + o(a)
            g = gu(torch.nn.functional.rms_norm(x, (H,)))
            x = x + d(torch.nn.functional.silu(g[:, :INTER]) * g[:, INTER:])
        return x


opts = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
flush = torch.empty(100_000_000)
res = {}
with torch.no_grad():
    q = QLin(960, H).eval()
    x1 = torch.randn(5, H, dtype=torch.bfloat16)
    with ic.patch(opts):
        cq = torch.compile(q, dynamic=False)
        print("one layer rel err", ((cq(x1).float() - q(x1).float()).norm() / q(x1).float().norm()).item(), flush=True)

for name, cls in (("w8a8", QLin), ("woq", WLin)):
    m = Stack(cls).eval()
    with torch.no_grad():
        x = torch.randn(4, H, dtype=torch.bfloat16)
        ref = m(x)
        t0 = time.time()
        with ic.patch(opts):
            c = torch.compile(m, dynamic=False)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=256)
            out = c(x)
        print(
            name,
            "compile s %.0f" % (time.time() - t0),
            "rel err vs eager",
            ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
            flush=True,
        )
        for M in (1, 2, 4, 6, 8, 12, 16):
            xm = torch.randn(M, H, dtype=torch.bfloat16)
            if M > 1:
                torch._dynamo.mark_dynamic(xm, 0, min=2, max=256)
            with ic.patch(opts):
                c(xm)
            ts = []
            for _ in range(15):
                flush.add_(1)
                t = time.perf_counter()
                c(xm)
                ts.append(time.perf_counter() - t)
            res[(name, M)] = statistics.median(ts[3:]) * 1000
        print(name, " ".join(f"{M}:{res[(name, M)]:.2f}" for M in (1, 2, 4, 6, 8, 12, 16)), flush=True)
