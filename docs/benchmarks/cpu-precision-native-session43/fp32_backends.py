"""The fp32 verify curve with the inductor engine's GEMMs from one backend: CPP (inductor's C++ template, the engine's
choice) or ATEN (oneDNN's packed linear, weights frozen):

    python docs/benchmarks/cpu-precision-native-session43/fp32_backends.py ATEN
"""

import runpy
import sys
from pathlib import Path

import medusa.runtime.static as static

static.INDUCTOR_CPU_OPTIONS["max_autotune_gemm_backends"] = sys.argv[1]
sys.argv = ["step_cost.py", "--dtype", "float32", "--rows", "512", "--prompt", "64", "--repeats", "20",
            "--queries", "1", "2", "3", "4", "6", "8", "12", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
