"""Candidate trees: a spec is a list of rank paths; TreeBuffers are the tensors derived from it once.

`[0, 1]` means "top-1 of head 0, then top-2 of head 1". Node 0 is the root: the target's own next token.
A node at depth d holds a token proposed by head d-1 (Medusa heads read only the last accepted hidden state,
so a node's token depends on its depth and rank, not on its parent).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

TREES_DIR = Path(__file__).resolve().parent / "trees"  # shipped trees: package data, found by name


class TreeSpec:
    """Validated, canonically ordered rank paths (sorted by depth, then ranks)."""

    def __init__(self, paths, num_heads: int | None = None):
        if not isinstance(paths, (list, tuple)):
            raise ValueError(f"a tree spec is a list of rank paths like [[0], [1], [0, 0]], got {type(paths).__name__}")
        clean = []
        for p in paths:
            if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
                raise ValueError(f"tree path {p!r} must be a non-empty list of non-negative integer ranks")
            clean.append(tuple(p))
        seen = set(clean)
        if len(seen) != len(clean):
            raise ValueError("tree spec has duplicate paths")
        for p in clean:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])}: add the parent path")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
                raise ValueError(
                    f"tree path {list(p)} skips rank {p[-1] - 1} (gap in ranks): add {list(p[:-1] + (p[-1] - 1,))}"
                )
            if num_heads is not None and len(p) > num_heads:
                raise ValueError(
                    f"tree path {list(p)} has depth {len(p)} but there are only {num_heads} heads: "
                    "shorten the path or use more heads"
                )
        self.paths: tuple[tuple[int, ...], ...] = tuple(sorted(clean, key=lambda p: (len(p), p)))

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def __len__(self) -> int:
        return len(self.paths) + 1  # + root

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Tensors derived once per spec (on CPU; `.to(device)` copies them)."""

    num_nodes: int  # N, root included
    visible: torch.Tensor  # (N, N) bool: node i attends to node j (itself, the root and its ancestors)
    depth: torch.Tensor  # (N,) long, root 0; position id of node i = current length + depth[i]
    parent: torch.Tensor  # (N,) long, root's parent is itself (0)
    candidate_index: torch.Tensor  # (N,) long: node -> index into [root, top-s_0 of head 0, top-s_1 of head 1, ...]
    topk_per_head: tuple[int, ...]  # s_k: how many ranks of head k the tree uses
    leaf_paths: torch.Tensor  # (L, D + 1) long: node indices root..leaf, padded with N (a sentinel)
    _bias_cache: dict = field(default_factory=dict, repr=False)

    @property
    def max_depth(self) -> int:
        return self.leaf_paths.shape[1] - 1

    def attention_bias(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(N, N) additive float mask: 0 where visible, dtype-min elsewhere (a boolean mask is wrong under eager)."""
        key = (dtype, str(device))
        if key not in self._bias_cache:
            bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            bias.masked_fill_(~self.visible, torch.finfo(dtype).min)
            self._bias_cache[key] = bias.to(device)
        return self._bias_cache[key]

    def to(self, device) -> TreeBuffers:
        return TreeBuffers(
            self.num_nodes,
            self.visible.to(device),
            self.depth.to(device),
            self.parent.to(device),
            self.candidate_index.to(device),
            self.topk_per_head,
            self.leaf_paths.to(device),
        )


def build_buffers(spec: TreeSpec, num_heads: int | None = None) -> TreeBuffers:
    """Derive the mask, depths, parents, candidate gather indices and root-to-leaf paths of a spec."""
    return _build_buffers(spec.paths, num_heads or max(spec.depth, 1))


@functools.lru_cache(maxsize=64)
def _build_buffers(paths: tuple[tuple[int, ...], ...], num_heads: int) -> TreeBuffers:
    n = len(paths) + 1
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    topk = [0] * num_heads
    for p in paths:
        topk[len(p) - 1] = max(topk[len(p) - 1], p[-1] + 1)
    head_offset = [1 + sum(topk[:k]) for k in range(num_heads)]  # where head k's top-s starts in the flat list

    parent, candidate_index = [0] * n, [0] * n
    for p, i in index.items():
        if p:
            parent[i] = index[p[:-1]]
            candidate_index[i] = head_offset[len(p) - 1] + p[-1]
    shape = _buffers_from_parents(tuple(parent), "cpu")  # mask, depths and leaf paths follow from the parents
    return TreeBuffers(
        n,
        shape.visible,
        shape.depth,
        shape.parent,
        torch.tensor(candidate_index, dtype=torch.long),
        tuple(topk),
        shape.leaf_paths,
    )


def buffers_from_parents(parent: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> TreeBuffers:
    """Tree buffers for an arbitrary tree given in topological order: the per-step trees (dynamic, prompt lookup).

    parent: (N,) node ids, parent[0] = 0 (the root), parent[i] < i; a tensor gives its device. Leaves are listed in
    node order, like build_buffers. `candidate_index` is unused for such trees (their tokens are placed directly) and
    holds zeros; `topk_per_head` is empty. Built once per tree shape and device, then shared: a dynamic proposer's
    trees repeat from step to step, and a shared one keeps its attention bias (`attention_bias`) too.
    """
    if isinstance(parent, torch.Tensor):
        device, parent = device or parent.device, parent.tolist()
    return _buffers_from_parents(tuple(parent), str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=4096)
def _buffers_from_parents(parent: tuple[int, ...], device: str) -> TreeBuffers:
    n = len(parent)
    if n == 0 or parent[0] != 0 or any(not 0 <= p < i for i, p in enumerate(parent[1:], 1)):
        raise ValueError(f"a tree's parents must start with the root (0) and precede each node, got {list(parent)}")
    depth, ancestors = [0] * n, [[0] for _ in range(n)]  # ancestors[i]: root .. i
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
        ancestors[i] = ancestors[parent[i]] + [i]
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, line in enumerate(ancestors):
        visible[i, line] = True
    leaves = sorted(set(range(n)) - set(parent[1:]))
    max_depth = max(depth)
    leaf_paths = torch.tensor([ancestors[i] + [n] * (max_depth - depth[i]) for i in leaves], dtype=torch.long)
    as_long = functools.partial(torch.tensor, dtype=torch.long)
    tree = TreeBuffers(n, visible, as_long(depth), as_long(parent), torch.zeros(n, dtype=torch.long), (), leaf_paths)
    return tree.to(device)


def load_tree(name_or_path: str | Path) -> list[list[int]]:
    """Rank paths from a JSON file (a bare list, or an object with a `paths` list) or the name of a shipped tree
    (medusa/trees/NAME.json)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = TREES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        available = sorted(p.stem for p in TREES_DIR.glob("*.json")) if TREES_DIR.is_dir() else []
        raise FileNotFoundError(f"tree {name_or_path!r} not found (a JSON file, or one of {available})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f'tree file {path} is not valid JSON ({err}): expected a list of rank paths or {{"paths": [...]}}'
        ) from err
    if isinstance(data, dict) and "paths" not in data:
        raise ValueError(
            f"tree file {path} has no 'paths' key: expected a list of rank paths or "
            f'{{"paths": [...]}}, got keys {sorted(data)}'
        )
    paths = data["paths"] if isinstance(data, dict) else data
    TreeSpec(paths)  # validate now, with a clear error
    if not paths:
        raise ValueError(f"tree file {path} holds no paths")
    return paths


def chain(depth: int) -> list[list[int]]:
    """The tree of width 1: top-1 of each of `depth` heads."""
    return [[0] * d for d in range(1, depth + 1)]


@dataclass(frozen=True)
class Candidates:
    tokens: torch.Tensor  # (N,) long: node 0 is the root (the target's own next token)
    tree: TreeBuffers  # on the model's device
    draft_probs: torch.Tensor | None = None  # (N, V): q that drew node i's token (draft-model sampling only)
