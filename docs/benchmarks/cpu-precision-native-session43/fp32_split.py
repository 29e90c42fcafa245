"""fp32 run as bf16 runs without AMX: the main package on oneDNN (ATEN) and one-token steps on a package of their own
over the model's weights (aten's GEMV), against the engine as it is (`stock`). A probe: it passes the fp32 target off
as bf16 to the engine's one-token switch.

    python docs/benchmarks/cpu-precision-native-session43/fp32_split.py split|stock
"""

import runpy
import sys
from pathlib import Path

import medusa.runtime.inductor as inductor
import medusa.runtime.static as static

if sys.argv[1] == "split":
    options = static.inductor_cpu_options
    static.inductor_cpu_options = lambda model: {**options(model), "max_autotune_gemm_backends": "ATEN"}
    precision = inductor.precision_of
    inductor.precision_of = lambda model: "bfloat16" if precision(model) == "float32" else precision(model)
sys.argv = ["step_cost.py", "--dtype", "float32", "--rows", "512", "--prompt", "64", "--repeats", "20",
            "--queries", "1", "2", "3", "4", "6", "8", "12", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
