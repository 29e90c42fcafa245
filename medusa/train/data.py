"""Training prompts, evaluation-overlap filtering and the tokenised, label-masked batches heads train on.

Prompt sources are named in configs as one of:
  - `bench:<name>` for the files in `../shared/bench_data` (t0, alpaca, gsm8k, seed_tasks);
  - a local `.json` / `.jsonl` file whose rows carry a `prompt`, `instruction` (+ `input`), `question`, `turns`, or
    a conversation: ShareGPT's `conversations` (`from` / `value`, what EAGLE and SpecForge read) or OpenAI's
    `messages` (`role` / `content`). A conversation's first user turn is the prompt, the assistant turn after it its
    reference answer, and its next user turn its own second turn (`data.second_turn_fraction`);
  - `hf:<dataset id>[:split]`, loaded whole with `datasets.load_dataset` (needs the Hub or its warm cache), or
    `hf-stream:<dataset id>[:split]` for a dataset too large to load: streamed, only as many rows read as the source's
    count (or slice's stop) asks, taken in the dataset's own order.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.evaluation import bench_data_dir
from medusa.questions import conversation, conversation_turn, row_prompt

BENCH_FILES = {
    "t0": "t0_train_50k_prompts.jsonl",
    "alpaca": "stanford_alpaca_5000_subset.json",
    "gsm8k": "gsm8k_train.jsonl",
    "seed_tasks": "stanford_alpaca_seed_tasks.jsonl",
}
# Evaluation sets: never trained on; any training prompt that matches one of their turns is dropped.
EVALUATION_FILES = (
    "spec_bench_question.jsonl",
    "mt_bench_question.jsonl",
    "eagle_gsm8k_question.jsonl",
    "self_instruct_user_oriented_instructions.jsonl",
)


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return rows
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _row_answer(row: dict) -> str | None:
    """A row's own answer, where its layout has one: Alpaca's `output`, the first instance's `output` (seed
    tasks), GSM8K's `answer` with its calculator annotations (`<<48/2=24>>`) removed, as a model would write it."""
    if row.get("output"):
        return row["output"]
    if row.get("instances") and row["instances"][0].get("output"):
        return row["instances"][0]["output"]
    if isinstance(row.get("answer"), str):
        return re.sub(r"<<[^>]*>>", "", row["answer"])
    return conversation_turn(row, "assistant", 1)


def _row_second_turn(row: dict) -> str | None:
    """A conversation's second user turn, after the assistant's first answer: what that user asked next."""
    turns = conversation(row) or []
    answered = len(turns) > 1 and turns[0][0] == "user" and turns[1][0] == "assistant"
    return conversation_turn(row, "user", 2) if answered else None


STREAM_PREFIX = "hf-stream:"


def rows_to_read(source: str, count: int | str) -> int | None:
    """How many rows of a streamed source its count reads (the count, or a slice's stop); None for other sources,
    which are read whole."""
    if not source.startswith(STREAM_PREFIX):
        return None
    stop = count if isinstance(count, int) else _slice(source, count)[1]
    if stop is None or stop < 0:
        raise ValueError(
            f"data.sources[{source!r}] = {count!r}: a streamed source is read from its start, so it needs a count "
            "or a 'start:stop' slice with a stop (use hf: instead of hf-stream: to load it whole)"
        )
    return stop


def _source_rows(source: str, rows: int | None = None) -> list[dict]:
    """The rows of a source; a streamed one's first `rows` (see rows_to_read)."""
    if source.startswith("bench:"):
        name = source.split(":", 1)[1]
        if name not in BENCH_FILES:
            raise ValueError(f"unknown bench source {name!r}: use one of {sorted(BENCH_FILES)}")
        path = bench_data_dir() / BENCH_FILES[name]
        if not path.is_file():  # an installed wheel has no checkout beside it
            raise FileNotFoundError(
                f"{source}: {path} does not exist; point $MEDUSA_BENCH_DATA at the folder holding {BENCH_FILES[name]}, "
                "or name a local .json/.jsonl file or an hf:<dataset> source instead"
            )
        return _read_rows(path)
    if source.startswith(("hf:", STREAM_PREFIX)):
        from datasets import load_dataset  # optional dependency, only for Hub datasets

        _, dataset_id, *split = source.split(":")
        streaming = source.startswith(STREAM_PREFIX)
        dataset = load_dataset(dataset_id, split=split[0] if split else "train", streaming=streaming)
        return list(itertools.islice(dataset, rows) if streaming else dataset)
    return _read_rows(Path(source))


def load_prompts(source: str, rows: int | None = None) -> list[str]:
    """All prompts of one source (see module docstring; `rows`: rows_to_read). Raises with the accepted layouts when
    none are found."""
    prompts = [p for p in (row_prompt(r) for r in _source_rows(source, rows)) if p and p.strip()]
    if not prompts:
        raise ValueError(
            f"no prompts in {source!r}: rows need a 'prompt', 'instruction' (+'input'), 'question' or 'turns' field, "
            "or a conversation ('conversations' with from/value turns, ShareGPT; 'messages' with role/content) that "
            "starts with a user turn"
        )
    return prompts


def _per_prompt(source: str, text_of, rows: int | None) -> dict[str, str]:
    """Prompt -> `text_of(row)` for the source's rows that have both (the first one where a prompt repeats)."""
    found: dict[str, str] = {}
    for row in _source_rows(source, rows):
        prompt, text = row_prompt(row), text_of(row)
        if prompt and prompt.strip() and text and text.strip():
            found.setdefault(prompt, text)
    return found


def reference_answers(source: str, rows: int | None = None) -> dict[str, str]:
    """Prompt -> the source's own answer to it: data.reference_answers. Raises naming the source when its rows carry
    no answers (T0's prompts, evaluation-style `turns`)."""
    answers = _per_prompt(source, _row_answer, rows)
    if not answers:
        raise ValueError(
            f"{source!r} has no answers to train on: data.reference_answers needs rows with an 'output' "
            "(Alpaca), 'instances[0].output' or 'answer' (GSM8K) field, or conversations; drop the source or let the "
            "target answer it (data.reference_answers false)"
        )
    return answers


def own_second_turns(source: str, rows: int | None = None) -> dict[str, str]:
    """Prompt -> the user's next turn in the source's own conversation (ShareGPT / messages rows): what a second turn
    asks instead of data.follow_ups. Empty for sources of other layouts."""
    return _per_prompt(source, _row_second_turn, rows)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def evaluation_prompts(directory: Path | None = None) -> set[str]:
    """Normalised text of every turn of every evaluation set that is present."""
    directory = directory or bench_data_dir()
    seen: set[str] = set()
    for name in EVALUATION_FILES:
        path = directory / name
        if not path.is_file():
            continue
        for row in _read_rows(path):
            turns = row.get("turns") or [row_prompt(row) or ""]
            seen.update(normalise(t) for t in turns if t)
    return seen


def drop_evaluation_overlap(prompts: Iterable[str], evaluation: set[str]) -> list[str]:
    """Drop prompts equal to, or containing, an evaluation turn (e.g. 'Prove the Pythagorean theorem.').

    A turn inside a prompt has its interior words (all but the first and last, which may be parts of longer
    words) as whole words of the prompt, so only prompts holding a turn's rarest interior word are searched
    for it: an exact filter without a Python loop over every (prompt, turn) pair.
    """
    prompts = list(prompts)
    norms = [normalise(p) for p in prompts]
    dropped = {i for i, norm in enumerate(norms) if norm in evaluation}
    turns = [t for t in evaluation if len(t) >= 20]
    interior = {t: t.split(" ")[1:-1] for t in turns}
    anchor_words = {w for words in interior.values() for w in words}
    holders: dict[str, list[int]] = {}
    for i, norm in enumerate(norms):
        for word in anchor_words.intersection(norm.split(" ")):
            holders.setdefault(word, []).append(i)
    everyone = range(len(norms))
    for turn in turns:
        candidates = min((holders.get(w, []) for w in interior[turn]), key=len, default=everyone)
        dropped.update(i for i in candidates if turn in norms[i])
    return [p for i, p in enumerate(prompts) if i not in dropped]


def _slice(source: str, count: str) -> tuple[int | None, int | None]:
    match = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", count)
    if not match:
        raise ValueError(f"data.sources[{source!r}] = {count!r}: use a count (-1 for all) or a 'start:stop' slice")
    start, stop = (int(x) if x else None for x in match.groups())
    return start, stop


def _take(prompts: list[str], source: str, count: int | str) -> list[str]:
    """`count` prompts from the start of a source's shuffled list; -1 takes all, "start:stop" a slice of it."""
    if isinstance(count, str):
        start, stop = _slice(source, count)
        return prompts[start:stop]
    if count < -1:
        raise ValueError(f"data.sources[{source!r}] = {count}: use a count >= 0, -1 for all, or a 'start:stop' slice")
    return prompts if count == -1 else prompts[:count]


def build_prompt_mix(sources: dict[str, int | str], seed: int = 0) -> list[tuple[str, str]]:
    """`{source: count}` -> a shuffled, evaluation-filtered, deterministic list of `(source, prompt)`.

    A count of -1 takes every prompt of that source; a "start:stop" string takes that slice of the source's
    shuffled prompts. Each source's shuffle depends only on the seed and the sources listed before it, not on
    the counts, so a config with the same sources in the same order and slices past the old counts (e.g.
    `bench:alpaca: "1600:4000"`) yields prompts the first one did not use: more data without overlap.
    Deterministic so that resumed runs see the same order.
    """
    if not sources:
        raise ValueError("data.sources is empty: name at least one prompt source, e.g. {'bench:alpaca': 1000}")
    rng = random.Random(seed)
    evaluation = evaluation_prompts()
    mix: list[tuple[str, str]] = []
    for source, count in sources.items():
        rows = rows_to_read(source, count)
        prompts = drop_evaluation_overlap(dict.fromkeys(load_prompts(source, rows)), evaluation)
        if rows is None:  # a stream is taken in its own order: only its first rows were read
            rng.shuffle(prompts)
        mix.extend((source, p) for p in _take(prompts, source, count))
    rng.shuffle(mix)
    return mix


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, T) right-padded with pad_id
    attention_mask: torch.Tensor  # (B, T) 1 for real tokens
    loss_mask: torch.Tensor  # (B, T) 1 where the token is part of a response (a training target)


def collate(rows: list[dict], pad_id: int, max_length: int) -> Batch:
    """Rows with `input_ids` and `response_start` -> a right-padded Batch, truncated to `max_length`."""
    if not rows:
        raise ValueError("collate got no rows: the dataset is empty")
    seqs = [r["input_ids"][:max_length] for r in rows]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        loss_mask[i, min(row["response_start"], len(seq)) : len(seq)] = 1
    return Batch(input_ids, attention, loss_mask)


def frequent_tokens(responses: Iterable[list[int]], count: int, vocab_size: int) -> torch.Tensor:
    """(count,) ids of the most frequent tokens in `responses`, ties to the lower id; unseen ids fill the rest."""
    if not 0 < count <= vocab_size:
        raise ValueError(f"vocab subset size must lie in [1, {vocab_size}], got {count}")
    freq = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in responses:
        freq += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(freq[t]), t))  # stable: reproducible across runs
    return torch.tensor(order[:count])
