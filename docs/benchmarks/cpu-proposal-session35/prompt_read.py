"""What the heads' context layer costs to read a prompt of N positions (w8a8 target's bf16 activations, the int8
heads a CPU proposes with), median of 5: a read now takes at most the layer's window (64) of them.

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-session35/prompt_read.py
"""

import statistics
import time

import torch

from medusa import MedusaModel


def main() -> None:
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype="w8a8", plan="off")
    heads = model.proposal_heads
    width = model.config.hidden_size * (1 + len(model.feature_layers))
    for rows in (769, 300, heads.context.window):
        hidden = torch.randn(1, rows, width, dtype=torch.bfloat16)
        following = torch.randn(1, rows, model.config.hidden_size, dtype=torch.bfloat16)
        past = heads.context.empty_past(torch.device("cpu"), torch.bfloat16)
        times = []
        with torch.inference_mode():
            for _ in range(6):
                start = time.perf_counter()
                heads.contextualise(hidden, following, past)
                times.append(time.perf_counter() - start)
        print(f"{rows} positions: {statistics.median(times[1:]) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
