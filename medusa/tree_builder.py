"""Choose a static tree from measured head accuracies and this machine's verify latency (DESIGN section 4).

acc[k][r] = how often rank r of head k is the token the target emits. A path's value is the product of its ranks'
accuracies (the chance the whole path is accepted); a tree's expected accepted length per step is
1 + the sum of its nodes' values. Growing the tree greedily by value gives, for every size, the best tree under that
model; the size to use is the one with the most expected tokens per second of measured step time.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from dataclasses import dataclass

import torch

from medusa.acceptance import greedy
from medusa.decode import prefill
from medusa.propose import build_medusa_proposer
from medusa.runtime import EagerEngine
from medusa.sampling import SamplingConfig
from medusa.tree import TreeSpec, build_buffers

RankPath = tuple[int, ...]
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # nodes, root included


def check_accuracy(acc) -> list[list[float]]:
    """Validate acc[k][r] (K heads, each with at least one rank), probabilities in [0, 1]."""
    if not isinstance(acc, (list, tuple)) or not acc:
        raise ValueError(
            "accuracy table must be a non-empty list (one list of rank accuracies per head), "
            "as `medusa accuracy` writes under the key 'acc'"
        )
    table = []
    for k, row in enumerate(acc):
        if not isinstance(row, (list, tuple)) or not row:
            raise ValueError(f"accuracy table: head {k} has no rank accuracies; expected a non-empty list of numbers")
        values = [float(x) for x in row]
        if not all(0.0 <= x <= 1.0 for x in values):
            raise ValueError(f"accuracy table: head {k} has values outside [0, 1]: {values}")
        table.append(values)
    return table


def path_value(path: RankPath, acc: list[list[float]]) -> float:
    """Product of acc[k][path[k]]: the chance every token of the path is accepted."""
    return math.prod(acc[k][r] for k, r in enumerate(path))


def grow_tree(acc, max_nodes: int) -> list[RankPath]:
    """Up to `max_nodes - 1` paths (the root is a node too), added best value first.

    A path becomes available once its parent and its lower-rank sibling are in the tree (TreeSpec's rules), so every
    prefix of the result is a valid tree. When accuracies fall with rank, every prefix is the set of highest-value
    paths of its size.
    """
    acc = check_accuracy(acc)
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
    frontier = [(-path_value((0,), acc), (0,))]  # a heap; equal values go to the lexicographically smaller path
    chosen: list[RankPath] = []
    while frontier and len(chosen) < max_nodes - 1:
        _, path = heapq.heappop(frontier)
        chosen.append(path)
        nexts = []
        if len(path) < len(acc):
            nexts.append(path + (0,))  # its first child: the parent exists now, rank 0 has no lower sibling
        if path[-1] + 1 < len(acc[len(path) - 1]):
            nexts.append(path[:-1] + (path[-1] + 1,))  # its next sibling: parent and lower sibling exist now
        for p in nexts:
            heapq.heappush(frontier, (-path_value(p, acc), p))
    return chosen


def expected_tau(paths, acc) -> float:
    """1 + sum of path values: expected tokens per step, bonus token included."""
    acc = check_accuracy(acc)
    return 1.0 + sum(path_value(tuple(p), acc) for p in paths)


@dataclass(frozen=True)
class StepLatency:
    """Median milliseconds of one decoding step's parts for a tree of `num_nodes` nodes."""

    num_nodes: int
    heads_ms: float  # propose: head blocks, projection, top-k
    verify_ms: float  # one target forward over the tree
    accept_ms: float  # greedy acceptance (argmax over N x V logits)

    @property
    def step_ms(self) -> float:
        return self.heads_ms + self.verify_ms + self.accept_ms


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def time_step(model, engine, proposer, state, sampling: SamplingConfig) -> tuple[float, float, float]:
    """Milliseconds of one step's propose, verify and (greedy) accept on `engine`; the cache is set back after it,
    so repeated steps all see the same KV length."""
    device = model.device
    sync(device)
    t0 = time.perf_counter()
    candidates = proposer.propose(state)
    sync(device)
    t1 = time.perf_counter()
    verified = engine.verify(state.cache, candidates, state.length, model.feature_layers)
    sync(device)
    t2 = time.perf_counter()
    greedy(candidates, verified, sampling)
    t3 = time.perf_counter()  # acceptance ends in a host sync
    engine.truncate(state.cache, state.length)
    return 1000 * (t1 - t0), 1000 * (t2 - t1), 1000 * (t3 - t2)


@torch.inference_mode()
def measure_step_latency(
    model, trees: dict[int, list[RankPath]], kv_length: int = 512, repeats: int = 10, warmup: int = 2, seed: int = 0
) -> dict[int, StepLatency]:
    """Time propose -> verify -> accept for each tree on `model` (a MedusaModel) after a `kv_length`-token prefill.

    trees: num_nodes -> paths. The cache is cropped back after every step, so all sizes see the same KV length.
    Sizes are interleaved within each repeat, so drifts in machine load hit all of them alike.
    """
    device = model.device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.base.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, kv_length), generator=generator).to(device)
    sampling = SamplingConfig()
    state = prefill(model.base, prompt, sampling, feature_layers=model.config.feature_layers)
    num_heads = model.config.num_heads
    proposers = {
        n: build_medusa_proposer(model, build_buffers(TreeSpec(paths, num_heads), num_heads).to(device))
        for n, paths in trees.items()
    }
    samples = {n: ([], [], []) for n in trees}
    sizes = sorted(trees)
    engine = EagerEngine(model.base)
    for rep in range(warmup + repeats):
        for n in sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]:
            times = time_step(model, engine, proposers[n], state, sampling)
            if rep >= warmup:
                for bucket, ms in zip(samples[n], times):
                    bucket.append(ms)
    return {n: StepLatency(n, *(statistics.median(b) for b in samples[n])) for n in sizes}


def best_size(taus: dict[int, float], step_ms: dict[int, float]) -> int:
    """The tree size (>= 2 nodes) with the most expected tokens per millisecond."""
    candidates = [n for n in taus if n >= 2 and n in step_ms]
    if not candidates:
        raise ValueError("no tree size with at least 2 nodes to choose from: raise max_nodes or give more accuracies")
    return max(candidates, key=lambda n: taus[n] / step_ms[n])
