"""aten's fp32 linear against the oneDNN pre-packed one (medusa.runtime.prepack) on SmolLM2's shapes, this CPU:
median microseconds of 30 calls after 5, 2 threads."""

import statistics
import time

import torch

from medusa.runtime import pack, packed_linear


def median_us(function, *args) -> float:
    for _ in range(5):
        function(*args)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    for out_features, in_features in ((1536, 576), (576, 1536), (49152, 576)):
        weight = torch.randn(out_features, in_features) * 0.02
        packed = pack(weight)
        for rows in (1, 2, 8, 16, 64):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(
                packed_linear(x, packed, out_features), torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4
            )
            aten = median_us(torch.nn.functional.linear, x, weight)
            ours = median_us(packed_linear, x, packed, out_features)
            print(f"{out_features}x{in_features} M={rows}: aten {aten:.0f} us, packed {ours:.0f} us", flush=True)


if __name__ == "__main__":
    main()
