"""Benchmark questions (Spec-Bench / MT-bench JSONL) and the chat conversations built from them."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


def load_questions(path: str | Path) -> list[dict]:
    """Spec-Bench / MT-bench style JSONL: one `{question_id, category, turns: [str, ...]}` object a line; rows of the
    training prompts' layouts (`{id, instruction, instances: [{input}]}` as self-instruct's, Alpaca's, GSM8K's, a
    conversation) give one turn, their prompt (row_prompt)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON ({err})") from err
        turns = row.get("turns") if isinstance(row, dict) else None
        if isinstance(row, dict) and turns is None:
            prompt = row_prompt(row)
            turns = [prompt] if prompt else None
        if not turns or not isinstance(turns[0], str):
            raise ValueError(
                f"{path}:{number}: expected {{question_id, category, turns: [str, ...]}} or a prompt row (instruction, "
                f"prompt, question or a conversation), got {line[:80]!r}"
            )
        questions.append(
            {
                "question_id": row.get("question_id", row.get("id", number)),
                "category": row.get("category"),
                "turns": turns,
            }
        )
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def spread(items: list, limit: int | None) -> list:
    """`limit` items evenly spaced through `items` (all when None): Spec-Bench is grouped by category, so the
    first N would all come from one category."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    return [items[i * len(items) // limit] for i in range(limit)]


def per_group(questions: list[dict], limit: int | None) -> list[dict]:
    """Questions with a reporting `group` (MT-bench's eight categories are one, 'mt_bench', as in Spec-Bench), `limit`
    per group (all when None)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for q in questions:
        category = q["category"] or "all"
        group = "mt_bench" if category in MT_BENCH_CATEGORIES else category
        groups[group].append({**q, "category": category, "group": group})
    selected = []
    for questions in groups.values():
        by_category: dict[str, list[dict]] = defaultdict(list)
        for q in questions:
            by_category[q["category"]].append(q)
        # round-robin across fine categories, so a small limit still samples all of MT-bench's kinds
        mixed = [
            q
            for rank in range(max(map(len, by_category.values())))
            for qs in by_category.values()
            if rank < len(qs)
            for q in [qs[rank]]
        ]
        selected += mixed[:limit] if limit else mixed
    return selected


def encode_conversation(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt ids ending with the assistant's turn opener (or plain text without a chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    return tokenizer(text)["input_ids"]


def answer_message(tokenizer, output_ids: list[int]) -> dict:
    """A turn's generated ids -> the assistant message that goes back into the conversation before the next turn."""
    return {"role": "assistant", "content": tokenizer.decode(output_ids, skip_special_tokens=True).strip()}


USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "model")


def conversation(row: dict) -> list[tuple[str, str]] | None:
    """A conversation row's turns as (role, text), role "user" or "assistant" (system turns and other roles left
    out): ShareGPT's `conversations` or OpenAI's `messages`. None for rows of other layouts."""
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        return None
    roles = {**dict.fromkeys(USER_ROLES, "user"), **dict.fromkeys(ASSISTANT_ROLES, "assistant")}
    out = []
    for turn in turns:
        role = roles.get(str(turn.get("from", turn.get("role"))).lower())
        text = turn.get("value", turn.get("content"))
        if role is not None and isinstance(text, str):
            out.append((role, text))
    return out


def conversation_turn(row: dict, role: str, after: int) -> str | None:
    """The first `role` turn after the first `after` turns of a conversation row (None: none, or not one)."""
    turns = conversation(row) or []
    if not turns or turns[0][0] != "user":
        return None
    return next((text for who, text in turns[after:] if who == role), None)


def row_prompt(row: dict) -> str | None:
    """The user prompt in one row of any supported layout."""
    if "prompt" in row:
        return row["prompt"]
    if "instruction" in row:
        extra = row.get("input") or ""
        if not extra and row.get("instances"):
            extra = row["instances"][0].get("input", "")
        return row["instruction"] + ("\n\n" + extra if extra else "")
    if "question" in row:
        return row["question"]
    if "turns" in row:
        return row["turns"][0]
    return conversation_turn(row, "user", 0)
