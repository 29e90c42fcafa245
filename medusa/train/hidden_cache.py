"""The frozen base's hidden states, computed once over the data and cached on disk (one file per data directory,
keyed by the data, the base and everything else that changes the states)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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
PROGRESS_BYTES = 256 << 20  # and a process holds at most about this many bytes of hidden states before writing a chunk


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
        """Written span by span: a cache read from disk is copied, never read whole."""
        bounds = self.offsets.tolist()
        index = {"ids": self.ids, "offsets": self.offsets, "response_start": self.response_start}
        spans = (self.hidden[start:end] for start, end in zip(bounds, bounds[1:]))
        _write_safetensors(path, key, index, tuple(self.hidden.shape), spans)

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
        """Spans held in memory (conversation r -> its span) -> a cache."""
        return cls(torch.cat([spans[r] for r in range(len(convs))]), **_index_tensors(convs, lookback))


def _index_tensors(convs: list[Conversation], lookback: int) -> dict[str, torch.Tensor]:
    """The cache's tensors besides the hidden states (ids, offsets, response_start), from the conversations."""
    starts = [span_start(c, lookback) for c in convs]
    lengths = [len(c.ids) - s for c, s in zip(convs, starts)]
    return {
        "ids": torch.tensor([t for c, s in zip(convs, starts) for t in c.ids[s:]], dtype=torch.long),
        "offsets": torch.tensor([0] + lengths).cumsum(0),
        "response_start": torch.tensor([c.response_start - s for c, s in zip(convs, starts)], dtype=torch.long),
    }


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


def _write_safetensors(
    path: Path, key: str, index: dict[str, torch.Tensor], shape: tuple[int, int], hidden_spans: Iterable
) -> None:
    """A safetensors file recording `key`: the `index` tensors (int64), then `shape` bf16 hidden states written piece
    by piece as `hidden_spans` yields them (tensors or their raw bytes), so they are never held whole. The layout is
    safetensors' own (an 8-byte header size, the JSON header padded to 8 bytes, the data in header order), which
    its save_file cannot write incrementally. Written under a temporary name and renamed (a killed write leaves
    none)."""
    header, begin = {"__metadata__": {"key": key}}, 0
    for name, tensor in index.items():
        header[name] = {
            "dtype": "I64",
            "shape": list(tensor.shape),
            "data_offsets": [begin, begin + 8 * tensor.numel()],
        }
        begin += 8 * tensor.numel()
    hidden_bytes = 2 * shape[0] * shape[1]
    header["hidden"] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [begin, begin + hidden_bytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with atomic_file(path) as tmp, open(tmp, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for tensor in index.values():
            out.write(tensor.to(torch.long).contiguous().numpy())
        written = 0
        for span in hidden_spans:
            if isinstance(span, torch.Tensor):  # (numpy has no bf16: its raw bytes as int16)
                span = span.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
            written += out.write(span)
        if written != hidden_bytes:
            raise RuntimeError(f"wrote {written} bytes of hidden states to {path}, expected {hidden_bytes}")


class StoredSpan(NamedTuple):
    """Where a computed span lies in a progress chunk: bytes offset:offset + size of the file."""

    file: Path
    offset: int
    size: int


def _save_spans(file: Path, spans: dict[int, torch.Tensor], key: str, hidden_size: int) -> None:
    """Conversation rows -> their spans, in one safetensors file (rows, lengths, hidden; atomic)."""
    rows = sorted(spans)
    lengths = torch.tensor([len(spans[i]) for i in rows], dtype=torch.long)
    index = {"rows": torch.tensor(rows, dtype=torch.long), "lengths": lengths}
    _write_safetensors(file, key, index, (int(lengths.sum()), hidden_size), (spans[i] for i in rows))


def _stored_spans(file: Path, key: str) -> dict[int, StoredSpan] | None:
    """A file of `_save_spans` -> where each of its spans lies (its hidden states are not read); None if it was
    written for another key."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:  # (checks the file is whole)
        if (f.metadata() or {}).get("key") != key:
            return None
        rows, lengths = f.get_tensor("rows").tolist(), f.get_tensor("lengths").tolist()
        row_bytes = 2 * f.get_slice("hidden").get_shape()[1]  # bf16
    with open(file, "rb") as raw:
        header_size = int.from_bytes(raw.read(8), "little")
        offset = 8 + header_size + json.loads(raw.read(header_size))["hidden"]["data_offsets"][0]
    stored = {}
    for row, length in zip(rows, lengths):
        stored[row] = StoredSpan(file, offset, length * row_bytes)
        offset += length * row_bytes
    return stored


def _saved_progress(directory: Path, key: str, log) -> dict[int, StoredSpan]:
    """Where the spans saved so far for this cache lie (any process's chunks, of this run or an interrupted one)."""
    from safetensors import SafetensorError

    stored: dict[int, StoredSpan] = {}
    for file in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        try:
            stored.update(_stored_spans(file, key) or {})
        except (SafetensorError, OSError, RuntimeError, KeyError, ValueError) as err:
            log(f"warning: skipping unreadable precompute progress {file} ({err}); its rows are computed again")
    return stored


def _write_from_progress(
    path: Path, key: str, convs: list[Conversation], lookback: int, stored: dict[int, StoredSpan], hidden_size: int
) -> None:
    """The cache file, its hidden states copied span by span in conversation order from the progress chunks (read
    with plain file reads, not memory-mapped: the process holds one span at a time)."""

    def spans():
        for r in range(len(convs)):
            with open(stored[r].file, "rb") as chunk:
                chunk.seek(stored[r].offset)
                yield chunk.read(stored[r].size)

    index = _index_tensors(convs, lookback)
    _write_safetensors(path, key, index, (int(index["offsets"][-1]), hidden_size), spans())


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

    No process holds the cache: each writes what it computes as chunks in `progress_dir(path)` (every
    PROGRESS_SECONDS and every PROGRESS_BYTES), then the main process copies the chunks' spans into the cache file in
    conversation order, one span at a time. Resumable: a run that finds chunks for this key computes only the rest
    (the chunks are removed once the cache is written)."""
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
    mine = {i for b in batches for i in b}
    done = {i for i in _saved_progress(progress, key, log) if i in mine}
    if done:
        log(f"resuming the precompute of {path.name}: {len(done)} conversations already done ({progress})")
    total = sum(lengths[i] for i in mine)
    done_tokens = sum(lengths[i] for i in done)
    bar = tqdm(
        total=total,
        initial=done_tokens,
        unit="tok",
        desc="precompute hidden",
        disable=not accelerator.is_local_main_process,
    )
    start = saved_at = time.time()
    unsaved: dict[int, torch.Tensor] = {}

    def save_progress():
        _save_spans(progress / f"rank{rank}-{time.time_ns()}.safetensors", unsaved, key, hidden_size)
        unsaved.clear()

    with torch.no_grad(), accelerator.autocast():
        for rows in batches:
            if all(i in done for i in rows):
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
            for j, i in enumerate(rows):  # (copies: a view would keep the whole batch alive)
                unsaved[i] = hidden[j, span_start(convs[i], lookback) : lengths[i]].to("cpu", torch.bfloat16, copy=True)
            del hidden
            bar.update(sum(lengths[i] for i in rows))
            held = sum(span.nbytes for span in unsaved.values())
            if held >= PROGRESS_BYTES or time.time() - saved_at >= PROGRESS_SECONDS:
                save_progress()
                saved_at = time.time()
    if unsaved:
        save_progress()
    bar.close()
    computed = total - done_tokens
    log(
        f"precomputed hidden states of {computed} tokens in {time.time() - start:.1f} s "
        f"({computed / max(time.time() - start, 1e-9):.0f} tok/s per process)"
    )
    accelerator.wait_for_everyone()  # every process's chunks are written
    if accelerator.is_main_process:
        stored = _saved_progress(progress, key, log)
        missing = [r for r in range(len(convs)) if r not in stored]
        if missing:
            raise RuntimeError(
                f"{len(missing)} conversations have no hidden states in {progress}: "
                "do all processes share training.cache_dir?"
            )
        _write_from_progress(path, key, convs, lookback, stored, hidden_size)
        shutil.rmtree(progress, ignore_errors=True)
    accelerator.wait_for_everyone()
    return HiddenCache.load(path, key)
