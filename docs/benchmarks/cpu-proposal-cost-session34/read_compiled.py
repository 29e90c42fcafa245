"""The heads' context layer read over two rows, on the int8 weights the heads propose with: eager against compiled
by inductor with its GEMM templates (max-autotune, C++ and aten's kernels, frozen weights). Median ms a read.

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-cost-session34/read_compiled.py
"""

import time

import torch
import torch.utils.benchmark

from medusa import MedusaModel

OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "freezing": True}


def median_ms(run) -> float:
    run()  # warm
    timer = torch.utils.benchmark.Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=1.0).median * 1000


def main() -> None:
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype="w8a8", plan="off")
    heads = model.proposal_heads  # int8 weights (medusa.runtime.int8_copy)
    size = model.config.hidden_size
    hidden = torch.randn(1, 2, size * (1 + len(model.feature_layers)))
    following = torch.randn(1, 2, size)
    keys, values, _ = heads.context.empty_past(torch.device("cpu"), torch.float32)
    seen = torch.tensor(100)

    def read(hidden, following, keys, values, seen):
        return heads.contextualise(hidden, following, (keys, values, seen))

    with torch.inference_mode():
        eager = median_ms(lambda: read(hidden, following, keys, values, seen))
        compiled = torch.compile(read, options=OPTIONS, dynamic=False)
        start = time.perf_counter()
        compiled(hidden, following, keys, values, seen)
        seconds = time.perf_counter() - start
        warm = median_ms(lambda: compiled(hidden, following, keys, values, seen))
    print(f"eager {eager:.2f} ms a read; compiled {warm:.2f} ms ({seconds:.0f} s to compile)")


if __name__ == "__main__":
    main()
