"""bf16's verify curve on an AVX-512 CPU without AMX (this Xeon with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), its GEMMs
on inductor's C++ template (bf16 weights widened to fp32 in registers). Before 9e81d13 bf16 took oneDNN for trees and
aten's GEMV for one token there; this gave it the template as bf16 on AMX had it (`static.bf16_on_amx`, gone since).
NARROW=1: the AVX-512 bf16-weight micro-kernels held to 16 x 16 register blocks, as fp32's are. The package key sees
neither, so give each variant a cache of its own with the converted base linked in:

    mkdir -p /tmp/bf16-t && ln -sfn ~/.cache/medusa/gguf /tmp/bf16-t/gguf
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MEDUSA_CACHE=/tmp/bf16-t \
        python docs/benchmarks/cpu-precision-noamx-session45/bf16_template.py
"""

import contextlib
import os
import runpy
import sys
from pathlib import Path

import medusa.runtime.aot as aot
import medusa.runtime.static as static

static.bf16_on_amx = lambda model: True  # before 9e81d13: the template for bf16 without AMX too
if os.environ.get("NARROW"):
    library = aot.prefetching_micro_kernels

    @contextlib.contextmanager
    def narrowed():
        import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their own order
        from torch._inductor.codegen import cpp_micro_gemm as micro
        from torch._inductor.cpu_vec_isa import VecAVX512

        def wide_bf16(config) -> bool:
            bf16 = config.input_dtype == config.input2_dtype == torch.bfloat16
            return bf16 and config.vec_isa_cls is VecAVX512 and tuple(config.register_blocking) != (16, 16, 1)

        with library():
            for kernel, configs in list(micro.micro_gemm_configs.items()):
                micro.micro_gemm_configs[kernel] = [c for c in configs if not wide_bf16(c)]
            yield

    aot.prefetching_micro_kernels = narrowed
sys.argv = ["step_cost.py", "--dtype", "bfloat16", "--rows", "512", "--prompt", "64", "--repeats", "15",
            "--queries", "1", "2", "4", "8", "16"]  # fmt: skip
runpy.run_path(str(Path(static.__file__).resolve().parents[2] / "scripts" / "step_cost.py"), run_name="__main__")
