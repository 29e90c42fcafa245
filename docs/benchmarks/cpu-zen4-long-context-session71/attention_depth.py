"""Attention alone at a decoding step's shapes (SmolLM2: 30 layers, 9 query heads over 3 key/value heads of 64, float32)
over C cached keys, each layer's keys and values its own tensors and 128 MB read between steps (as a verify reads
the weights), so that they come from memory as in decoding: torch's sdpa (what the engines run), the 3 query heads
of each key/value head folded into one matrix product's rows (torch's math), and inductor's compiled flex_attention
with a block mask. Milliseconds a step at 1, 4 and 8 query rows.

    python docs/benchmarks/cpu-zen4-long-context-session71/attention_depth.py [--context 4000] [--threads 2]
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def median_ms(step, repeats: int = 15) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def folded(query, key, value, mask):
    """sdpa with each key/value head's query heads as rows of one product (math, softmax in between)."""
    batch, heads, rows, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per = heads // groups
    scores = (query.reshape(batch, groups, per * rows, dim) @ key.transpose(-1, -2)) * dim**-0.5
    scores = scores.view(batch, groups, per, rows, keys).masked_fill(~mask[:, :, None], float("-inf"))
    return (scores.softmax(-1).view(batch, groups, per * rows, keys) @ value).view(batch, heads, rows, dim)


def time_rows(rows: int, context: int, keys, values, flush, flex) -> str:
    """Each way's ms a step at `rows` query rows (a chain after `context` cached keys), less the flush's."""
    width = context + rows
    query = torch.randn(1, HEADS, rows, HEAD_DIM)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, context:] = torch.ones(rows, rows, dtype=torch.bool).tril()  # a chain: each row sees those before it
    dense = mask[None, None]
    block = create_block_mask(lambda b, h, q, k: mask[q, k], 1, 1, rows, width, device="cpu", BLOCK_SIZE=128)
    ways = {
        "sdpa": lambda k, v: F.scaled_dot_product_attention(query, k, v, attn_mask=dense, enable_gqa=True),
        "folded": lambda k, v: folded(query, k, v, dense),
        "flex": lambda k, v: flex(query, k, v, block_mask=block, enable_gqa=True),
    }
    layers = [(k[:, :, :width], v[:, :, :width]) for k, v in zip(keys, values)]
    reference = ways["sdpa"](*layers[0])
    read = median_ms(lambda: flush.sum())
    timed = []
    for name, attend in ways.items():
        assert torch.allclose(attend(*layers[0]), reference, atol=1e-5), name

        def step(attend=attend):
            flush.sum()
            for k, v in layers:
                attend(k, v)

        timed.append(f"{name} {median_ms(step) - read:.1f}")
    return ", ".join(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flush = torch.randn(32 * 1024 * 1024)  # 128 MB
    flex = torch.compile(flex_attention, dynamic=False)
    keys = [torch.randn(1, KV_HEADS, args.context + 8, HEAD_DIM) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, args.context + 8, HEAD_DIM) for _ in range(LAYERS)]
    for rows in (1, 4, 8):
        timed = time_rows(rows, args.context, keys, values, flush, flex)
        print(f"{args.context} cached keys, {rows} query rows: {timed} ms a step")


if __name__ == "__main__":
    main()
