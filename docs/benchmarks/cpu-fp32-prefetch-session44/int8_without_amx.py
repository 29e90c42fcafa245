"""The int8 verify curve (bf16 activations, int8 weights) with inductor's AMX micro-kernels taken away while a
package compiles: the kernels an AVX-512 CPU without AMX gets (inductor's fp32 kernel, int8 weights widened in
registers). NO_PREFETCH=1: without the prefetch; BLOCKS (e.g. 16x16): int8's AVX-512 blocks narrowed to those. The
package key sees neither, so give each variant a cache of its own with the converted base linked in:

    mkdir -p /tmp/int8-a && ln -sfn ~/.cache/medusa/gguf /tmp/int8-a/gguf
    MEDUSA_CACHE=/tmp/int8-a python docs/benchmarks/cpu-fp32-prefetch-session44/int8_without_amx.py
"""

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch
import torch._inductor.compile_fx  # noqa: F401 - loads inductor's codegen modules in their own order
from torch._inductor.codegen import cpp_micro_gemm as micro
from torch._inductor.cpu_vec_isa import VecAMX, VecAVX512

import medusa.runtime.aot as aot
import medusa.runtime.torch_patches as patches

if os.environ.get("NO_PREFETCH"):
    patches.prefetching_kernel = lambda stock: None
blocks = [(*(int(v) for v in b.split("x")), 1) for b in sys.argv[1:]]
library = aot.prefetching_micro_kernels


def avx512_int8(config) -> bool:
    return (
        config.vec_isa_cls is VecAVX512 and config.input_dtype == torch.bfloat16 and config.input2_dtype == torch.int8
    )


@contextlib.contextmanager
def without_amx():
    with library():
        saved = {kernel: list(configs) for kernel, configs in micro.micro_gemm_configs.items()}
        for kernel, configs in saved.items():
            kept = [c for c in configs if c.vec_isa_cls is not VecAMX]
            if blocks and any(avx512_int8(c) for c in kept):
                kept = [c for c in kept if not avx512_int8(c)] + micro.generate_gemm_config(
                    VecAVX512, blocks, input_dtype=torch.bfloat16, input2_dtype=torch.int8, output_dtype=torch.float,
                    compute_dtype=torch.float,
                )  # fmt: skip
            micro.micro_gemm_configs[kernel] = kept
        try:
            yield
        finally:
            micro.micro_gemm_configs.clear()
            micro.micro_gemm_configs.update(saved)


aot.prefetching_micro_kernels = without_amx
sys.argv = ["step_cost.py", "--dtype", "int8", "--rows", "512", "--prompt", "64", "--repeats", "15",
            "--queries", "1", "2", "3", "4", "6", "8", "12", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
