"""medusa bench (medusa/cli/bench.py): question selection, step accounting, the speedup formula, a tiny run."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from medusa import llama_cpp
from medusa.cli import bench as benchmark
from medusa.questions import encode_conversation, load_questions, per_group
from tests.conftest import make_tiny_model, save_tiny_checkpoint, tiny_tokenizer
from tests.test_llama_cpp import COMPLETION_STDERR, fake, write_gguf  # noqa: F401 - fake is a fixture

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(autouse=True)
def cache_of_this_test(tmp_path, monkeypatch):
    """`medusa bench` calibrates plans for the tiny models it runs: kept in the test's folder, not in the user's
    cache (where they accumulated, one per test run)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "medusa-cache"))


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
    {"question_id": 82, "category": "roleplay", "turns": ["Pretend to be a cat.", "Now a dog."]},
    {"question_id": 91, "category": "writing", "turns": ["Write a haiku."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: the cat sat on the mat, the cat sat."]},
]


def test_without_matplotlib_the_chart_is_left_out_with_a_note(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    benchmark.plot_speedups({"per_category": {}, "overall": {}, "settings": {}}, tmp_path / "speedup.png")
    assert not (tmp_path / "speedup.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_load_questions_groups_mt_bench_and_limits_per_group(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    selected = per_group(load_questions(str(path)), limit=2)
    assert [(q["question_id"], q["group"]) for q in selected] == [
        (81, "mt_bench"),
        (82, "mt_bench"),
        (161, "translation"),
    ]
    assert len(per_group(load_questions(str(path)), limit=None)) == 4
    path.write_text(json.dumps({"question_id": 1, "category": "x"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_questions(str(path))


def test_longest_context_bounds_every_turn_with_full_length_answers():
    """The benchmark compiles cache sizes up to this bound before timing: no turn may need more rows."""
    tokenizer = tiny_tokenizer()  # one id per character
    max_new_tokens = 12
    bound = benchmark.longest_context(QUESTIONS, tokenizer, max_new_tokens)
    for q in QUESTIONS:
        messages = []
        for text in q["turns"]:
            messages.append({"role": "user", "content": text})
            rows = len(encode_conversation(tokenizer, messages)) + max_new_tokens
            assert rows + benchmark.PROPOSAL_ROWS <= bound
            messages.append({"role": "assistant", "content": "x" * max_new_tokens})
    assert benchmark.longest_context(QUESTIONS[2:3], tokenizer, 0) < bound


def test_steps_from_calls():
    # prefill of a 10-token prompt, then steps feeding 1 + 3 guesses: 4 tokens committed, then 2, then 1 (the last
    # call's result is unknown: left out)
    calls = [[0, 10, 0.1], [10, 4, 0.1], [14, 4, 0.1], [16, 4, 0.1], [17, 4, 0.1]]
    committed, guesses = benchmark.steps_from_calls(calls)
    assert committed == [4, 2, 1] and guesses == [3, 3, 3]


def test_predicted_speedup():
    assert benchmark.predicted_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert benchmark.predicted_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
    assert benchmark.predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # (1 - 0.125) / 0.5
    assert benchmark.predicted_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)


def test_benchmark_smoke(tmp_path):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in (QUESTIONS[0], QUESTIONS[3])) + "\n")
    methods = "baseline,prompt_lookup,medusa,medusa_dynamic,hybrid,lookup,assisted"
    argv = [
        "--questions",
        str(questions),
        "--methods",
        methods,
        "--out",
        str(tmp_path / "run"),
        "--base",
        str(base_dir),
        "--heads",
        str(heads_dir),
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
    ]
    summary = benchmark.main(argv)

    ran = methods.split(",")[:-1]  # 'assisted' is skipped without --draft
    assert list(summary["overall"]) == ran
    assert "--draft" in summary["settings"]["skipped"]["assisted"]
    assert set(summary["per_category"]) == {"mt_bench", "translation"}
    base = summary["overall"]["baseline"]
    assert base["speedup"] == pytest.approx(1.0) and base["tau"] == pytest.approx(1.0)
    for method, stats in summary["overall"].items():
        assert stats["identical"] is True, method  # greedy, fp32: every method is lossless
        assert stats["tokens_per_s"] > 0 and stats["tau"] >= 1.0
        assert stats["new_tokens"] == 3 * 12  # three turns (two for the MT-bench question), no EOS in tiny models
    assert summary["overall"]["prompt_lookup"]["c"] == 0.0
    assert summary["overall"]["medusa"]["gamma"] > 0 and summary["overall"]["medusa"]["c"] > 0

    out = tmp_path / "run"
    for name in ("summary.json", "summary.md", "speedup.png", "raw.jsonl", "settings.json"):
        assert (out / name).is_file(), name
    raw = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    assert len(raw) == 2 * len(ran)
    depth = max(len(path) for path in summary["settings"]["tree_paths"])  # the recorded tree is the one medusa ran
    assert {n for r in raw if r["method"] == "medusa" for t in r["turns"] for n in t["proposed_lengths"]} == {depth}
    mt = next(r for r in raw if r["question_id"] == 81 and r["method"] == "medusa")
    assert len(mt["turns"]) == 2  # the second prompt holds the first exchange and the new question:
    assert mt["turns"][1]["prompt_tokens"] > mt["turns"][0]["prompt_tokens"] + len(QUESTIONS[0]["turns"][1])
    assert "| baseline |" in (out / "summary.md").read_text()

    again = benchmark.main(argv)  # resumes: nothing is rerun
    assert len((out / "raw.jsonl").read_text().splitlines()) == 2 * len(ran)
    assert again["overall"]["medusa"]["new_tokens"] == summary["overall"]["medusa"]["new_tokens"]
    with pytest.raises(ValueError, match="other settings"):
        benchmark.main(argv[:-4] + ["--max-new-tokens", "8", "--threads", "1"])


def test_benchmark_draft_rows_greedy_and_sampled(tmp_path):
    """The draft-model rows (ours and transformers' assisted generation) with an early-exit draft, at T=0 and T=0.7."""
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    common = [
        "--questions",
        str(questions),
        "--base",
        str(base_dir),
        "--heads",
        str(heads_dir),
        "--max-new-tokens",
        "10",
        "--threads",
        "1",
        "--draft",
        "early-exit:1",
        "--gamma",
        "2",
    ]
    greedy = benchmark.main(common + ["--methods", "baseline,assisted,draft", "--out", str(tmp_path / "greedy")])
    for method in ("assisted", "draft"):
        assert greedy["overall"][method]["identical"] is True, method
    draft = greedy["overall"]["draft"]
    assert draft["gamma"] == pytest.approx(2.0) and 0.0 <= draft["alpha"] <= 1.0 and draft["c"] > 0
    assert greedy["settings"]["gamma"] == 2
    sampled = benchmark.main(
        common
        + [
            "--methods",
            "baseline,medusa,medusa_typical,draft",
            "--temperature",
            "0.7",
            "--out",
            str(tmp_path / "sampled"),
        ]
    )
    assert set(sampled["overall"]) == {"baseline", "medusa", "medusa_typical", "draft"}
    assert sampled["settings"]["temperature"] == 0.7
    assert all(stats["tau"] >= 1.0 and 1 <= stats["new_tokens"] <= 10 for stats in sampled["overall"].values())


def test_divergence_finds_the_first_differing_token():
    divergence = load_script("divergence")
    assert divergence.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert divergence.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert divergence.first_difference([1, 2], [1, 2, 3]) == 2
    turns = lambda *outs: [{"output_ids": o} for o in outs]  # noqa: E731
    records = [
        {"question_id": 1, "method": "baseline", "turns": turns([4, 5, 6], [7, 8])},
        {"question_id": 1, "method": "medusa", "turns": turns([4, 5, 6], [7, 9])},  # turn 1, token 1
        {"question_id": 1, "method": "hybrid", "turns": turns([4, 6, 6], [1, 1])},  # turn 0, token 1 (only)
        {"question_id": 1, "method": "lookup", "turns": turns([4, 5], [7, 8])},
    ]  # a prefix: not scored
    found = divergence.divergences(records, {1: {"turns": ["a", "b"]}})
    assert [(d["method"], d["turn"], d["position"], d["baseline_token"], d["method_token"]) for d in found] == [
        ("medusa", 1, 1, 8, 9),
        ("hybrid", 0, 1, 5, 6),
    ]
    assert found[0]["earlier_turns"] == [[4, 5, 6]] and found[0]["prefix"] == [7]


def test_divergence_report_on_a_half_precision_run(tmp_path):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS[:3]) + "\n")
    run = tmp_path / "run"
    benchmark.main(
        [
            "--questions",
            str(questions),
            "--methods",
            "baseline,medusa,hybrid",
            "--out",
            str(run),
            "--base",
            str(base_dir),
            "--heads",
            str(heads_dir),
            "--max-new-tokens",
            "24",
            "--threads",
            "1",
            "--dtype",
            "bfloat16",
        ]
    )
    result = load_script("divergence").main([str(run)])
    assert set(result["summary"]) == {"medusa", "hybrid"}
    for counts in result["summary"].values():
        assert counts["outputs"] == 3 and 0 <= counts["near_ties"] <= counts["differ"] <= 3
    assert json.loads((run / "divergence.json").read_text())["summary"] == result["summary"]
    for case in result["cases"]:
        assert case["half_error"] >= 0 and isinstance(case["near_tie"], bool)
    # Scoring one case by hand: the float32 gap is the difference of the two tokens' float32 logits.
    divergence = load_script("divergence")
    from medusa.loading import load_base

    exact, tokenizer = load_base(str(base_dir), dtype=torch.float32)
    half, _ = load_base(str(base_dir), dtype=torch.bfloat16, tokenizer=tokenizer)
    case = {
        "question_id": 1,
        "method": "medusa",
        "turn": 0,
        "position": 2,
        "baseline_token": 40,
        "method_token": 41,
        "earlier_turns": [],
        "prefix": [50, 51],
        "turns": ["hello"],
    }
    scored = divergence.score(case, exact, half, tokenizer)
    logits = divergence.last_logits(exact, divergence.context_ids(tokenizer, case))
    assert scored["float32_gap"] == pytest.approx(float(logits[40] - logits[41]))
    assert scored["near_tie"] == (
        abs(scored["float32_gap"]) <= max(2 * scored["half_error"], divergence.NEAR_TIE_LOGITS)
    )


def test_llama_cpp_runs_beside_our_methods_timed_by_its_own_lines(tmp_path, fake, monkeypatch):  # noqa: F811
    """The peer gets the same chat-templated prompt as text; its tokens/s come from llama.cpp's prompt-eval + eval
    times (model load left out), its text is tokenized to compare outputs, and every method gets a vs llama.cpp
    ratio. Without binaries, or without a GGUF base, the peer is skipped and says why."""
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    argv = ["--questions", str(questions), "--base", str(base_dir), "--heads", str(heads_dir)]
    argv += ["--max-new-tokens", "12", "--threads", "1", "--plan", "off"]
    skipped = benchmark.main([*argv, "--methods", "baseline,llama_cpp", "--out", str(tmp_path / "no-gguf")])
    assert "GGUF" in skipped["settings"]["skipped"]["llama_cpp"] and list(skipped["overall"]) == ["baseline"]

    monkeypatch.setattr(benchmark, "base_gguf", lambda source: write_gguf(tmp_path / "m.gguf", 0))  # F32
    fake.behave(text="the cat sat", stderr=COMPLETION_STDERR, crash_unless_no_repack=True)
    monkeypatch.setattr(llama_cpp, "WITHOUT_REPACKING", set())
    (tmp_path / "BUILD_INFO").write_text("llama.cpp from llama-cpp-python 9.9, built for AVX2\n")  # beside bin/
    summary = benchmark.main([*argv, "--methods", "baseline,llama_cpp", "--out", str(tmp_path / "run")])
    peer = summary["overall"]["llama_cpp"]
    assert peer["new_tokens"] == 64 and peer["time_s"] == pytest.approx((692.10 + 7433.03 + 3.13) / 1000)
    assert peer["speedup_vs_llama_cpp"] == pytest.approx(1.0) and peer["tau"] == pytest.approx(1.0)
    base = summary["overall"]["baseline"]
    assert base["speedup_vs_llama_cpp"] == pytest.approx(base["tokens_per_s"] / peer["tokens_per_s"])
    prompt = [c for c in fake.calls() if c["name"] == "llama-completion"][-1]["argv"]
    assert QUESTIONS[3]["turns"][0] + " | assistant:" in prompt[prompt.index("-p") + 1]  # as templated text
    markdown = (tmp_path / "run" / "summary.md").read_text()
    assert "vs llama.cpp" in markdown
    # which llama.cpp ran, and on what CPU, is written down with the figures
    build = "llama.cpp from llama-cpp-python 9.9, built for AVX2"
    assert summary["settings"]["llama_cpp"] == {
        "bin": str(tmp_path / "bin"),
        "build": build,
        "without_repacking": ["m.gguf"],
    }
    assert "run with --no-repack (it crashed with repacked weights): m.gguf" in markdown
    monkeypatch.setattr(llama_cpp, "WITHOUT_REPACKING", set())  # a later process resumes: nothing left to run
    resumed = benchmark.main([*argv, "--methods", "baseline,llama_cpp", "--out", str(tmp_path / "run")])
    assert resumed["settings"]["llama_cpp"]["without_repacking"] == ["m.gguf"]  # what the records ran with
    assert build in markdown and f"({summary['settings']['hardware']['capability']})" in markdown
    assert skipped["settings"]["llama_cpp"]["build"] is None  # no BUILD_INFO yet

    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path / "nowhere"))
    absent = benchmark.main([*argv, "--methods", "baseline,llama_cpp_lookup", "--out", str(tmp_path / "absent")])
    assert "build_llama_cpp.sh" in absent["settings"]["skipped"]["llama_cpp_lookup"]


def test_an_int8_run_is_judged_against_plain_decoding_of_the_int8_target(tmp_path):
    """Without transformers' baseline in the run, divergences are found against baseline_compiled (plain decoding at
    the run's precision on our engine) and scored by the int8 weights computed in float32."""
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS[:2]) + "\n")
    run = tmp_path / "run"
    argv = [
        "--questions",
        str(questions),
        "--methods",
        "baseline_compiled,medusa",
        "--out",
        str(run),
        "--dtype",
        "int8",
    ]
    benchmark.main(
        argv + ["--base", str(base_dir), "--heads", str(heads_dir), "--max-new-tokens", "16", "--plan", "off"]
    )
    result = load_script("divergence").main([str(run)])
    assert result["reference"] == "baseline_compiled" and result["dtype"] == "int8"
    assert set(result["summary"]) == {"medusa"} and result["summary"]["medusa"]["outputs"] == 2
    assert all(case["near_tie"] for case in result["cases"])  # a bf16-activation rounding, never a wrong token


def test_benchmark_eagle3_row(tmp_path):
    """The eagle3 method: a (random) EAGLE-3 draft drafting --gamma tokens a step, greedy identical; skipped, saying
    what it needs, without --eagle3."""
    from medusa.eagle3_io import save_eagle3
    from medusa.loading import load_base
    from tests.test_eagle3 import random_draft

    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    target, _ = load_base(str(base_dir))
    save_eagle3(random_draft(target), tmp_path / "eagle3", verifier=str(base_dir))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    common = ["--questions", str(questions), "--base", str(base_dir), "--heads", str(heads_dir)]
    common += ["--max-new-tokens", "10", "--threads", "1", "--gamma", "3", "--methods", "baseline,eagle3"]
    summary = benchmark.main(common + ["--eagle3", str(tmp_path / "eagle3"), "--out", str(tmp_path / "run")])
    eagle3 = summary["overall"]["eagle3"]
    assert eagle3["identical"] is True and eagle3["gamma"] == pytest.approx(3.0) and eagle3["tau"] >= 1.0
    assert summary["settings"]["eagle3"] == str(tmp_path / "eagle3")
    tree = benchmark.main(
        common + ["--eagle3", str(tmp_path / "eagle3"), "--eagle3-nodes", "6", "--out", str(tmp_path / "tree")]
    )
    assert tree["overall"]["eagle3"]["identical"] is True and tree["settings"]["eagle3_nodes"] == 6
    skipped = benchmark.main(common + ["--out", str(tmp_path / "without")])
    assert list(skipped["overall"]) == ["baseline"]
    assert "--eagle3 DRAFT" in skipped["settings"]["skipped"]["eagle3"]


def test_benchmark_eagle3_planned_row_runs_the_drafts_own_plan(tmp_path, monkeypatch):
    from medusa.eagle3_io import save_eagle3
    from medusa.loading import load_base
    from tests.test_eagle3 import random_draft

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    target, _ = load_base(str(base_dir))
    save_eagle3(random_draft(target), tmp_path / "eagle3", verifier=str(base_dir))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    common = ["--questions", str(questions), "--base", str(base_dir), "--heads", str(heads_dir), "--threads", "1"]
    common += ["--max-new-tokens", "10", "--methods", "baseline,eagle3_planned", "--eagle3", str(tmp_path / "eagle3")]
    summary = benchmark.main(common + ["--plan", "auto", "--out", str(tmp_path / "run")])
    assert summary["overall"]["eagle3_planned"]["identical"] is True
    plan = summary["settings"]["eagle3_plan"]
    assert plan["proposer"] == "eagle3" and "decoded taus" in plan["reason"]  # none written: its own chain, guarded
    off = benchmark.main(common + ["--plan", "off", "--out", str(tmp_path / "off")])
    assert "--plan auto" in off["settings"]["skipped"]["eagle3_planned"]


def test_a_batched_benchmark_runs_the_questions_together_and_stays_exact(tmp_path, monkeypatch):
    """--batch-size 2: first turns two at a time; every row equals transformers' batched greedy output, the
    one-sequence methods are skipped by name, and tokens/s counts each batch's time once. Every method is warmed
    up untimed on a batch of each size the questions come in (2, then the last question alone) before any batch is
    timed: a layout or package loaded for a new batch size would otherwise be paid inside its first batch."""
    batches = []
    run_batch = benchmark.run_batch

    def counted(run, recorders, prompts, *args):
        batches.append(len(prompts))
        return run_batch(run, recorders, prompts, *args)

    monkeypatch.setattr(benchmark, "run_batch", counted)
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS[:3]) + "\n")
    argv = ["--questions", str(questions), "--out", str(tmp_path / "run"), "--base", str(base_dir)]
    argv += ["--heads", str(heads_dir), "--max-new-tokens", "10", "--threads", "1", "--batch-size", "2"]
    summary = benchmark.main(argv + ["--methods", "baseline,baseline_compiled,medusa,medusa_dynamic,prompt_lookup"])
    assert list(summary["overall"]) == ["baseline", "baseline_compiled", "medusa", "medusa_dynamic"]
    assert "one sequence" in summary["settings"]["skipped"]["prompt_lookup"]
    assert "batched plain decoding" in summary["settings"]["baseline_compiled"]
    for method, stats in summary["overall"].items():
        assert stats["identical"] is True, method
        assert stats["new_tokens"] == 3 * 10  # first turns only
    raw = [json.loads(line) for line in (tmp_path / "run" / "raw.jsonl").read_text().splitlines()]
    assert {r["turns"][0]["batch"] for r in raw} == {2, 1}  # two questions together, then the third alone
    assert batches == [1, 2] * 4 + [2] * 4 + [1] * 4  # warm-ups (each method, each size), then the timed batches
    medusa = [r["turns"][0] for r in raw if r["method"] == "medusa"]
    assert sum(t["forwards"] for t in medusa) == pytest.approx(summary["overall"]["medusa"]["forwards"])


def test_the_benchmarks_precision_defaults_to_bf16_on_a_gpu_and_fp32_on_a_cpu():
    base = ["--questions", "q.jsonl", "--out", "o", "--methods", "baseline"]
    assert benchmark.parse_args(base).dtype == "float32"
    assert benchmark.parse_args([*base, "--device", "cuda"]).dtype == "bfloat16"
    assert benchmark.parse_args([*base, "--device", "cuda:1"]).dtype == "bfloat16"
    assert benchmark.parse_args([*base, "--device", "cuda", "--dtype", "float32"]).dtype == "float32"


def test_profile_step_times_the_proposal_parts_and_restores_them():
    """scripts/profile_step.py's timed_parts: the seconds spent in a wrapped part are counted under its label, and
    the proposers' own methods are back in place afterwards (also when the timed code raises)."""
    from medusa.propose import CandidateProjection, MedusaProposer

    profile_step = load_script("profile_step")
    originals = {name: getattr(owner, name) for _, owner, name in profile_step.PROPOSAL_PARTS}
    projection = CandidateProjection(weight=torch.randn(32, 16), token_ids=None)
    with profile_step.timed_parts() as seconds:
        logits = projection.head_logits(0, torch.randn(2, 16))
    assert logits.shape == (2, 32)
    assert seconds["their projection"] > 0 and "context read" not in seconds
    with pytest.raises(AttributeError), profile_step.timed_parts() as seconds:
        MedusaProposer.read(None, None)  # no proposer: fails inside the timed part
    assert "context read" in seconds
    assert {name: getattr(owner, name) for _, owner, name in profile_step.PROPOSAL_PARTS} == originals


def test_the_plans_fixed_options_run_as_methods_with_its_trees(tmp_path):
    """ "medusa@N" / "medusa_dynamic@N": the tree of N nodes the plan grows from the heads' accuracy table, so planned
    can be compared with each option it weighed, side by side in one run."""
    from medusa.plan import save_accuracy
    from medusa.tree_builder import grow_tree

    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    argv = ["--questions", str(questions), "--base", str(base_dir), "--heads", str(heads_dir), "--max-new-tokens", "10"]
    argv += ["--threads", "1", "--methods", "baseline,medusa@3,medusa_dynamic@5,medusa@6"]
    summary = benchmark.main(argv + ["--out", str(tmp_path / "no-table")])
    assert list(summary["overall"]) == ["baseline"] and "accuracy table" in summary["settings"]["skipped"]["medusa@3"]

    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    save_accuracy(heads_dir, acc)
    summary = benchmark.main(argv + ["--out", str(tmp_path / "run")])
    assert list(summary["overall"]) == ["baseline", "medusa@3", "medusa_dynamic@5", "medusa@6"]
    assert all(stats["identical"] for stats in summary["overall"].values())  # greedy fp32: lossless
    raw = [json.loads(line) for line in (tmp_path / "run" / "raw.jsonl").read_text().splitlines()]
    for method, nodes in (("medusa@3", 3), ("medusa@6", 6)):
        depth = max(len(path) for path in grow_tree(acc, nodes))
        proposed = {n for r in raw if r["method"] == method for t in r["turns"] for n in t["proposed_lengths"]}
        assert proposed == {depth}, method  # a static tree proposes its depth every step
    assert grow_tree(acc, 3) != grow_tree(acc, 6)


@pytest.mark.parametrize("name", ["medusa@1", "plain@4", "medusa@x", "eagle3@4"])
def test_a_sized_method_names_a_tree_method_and_two_nodes_at_least(name):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--questions", "q.jsonl", "--methods", name, "--out", "run"])


def test_a_base_without_heads_benchmarks_the_methods_that_need_none(tmp_path):
    """`--heads none`: untrained heads on the base, said so in the results (the shipped heads fit SmolLM2 only); here
    a sliding-window model (a window of 8 tokens), whose answers run past it, identical to transformers' greedy."""
    base_dir = tmp_path / "base"
    make_tiny_model("gemma3", sliding=True).save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[3]) + "\n")
    argv = ["--questions", str(questions), "--base", str(base_dir), "--heads", "none", "--max-new-tokens", "24"]
    result = benchmark.main(
        argv + ["--methods", "baseline,plain,lookup,planned", "--threads", "1", "--out", str(tmp_path / "run")]
    )
    assert all(result["overall"][method]["identical"] is True for method in ("plain", "lookup", "planned"))
    assert result["settings"]["heads"].startswith("untrained (--heads none)")
