"""A w8a8 step's 121 int8 GEMMs (SmolLM2's fused shapes) on inductor's int8 weight-only C++ template for AVX2 (bf16
activations holding the integer levels exactly, fp32 sums, bf16 outputs), compiled as one graph, against w8a8's
`int8_sums` called eagerly (fbgemm plus the pin's eager glue: fbgemm_rows.py times fbgemm alone), ms, median of 20.

    python docs/benchmarks/cpu-zen3-avx2-session76/template_vs_fbgemm.py 1 4 8"""

import statistics
import sys
import time

import torch
from torch import nn

from medusa.runtime.quantize import int8_sums
from medusa.runtime.static import INDUCTOR_CPU_OPTIONS

torch.manual_seed(0)
torch.set_num_threads(2)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        for i, s in enumerate(SHAPES):
            self.register_buffer(f"w{i}", torch.randint(-63, 64, s, dtype=torch.int8))
            self.register_buffer(f"s{i}", torch.ones(s[0], dtype=torch.bfloat16))

    def forward(self, a, b):
        out = []
        for i, s in enumerate(SHAPES):
            x = a if s[1] == 576 else b
            out.append(torch.ops.aten._weight_int8pack_mm(x, getattr(self, f"w{i}"), getattr(self, f"s{i}")))
        return out


def median_ms(fn, repeats=20):
    fn()
    fn()
    t = []
    for _ in range(repeats):
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1000


step = Step().eval()
ms = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8]
with torch.no_grad(), torch._inductor.config.patch({**INDUCTOR_CPU_OPTIONS, "max_autotune_gemm_backends": "CPP"}):
    compiled = torch.compile(step, dynamic=False)
    for m in ms:
        a = torch.randint(-127, 128, (m, 576)).to(torch.bfloat16)
        b = torch.randint(-127, 128, (m, 1536)).to(torch.bfloat16)
        start = time.perf_counter()
        got = compiled(a, b)
        comp = time.perf_counter() - start
        weights = [getattr(step, f"w{i}") for i in range(len(SHAPES))]
        exact = [(a if s[1] == 576 else b).float() @ w.float().T for s, w in zip(SHAPES, weights)]
        same = all(torch.equal(g.float(), e.to(torch.bfloat16).float()) for g, e in zip(got, exact))
        woq = median_ms(lambda a=a, b=b: compiled(a, b))
        fa, fb = a.float(), b.float()
        fbg = median_ms(
            lambda fa=fa, fb=fb, ws=weights: [int8_sums(fa if s[1] == 576 else fb, w) for s, w in zip(SHAPES, ws)]
        )
        print(
            f"M={m}: template {woq:.2f} ms (compiled in {comp:.0f} s; exact sums rounded to bf16: {same}), "
            f"fbgemm {fbg:.2f} ms",
            flush=True,
        )
