"""The frozen base's hidden states, computed once over the data and cached on disk (one file per data directory,
keyed by the data, the base and everything else that changes the states)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from medusa.config import MedusaConfig
from medusa.heads import base_features, head_target_offset
from train.batches import Conversation
from train.data import collate

CACHE_FORMAT = 1  # bump when the hidden-state cache layout changes, so old files are not read


def cache_lookback(config: MedusaConfig) -> int:
    """How many positions before the first response token the heads read: a head at t targets up to t + the last
    head's offset, and a context layer reads the window of positions before t."""
    return head_target_offset(config.num_heads - 1) + max(config.context_window - 1, 0)


def span_start(conv: Conversation, lookback: int) -> int:
    """First position whose hidden state the heads need: `lookback` before the first response token (a head at t
    targets t + offset and, with a context layer, reads the window of positions before t)."""
    return max(0, conv.response_start - lookback)


@dataclass(frozen=True)
class HiddenCache:
    """The frozen base's last hidden states over the part of each conversation the heads read."""

    hidden: torch.Tensor  # (P, H) bfloat16: spans of every conversation, back to back
    ids: torch.Tensor  # (P,) long: the tokens at those positions
    offsets: torch.Tensor  # (R+1,) long: conversation r occupies rows offsets[r]:offsets[r+1]
    response_start: torch.Tensor  # (R,) long: first response row within conversation r's span

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """-> hidden (B, L, H), input_ids (B, L), loss_mask (B, L), right-padded to the longest span."""
        spans = [(int(self.offsets[r]), int(self.offsets[r + 1]), int(self.response_start[r])) for r in rows]
        width = max(end - start for start, end, _ in spans)
        hidden = self.hidden.new_zeros((len(rows), width, self.hidden.shape[1]))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, (start, end, rs) in enumerate(spans):
            hidden[j, : end - start] = self.hidden[start:end]
            ids[j, : end - start] = self.ids[start:end]
            loss_mask[j, rs : end - start] = 1
        return {"hidden": hidden, "input_ids": ids, "loss_mask": loss_mask}

    def save(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(
            {"hidden": self.hidden, "ids": self.ids, "offsets": self.offsets, "response_start": self.response_start},
            str(tmp),
            metadata={"key": key},
        )
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: str) -> HiddenCache | None:
        """The cache at `path` if it was written for `key`, else None; a ValueError naming the file if it is
        unreadable (truncated by a full disk, say: writes go through a rename, so a killed run leaves none)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") != key:
                    return None
                cache = cls(*(f.get_tensor(name) for name in ("hidden", "ids", "offsets", "response_start")))
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
        return cls(
            torch.cat([c.hidden for c in caches]),
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
    """Run the frozen base once over every conversation (each process a share) and cache what the heads read."""
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
    spans: dict[int, torch.Tensor] = {}
    total = sum(lengths[i] for b in batches for i in b)
    bar = tqdm(total=total, unit="tok", desc="precompute hidden", disable=not accelerator.is_local_main_process)
    start = time.time()
    with torch.no_grad(), accelerator.autocast():
        for rows in batches:
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
                spans[i] = hidden[j, span_start(convs[i], lookback) : lengths[i]].to(torch.bfloat16).cpu()
            bar.update(sum(lengths[i] for i in rows))
    bar.close()
    log(
        f"precomputed hidden states of {total} tokens in {time.time() - start:.1f} s "
        f"({total / max(time.time() - start, 1e-9):.0f} tok/s per process)"
    )
    if world == 1:
        cache = HiddenCache.assemble(convs, spans, lookback)
        cache.save(path, key)
        return cache
    from safetensors.torch import load_file, save_file

    part = path.with_name(f".{path.stem}.part-{rank}-of-{world}.safetensors")
    part.parent.mkdir(parents=True, exist_ok=True)
    mine = sorted(spans)
    hidden_size = base.config.get_text_config().hidden_size * (1 + len(feature_layers))
    save_file(
        {
            "rows": torch.tensor(mine, dtype=torch.long),
            "lengths": torch.tensor([len(spans[i]) for i in mine], dtype=torch.long),
            "hidden": torch.cat([spans[i] for i in mine])
            if mine
            else torch.zeros(0, hidden_size, dtype=torch.bfloat16),
        },
        str(part),
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        spans = {}
        for r in range(world):
            other = path.with_name(f".{path.stem}.part-{r}-of-{world}.safetensors")
            parts = load_file(str(other))
            for i, piece in zip(parts["rows"].tolist(), parts["hidden"].split(parts["lengths"].tolist())):
                spans[i] = piece
            other.unlink()
        HiddenCache.assemble(convs, spans, lookback).save(path, key)
    accelerator.wait_for_everyone()
    return HiddenCache.load(path, key)
