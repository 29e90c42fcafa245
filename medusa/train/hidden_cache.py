"""The frozen base's hidden states, computed once over the data and cached on disk (one file per data directory,
keyed by the data, the base and everything else that changes the states)."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from medusa.config import MedusaConfig
from medusa.fileio import atomic_file
from medusa.heads import head_target_offset
from medusa.runtime import base_features
from medusa.train.batches import Conversation
from medusa.train.data import collate

CACHE_FORMAT = 1  # bump when the hidden-state cache layout changes, so old files are not read
PROGRESS_SECONDS = 120.0  # a killed precompute loses at most about this much work (progress chunks, see below)


def cache_lookback(config: MedusaConfig) -> int:
    """How many positions before the first response token the heads read: a head at t targets up to t + the last
    head's offset, and a context layer reads the window of positions before t."""
    return head_target_offset(config.num_heads - 1) + max(config.context_window - 1, 0)


def span_start(conv: Conversation, lookback: int) -> int:
    """First position whose hidden state the heads need: `lookback` before the first response token (a head at t
    targets t + offset and, with a context layer, reads the window of positions before t)."""
    return max(0, conv.response_start - lookback)


class HiddenRows:
    """Rows of hidden states kept where they are: in memory, or in a safetensors file read through its memory map
    (safetensors' lazy slices), so training reads the rows of each batch and never holds the whole cache. Several
    parts chain into one row index (HiddenCache.concat)."""

    def __init__(self, parts: list):
        self.parts = parts  # tensors and safetensors slices (both take [start:end] -> tensor), in row order
        sizes = [p.shape[0] if isinstance(p, torch.Tensor) else p.get_shape()[0] for p in parts]
        self.starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        empty = parts[0][0:0]  # no rows read: the width and dtype
        self.width, self.dtype = empty.shape[1], empty.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.starts[-1], self.width

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """Rows start:end (within one part or across several) as a tensor."""
        start, end = rows.start or 0, self.starts[-1] if rows.stop is None else rows.stop
        pieces = []
        for part, first, last in zip(self.parts, self.starts, self.starts[1:]):
            if start < last and end > first:
                pieces.append(part[max(start, first) - first : min(end, last) - first])
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


@dataclass(frozen=True)
class HiddenCache:
    """The frozen base's last hidden states over the part of each conversation the heads read."""

    hidden: torch.Tensor | HiddenRows  # (P, H) bfloat16: spans of every conversation, back to back (a loaded
    # cache: on disk, read per batch)
    ids: torch.Tensor  # (P,) long: the tokens at those positions
    offsets: torch.Tensor  # (R+1,) long: conversation r occupies rows offsets[r]:offsets[r+1]
    response_start: torch.Tensor  # (R,) long: first response row within conversation r's span

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """-> hidden (B, L, H), input_ids (B, L), loss_mask (B, L), right-padded to the longest span."""
        spans = [(int(self.offsets[r]), int(self.offsets[r + 1]), int(self.response_start[r])) for r in rows]
        width = max(end - start for start, end, _ in spans)
        hidden = torch.zeros((len(rows), width, self.hidden.shape[1]), dtype=self.hidden.dtype)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, (start, end, rs) in enumerate(spans):
            hidden[j, : end - start] = self.hidden[start:end]
            ids[j, : end - start] = self.ids[start:end]
            loss_mask[j, rs : end - start] = 1
        return {"hidden": hidden, "input_ids": ids, "loss_mask": loss_mask}

    def save(self, path: Path, key: str) -> None:
        tensors = {
            "hidden": self.hidden[:],  # (a cache read from disk: its rows, read now)
            "ids": self.ids,
            "offsets": self.offsets,
            "response_start": self.response_start,
        }
        _save_atomic(path, tensors, key)

    @classmethod
    def load(cls, path: Path, key: str) -> HiddenCache | None:
        """The cache at `path` if it was written for `key`, else None; a ValueError naming the file if it is
        unreadable (truncated by a full disk, say: writes go through a rename, so a killed run leaves none)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") != key:
                    return None
                # the hidden states stay in the file (memory-mapped, read per batch); the small index is read now
                hidden = HiddenRows([f.get_slice("hidden")])
                cache = cls(hidden, *(f.get_tensor(name) for name in ("ids", "offsets", "response_start")))
        except (SafetensorError, OSError, RuntimeError, KeyError) as err:
            raise ValueError(f"hidden-state cache {path} is unreadable ({err}): delete it and it is rebuilt") from err
        rows = int(cache.offsets[-1])
        if (
            cache.hidden.shape[0] != rows
            or cache.ids.shape[0] != rows
            or cache.response_start.shape[0] != cache.offsets.shape[0] - 1
        ):
            raise ValueError(
                f"hidden-state cache {path} is inconsistent ({rows} rows in its offsets, "
                f"{cache.hidden.shape[0]} hidden states): delete it and it is rebuilt"
            )
        return cache

    @classmethod
    def concat(cls, caches: list[HiddenCache]) -> HiddenCache:
        """Caches of consecutive conversation lists -> one cache over all of them, in order."""
        if len(caches) == 1:
            return caches[0]
        shifts = torch.tensor([0] + [int(c.offsets[-1]) for c in caches[:-1]]).cumsum(0)
        offsets = torch.cat([caches[0].offsets[:1]] + [c.offsets[1:] + shift for c, shift in zip(caches, shifts)])
        parts = [part for c in caches for part in (c.hidden.parts if isinstance(c.hidden, HiddenRows) else [c.hidden])]
        return cls(
            HiddenRows(parts),
            torch.cat([c.ids for c in caches]),
            offsets,
            torch.cat([c.response_start for c in caches]),
        )

    @classmethod
    def assemble(cls, convs: list[Conversation], spans: dict[int, torch.Tensor], lookback: int) -> HiddenCache:
        starts = [span_start(c, lookback) for c in convs]
        lengths = [len(c.ids) - s for c, s in zip(convs, starts)]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        ids = torch.tensor([t for c, s in zip(convs, starts) for t in c.ids[s:]], dtype=torch.long)
        hidden = torch.cat([spans[r] for r in range(len(convs))])
        rs = torch.tensor([c.response_start - s for c, s in zip(convs, starts)], dtype=torch.long)
        return cls(hidden, ids, offsets, rs)


def last_hidden(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, feature_layers=()
) -> torch.Tensor:
    """(B, T) -> (B, T, H): the base's last, post-norm hidden state (with feature layers, their features after it:
    medusa.heads.base_features); logits only for the last position (cheap)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1)
    return base_features(out.hidden_states, feature_layers)


def progress_dir(path: Path) -> Path:
    """Where an unfinished precompute of the cache at `path` keeps what it has computed so far (chunks of spans)."""
    return path.with_name(f".{path.stem}.progress")


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    """Tensors -> a safetensors file recording `key`, written under a temporary name and renamed (a killed write
    leaves none)."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"key": key})


def _save_spans(file: Path, spans: dict[int, torch.Tensor], key: str, hidden_size: int) -> None:
    """Conversation rows -> their spans, in one safetensors file (atomic)."""
    rows = sorted(spans)
    tensors = {
        "rows": torch.tensor(rows, dtype=torch.long),
        "lengths": torch.tensor([len(spans[i]) for i in rows], dtype=torch.long),
        "hidden": torch.cat([spans[i] for i in rows]) if rows else torch.zeros(0, hidden_size, dtype=torch.bfloat16),
    }
    _save_atomic(file, tensors, key)


def _load_spans(file: Path, key: str | None = None) -> dict[int, torch.Tensor] | None:
    """A file of `_save_spans` -> its spans; None if it was written for another key."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        if key is not None and (f.metadata() or {}).get("key") != key:
            return None
        rows, lengths, hidden = (f.get_tensor(name) for name in ("rows", "lengths", "hidden"))
    return dict(zip(rows.tolist(), hidden.split(lengths.tolist())))


def _resume(directory: Path, key: str, wanted: set[int], log) -> dict[int, torch.Tensor]:
    """The spans an earlier, interrupted precompute of this cache saved (any process's, for rows in `wanted`)."""
    from safetensors import SafetensorError

    spans: dict[int, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        try:
            saved = _load_spans(file, key)
        except (SafetensorError, OSError, RuntimeError, KeyError) as err:
            log(f"warning: skipping unreadable precompute progress {file} ({err}); its rows are computed again")
            continue
        spans.update({i: span for i, span in (saved or {}).items() if i in wanted})
    return spans


def build_hidden_cache(
    accelerator,
    base: nn.Module,
    convs: list[Conversation],
    lookback: int,
    path: Path,
    key: str,
    batch_tokens: int,
    log,
    feature_layers=(),
) -> HiddenCache:
    """Run the frozen base once over every conversation (each process a share) and cache what the heads read.

    Resumable: every PROGRESS_SECONDS each process saves the spans it computed since as a chunk in
    `progress_dir(path)`; a run that finds chunks for this key computes only the rest (the chunks are removed once
    the cache is written)."""
    if path.is_file():
        try:
            cache = HiddenCache.load(path, key)
        except ValueError as err:  # the states are a function of the key: computing them again is always right
            cache = None
            log(f"warning: {err}; rebuilding it")
        if cache is not None:
            log(f"reusing precomputed hidden states {path}")
            return cache
    rank, world = accelerator.process_index, accelerator.num_processes
    lengths = [len(c.ids) for c in convs]
    order = sorted(range(len(convs)), key=lambda i: lengths[i])  # similar lengths together: little padding
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    batches = (batches + [current])[rank::world]
    hidden_size = base.config.get_text_config().hidden_size * (1 + len(feature_layers))
    progress = progress_dir(path)
    spans = _resume(progress, key, {i for b in batches for i in b}, log)
    if spans:
        log(f"resuming the precompute of {path.name}: {len(spans)} conversations already done ({progress})")
    total = sum(lengths[i] for b in batches for i in b)
    done = sum(lengths[i] for i in spans)
    bar = tqdm(
        total=total, initial=done, unit="tok", desc="precompute hidden", disable=not accelerator.is_local_main_process
    )
    start = saved_at = time.time()
    unsaved: dict[int, torch.Tensor] = {}
    with torch.no_grad(), accelerator.autocast():
        for rows in batches:
            if all(i in spans for i in rows):
                continue
            batch = collate(
                [{"input_ids": convs[i].ids, "response_start": convs[i].response_start} for i in rows],
                pad_id=0,
                max_length=max(lengths[i] for i in rows),
            )
            hidden = last_hidden(
                base,
                batch.input_ids.to(accelerator.device),
                batch.attention_mask.to(accelerator.device),
                feature_layers,
            )
            for j, i in enumerate(rows):
                spans[i] = unsaved[i] = hidden[j, span_start(convs[i], lookback) : lengths[i]].to(torch.bfloat16).cpu()
            bar.update(sum(lengths[i] for i in rows))
            if time.time() - saved_at >= PROGRESS_SECONDS:
                _save_spans(progress / f"rank{rank}-{time.time_ns()}.safetensors", unsaved, key, hidden_size)
                unsaved, saved_at = {}, time.time()
    bar.close()
    computed = total - done
    log(
        f"precomputed hidden states of {computed} tokens in {time.time() - start:.1f} s "
        f"({computed / max(time.time() - start, 1e-9):.0f} tok/s per process)"
    )
    if world == 1:
        cache = HiddenCache.assemble(convs, spans, lookback)
        cache.save(path, key)
        shutil.rmtree(progress, ignore_errors=True)
        return cache
    part = path.with_name(f".{path.stem}.part-{rank}-of-{world}.safetensors")
    _save_spans(part, spans, key, hidden_size)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        spans = {}
        for r in range(world):
            other = path.with_name(f".{path.stem}.part-{r}-of-{world}.safetensors")
            spans.update(_load_spans(other))
            other.unlink()
        HiddenCache.assemble(convs, spans, lookback).save(path, key)
        shutil.rmtree(progress, ignore_errors=True)
    accelerator.wait_for_everyone()
    return HiddenCache.load(path, key)
