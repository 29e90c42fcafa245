"""Self-distillation data: the target answers training prompts through its chat template.

    python train/generate_data.py --config configs/smollm2-135m.yaml [--data.sources '{bench:alpaca: 100}']

Output: `<data.out_dir>/shard-00000/ ...`, each a `datasets` dataset on disk with columns
`input_ids` (prompt + response tokens), `response_start`, `source`, `greedy`. A shard is written to a temporary
folder and renamed into place, so a killed run loses at most the shard in flight and a restart continues there.
The answers come from `MedusaModel.generate` over each batch (`data.engine: medusa`, with `data.heads`: every row as
the base alone would decode it), or from the base's own transformers `generate` (`data.engine: transformers`).
With `data.second_turn_fraction` > 0 some conversations also get a follow-up user turn that the target answers (a
conversation source's own next user turn where it has one, else one of `data.follow_ups`);
they are stored as a second row (prompt + answer + follow-up + second answer, `response_start` at the second answer).
With `data.reference_answers: true` nothing is generated either: each prompt's response is its source's own answer
(Alpaca's output, GSM8K's answer; sources without answers are refused), rendered through the chat template.
With `data.answer: false` nothing is generated: each row is a prompt alone (`response_start` = its length), data
that training reads only with `training.prompt_tokens` (the heads then learn the base's distribution over it).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from medusa.answers import answer_prompts, stop_and_pad_ids, token_ids, tokenize_prompts
from medusa.fileio import atomic_write_text, write_directory
from medusa.loading import load_base
from medusa.train.config import DataConfig, parse_args
from medusa.train.data import (
    build_prompt_mix,
    drop_evaluation_overlap,
    evaluation_prompts,
    own_second_turns,
    reference_answers,
    rows_to_read,
)

# The settings a data directory was made with (read back on resume, and by training: data.answer).
SETTINGS_NAME = "data_config.json"

# Fields that decide which prompt lands in which shard: a resumed run must agree on them.
ORDER_FIELDS = (
    "sources",
    "seed",
    "shard_size",
    "max_prompt_tokens",
    "second_turn_fraction",
    "follow_ups",
    "answer",
    "reference_answers",
)

# Generic second turns, in the spirit of MT-bench's follow-up questions (none of them is an evaluation turn).
DEFAULT_FOLLOW_UPS = [
    "Can you explain that in more detail?",
    "Summarize your answer in two sentences.",
    "Give a concrete example.",
    "Rewrite your answer so that a ten-year-old understands it.",
    "What are the weaknesses or limits of your answer?",
    "Now present the same answer as a numbered list.",
    "Make it shorter and more formal.",
    "Why? Explain your reasoning step by step.",
]
PLACEHOLDER = "MEDUSAPLACEHOLDERANSWER"


def shard_dirs(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("shard-*") if p.is_dir())


def load_shards(out_dir: str | Path):
    """Every finished shard of a data directory as one `datasets.Dataset`."""
    from datasets import concatenate_datasets, load_from_disk

    shards = shard_dirs(Path(out_dir))
    if not shards:
        raise FileNotFoundError(f"no data shards in {out_dir}: run train/generate_data.py first")
    return concatenate_datasets([load_from_disk(str(s)) for s in shards])


def is_greedy_shard(shard: int, greedy_fraction: float) -> bool:
    """Spread greedy shards evenly (fraction 0.5: every other shard), so any prefix of the data has the mix."""
    return int((shard + 1) * greedy_fraction) > int(shard * greedy_fraction)


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def shard_groups(pending: list[int], cfg: DataConfig) -> list[list[int]]:
    """Shards answered together: consecutive greedy shards fill one batch_size (a GPU answers 512 prompts about as
    fast as 64); a sampled shard stays alone, so its random stream, seeded by the shard, survives a resume."""
    groups: list[list[int]] = []
    per_group = max(1, cfg.batch_size // cfg.shard_size)
    for shard in pending:
        last = groups[-1] if groups else None
        if (
            last
            and is_greedy_shard(shard, cfg.greedy_fraction)
            and is_greedy_shard(last[0], cfg.greedy_fraction)
            and last[-1] == shard - 1
            and len(last) < per_group
        ):
            last.append(shard)
        else:
            groups.append([shard])
    return groups


def check_resume(out_dir: Path, cfg: DataConfig) -> None:
    """Refuse to resume `out_dir` with settings that would change its rows (reads only: nothing is written yet)."""
    meta = out_dir / SETTINGS_NAME
    current = {k: asdict(cfg)[k] for k in ORDER_FIELDS}
    if meta.is_file():
        try:
            recorded = json.loads(meta.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{meta} is not valid JSON ({err}): it records the settings of the data in {out_dir}; "
                "restore it, or use another data.out_dir"
            ) from err
        defaults = asdict(DataConfig())  # keys an older data_config.json lacks had their defaults then
        previous = {k: recorded.get(k, defaults[k]) for k in ORDER_FIELDS}
        if previous != current:
            raise ValueError(
                f"{out_dir} was generated with {previous}, this run asks for {current}: "
                "use another data.out_dir or the same settings to resume"
            )


def record_settings(out_dir: Path, cfg: DataConfig) -> None:
    """Written once the prompts have been read, so a mistyped prompt path leaves nothing that refuses the fix."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / SETTINGS_NAME, json.dumps(asdict(cfg), indent=2))


def next_turn_ids(tokenizer, prompt: str, follow_up: str, response: list[int], stop_ids: list[int]) -> list[int]:
    """The tokens between the first answer and the second one: the chat template's end of the assistant turn, the
    follow-up as a user turn, and the generation prompt. Cut from the rendered template around a placeholder
    answer, so the first answer keeps the exact tokens the target generated."""
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": PLACEHOLDER},
            {"role": "user", "content": follow_up},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    if PLACEHOLDER not in text:
        raise ValueError(
            "the chat template does not render assistant turns verbatim: data.second_turn_fraction "
            "needs one that does (set it to 0 for single-turn data)"
        )
    ids = token_ids(tokenizer(text[text.index(PLACEHOLDER) + len(PLACEHOLDER) :], add_special_tokens=False))
    if response and response[-1] in stop_ids and ids and ids[0] == response[-1]:
        ids = ids[1:]  # the answer already ends with the end-of-turn token the template writes
    return ids


def check_follow_ups(follow_ups: list[str]) -> list[str]:
    """Second turns must not be evaluation prompts either."""
    leaked = [f for f in follow_ups if f not in drop_evaluation_overlap(follow_ups, evaluation_prompts())]
    if leaked:
        raise ValueError(
            f"data.follow_ups holds evaluation prompts {leaked[:3]}: training on them would inflate "
            "the measured accuracy; remove them"
        )
    return follow_ups


def conversation_second_turns(sources) -> dict[tuple[str, str], str]:
    """(source, prompt) -> the next user turn of the source's own conversation (ShareGPT / messages rows), asked as
    the second turn instead of a data.follow_ups one; turns matching an evaluation prompt are left out."""
    evaluation, turns = evaluation_prompts(), {}
    for source in sources:
        own = own_second_turns(source, rows_to_read(source, sources[source]))
        allowed = set(drop_evaluation_overlap(list(dict.fromkeys(own.values())), evaluation))
        turns.update({(source, prompt): turn for prompt, turn in own.items() if turn in allowed})
    return turns


def has_second_turn(index: int, fraction: float) -> bool:
    return is_greedy_shard(index, fraction)  # the same even spread, over conversations


def answering_model(config):
    """What answers the prompts (data.engine, data.heads) -> (model, tokenizer, proposer for its generate): the base
    itself under transformers' generate; else a MedusaModel over it with data.heads (the shipped heads on the
    embedded default base), its plan choosing how each batch decodes, or, with no heads for this base, its plan's
    fastest plain decoding (proposer "plain": the untrained heads from_base adds never guess)."""
    cfg, device = config.data, config.model.resolved_device()
    if cfg.engine == "transformers":
        return (*load_base(config.model.base, dtype=cfg.dtype, device=device), None)
    from medusa.model import MedusaModel

    if cfg.heads is not None or config.model.base is None:
        model = MedusaModel.from_pretrained(cfg.heads, base=config.model.base, dtype=cfg.dtype, device=device)
        return model, model.tokenizer, None
    model = MedusaModel.from_base(config.model.base, dtype=cfg.dtype, device=device)  # its plan: the engines timed
    return model, model.tokenizer, "plain"


def answer_pairs(
    model,
    pairs: list[tuple[int, dict]],
    pad_id: int,
    eos_ids: list[int],
    cfg: DataConfig,
    greedy: bool,
    proposer: str | None = None,
):
    """(shard, item) pairs -> (shard, item, response), answered batch_size at a time in order of prompt length;
    `proposer` goes to a medusa model's generate."""
    answers = answer_prompts(
        model,
        [item["prompt_ids"] for _, item in pairs],
        pad_id,
        eos_ids,
        cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        greedy=greedy,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        proposer=proposer,
    )
    for i, response in answers:
        shard, item = pairs[i]
        yield shard, item, response


def reference_response(tokenizer, item: dict, answer: str, eos_ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens the chat template puts after the generation prompt for `answer`, up to and including its end-of-turn
    token (what a generated answer stops at), cut to max_new_tokens like a generated one."""
    conversation = [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": answer}]
    ids = token_ids(tokenizer.apply_chat_template(conversation))
    prompt_ids = item["prompt_ids"]
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "the chat template renders an answered conversation with a different prefix than the generation prompt: "
            "data.reference_answers needs one that does not (set it false and let the target answer)"
        )
    response = ids[len(prompt_ids) :]
    ends = [i for i, token in enumerate(response) if token in eos_ids]
    if ends:
        response = response[: ends[-1] + 1]  # drop what the template writes after the end-of-turn token
    return response[:max_new_tokens]


def add_record(records: list[dict], item: dict, response: list[int], greedy: bool) -> int:
    """Append one conversation row (prompt + response); return the number of response tokens."""
    records.append(
        {
            "input_ids": item["prompt_ids"] + response,
            "response_start": len(item["prompt_ids"]),
            "source": item["source"],
            "greedy": greedy,
        }
    )
    return len(response)


def main(argv=None) -> None:
    _, config = parse_args(__doc__, argv)
    cfg = config.data
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    check_resume(out_dir, cfg)
    mix = build_prompt_mix(
        cfg.sources, cfg.seed
    )  # reads the prompt files: before the model loads or anything is written
    follow_ups = check_follow_ups(cfg.follow_ups or DEFAULT_FOLLOW_UPS)
    own_turns = conversation_second_turns(cfg.sources) if cfg.second_turn_fraction > 0 else {}
    references = None
    if cfg.reference_answers:
        references = {
            source: reference_answers(source, rows_to_read(source, count)) for source, count in cfg.sources.items()
        }
        mix = [(source, prompt) for source, prompt in mix if prompt in references[source]]  # rows without an answer
    model, tokenizer, proposer = answering_model(config)
    eos_ids, pad_id = stop_and_pad_ids(getattr(model, "base", model), tokenizer)

    items = tokenize_prompts(tokenizer, mix, cfg.max_prompt_tokens)
    record_settings(out_dir, cfg)
    n_shards = (len(items) + cfg.shard_size - 1) // cfg.shard_size
    if cfg.max_shards is not None:
        n_shards = min(n_shards, cfg.max_shards)
        items = items[: n_shards * cfg.shard_size]
    done = {p.name for p in shard_dirs(out_dir)}
    from datasets import Dataset

    desc = "reference answers" if references else "self-distill" if cfg.answer else "prompts"
    bar = tqdm(total=len(items), unit="prompt", desc=desc)
    bar.update(
        sum(min(cfg.shard_size, len(items) - s * cfg.shard_size) for s in range(n_shards) if shard_name(s) in done)
    )
    tokens, start = 0, time.time()
    for group in shard_groups([s for s in range(n_shards) if shard_name(s) not in done], cfg):
        greedy = is_greedy_shard(group[0], cfg.greedy_fraction)
        torch.manual_seed(
            cfg.seed * 100_003 + group[0]
        )  # a sampled shard is its own group: a resume resamples it alike
        chunk = [
            (shard, item) for shard in group for item in items[shard * cfg.shard_size : (shard + 1) * cfg.shard_size]
        ]
        records, second = {shard: [] for shard in group}, []
        if references:
            answered = (
                (
                    shard,
                    item,
                    reference_response(
                        tokenizer, item, references[item["source"]][item["prompt"]], eos_ids, cfg.max_new_tokens
                    ),
                )
                for shard, item in chunk
            )
        elif cfg.answer:
            answered = answer_pairs(model, chunk, pad_id, eos_ids, cfg, greedy, proposer)
        else:
            answered = ((shard, item, []) for shard, item in chunk)  # prompt-only data: no response
        for shard, item, response in answered:
            tokens += add_record(records[shard], item, response, greedy)
            if has_second_turn(item["index"], cfg.second_turn_fraction):
                follow_up = (
                    own_turns.get((item["source"], item["prompt"])) or follow_ups[item["index"] % len(follow_ups)]
                )
                context = records[shard][-1]["input_ids"] + next_turn_ids(
                    tokenizer, item["prompt"], follow_up, response, eos_ids
                )
                if len(context) <= cfg.max_prompt_tokens:
                    second.append((shard, {**item, "prompt_ids": context}))
            bar.update(1)
            bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / (time.time() - start):.0f}", refresh=False)
        # second turns, after every first answer of the group
        for shard, item, response in answer_pairs(model, second, pad_id, eos_ids, cfg, greedy, proposer):
            tokens += add_record(records[shard], item, response, greedy)
            bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / (time.time() - start):.0f}", refresh=False)
        for shard in group:  # each written whole into place: a killed run leaves no half-written shard
            rows = Dataset.from_list(records[shard])
            write_directory(out_dir / shard_name(shard), lambda tmp, rows=rows: rows.save_to_disk(str(tmp)))
    bar.close()
    print(
        f"{n_shards} shards in {out_dir}; "
        + (
            f"{tokens} reference answer tokens this run"
            if references
            else f"{tokens} response tokens generated this run"
            if cfg.answer
            else "prompts only (data.answer false)"
        )
    )


if __name__ == "__main__":
    main()
