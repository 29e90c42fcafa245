"""The `medusa` command: chat from a pipe (burst and steady streaming), head accuracy, and the command index."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa import MedusaModel
from medusa.cli import chat, main
from medusa.evaluation import head_rank_accuracy
from medusa.plan import ACCURACY_NAME
from tests.conftest import save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("chat"))


def _chat(monkeypatch, capsys, argv, lines):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    chat.main(argv)
    return capsys.readouterr()


def test_chat_from_a_pipe_streams_each_answer_with_its_rate_and_tau(monkeypatch, capsys, checkpoint):
    base_dir, heads_dir = checkpoint
    out = _chat(
        monkeypatch,
        capsys,
        ["--heads", str(heads_dir), "--base", str(base_dir), "--max-new-tokens", "10"],
        ["hello", "", "and then"],
    )
    reports = [line for line in out.err.splitlines() if line.startswith("[")]
    assert len(reports) == 2 and all("tok/s" in r and "tau" in r for r in reports)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir)
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_tensors="pt"
    )
    first = model.tokenizer.decode(
        model.generate(ids, max_new_tokens=10)[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert out.out.startswith(first)  # greedy: the same answer as generate, streamed


def test_steady_stream_emits_fixed_chunks_and_hides_the_accepted_lengths():
    log = chat.EmissionLog()
    sink = []
    streamer = chat.SteadyStreamer(
        type("Sink", (), {"put": lambda s, v: sink.append(v), "end": lambda s: None})(), log, chunk=3, interval=0.002
    )
    streamer.put(torch.tensor([[1, 2]]))  # the prompt
    accepted = [1, 4, 2, 5, 1, 3]
    for n in [1] + accepted:
        streamer.put(torch.arange(n))
    streamer.end()
    sizes = [n for _, n in log.emissions]
    assert sizes[:-1] == [3] * (len(sizes) - 1) and sum(sizes) == 1 + sum(accepted)
    steady = chat.leak_report(log, accepted)
    assert steady["size_corr"] == pytest.approx(0.0, abs=0.5)
    bursts = chat.EmissionLog()
    for n in [1] + accepted:  # the prefill's token, then one burst per verify step
        bursts.record(n)
    assert chat.leak_report(bursts, accepted)["size_corr"] == pytest.approx(1.0)  # bursts give it away


def test_the_command_lists_its_subcommands_and_names_unknown_ones():
    done = subprocess.run([sys.executable, "-m", "medusa", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and all(
        name in done.stdout for name in ("chat", "calibrate", "export", "bench", "accuracy")
    )
    done = subprocess.run([sys.executable, "-m", "medusa", "chatt"], capture_output=True, text=True)
    assert done.returncode != 0 and "unknown command 'chatt'" in done.stderr


def test_main_dispatches(monkeypatch):
    called = []
    monkeypatch.setattr(chat, "main", lambda argv: called.append(argv))
    main(["chat", "--steady"])
    assert called == [["--steady"]]


def test_calibrate_measures_and_writes_the_plan(tmp_path, capsys, monkeypatch, checkpoint):
    from medusa.cli import calibrate

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))  # the plan cache: not the user's
    base_dir, heads_dir = checkpoint
    plan = calibrate.main(["--heads", str(heads_dir), "--base", str(base_dir), "--out", str(tmp_path / "plan.json")])
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written == json.loads(json.dumps(plan)) and written["engine"] in ("eager", "compiled")
    assert "measured in" in capsys.readouterr().out


def test_a_base_without_heads_chats_and_calibrates_with_prompt_lookup(tmp_path, capsys, monkeypatch, checkpoint):
    """--heads none: untrained heads on --base (MedusaModel.from_base), whose plan guesses with prompt lookup,
    its trees sized by the verify's cost on the plan's engine; the chat's answer is the base's greedy answer."""
    from medusa.cli import calibrate

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    base_dir, _ = checkpoint
    plan = calibrate.main(["--heads", "none", "--base", str(base_dir)])
    printed = capsys.readouterr().out
    assert plan["proposer"] == "prompt_lookup" and "no trained heads" in printed
    assert f"plan: prompt lookup on the {plan['engine']} engine, trees sized by the verify's cost" in printed
    assert len(plan["latency_ms"][plan["engine"]]) > 2  # the chains' verifies, timed
    out = _chat(monkeypatch, capsys, ["--heads", "none", "--base", str(base_dir), "--max-new-tokens", "10"], ["hi"])
    model = MedusaModel.from_base(base_dir, plan="off")
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt"
    )
    greedy = model.base.generate(**ids, max_new_tokens=10, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert out.out.startswith(model.tokenizer.decode(greedy, skip_special_tokens=True))


QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Tell me a story about owls.", "Shorter."]},
    {"question_id": 2, "category": "math", "turns": ["What is 2 + 2?"]},
    {"question_id": 3, "turns": ["Hi."]},  # no category
]


def _accuracy(tmp_path, checkpoint, *extra):
    base_dir, heads_dir = checkpoint
    heads = tmp_path / "heads"  # a copy: --heads-dir writes into it
    shutil.copytree(heads_dir, heads)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    argv = ["accuracy", "--questions", str(questions), "--heads", str(heads), "--base", str(base_dir)]
    main([*argv, "--out", str(tmp_path / "acc.json"), "--max-new-tokens", "6", "--ranks", "3", *extra])
    return heads


def test_accuracy_scores_the_heads_on_the_targets_greedy_answers(tmp_path, capsys, checkpoint):
    heads = _accuracy(tmp_path, checkpoint, "--batch-size", "2", "--heads-dir")
    report = json.loads((tmp_path / "acc.json").read_text())
    model = MedusaModel.from_pretrained(heads, base=checkpoint[0])
    # each question answered alone, unpadded: the batched, left-padded answers must be the same tokens
    sequences, starts = [], []
    for q in QUESTIONS:
        ids = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
        out = model.base.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        sequences.append(out[0].tolist())
        starts.append(ids.shape[1])
    expected = head_rank_accuracy(model, sequences, starts, ranks=3)
    torch.testing.assert_close(torch.tensor(report["acc"], dtype=torch.double), expected.acc)
    torch.testing.assert_close(torch.tensor(report["acc_given_prefix"], dtype=torch.double), expected.acc_given_prefix)
    assert report["positions"] == sum(len(s) - start for s, start in zip(sequences, starts))
    assert report["questions"] == 3 and sorted(report["settings"]["question_ids"]) == [1, 2, 3]
    assert sorted(report["by_category"]) == ["math", "none", "writing"]
    assert model.accuracy == report["acc_given_prefix"]  # --heads-dir: the table the plan reads
    out = capsys.readouterr()
    assert "answered 2/3" in out.err and "answered 3/3" in out.err
    assert "3 questions" in out.out and "top1|prefix" in out.out


def test_accuracy_taus_decodes_each_option_and_keeps_them_beside_the_table(tmp_path, capsys, checkpoint):
    """--taus: every option the plan weighs answers the questions; --heads-dir keeps the table and adds the taus."""
    heads = _accuracy(tmp_path, checkpoint, "--heads-dir")  # the table the trees grow from
    table = json.loads((heads / ACCURACY_NAME).read_text())
    main(
        ["accuracy", "--taus", "--heads-dir", "--questions", str(tmp_path / "questions.jsonl"), "--heads", str(heads)]
        + ["--base", str(checkpoint[0]), "--out", str(tmp_path / "taus.json"), "--max-new-tokens", "6"]
    )
    decoded = json.loads((tmp_path / "taus.json").read_text())["decoded"]
    model = MedusaModel.from_pretrained(heads, base=checkpoint[0])
    assert model.accuracy == table["acc_given_prefix"]  # unchanged, and its source kept
    assert json.loads((heads / ACCURACY_NAME).read_text())["source"] == table["source"]
    assert model.decoded_taus == decoded and "--taus" in decoded["source"]
    assert set(decoded["tau"]) == {"medusa", "dynamic", "hybrid"}
    assert all(n == float(size) for size, n in decoded["nodes"]["medusa"].items())  # a static tree verifies itself
    assert all(1 <= tau <= int(size) for size, tau in decoded["tau"]["dynamic"].items())
    assert "hybrid tau" in capsys.readouterr().out


def test_accuracy_says_when_no_question_fits_the_context_window(tmp_path, capsys, checkpoint):
    with pytest.raises(SystemExit) as exit_info:
        _accuracy(tmp_path, checkpoint, "--max-new-tokens", "512")  # overrides 6: the tiny base's whole window
    assert exit_info.value.code == 1
    assert "no question of" in capsys.readouterr().err


def test_the_head_accuracy_script_runs_medusa_accuracy_from_anywhere(tmp_path):
    script = Path(__file__).resolve().parent.parent / "scripts" / "head_accuracy.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: medusa accuracy")


def test_accuracy_without_questions_or_bench_data_names_both_ways(tmp_path, monkeypatch, capsys):
    """An installed wheel has no ../shared/bench_data beside it: the default is named with its two fixes before any
    model loads."""
    monkeypatch.setenv("MEDUSA_BENCH_DATA", str(tmp_path))  # a folder without Spec-Bench
    with pytest.raises(SystemExit):
        main(["accuracy", "--out", str(tmp_path / "acc.json")])
    message = capsys.readouterr().err
    assert "--questions" in message and "MEDUSA_BENCH_DATA" in message and str(tmp_path) in message
