"""EAGLE-3 training (medusa/train/eagle3.py through medusa/train/train.py): it learns the target, resumes exactly,
and writes a draft that decodes exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa import MedusaModel
from medusa.eagle3 import Eagle3Draft, Eagle3Model
from medusa.eagle3_io import load_eagle3, save_eagle3
from medusa.train import eagle3 as eagle3_training
from medusa.train import train as train_mod
from medusa.train.batches import Conversation, load_directories, split_eval
from medusa.train.config import TrainingConfig
from medusa.train.trainer import precomputed_hidden
from tests.conftest import make_tiny_model
from tests.test_train import (
    RankAccelerator,
    _assert_same_weights,
    _launch_two,
    assert_killed_then_resumed_equals_uninterrupted,
    run,
    save_tiny_base,
    sections,
    write_shards,
)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("tiny-data"), n=24, response_len=24)


def eagle3_sections(tmp, base, data, **training):
    tmp.mkdir(exist_ok=True)
    raw = sections(tmp, base, data, **{"lr": 3e-3, "eval_conversations": 4, "batch_size": 1, **training})
    raw["training"]["output_dir"] = str(tmp / "draft")
    raw["eagle3"] = {"enabled": True, "aux_layers": [0, 1], "draft_vocab_size": 64, "ttt_steps": 3}
    return raw


def test_the_draft_learns_the_target_and_decodes_exactly(tmp_path, tiny_base, tiny_data):
    untrained = run(eagle3_sections(tmp_path / "a", tiny_base, tiny_data, max_steps=1, lr=1e-9))
    trained = run(eagle3_sections(tmp_path / "b", tiny_base, tiny_data, max_steps=60))
    before, after = untrained.eval_history[-1], trained.eval_history[-1]
    assert after["eval/step0/top1"] > before["eval/step0/top1"] + 0.15, (before, after)
    assert after["eval/step1/top1"] > before["eval/step1/top1"], (before, after)

    draft, config = load_eagle3(trained.output_dir)
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1] and config["draft_vocab_size"] == 64
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_base)
    model = MedusaModel.from_draft_model(str(tiny_base), str(trained.output_dir), num_speculative_tokens=3)
    assert isinstance(model, Eagle3Model)
    prompt = torch.tensor([[5, 9, 17, 33, 2]])
    want = model.target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=24)
    assert torch.equal(out, want)


def test_init_from_continues_a_trained_draft_with_its_weights_and_vocabulary(tmp_path, tiny_base, tiny_data):
    untrained = run(eagle3_sections(tmp_path / "u", tiny_base, tiny_data, max_steps=1, lr=1e-9))
    trained = run(eagle3_sections(tmp_path / "a", tiny_base, tiny_data, max_steps=60))

    def continued(init_from, run_dir, **eagle3):
        raw = eagle3_sections(tmp_path / run_dir, tiny_base, tiny_data, max_steps=1, lr=1e-9, save_dtype="float32")
        raw["eagle3"].update(init_from=str(init_from), **eagle3)
        return run(raw)

    # nearly no step: the eval is the trained draft's (its weights, saved bf16), far above a fresh one's
    again = continued(trained.output_dir, "b")
    assert f"starting from the draft {trained.output_dir}" in (again.output_dir / "README.md").read_text()
    before, after = trained.eval_history[-1]["eval/step0/top1"], again.eval_history[-1]["eval/step0/top1"]
    assert after == pytest.approx(before, abs=0.05) and after > untrained.eval_history[-1]["eval/step0/top1"] + 0.15

    # the vocabulary is the draft's own, not the one the data would give
    draft, _ = load_eagle3(trained.output_dir)
    own = torch.arange(32, 96)  # (the tiny vocabulary has 96 ids)
    draft.set_vocabulary(own)
    save_eagle3(draft, tmp_path / "own-vocabulary")
    kept, _ = load_eagle3(continued(tmp_path / "own-vocabulary", "c").output_dir)
    assert torch.equal(kept.target_ids, own)
    continued_head = load_file(str(tmp_path / "c" / "draft" / "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(continued_head, draft.lm_head.weight.detach().float(), atol=1e-6, rtol=0)

    # a larger vocabulary keeps the learned rows at their tokens and adds the data's most frequent missing tokens,
    # their rows the target's own (a fresh draft's start)
    grown, _ = load_eagle3(continued(tmp_path / "own-vocabulary", "grown", draft_vocab_size=80).output_dir)
    ids, added = grown.target_ids, sorted(set(grown.target_ids.tolist()) - set(own.tolist()))
    assert ids.numel() == 80 and set(own.tolist()) <= set(ids.tolist()) and len(added) == 16
    grown_head = load_file(str(tmp_path / "grown" / "draft" / "model.safetensors"))["lm_head.weight"]
    rows = torch.searchsorted(ids, own)
    torch.testing.assert_close(grown_head[rows], draft.lm_head.weight.detach().float(), atol=1e-6, rtol=0)
    target_rows = AutoModelForCausalLM.from_pretrained(tiny_base).get_output_embeddings().weight.detach()[added]
    torch.testing.assert_close(grown_head[torch.searchsorted(ids, torch.tensor(added))], target_rows, atol=1e-6, rtol=0)
    convs, _ = load_directories([tiny_data], 1024, 96)
    answers = [token for i in split_eval(convs, 4)[0] for token in convs[i].ids[convs[i].response_start :]]
    counts = torch.bincount(torch.tensor(answers), minlength=96)
    left_out = set(range(96)) - set(own.tolist()) - set(added)
    assert max(int(counts[t]) for t in left_out) <= min(int(counts[t]) for t in added)  # the most frequent ones

    with pytest.raises(ValueError, match=r"draft_vocab_size 64 where this run has 32 \(a vocabulary grows"):
        continued(trained.output_dir, "d", draft_vocab_size=32)
    with pytest.raises(ValueError, match="aux_layers"):
        continued(trained.output_dir, "e", aux_layers=[0])
    with pytest.raises(ValueError, match="names no EAGLE-3 draft"):
        continued(tiny_base, "f")
    # a draft of another family (qwen2's attention has biases) with the same sizes and layers
    other_family = Eagle3Draft(make_tiny_model("qwen2").config, [0, 1], 64, draft.t2d.numel())
    save_eagle3(other_family, tmp_path / "qwen2-draft")
    with pytest.raises(ValueError, match=r"does not fit this run: (?s:.*)q_proj\.bias"):
        continued(tmp_path / "qwen2-draft", "g")


def test_bf16_mixed_precision_runs_target_and_draft_in_bf16_and_learns(tmp_path, tiny_base, tiny_data, monkeypatch):
    """training.mixed_precision bf16 (what `auto` picks on an AVX512-BF16 CPU) reaches the draft: its layer runs
    in bf16 autocast, its weights stay float32, and it learns as in float32."""
    dtypes, unrolled_outputs = [], eagle3_training.unrolled_outputs

    def spy(*args, **kwargs):  # the dtype of the draft layer's outputs in training
        outputs = unrolled_outputs(*args, **kwargs)
        dtypes.append(outputs[0].dtype)
        return outputs

    monkeypatch.setattr(eagle3_training, "unrolled_outputs", spy)
    untrained = run(eagle3_sections(tmp_path / "a", tiny_base, tiny_data, max_steps=1, lr=1e-9, mixed_precision="no"))
    assert set(dtypes) == {torch.float32}
    dtypes.clear()
    trained = run(eagle3_sections(tmp_path / "b", tiny_base, tiny_data, max_steps=60, mixed_precision="bf16"))
    assert set(dtypes) == {torch.bfloat16}
    before, after = untrained.eval_history[-1], trained.eval_history[-1]
    assert after["eval/step0/top1"] > before["eval/step0/top1"] + 0.15, (before, after)
    draft, _ = load_eagle3(trained.output_dir)
    assert draft.fc.weight.dtype == torch.float32


def test_cached_features_give_the_losses_of_the_target_run_online(tmp_path):
    """eagle3.cache_features: the target's last hidden state and aux-layer features, computed once and read from
    disk, score a conversation as running the target does (within the cache's bf16 rounding)."""
    base = make_tiny_model("llama")
    draft = eagle3_training.build_draft(
        SimpleNamespace(eagle3=SimpleNamespace(aux_layers=[0, 1], draft_vocab_size=64)), base, torch.arange(64)
    )
    with torch.no_grad():  # outputs that depend on the features (a fresh draft's are near uniform)
        draft.fc.weight.normal_(0, 0.5)
        draft.lm_head.weight.normal_(0, 0.5)
    rng = random.Random(0)
    convs = [Conversation([rng.randrange(1, 96) for _ in range(n)], 5) for n in (30, 17, 41)]
    tcfg = TrainingConfig(cache_dir=str(tmp_path), max_length=64, precompute_batch_tokens=64)
    cache = precomputed_hidden(RankAccelerator(), tcfg, base, convs, [range(3)], "no", 64, draft.aux_layers, print)
    assert len(list(tmp_path.glob("hidden-*.safetensors"))) == 1
    for index, conv in enumerate(convs):
        ids = torch.tensor([conv.ids])
        cached = cache.batch([index])["hidden"]
        assert cached.shape == (1, len(conv.ids), 3 * base.config.hidden_size)
        online, online_stats = eagle3_training.step_losses(draft, base, ids, 2, 3, 0.8)
        read, read_stats = eagle3_training.step_losses(draft, base, ids, 2, 3, 0.8, cached)
        assert [count for count, _ in read_stats] == [count for count, _ in online_stats]
        # the wrong positions' features (one over): what a misread cache would give
        shifted, _ = eagle3_training.step_losses(draft, base, ids, 2, 3, 0.8, torch.roll(cached, 1, dims=1))
        assert abs(float(read - online)) < abs(float(shifted - online)) / 20, (read, online, shifted)


def test_a_draft_trained_on_cached_features_learns_and_reuses_the_cache(
    tmp_path, tiny_base, tiny_data, capsys, monkeypatch
):
    raws = [eagle3_sections(tmp_path / run_dir, tiny_base, tiny_data, max_steps=60) for run_dir in ("a", "b")]
    for raw in raws:
        raw["eagle3"]["cache_features"] = True
        raw["training"]["cache_dir"] = str(tmp_path / "cache")
    untrained = run(eagle3_sections(tmp_path / "u", tiny_base, tiny_data, max_steps=1, lr=1e-9))
    trained = run(raws[0])
    before, after = untrained.eval_history[-1], trained.eval_history[-1]
    assert after["eval/step0/top1"] > before["eval/step0/top1"] + 0.15, (before, after)
    assert len(list((tmp_path / "cache").glob("hidden-*.safetensors"))) == 1
    capsys.readouterr()
    raws[1]["training"]["max_steps"] = 2
    run(raws[1])
    assert "reusing precomputed hidden states" in capsys.readouterr().out
    monkeypatch.setattr(train_mod, "resolve_shard", lambda *args: True)  # as over several processes
    with pytest.raises(ValueError, match="eagle3.cache_features"):
        run(raws[1])


def test_resume_equals_uninterrupted(tmp_path, tiny_base, tiny_data):
    common = dict(max_steps=8, warmup_steps=2, save_every=4, grad_accum=2)
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = run(eagle3_sections(whole_dir, tiny_base, tiny_data, **common))
    stopped = run(eagle3_sections(split_dir, tiny_base, tiny_data, **common), stop_after_steps=4)
    assert stopped.output_dir is None and stopped.steps == 4
    resumed = run(eagle3_sections(split_dir, tiny_base, tiny_data, **common), resume=True)
    a = load_file(str(whole.output_dir / "model.safetensors"))
    b = load_file(str(resumed.output_dir / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert whole.eval_history[-1] == pytest.approx(resumed.eval_history[-1], abs=1e-6)


@pytest.mark.slow
def test_fsdp_over_two_processes_trains_the_draft_as_ddp_does(tmp_path, tiny_base, tiny_data):
    """The draft under training.shard fsdp over 2 CPU processes (gloo), the target's layers sharded: the same draft
    (within 1e-5) and held-out scores as DDP over the same 2 processes, which see the same conversations; its
    checkpoints hold the draft's whole weights, as a single-process run's do."""
    common = dict(max_steps=6, warmup_steps=2, save_every=3, grad_accum=2, eval_every=3)
    outputs, logs = {}, {}
    for shard in ("none", "fsdp"):
        raw = eagle3_sections(tmp_path / shard, tiny_base, tiny_data, shard=shard, **common)
        config = tmp_path / shard / "config.yaml"
        config.write_text(yaml.safe_dump(raw))
        logs[shard] = _launch_two(tmp_path / shard, config, "torchrun")
        outputs[shard] = Path(raw["training"]["output_dir"])
    held = next(line for line in logs["fsdp"].splitlines() if line.startswith("FSDP2: this process holds"))
    local, total = (int(n.replace(",", "")) for n in held.split("holds ")[1].split(" weights")[0].split(" of "))
    assert local <= total // 2 + 1000, held  # the target's layers and the root split between the 2 processes
    assert "FSDP2" not in logs["none"]
    _assert_same_weights(outputs["none"], outputs["fsdp"], ("model.safetensors",), atol=1e-5)
    history = [json.loads((outputs[s] / "training_history.json").read_text()) for s in ("none", "fsdp")]
    assert len(history[0]) == 2 and history[0][-1]["eval/step0/top1"] > 0
    for ddp, fsdp in zip(*history):
        assert fsdp == pytest.approx(ddp, abs=1e-6)
    checkpoint = tmp_path / "fsdp" / "ckpt" / "checkpoints" / "checkpoint_0"
    saved = load_file(str(checkpoint / "model.safetensors"))
    whole = load_file(str(outputs["fsdp"] / "model.safetensors"))
    assert {k.removeprefix("draft.") for k in saved} >= {k for k in whole if k not in ("d2t", "t2d")}


@pytest.mark.slow
def test_fsdp_sigkill_then_resume_equals_uninterrupted(tmp_path, tiny_base, tiny_data):
    """The draft sharded over 2 processes, SIGKILLed after its first checkpoint and resumed with --resume: the same
    draft as the uninterrupted sharded run."""
    common = dict(max_steps=12, warmup_steps=2, save_every=4, grad_accum=2, shard="fsdp")
    assert_killed_then_resumed_equals_uninterrupted(
        tmp_path, lambda directory: eagle3_sections(directory, tiny_base, tiny_data, **common), ("model.safetensors",)
    )
