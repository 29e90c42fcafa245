"""EAGLE-3 training (medusa/train/eagle3.py through medusa/train/train.py): it learns the target, resumes exactly,
and writes a draft that decodes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from medusa import MedusaModel
from medusa.eagle3 import Eagle3Model
from medusa.eagle3_io import load_eagle3
from tests.test_train import (
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
