"""Training conversations: read from generate_data's shards, held out by hash, cut into each step's batches.

Which conversations a process reads at a step is a pure function of (seed, step) (StepPlan), so a resumed run
reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.heads import head_target_offset
from medusa.train.config import TrainingConfig
from medusa.train.losses import BASE_TARGET_OFFSET, scored_positions


@dataclass(frozen=True)
class Conversation:
    ids: list[int]  # prompt + response tokens, truncated to training.max_length
    response_start: int  # index of the first response token (< len(ids))

    @property
    def response_tokens(self) -> int:
        return len(self.ids) - self.response_start


def _shard_has_rows(shard: Path) -> bool:
    """A dataset saved with no rows has no arrow file, and `datasets.load_from_disk` fails on it (IndexError)."""
    state = shard / "state.json"
    return not state.is_file() or bool(json.loads(state.read_text()).get("_data_files", [None]))


def load_conversations(
    data_dir: str | Path, max_length: int, vocab_size: int, prompt_only: bool = False
) -> list[Conversation]:
    """Every conversation of the shards in `data_dir`, truncated; those with no response token left are dropped,
    unless `prompt_only` (training on prompt positions: data.answer false writes prompts without responses)."""
    from datasets import concatenate_datasets, load_from_disk

    from medusa.train.generate_data import SETTINGS_NAME, shard_dirs

    shards = shard_dirs(Path(data_dir))
    if not shards:
        raise FileNotFoundError(
            f"no data shards in {data_dir}: run train/generate_data.py first "
            "(or point data.out_dir at the directory it wrote)"
        )
    shards = [s for s in shards if _shard_has_rows(s)]
    if not shards:
        raise ValueError(
            f"the dataset in {data_dir} is empty (its shards hold no conversations): "
            "run train/generate_data.py, or point data.out_dir at the directory it wrote"
        )
    settings = Path(data_dir) / SETTINGS_NAME  # what generate_data made it with: was the data answered?
    answered = not settings.is_file() or json.loads(settings.read_text()).get("answer", True)
    if not answered and not prompt_only:
        raise ValueError(
            f"the dataset in {data_dir} holds prompts without responses (data.answer false): train on it "
            "with training.prompt_tokens true (and training.distill true)"
        )
    data = concatenate_datasets([load_from_disk(str(s)) for s in shards])
    missing = sorted({"input_ids", "response_start"} - set(data.column_names))
    if missing:
        raise ValueError(f"data in {data_dir} lacks column(s) {missing}: regenerate it with train/generate_data.py")
    columns = data.select_columns(["input_ids", "response_start"]).to_dict()
    convs = [
        Conversation(list(ids[:max_length]), min(int(rs), max_length))
        for ids, rs in zip(columns["input_ids"], columns["response_start"])
        if int(rs) < min(len(ids), max_length) or (prompt_only and len(ids) > 1)
    ]
    if not convs:
        raise ValueError(
            f"the dataset in {data_dir} has {len(data)} conversations and none has a response token within "
            f"training.max_length={max_length}: raise training.max_length or regenerate the data"
        )
    top = max(max(c.ids) for c in convs)
    if top >= vocab_size:
        raise ValueError(
            f"data in {data_dir} holds token id {top} but the base vocabulary has {vocab_size} tokens: the "
            "data was generated with another tokenizer; use the base it was made with (model.base)"
        )
    return convs


def load_directories(
    data_dirs: list[str | Path], max_length: int, vocab_size: int, prompt_only: bool = False
) -> tuple[list[Conversation], list[range]]:
    """`load_conversations` of each directory, in order -> (all of them, each directory's index range): each
    directory has its own hidden-state cache file."""
    convs, parts = [], []
    for data_dir in data_dirs:
        loaded = load_conversations(data_dir, max_length, vocab_size, prompt_only=prompt_only)
        parts.append(range(len(convs), len(convs) + len(loaded)))
        convs += loaded
    return convs, parts


def _conversation_hash(conv: Conversation) -> bytes:
    return hashlib.blake2b(
        torch.tensor(conv.ids).numpy().tobytes() + conv.response_start.to_bytes(8, "little"), digest_size=16
    ).digest()


def split_eval(convs: list[Conversation], n_eval: int) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): the `n_eval` conversations with the smallest token hash are held out.

    Depends only on the conversations themselves, not on the seed or the shard order.
    """
    answered = [i for i in range(len(convs)) if convs[i].response_tokens]  # prompt-only rows are never held out
    if n_eval >= len(answered):
        raise ValueError(
            f"the data has {len(answered)} conversations with responses and training.eval_conversations="
            f"{n_eval} leaves none to train on: lower training.eval_conversations or generate more data"
        )
    ranked = sorted(answered, key=lambda i: (_conversation_hash(convs[i]), i))
    held_out = set(ranked[:n_eval])
    return [i for i in range(len(convs)) if i not in held_out], sorted(held_out)


def data_fingerprint(convs: list[Conversation]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for conv in convs:
        digest.update(_conversation_hash(conv))
    return digest.hexdigest()


def pack(order: list[int], lengths: list[int], batch_size: int, unit: str) -> list[list[int]]:
    """Cut `order` into batches of `batch_size` conversations, or of at most `batch_size` tokens (at least one)."""
    if unit == "sequences":
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    batches, current, tokens = [], [], 0
    for i in order:
        if current and tokens + lengths[i] > batch_size:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return batches + ([current] if current else [])


class StepPlan:
    """Which conversations each process reads at each optimizer step; a pure function of (seed, step)."""

    def __init__(self, train_idx: list[int], lengths: list[int], cfg: TrainingConfig, world: int):
        self.train_idx, self.lengths, self.cfg, self.world = train_idx, lengths, cfg, world
        self.per_step = world * cfg.grad_accum  # micro-batches consumed per optimizer step, all processes
        self._epochs: dict[int, list[list[int]]] = {}
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"one optimizer step needs {self.per_step} batches ({world} processes x grad_accum "
                f"{cfg.grad_accum}) but "
                f"the {len(train_idx)} training conversations make {len(self.epoch_batches(0))}: lower "
                "training.batch_size or training.grad_accum, or generate more data"
            )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            order = [self.train_idx[i] for i in torch.randperm(len(self.train_idx), generator=gen).tolist()]
            self._epochs[epoch] = pack(order, self.lengths, self.cfg.batch_size, self.cfg.batch_unit)
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch)) // self.per_step

    def total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        return sum(self.steps_in_epoch(e) for e in range(self.cfg.epochs))

    def locate(self, step: int) -> tuple[int, int]:
        """Global optimizer step -> (epoch, step within that epoch)."""
        epoch = 0
        while step >= (n := self.steps_in_epoch(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The grad_accum micro-batches process `rank` runs at optimizer step `step`."""
        epoch, within = self.locate(step)
        batches = self.epoch_batches(epoch)
        first = within * self.per_step
        return [batches[first + a * self.world + rank] for a in range(self.cfg.grad_accum)]

    def step_rows(self, step: int) -> list[int]:
        """Every conversation any process reads at optimizer step `step`."""
        return [i for rank in range(self.world) for rows in self.micro_batches(step, rank) for i in rows]


def loss_positions(convs: list[Conversation], num_heads: int) -> torch.Tensor:
    """(R, K + 1): positions each conversation contributes to each head's loss and (last) to the base KL."""
    offsets = [head_target_offset(k) for k in range(num_heads)] + [BASE_TARGET_OFFSET]
    return torch.tensor(
        [[scored_positions(len(c.ids), c.response_start, o) for o in offsets] for c in convs], dtype=torch.float64
    )
