"""Keep the accepted path's KV rows after a tree verification; drop the rest. A batch's cache, whose rows keep their
own lengths (medusa.batch). A cache as one chunk of a prompt sees it (`reading_rows`)."""

from __future__ import annotations

import copy
import functools

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from medusa.runtime.graphs import StepGraph


def keep_rows(tensors: list[torch.Tensor], past_length: int | torch.Tensor, accepted_nodes: torch.Tensor) -> None:
    """The one KV gather: in each of `tensors` (B, heads, T, head_dim), rows past_length + accepted_nodes (src) ->
    past_length .. past_length + a (dst), in place; rows beyond stay as they are (stale). Fixed shapes and no host
    sync, also with the past's length as a 0-d device tensor: a CUDA graph can hold it (the static engine's commit)."""
    source = past_length + accepted_nodes
    target = past_length + torch.arange(accepted_nodes.numel(), device=accepted_nodes.device)
    for rows in tensors:
        rows.index_copy_(2, target, rows.index_select(2, source))  # the source rows are gathered (copied) first


def row_mover(tensors: list[torch.Tensor]) -> StepGraph:
    """keep_rows over `tensors` (a cache's keys and values), called with the past's length as a 0-d tensor and the
    accepted nodes: on a GPU a CUDA graph per accepted length, as it is elsewhere. A move changes rows it reads, so
    each length is captured with an identity move (the capture's warm-up runs move nothing)."""
    return StepGraph(functools.partial(keep_rows, tensors), "the KV commit", capture_with=_identity_move)


def _identity_move(past: torch.Tensor, accepted_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return past, torch.arange(accepted_nodes.numel(), device=accepted_nodes.device)


@torch.inference_mode()
def commit(cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """Cache rows past_length + accepted_nodes (src) move to past_length .. past_length + a (dst); the rest go.

    accepted_nodes: (a + 1,) long node indices, root first. In place on every layer of a transformers Cache.
    """
    keep = past_length + accepted_nodes.numel()
    for layer in cache.layers:
        keep_rows([layer.keys, layer.values], past_length, accepted_nodes)
        layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = keep


class RowsReadLayer:
    """A cache layer as one forward sees it: `update` writes as `layer` does (after the rows it holds) and hands
    attention only the rows `first` .. `visible` of what the layer gives; everything else is the layer's."""

    def __init__(self, layer, first: int, visible: int):
        self.layer, self.first, self.visible = layer, first, visible

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.layer.update(key_states, value_states, *args, **kwargs)
        return keys[:, :, self.first : self.visible], values[:, :, self.first : self.visible]

    def __getattr__(self, name: str):
        return getattr(self.layer, name)


def reading_rows(cache, firsts: list[int], visible: int):
    """`cache` (written through, in place) whose layer i hands attention only its rows firsts[i] .. `visible`: a
    prompt's chunk reads the keys up to its own end, a sliding layer only from where its window starts
    (runtime.verify.prefill_in_chunks)."""
    view = copy.copy(cache)
    view.layers = [RowsReadLayer(layer, first, visible) for layer, first in zip(cache.layers, firsts)]
    return view


class KeptDtypeLayer(StaticLayer):
    """transformers' static layer that keeps its rows in `kept_dtype` (set by the engine that allocates it:
    runtime.attention.kv_dtype; None: as they come), converting each step's new rows as they are written."""

    kept_dtype: torch.dtype | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return super().update(*self.kept(key_states, value_states), *args, **kwargs)

    def kept(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows in the dtype this layer keeps."""
        if self.kept_dtype is None:
            return key_states, value_states
        return key_states.to(self.kept_dtype), value_states.to(self.kept_dtype)

    def write_at(self, starts: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each batch row b's N new rows (B, heads, N, head_dim) written at starts[b] .. + N, in place: a batch's rows
        keep their own lengths (RowsCache, and the inductor engine's batch package). An index_put: in a package whose
        cache size is dynamic inductor writes it in place, where a scatter became a copy of the whole cache a step
        (docs/benchmarks/cpu-one-package-session55)."""
        batch, heads, n, _ = key_states.shape
        device = key_states.device
        rows = (starts[:, None] + torch.arange(n, device=device))[:, None, :]  # (B, 1, n)
        where = (torch.arange(batch, device=device)[:, None, None], torch.arange(heads, device=device)[:, None], rows)
        self.keys.index_put_(where, key_states)
        self.values.index_put_(where, value_states)


class RowsLayer(KeptDtypeLayer):
    """A static layer whose batch rows are written at their own lengths (one list shared by every layer): a forward of
    N tokens writes row b's at lengths[b] .. + N and attends over the first max(lengths) + N positions (the caller's
    mask hides what a row does not see). Rows are kept in `kept_dtype` where that is set (as KeptDtypeLayer)."""

    def __init__(self, max_cache_len: int, lengths: list[int], kept_dtype: torch.dtype | None = None):
        super().__init__(max_cache_len=max_cache_len)
        self.lengths, self.kept_dtype = lengths, kept_dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_states, value_states = self.kept(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        first = self.lengths[0]
        if all(length == first for length in self.lengths):  # rows in step (plain decoding): a slice, no scatter
            self.keys[:, :, first : first + n] = key_states
            self.values[:, :, first : first + n] = value_states
            return self.keys[:, :, : first + n], self.values[:, :, : first + n]
        self.write_at(torch.tensor(self.lengths, device=key_states.device), key_states, value_states)
        width = max(self.lengths) + n
        return self.keys[:, :, :width], self.values[:, :, :width]


class RowsCache:
    """A batch's KV cache: each row's tokens contiguous from position 0 to `lengths[b]`; a forward writes each row's
    new tokens after its own, `commit` keeps a row's accepted path in place there (no gaps, no growth), `keep` drops
    the rows of sequences that finished. `cache` is what the model's forward takes; `kept_dtype`: the dtype its rows
    are kept in (None: as they come)."""

    def __init__(self, config, max_rows: int, kept_dtype: torch.dtype | None = None):
        self.lengths: list[int] = []
        self.config, self.max_rows, self.kept_dtype = config, max_rows, kept_dtype
        self.cache = StaticCache(config=config, max_cache_len=max_rows)
        self.cache.layers = [RowsLayer(max_rows, self.lengths, kept_dtype) for _ in self.cache.layers]

    def start(self, batch: int, length: int = 0) -> None:
        """The next forward writes every one of `batch` rows at `length` (the prompts, left-padded to one width)."""
        self.lengths[:] = [length] * batch

    def advance(self, length: int) -> None:
        """Every row now holds `length` tokens (after the prompts' forward)."""
        self.lengths[:] = [length] * len(self.lengths)

    @torch.inference_mode()
    def commit(self, accepted_nodes: list[torch.Tensor]) -> None:
        """Each row keeps the accepted nodes of the forward just run (its positions lengths[b] + accepted_nodes[b]),
        moved to lengths[b] onward: one gather and one scatter per tensor for the whole batch, none when every row's
        path is already in place (plain decoding's root, a chain accepted in order)."""
        if all(nodes.tolist() == list(range(nodes.numel())) for nodes in accepted_nodes):
            self.lengths[:] = [length + nodes.numel() for length, nodes in zip(self.lengths, accepted_nodes)]
            return
        longest = max(nodes.numel() for nodes in accepted_nodes)
        device = accepted_nodes[0].device
        moves = torch.arange(longest, device=device).repeat(len(accepted_nodes), 1)  # a row's padding moves in place
        for row, nodes in enumerate(accepted_nodes):
            moves[row, : nodes.numel()] = nodes
        starts = torch.tensor(self.lengths, device=device)[:, None]
        source, target = (
            (starts + moves)[:, None, :, None],
            (starts + torch.arange(longest, device=device))[:, None, :, None],
        )
        for layer in self.cache.layers:
            for rows in (layer.keys, layer.values):
                shape = (rows.shape[0], rows.shape[1], longest, rows.shape[3])
                rows.scatter_(2, target.expand(shape), rows.gather(2, source.expand(shape)))
        self.lengths[:] = [length + nodes.numel() for length, nodes in zip(self.lengths, accepted_nodes)]

    def scratch(self, max_rows: int) -> RowsCache:
        """An empty cache like this one (rows kept in the same dtype) of `max_rows` positions per row: where some of
        its rows are prefilled on their own (`place`)."""
        return RowsCache(self.config, max_rows, self.kept_dtype)

    @torch.inference_mode()
    def place(self, rows: list[int], layers, length: int, at: int) -> None:
        """Batch rows `rows` take the first `length` positions of `layers`' rows, in order (another cache's layers: a
        batch's, or one sequence's), written at `at` onward (the rest of the row, before `at`, is padding the batch's
        masks hide). Allocates this cache's layers, for every row of the batch (`start`), in the dtype they keep,
        where nothing was written yet."""
        index = torch.tensor(rows, device=layers[0].keys.device)
        for layer, theirs in zip(self.cache.layers, layers):
            if not layer.is_initialized:
                batch = (len(self.lengths), -1, -1, -1)  # (only shapes, dtype and device are read)
                layer.lazy_initialization(
                    *layer.kept(theirs.keys[:1, :, :1].expand(batch), theirs.values[:1, :, :1].expand(batch))
                )
            layer.keys[index, :, at : at + length] = theirs.keys[:, :, :length]
            layer.values[index, :, at : at + length] = theirs.values[:, :, :length]

    def add_rows(self, count: int) -> None:
        """`count` empty rows after the batch's (rows joining a running batch: `place` fills them)."""
        self.lengths.extend([0] * count)
        for layer in self.cache.layers:
            if layer.is_initialized:
                empty = (count, *layer.keys.shape[1:])
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(empty)])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(empty)])

    def keep(self, rows: list[int]) -> None:
        """Keep only these batch rows, in this order."""
        self.lengths[:] = [self.lengths[i] for i in rows]
        index = torch.tensor(rows, device=self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
