"""bf16's verify curve on an AVX-512 CPU without AMX (this Xeon with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), its GEMMs
on inductor's C++ template (bf16 weights widened to fp32 in registers) instead of oneDNN for trees and aten's GEMV for
one token: what bf16 gets on AMX (static.bf16_on_amx) given to it without AMX. The package key does not see it, so
give each variant a cache of its own with the converted base linked in:

    mkdir -p /tmp/bf16-t && ln -sfn ~/.cache/medusa/gguf /tmp/bf16-t/gguf
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MEDUSA_CACHE=/tmp/bf16-t \
        python docs/benchmarks/cpu-precision-noamx-session45/bf16_template.py
"""

import runpy
import sys
from pathlib import Path

import medusa.runtime.static as static

static.bf16_on_amx = lambda model: True
sys.argv = ["step_cost.py", "--dtype", "bfloat16", "--rows", "512", "--prompt", "64", "--repeats", "15",
            "--queries", "1", "2", "4", "8", "16"]  # fmt: skip
runpy.run_path(str(Path(static.__file__).resolve().parents[2] / "scripts" / "step_cost.py"), run_name="__main__")
