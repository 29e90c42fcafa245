"""Self-distillation data: evaluation prompts dropped, shards written atomically, a killed run resumes exactly."""

import json
import random
import shutil

import pytest

from medusa.answers import token_ids
from medusa.train.config import DataConfig
from medusa.train.data import (
    build_prompt_mix,
    drop_evaluation_overlap,
    load_prompts,
    normalise,
    own_second_turns,
    reference_answers,
)
from medusa.train.generate_data import is_greedy_shard, load_shards, main, reference_response, shard_dirs, shard_groups
from tests.conftest import make_tiny_model, tiny_tokenizer

PROMPTS = [f"Tell me fact number {i} about owls." for i in range(7)] + ["Prove the Pythagorean theorem."]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    base = tmp_path / "base"
    make_tiny_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "mt_bench_question.jsonl").write_text(
        json.dumps({"question_id": 99, "category": "math", "turns": ["Prove the Pythagorean theorem."]}) + "\n"
    )
    monkeypatch.setenv("MEDUSA_BENCH_DATA", str(bench))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "data"
    args = [
        "--model.base",
        str(base),
        "--model.dtype",
        "float32",
        "--data.sources",
        json.dumps({str(prompts): -1}),
        "--data.out_dir",
        str(out),
        "--data.shard_size",
        "3",
        "--data.batch_size",
        "2",
        "--data.max_new_tokens",
        "6",
        "--data.dtype",
        "float32",
        "--data.greedy_fraction",
        "1.0",
    ]
    return args, out


def _rows(out):
    return sorted((tuple(r["input_ids"]), r["response_start"]) for r in load_shards(out))


def test_generates_filters_evaluation_prompts_and_resumes_after_a_kill(setup):
    args, out = setup
    main(args)
    shards = shard_dirs(out)
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]  # 7 prompts kept, 3 per shard
    full = _rows(out)
    assert len(full) == 7 and all(len(ids) > start for ids, start in full)
    text = tiny_tokenizer().decode([t for ids, _ in full for t in ids])
    assert "Pythagorean" not in text  # the MT-bench prompt never reached the training data

    # a kill mid-shard: the last shard is gone and a half-written temporary folder remains
    kept = shards[0].stat().st_mtime_ns
    shutil.rmtree(shards[-1])
    (out / ".shard-00002.tmp-killed").mkdir()  # medusa.fileio.write_directory's temporary name
    main(args)
    assert _rows(out) == full  # greedy answers: the resumed run rebuilds exactly what was lost
    assert shard_dirs(out)[0].stat().st_mtime_ns == kept  # finished shards are not redone
    assert not (out / ".shard-00002.tmp-killed").exists()


def test_resume_with_other_settings_is_refused(setup):
    args, out = setup
    main(args)
    with pytest.raises(ValueError, match="use another data.out_dir"):
        main(args + ["--data.shard_size", "4"])


def _count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(kwargs.get("proposer"))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_medusa_answers_every_row_as_transformers_generate_does(setup, tmp_path, monkeypatch):
    """data.engine medusa (the default) decodes the batches with MedusaModel.generate: greedy fp32 rows identical to
    transformers' generate's, plainly on a base without heads and guessing with data.heads where given (sampled
    rows: test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run resumes them on this engine)."""
    from medusa import MedusaModel

    args, _ = setup
    base = args[args.index("--model.base") + 1]
    heads = tmp_path / "heads"
    MedusaModel.from_base(base, num_heads=2).save_pretrained(heads)
    runs = {}
    calls = _count_calls(monkeypatch, MedusaModel, "generate")
    for name, engine, extra in (
        ("transformers", "transformers", []),
        ("plain", "medusa", []),
        ("heads", "medusa", ["--data.heads", str(heads)]),
    ):
        out = tmp_path / name
        main([*args, "--data.out_dir", str(out), "--data.max_new_tokens", "12", "--data.engine", engine, *extra])
        runs[name] = _rows(out)
        assert json.loads((out / "data_config.json").read_text())["engine"] == engine  # where the data came from
    assert runs["plain"] == runs["transformers"] and runs["heads"] == runs["transformers"]
    assert len(runs["transformers"]) == 7
    # a call per batch of up to 2 prompts of a shard (shards of 3, 3 and 1 prompts): 5 per medusa run, plain on the
    # base without heads, the heads' own proposer with data.heads
    assert calls == ["plain"] * 5 + [None] * 5


def test_an_unknown_answer_engine_and_heads_without_medusa_are_refused():
    with pytest.raises(ValueError, match=r"data.engine must be one of \('medusa', 'transformers'\), got 'vllm'"):
        DataConfig(engine="vllm")
    with pytest.raises(ValueError, match="data.heads guess for the medusa engine"):
        DataConfig(engine="transformers", heads="embedded:smollm2-135m-instruct")


def test_prompts_need_a_chat_template(setup, tmp_path):
    args, _ = setup
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no chat template"):
        main(args)


def test_empty_prompt_source_and_unknown_keys_are_named(setup, tmp_path):
    args, _ = setup
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        main(args + ["--data.sources", json.dumps({str(tmp_path / "empty.jsonl"): -1})])
    with pytest.raises(ValueError, match="unknown key"):
        main(args + ["--data.sorces", "{}"])


def test_greedy_shards_are_spread_evenly():
    assert [is_greedy_shard(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert sum(is_greedy_shard(i, 0.25) for i in range(100)) == 25


def test_max_shards_stops_early_and_resumes_to_the_same_rows(setup):
    args, out = setup
    main(args + ["--data.max_shards", "2"])
    assert [s.name for s in shard_dirs(out)] == ["shard-00000", "shard-00001"]
    first_two = _rows(out)
    main(args)  # the same mix without the cap: continues at shard 2, the first two are kept as they were
    assert len(shard_dirs(out)) == 3 and set(first_two) < set(_rows(out))
    with pytest.raises(ValueError, match="max_shards"):
        main(args + ["--data.max_shards", "0"])


def test_slices_extend_a_mix_without_overlap(setup, tmp_path):
    prompts = str(tmp_path / "prompts.jsonl")
    first = build_prompt_mix({prompts: 3}, seed=0)
    rest = build_prompt_mix({prompts: "3:"}, seed=0)
    everything = build_prompt_mix({prompts: -1}, seed=0)
    assert len(first) == 3 and len(rest) == 4  # 8 prompts, the MT-bench one dropped
    assert not {p for _, p in first} & {p for _, p in rest}
    assert {p for _, p in first} | {p for _, p in rest} == {p for _, p in everything}
    assert len(build_prompt_mix({prompts: "1:3"}, seed=0)) == 2 and build_prompt_mix({prompts: 0}, seed=0) == []
    for bad in ("three", "1:2:3", -2):
        with pytest.raises(ValueError, match="start:stop"):
            build_prompt_mix({prompts: bad}, seed=0)


def test_greedy_shards_are_answered_together_and_give_the_same_rows(setup, tmp_path):
    args, out = setup
    main(args)  # batch 2: one shard at a time
    together = tmp_path / "together"
    main(args + ["--data.out_dir", str(together), "--data.batch_size", "6"])  # two 3-prompt shards per batch
    assert [s.name for s in shard_dirs(together)] == [s.name for s in shard_dirs(out)]
    assert _rows(together) == _rows(out)


def test_shard_groups_join_consecutive_greedy_shards_only():
    cfg = DataConfig(batch_size=8, shard_size=4, greedy_fraction=0.5)  # every other shard is greedy
    assert shard_groups([0, 1, 2, 3, 4, 6], cfg) == [[0], [1], [2], [3], [4], [6]]
    cfg = DataConfig(batch_size=8, shard_size=4, greedy_fraction=1.0)
    assert shard_groups([0, 1, 2, 4, 5], cfg) == [[0, 1], [2], [4, 5]]  # a done shard (3) breaks a run
    assert shard_groups([0, 1, 2], DataConfig(batch_size=2, shard_size=4, greedy_fraction=1.0)) == [[0], [1], [2]]


def test_second_turns_continue_the_first_answer_and_resume(setup):
    args, out = setup
    follow_ups = ["Say more.", "Why so?"]
    args = args + ["--data.second_turn_fraction", "0.5", "--data.follow_ups", json.dumps(follow_ups)]
    main(args)
    rows = load_shards(out)
    assert len(rows) == 7 + 3  # prompts 1, 3 and 5 (an even spread of half) also get a second turn
    first = [(r["input_ids"], r["response_start"]) for r in rows]
    firsts = [ids for ids, start in first if tiny_tokenizer().decode(ids[:start]).count("user:") == 1]
    seconds = [(ids, start) for ids, start in first if tiny_tokenizer().decode(ids[:start]).count("user:") == 2]
    assert len(firsts) == 7 and len(seconds) == 3
    for ids, start in seconds:
        turn = next(f for f in firsts if ids[: len(f)] == f)  # the whole first exchange, answer tokens unchanged
        between = tiny_tokenizer().decode(ids[len(turn) : start])
        assert between in {f" | user: {f} | assistant:" for f in follow_ups}  # the template's next user turn
        assert len(ids) > start  # and the target answered it
    full = _rows(out)
    shutil.rmtree(shard_dirs(out)[1])
    main(args)
    assert _rows(out) == full  # resumes to the same rows, second turns included


def test_prompt_only_data_holds_the_answered_prompts_without_responses(setup, tmp_path):
    """data.answer false: the rows are exactly the prompts the answered data starts with, nothing generated."""
    args, out = setup
    main(args)
    answered = _rows(out)
    prompts_only = tmp_path / "prompts-only"
    main(args + ["--data.out_dir", str(prompts_only), "--data.answer", "false"])
    rows = _rows(prompts_only)
    assert all(start == len(ids) for ids, start in rows)
    assert sorted(ids for ids, _ in rows) == sorted(ids[:start] for ids, start in answered)
    with pytest.raises(ValueError, match="use another data.out_dir"):  # answered and prompt-only never mix in a dir
        main(args + ["--data.out_dir", str(prompts_only)])
    with pytest.raises(ValueError, match="second_turn_fraction needs answers"):
        DataConfig(answer=False, second_turn_fraction=0.5)


def test_follow_ups_from_evaluation_sets_and_bad_fractions_are_refused(setup):
    args, _ = setup
    with pytest.raises(ValueError, match="evaluation prompts"):
        main(args + ["--data.second_turn_fraction", "1.0", "--data.follow_ups", '["Prove the Pythagorean theorem."]'])
    with pytest.raises(ValueError, match="second_turn_fraction"):
        DataConfig(second_turn_fraction=1.5)
    with pytest.raises(ValueError, match="follow_ups"):
        DataConfig(follow_ups=[])


def test_older_data_dirs_without_the_second_turn_keys_resume(setup):
    args, out = setup
    main(args)
    meta = out / "data_config.json"
    settings = json.loads(meta.read_text())
    del settings["second_turn_fraction"], settings["follow_ups"]  # as written before multi-turn data existed
    meta.write_text(json.dumps(settings))
    main(args)  # no "generated with other settings" error
    with pytest.raises(ValueError, match="second_turn_fraction"):
        main(args + ["--data.second_turn_fraction", "0.5"])


def test_evaluation_overlap_filter_equals_the_naive_definition():
    """Dropped = equal to a turn, or containing a turn of >= 20 characters anywhere (mid-word starts included)."""
    rng = random.Random(0)
    words = ["owl", "the", "prove", "theorem", "of", "a", "pythagorean", "x", "tell", "me"]
    turns = {normalise(" ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))) for _ in range(40)}
    turns |= {"prove the pythagorean theorem.", "owls"}
    prompts = []
    for _ in range(400):
        parts = [rng.choice(words) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:  # plant a turn, sometimes glued to the word before it or in other case
            turn = rng.choice(sorted(turns))
            parts.insert(rng.randint(0, len(parts)), turn.upper() if rng.random() < 0.3 else turn)
        prompts.append(("" if rng.random() < 0.5 else "  ").join(parts) if rng.random() < 0.2 else " ".join(parts))
    long_turns = [t for t in turns if len(t) >= 20]
    naive = [p for p in prompts if normalise(p) not in turns and not any(t in normalise(p) for t in long_turns)]
    kept = drop_evaluation_overlap(prompts, turns)
    assert kept == naive
    assert 0 < len(kept) < len(prompts)  # the case mixes both outcomes


@pytest.mark.slow  # filters all 52k T0 prompts against the evaluation sets four times (~20 s)
def test_the_shipped_data_parts_do_not_overlap():
    """The greedy parts never share a prompt; the sampled part and the fourth (GPU) part re-ask Alpaca only; the
    prompt-only part shares none with any of them."""
    from pathlib import Path

    from medusa.train.config import load_config

    repo = Path(__file__).resolve().parent.parent
    names = ("smollm2-135m.yaml", "smollm2-135m-chat-data.yaml", "smollm2-135m-sampled-data.yaml")
    parts = [load_config(str(repo / "configs" / name)).data for name in names]
    first, second, sampled = ({(src, p) for src, p in build_prompt_mix(c.sources, c.seed)} for c in parts)
    assert len(second) == 3600 and not first & second
    assert {src for src, _ in sampled} == {"bench:t0", "bench:alpaca", "bench:gsm8k"}
    assert not {x for x in sampled if x[0] != "bench:alpaca"} & (first | second)  # new T0 and GSM8K prompts
    assert parts[2].greedy_fraction == 0.0
    # the prompt-only T0 part holds no prompt an answered part holds
    prompts = load_config(str(repo / "configs" / "smollm2-135m-prompts-data.yaml")).data
    prompt_only = set(build_prompt_mix(prompts.sources, prompts.seed))
    assert not prompts.answer and not prompt_only & (first | second | sampled)
    # the fourth answered part (GPU) asks new T0 and GSM8K prompts and re-asks Alpaca only
    more_cfg = load_config(str(repo / "configs" / "smollm2-135m-more-data.yaml")).data
    more = set(build_prompt_mix(more_cfg.sources, more_cfg.seed))
    assert {src for src, _ in more & (first | second | sampled | prompt_only)} == {"bench:alpaca"}
    assert {src for src, _ in more} == {"bench:t0", "bench:alpaca", "bench:gsm8k"}
    # the shipped recipe reads every part
    read = {str(repo / d) for d in parts[0].extra_dirs}
    assert read == {str(repo / c.out_dir) for c in (*parts[1:], more_cfg, prompts)}


def test_a_mistyped_prompt_path_writes_nothing_and_a_corrupt_record_is_named(setup, tmp_path):
    args, out = setup
    with pytest.raises(FileNotFoundError):
        main(args + ["--data.sources", json.dumps({str(tmp_path / "promts.jsonl"): -1})])
    assert not (out / "data_config.json").exists()  # so the corrected run is not refused as "other settings"
    main(args)
    (out / "data_config.json").write_text('{"seed": 0, ')
    with pytest.raises(ValueError, match="data_config.json is not valid JSON"):
        main(args)


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(setup, tmp_path):
    """A real SIGKILL (no cleanup runs) while shards are being written: the re-run completes the data, and every
    row, greedy and sampled, equals an uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    args, out = setup
    prompts = tmp_path / "many.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Tell me fact number {i} about owls."}) + "\n" for i in range(60))
    )
    args = args + [
        "--data.sources",
        json.dumps({str(prompts): -1}),
        "--data.greedy_fraction",
        "0.5",
        "--data.max_new_tokens",
        "24",
    ]
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, str(repo / "train" / "generate_data.py"), *args],
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (out / "shard-00001").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{stderr[-2000:]}"
    written = len(shard_dirs(out))
    assert 0 < written < 20, written  # killed part-way: some shards written, not all
    main(args)  # the re-run
    whole = tmp_path / "whole"
    main(args + ["--data.out_dir", str(whole)])
    assert len(shard_dirs(out)) == len(shard_dirs(whole)) == 20
    assert _rows(out) == _rows(whole)
    assert not list(out.glob(".*.tmp-*"))


def test_reference_answers_are_the_sources_own_answers_through_the_chat_template(setup, tmp_path):
    """data.reference_answers: each response is the row's own answer (GSM8K's calculator notes removed), rendered as
    the chat template writes an assistant turn and cut to max_new_tokens; rows without an answer are left out."""
    args, out = setup
    rows = [
        {"instruction": "Name a bird.", "input": "", "output": "Owl"},
        {"question": "What is 48/2?", "answer": "It is 48/2 = <<48/2=24>>24. #### 24"},
        {"instruction": "Say nothing.", "input": "", "output": ""},  # no answer: left out
        {"instruction": "Prove the Pythagorean theorem.", "output": "By areas."},  # an evaluation turn: dropped
    ]
    source = tmp_path / "answered.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reference = tmp_path / "reference"
    base = args + ["--data.sources", json.dumps({str(source): -1}), "--data.max_new_tokens", "40"]
    main(base + ["--data.out_dir", str(reference), "--data.reference_answers", "true"])
    tokenizer = tiny_tokenizer()
    texts = sorted(
        (
            tokenizer.decode(r["input_ids"][: r["response_start"]]),
            tokenizer.decode(r["input_ids"][r["response_start"] :]),
        )
        for r in load_shards(reference)
    )
    assert texts == [
        ("user: Name a bird. | assistant:", " Owl | "),
        ("user: What is 48/2? | assistant:", " It is 48/2 = 24. #### 24 | "),
    ]
    short = tmp_path / "short"
    main(base + ["--data.out_dir", str(short), "--data.reference_answers", "true", "--data.max_new_tokens", "3"])
    assert sorted(len(r["input_ids"]) - r["response_start"] for r in load_shards(short)) == [3, 3]
    with pytest.raises(ValueError, match="no answers to train on"):  # a source of prompts alone is named
        main(args + ["--data.out_dir", str(tmp_path / "none"), "--data.reference_answers", "true"])
    with pytest.raises(ValueError, match="set one of them"):
        DataConfig(answer=False, reference_answers=True)
    with pytest.raises(ValueError, match="reference answers cannot"):
        DataConfig(reference_answers=True, second_turn_fraction=0.5)


def test_a_reference_answer_ends_at_the_templates_end_of_turn_token():
    """What a template writes after the end-of-turn token (SmolLM2's newline) is not part of the answer."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}~ {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    item = {"prompt": "Hi", "prompt_ids": token_ids(prompt_ids)}
    end = tokenizer.convert_tokens_to_ids("~")
    response = reference_response(tokenizer, item, "Hello", [end], max_new_tokens=64)
    assert tokenizer.decode(response) == "Hello~"
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(ValueError, match="different prefix"):  # the generation prompt is not what answers follow
        reference_response(
            tokenizer, {"prompt": "Hi", "prompt_ids": [tokenizer.convert_tokens_to_ids(">")]}, "x", [end], 9
        )


SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Name an owl."},
            {"from": "gpt", "value": "The barn owl."},
            {"from": "human", "value": "Where does it live?"},
            {"from": "gpt", "value": "Almost everywhere."},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "Name a hawk."}, {"from": "gpt", "value": "A kestrel."}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Hi."}]},  # no prompt
    {"id": "d", "conversations": [{"from": "human", "value": "Prove the Pythagorean theorem."}]},  # evaluation
]
MESSAGES = [
    {
        "messages": [
            {"role": "user", "content": "Name an owl."},
            {"role": "assistant", "content": "The barn owl."},
            {"role": "user", "content": "Where does it live?"},
        ]
    },
    {"messages": [{"role": "User", "content": "Name a hawk."}, {"role": "Assistant", "content": "A kestrel."}]},
]


@pytest.mark.parametrize("rows", [SHAREGPT, MESSAGES], ids=["sharegpt", "messages"])
def test_conversations_give_prompts_answers_and_their_own_second_turns(tmp_path, rows):
    source = tmp_path / "chats.json"
    source.write_text(json.dumps(rows))
    prompts = load_prompts(str(source))
    assert prompts[:2] == ["Name an owl.", "Name a hawk."] and "Hello!" not in prompts and "Hi." not in prompts
    assert reference_answers(str(source)) == {"Name an owl.": "The barn owl.", "Name a hawk.": "A kestrel."}
    assert own_second_turns(str(source)) == {"Name an owl.": "Where does it live?"}


def test_a_conversation_asks_its_own_next_turn_as_the_second_turn(setup, tmp_path):
    """ShareGPT rows train as multi-turn conversations: the second turn is the user's own next message where the
    conversation has one (a data.follow_ups one elsewhere); the evaluation prompt is dropped as in any source."""
    args, out = setup
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(SHAREGPT))
    args = args + ["--data.sources", json.dumps({str(source): -1}), "--data.second_turn_fraction", "1.0"]
    main(args + ["--data.follow_ups", json.dumps(["Say more."])])
    tokenizer = tiny_tokenizer()
    rows = [(r["input_ids"], r["response_start"]) for r in load_shards(out)]
    firsts = {
        tokenizer.decode(ids[:start]): ids for ids, start in rows if tokenizer.decode(ids[:start]).count("user:") == 1
    }
    assert sorted(firsts) == ["user: Name a hawk. | assistant:", "user: Name an owl. | assistant:"]
    seconds = {}
    for ids, start in rows:
        if tokenizer.decode(ids[:start]).count("user:") == 2:
            first = next(text for text, turn in firsts.items() if ids[: len(turn)] == turn)
            seconds[first] = tokenizer.decode(ids[len(firsts[first]) : start])
    assert seconds == {
        "user: Name an owl. | assistant:": " | user: Where does it live? | assistant:",
        "user: Name a hawk. | assistant:": " | user: Say more. | assistant:",
    }


def test_a_bench_source_without_bench_data_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_DATA", str(tmp_path))  # as an installed wheel: no bench_data folder
    with pytest.raises(FileNotFoundError, match="MEDUSA_BENCH_DATA"):
        load_prompts("bench:alpaca")


class FakeHub:
    """datasets.load_dataset stood in for: 100 ShareGPT rows, counting how many a streamed read consumed."""

    def __init__(self):
        self.calls, self.consumed = [], 0

    def rows(self):
        for i in range(100):
            self.consumed += 1
            yield {"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": f"A{i}."}]}

    def __call__(self, dataset_id, split="train", streaming=False):
        self.calls.append((dataset_id, split, streaming))
        return self.rows() if streaming else list(self.rows())


def test_hub_sources_load_whole_or_stream_only_the_rows_asked(monkeypatch):
    import datasets

    hub = FakeHub()
    monkeypatch.setattr(datasets, "load_dataset", hub)
    first = build_prompt_mix({"hf-stream:org/big:train": 5})
    assert sorted(p for _, p in first) == [f"Question {i}?" for i in range(5)]  # the stream's first rows
    assert hub.calls == [("org/big", "train", True)] and hub.consumed == 5  # and no more were read
    more = build_prompt_mix({"hf-stream:org/big:train": "5:9"})
    assert sorted(p for _, p in more) == [f"Question {i}?" for i in range(5, 9)]  # a slice past them: new prompts
    assert len(build_prompt_mix({"hf:org/small": 7})) == 7 and hub.calls[-1] == ("org/small", "train", False)
    assert reference_answers("hf-stream:org/big", 2) == {"Question 0?": "A0.", "Question 1?": "A1."}
    with pytest.raises(ValueError, match="needs a count"):
        build_prompt_mix({"hf-stream:org/big": -1})
