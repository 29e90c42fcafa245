"""The fp32 verify curve with another register block or prefetch distance than torch_patches' (both are in the
package key, so each variant compiles a package of its own beside the others):

    python docs/benchmarks/cpu-fp32-prefetch-session44/fp32_variant.py 16x16 128
"""

import runpy
import sys
from pathlib import Path

import medusa.runtime.aot as aot
import medusa.runtime.torch_patches as patches

blocks = tuple((*(int(v) for v in b.split("x")), 1) for b in sys.argv[1].split(","))
patches.FP32_REGISTER_BLOCKS = aot.FP32_REGISTER_BLOCKS = blocks
patches.FP32_PREFETCH_ROWS = aot.FP32_PREFETCH_ROWS = int(sys.argv[2])
sys.argv = ["step_cost.py", "--dtype", "float32", "--rows", "512", "--prompt", "64", "--repeats", "15",
            "--queries", "1", "2", "3", "4", "6", "8", "12", "16"]  # fmt: skip
runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "step_cost.py"), run_name="__main__")
