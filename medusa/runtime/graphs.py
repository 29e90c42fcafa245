"""The small tensor functions of a decoding step (the heads' proposal, the greedy acceptance) as CUDA graphs.

On a GPU each ran eagerly, hundreds of kernel launches a step: the proposal alone cost 4-6 ms of an H100 bf16 step
whose verify took 3-4 (docs/benchmarks/h100-step-graphs). Each is captured here once per input shape with
`torch.cuda.CUDAGraph` and replayed: one launch. Not torch.compile's CUDA graphs ("reduce-overhead"): those share one
tree with the verify's graphs, and calling a second compiled function between verifies made a tree's verify 0.8-1.4
ms slower and the step no faster (the record beside that benchmark). The function must be pure tensor code with
fixed shapes (no host syncs, no data-dependent shapes); the CPU tests compile each one with `fullgraph=True`, which
refuses anything else. Elsewhere (a CPU) the function runs as it is.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

# MEDUSA_STEP_GRAPHS=0 runs the step's small functions eagerly on a GPU too (to compare, or to rule them out)
STEP_GRAPHS = os.environ.get("MEDUSA_STEP_GRAPHS", "1") != "0"
MAX_SHAPES = 64  # graphs one StepGraph keeps (a dynamic tree's acceptance sees many sizes); later shapes run eagerly


class StepGraph:
    """`fn(*tensors)` as a CUDA graph where its first tensor argument is on a GPU, as it is elsewhere.

    Each input shape is captured once (after two warm-up calls on a side stream) into a graph that reads static
    copies of the arguments: a call copies the arguments in, replays, and returns copies of the outputs. `fn` must
    read nothing else that changes between calls except through its arguments (tensors it closes over, such as a
    proposer's tree, are read at the addresses captured). If capturing fails, a warning says so and every StepGraph
    of that `name` runs eagerly from then on in this process (a proposer is built per call): a step must not fail
    for want of a graph.

    A function that changes state it also reads (the KV commit moves cache rows) must not run three times on one
    call's arguments: `capture_with(*args)` gives the arguments a shape is captured (and warmed up) with instead,
    ones whose runs change nothing."""

    def __init__(self, fn, name: str, capture_with=None):
        self.fn, self.name, self.capture_with = fn, name, capture_with
        self._graphs: dict[tuple, _Captured] = {}
        self._lock = threading.Lock()  # copy in, replay, copy out: one caller at a time

    @property
    def failed(self) -> bool:
        return self.name in _FAILED

    @property
    def captured(self) -> int:
        """How many input shapes have a graph."""
        return len(self._graphs)

    def __call__(self, *args: torch.Tensor):
        if not (STEP_GRAPHS and not self.failed and _on_gpu(args)):
            return self.fn(*args)
        key = tuple((tuple(a.shape), a.dtype, a.device) for a in args)
        graph = self._graphs.get(key)
        if graph is None and len(self._graphs) >= MAX_SHAPES:
            return self.fn(*args)
        try:
            with self._lock, torch.inference_mode():
                if graph is None:
                    captured_args = args if self.capture_with is None else self.capture_with(*args)
                    graph = self._graphs[key] = _Captured(self.fn, captured_args)
                return graph.replay(args)
        except Exception as err:  # noqa: BLE001 - a capture failure must not end generation: run eagerly
            logger.warning(
                "%s could not run as a CUDA graph (%s: %s); it runs eagerly", self.name, type(err).__name__, err
            )
            _FAILED.add(self.name)
            self._graphs.clear()
            return self.fn(*args)


class _Captured:
    """One shape's graph: static inputs, the captured call, its static outputs."""

    def __init__(self, fn, args: tuple[torch.Tensor, ...]):
        self.inputs = tuple(a.clone() for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy set-up (cuBLAS workspaces, kernels' first loads) happens outside capture
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def replay(self, args: tuple[torch.Tensor, ...]):
        for static, given in zip(self.inputs, args):
            static.copy_(given)
        self.graph.replay()
        if isinstance(self.outputs, tuple):
            return tuple(t.clone() for t in self.outputs)
        return self.outputs.clone()


_FAILED: set[str] = set()  # names of the StepGraphs that could not be captured


def upload_ids(ids: int | list[int] | torch.Tensor, device) -> torch.Tensor:
    """Token ids or a length (an int, a list, or a CPU tensor) -> a long tensor on `device`. To a GPU through pinned
    memory without waiting: a pageable copy waits for the work queued before it, which puts the host back in step
    with the GPU."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def _on_gpu(args) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == "cuda"
