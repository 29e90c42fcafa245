"""The fp32 verify curve with inductor's AVX-512 fp32 micro-kernels restricted to the register blocks named, as they
were before `torch_patches.fp32_register_blocks` (run from a checkout before it; the package key does not see this
patch, so give each variant an empty cache with the converted base linked in):

    MEDUSA_CACHE=/tmp/cache-16x16 python docs/benchmarks/cpu-precision-native-session43/fp32_blocks.py 16x16
"""

import runpy
import sys
from pathlib import Path

import torch
import torch._inductor.compile_fx  # noqa: F401 - loads inductor's codegen modules in their own order
from torch._inductor.codegen import cpp_micro_gemm as micro
from torch._inductor.cpu_vec_isa import VecAVX512

blocks = [(*(int(v) for v in b.split("x")), 1) for b in sys.argv[1:]]
stock = micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec]
micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec] = [
    c for c in stock if not (c.vec_isa_cls is VecAVX512 and c.input_dtype == c.input2_dtype == torch.float)
] + micro.generate_gemm_config(VecAVX512, blocks, input_dtype=torch.float)
sys.argv = ["step_cost.py", "--dtype", "float32", "--rows", "512", "--prompt", "64", "--repeats", "20",
            "--queries", "1", "2", "3", "4", "6", "8", "12", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
