"""A verify curve on AMX with the AMX micro-kernels asking for their weights ahead. inductor's weight-only int8 one
widens the weights to bf16 asking for them 64 rows ahead into L1, its int4 one 64 rows ahead of the first block of
columns only (its prefetch leaves out the block's offset); its bf16 and int8 x int8 (w8a8) ones load weight tiles
asking for none. INT8_ROWS / INT4_ROWS: rows ahead for those two (int4's at its block's offset); TILE_ROWS: k steps
ahead for a weight tile's 16 rows (bf16, w8a8); INT4_VEC_ROWS: rows ahead in the AVX-512 int4 kernel; HINT: T0 or
T1; unset, inductor's kernels as shipped. The package key sees none of it, so give each variant a cache of its own
with the converted base linked in:

    mkdir -p /tmp/amx-a && ln -sfn ~/.cache/medusa/gguf /tmp/amx-a/gguf
    MEDUSA_CACHE=/tmp/amx-a INT4_ROWS=512 python docs/benchmarks/cpu-amx-prefetch-session45/amx_prefetch.py int4
"""

import os
import runpy
import sys
from pathlib import Path

import torch._inductor.compile_fx  # noqa: F401 - loads inductor's codegen modules in their own order
from torch._inductor.codegen import cpp_micro_gemm as micro

hint = os.environ.get("HINT", "T1")
INT8_STOCK = "_mm_prefetch(base_addr + idx_q + 64 * ldb, _MM_HINT_T0);"
INT4_STOCK = "_mm_prefetch(B + (k + PREFETCH_SIZE_K) * ldb_int4, _MM_HINT_T0);"
if os.environ.get("INT8_ROWS"):
    entry = micro.CppMicroGemmAMX.TEMPLATE_ENTRY
    assert entry.count(INT8_STOCK) == 1
    moved = f"_mm_prefetch(base_addr + idx_q + {os.environ['INT8_ROWS']} * ldb, _MM_HINT_{hint});"
    micro.CppMicroGemmAMX.TEMPLATE_ENTRY = entry.replace(INT8_STOCK, moved)
if os.environ.get("INT4_ROWS"):
    entry = micro.CppMicroGemmWoQInt4Amx.TEMPLATE_ENTRY
    assert entry.count(INT4_STOCK) == 1
    moved = f"_mm_prefetch(B + n / 2 * K + (k + {os.environ['INT4_ROWS']}) * ldb_int4, _MM_HINT_{hint});"
    micro.CppMicroGemmWoQInt4Amx.TEMPLATE_ENTRY = entry.replace(INT4_STOCK, moved)
INT4_VEC_STOCK = "_mm_prefetch(B + (k + PREFETCH_SIZE_K) * ldb, _MM_HINT_T0);"
if os.environ.get("INT4_VEC_ROWS"):  # the AVX-512 int4 kernel (no AMX; on AMX, one-token steps): 64 rows ahead, into L1
    kernel = micro.CppMicroGemmWoQInt4Avx512.TEMPLATE_KERNEL
    assert kernel.count(INT4_VEC_STOCK) == 1
    moved = f"_mm_prefetch(B + (k + {os.environ['INT4_VEC_ROWS']}) * ldb, _MM_HINT_{hint});"
    micro.CppMicroGemmWoQInt4Avx512.TEMPLATE_KERNEL = kernel.replace(INT4_VEC_STOCK, moved)
TILE_LOAD = "        _tile_loadd({{tile_idx_b}}, B + k * ldb"
if os.environ.get("TILE_ROWS"):
    kernel = micro.CppMicroGemmAMX.TEMPLATE_KERNEL
    assert kernel.count(TILE_LOAD) == 1
    ahead = (
        f"B + (k + {os.environ['TILE_ROWS']}) * ldb + {{{{tile_col * 16 * vnni_size}}}} + r * ldb * {{{{vnni_size}}}}"
    )
    prefetch = (
        "        {%- if not use_cached_dequantized_B %}\n"
        f"        for (int r = 0; r < 16; r++) _mm_prefetch(reinterpret_cast<const char*>({ahead}), _MM_HINT_{hint});\n"
        "        {%- endif %}\n"
    )
    micro.CppMicroGemmAMX.TEMPLATE_KERNEL = kernel.replace(TILE_LOAD, prefetch + TILE_LOAD)
sys.argv = ["step_cost.py", "--dtype", sys.argv[1], "--rows", "512", "--prompt", "64", "--repeats", "15",
            "--queries", "1", "2", "4", "8", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
