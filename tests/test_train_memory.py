"""Training with less memory: gradient checkpointing (Medusa-2's adapted base, the EAGLE-3 draft) and an int8 frozen
base (torchao weight-only). Tiny random models on CPU.

Activation memory is measured, not assumed: `saved_bytes` counts every tensor autograd keeps for backward (through
`torch.autograd.graph.saved_tensors_hooks`, which see what checkpointing keeps too: its inputs, saved before its
own hooks take over), once per storage, leaving out the parameters (kept whatever the setting)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from medusa.config import WEIGHTS_NAME
from medusa.eagle3 import Eagle3Draft
from medusa.train.config import TrainingConfig, load_config
from medusa.train.eagle3 import step_losses
from medusa.train.trainer import HeadTrainer, build_heads, enable_gradient_checkpointing
from tests import test_eagle3_train
from tests.conftest import VOCAB, make_tiny_model
from tests.test_eagle3_train import eagle3_sections
from tests.test_train import _fresh_accelerate_state, run, save_tiny_base, sections, top1, write_shards  # noqa: F401

pytest.importorskip("peft")

tiny_base, tiny_data = test_eagle3_train.tiny_base, test_eagle3_train.tiny_data  # the same module-scoped fixtures


def saved_bytes(model: torch.nn.Module, step) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `step()`'s graph, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    loss.backward()
    return sum(kept.values())


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def medusa2_trainer(checkpointing: bool) -> HeadTrainer:
    from peft import LoraConfig, get_peft_model

    base = make_tiny_model("llama")
    base.requires_grad_(False)
    if checkpointing:
        enable_gradient_checkpointing(base)
    base = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    for name, p in base.named_parameters():  # LoRA's B starts at zero: move it so that every LoRA weight has a grad
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    cfg = TrainingConfig(medusa2=True, precompute_hidden=False, chunk_tokens=64)
    heads = build_heads(
        load_config(None, ["--heads.num_heads", "3"]).heads, 64, VOCAB, base.get_output_embeddings(), None
    )
    torch.nn.init.normal_(heads.blocks[0][0].linear.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    return HeadTrainer(heads, base.get_output_embeddings(), cfg, base=base).train()


def test_gradient_checkpointing_keeps_medusa2_gradients_and_saves_activation_memory():
    ids = torch.randint(1, VOCAB, (4, 96), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    measured = {}
    for checkpointing in (False, True):
        trainer = medusa2_trainer(checkpointing)
        torch.manual_seed(1)  # the same LoRA dropout masks: checkpointing replays the random state it recomputes in
        used = saved_bytes(trainer, lambda: trainer(**batch)["loss"])  # noqa: B023 (called at once)
        measured[checkpointing] = (used, grads(trainer))
    (plain_bytes, plain), (ckpt_bytes, ckpt) = measured[False], measured[True]
    assert set(plain) == set(ckpt) and any("lora_A" in n for n in plain) and any("heads." in n for n in plain)
    for name in plain:
        assert plain[name].abs().max() > 0, name
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    # measured 6.09 MB -> 1.25 MB: each layer keeps only its input (what is left: the heads' loss)
    assert ckpt_bytes < 0.4 * plain_bytes, (ckpt_bytes, plain_bytes)


def test_gradient_checkpointing_keeps_eagle3_gradients_and_saves_activation_memory():
    target = make_tiny_model("llama")
    torch.manual_seed(0)
    draft = Eagle3Draft(target.config, [0, 1], 64, VOCAB)
    draft.set_vocabulary(torch.arange(16, 80))
    ids = torch.randint(1, VOCAB, (1, 160), generator=torch.Generator().manual_seed(0))
    measured = {}
    for checkpointing in (False, True):
        draft.zero_grad(set_to_none=True)
        draft.gradient_checkpointing = checkpointing
        used = saved_bytes(draft, lambda: step_losses(draft, target, ids, 2, 3, 0.8)[0])
        measured[checkpointing] = (used, grads(draft))
    (plain_bytes, plain), (ckpt_bytes, ckpt) = measured[False], measured[True]
    assert set(plain) == set(ckpt) and {"fc.weight", "lm_head.weight"} <= set(plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    # measured 4.10 MB -> 2.39 MB: the attention (which appends to the step cache) keeps its activations
    assert ckpt_bytes < 0.75 * plain_bytes, (ckpt_bytes, plain_bytes)


def test_medusa2_with_gradient_checkpointing_trains_to_the_same_weights(tmp_path, tiny_base, tiny_data):
    common = dict(max_steps=4, medusa2=True, precompute_hidden=False, lora_r=4, lora_alpha=8, lora_lr=1e-2)
    out = {}
    for checkpointing in (False, True):
        (tmp_path / str(checkpointing)).mkdir()
        raw = sections(
            tmp_path / str(checkpointing), tiny_base, tiny_data, gradient_checkpointing=checkpointing, **common
        )
        out[checkpointing] = run(raw).output_dir
    for name in (WEIGHTS_NAME, "adapter_model.safetensors"):
        a, b = (load_file(str(out[c] / name)) for c in (False, True))
        assert set(a) == set(b) and a
        for key in a:
            torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")


def test_eagle3_trains_with_gradient_checkpointing(tmp_path, tiny_base, tiny_data):
    out = {}
    for checkpointing in (False, True):
        raw = eagle3_sections(tmp_path / str(checkpointing), tiny_base, tiny_data, max_steps=3)
        raw["training"]["gradient_checkpointing"] = checkpointing
        out[checkpointing] = load_file(str(run(raw).output_dir / "model.safetensors"))
    for key in out[False]:
        torch.testing.assert_close(out[True][key], out[False][key], atol=1e-5, rtol=1e-4, msg=key)


def test_gradient_checkpointing_is_refused_for_medusa1():
    with pytest.raises(ValueError, match="Medusa-1's base is frozen"):
        load_config(None, ["--training.gradient_checkpointing", "true"])


# --------------------------------------------------------------------------- int8 frozen base
def test_int8_base_hidden_states_stay_close_to_float32(tiny_base):
    from medusa.loading import base_fingerprint
    from medusa.train.trainer import load_frozen_base

    pytest.importorskip("torchao")
    full = load_frozen_base(load_config(None, ["--model.base", str(tiny_base)]).model, "cpu")
    int8 = load_frozen_base(
        load_config(None, ["--model.base", str(tiny_base), "--model.quantize", "int8"]).model, "cpu"
    )
    linear = int8.get_decoder().layers[0].mlp.up_proj.weight
    assert type(linear).__name__ != "Parameter" and linear.__tensor_flatten__()  # torchao's int8 tensor
    assert type(int8.get_output_embeddings().weight) is torch.nn.Parameter  # the heads' projection stays as is
    ids = torch.randint(1, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (m(ids, output_hidden_states=True).hidden_states[-1] for m in (full, int8))
    relative = float((a - b).norm() / a.norm())
    assert 0 < relative < 0.02, relative  # measured 0.0058: per-row int8 of every decoder linear layer
    assert base_fingerprint(full) != base_fingerprint(int8)  # a separate hidden-state cache


@pytest.mark.parametrize("medusa2", [False, True], ids=["medusa1", "medusa2"])
def test_heads_learn_on_an_int8_base(tmp_path, tiny_base, tiny_data, medusa2):
    pytest.importorskip("torchao")
    extra = dict(medusa2=True, precompute_hidden=False, lora_r=4, lora_alpha=8, lora_lr=1e-2) if medusa2 else {}
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=30, eval_conversations=4, **extra)
    raw["model"]["quantize"] = "int8"
    result = run(raw)
    first, last = result.eval_history[0], result.eval_history[-1]
    for k in range(3):
        assert top1(last, k) > top1(first, k) + 0.3, (k, first, last)
    if medusa2:
        adapter = load_file(str(result.output_dir / "adapter_model.safetensors"))
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())
    else:
        assert len(list((tmp_path / "cache").glob("hidden-*.safetensors"))) == 1


@pytest.mark.slow
def test_the_memory_script_measures_a_configuration_in_a_process_of_its_own():
    """scripts/training_memory.py --measure's per-configuration process: a real training step of SmolLM2's shape on
    the CPU, whose own peak (the high-water mark reset before it) lies above the built trainer's resident memory by
    at least one [T, V] block of logits."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "training_memory.py"
    command = [sys.executable, str(script), "--measure-one", "bf16 base + checkpointing", "--shapes", "SmolLM2-135M"]
    out = subprocess.run([*command, "--tokens", "512"], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["configuration"] == "bf16 base + checkpointing"
    assert result["peak"] > result["built"] + 512 * 49152 * 4, result  # one fp32 [512, V] block: 96 MiB
