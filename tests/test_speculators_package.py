"""The speculators package's own loader (`SpeculatorModel.from_pretrained`, PyPI speculators==0.9.0) reads our
speculators-format EAGLE-3 export and computes our draft's step-0 logits.

speculators pins transformers <= 5.19 (ours is newer), so it runs in a venv of its own, built once and cached in
~/.cache/medusa-peers (about 40 s with the local torch CPU wheel, 1.5 GB). Its forward returns only argmax tokens; the
logits are read off its lm_head with a forward hook.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa.eagle3 import unrolled_outputs
from medusa.eagle3_io import save_eagle3
from tests.conftest import HIDDEN, VOCAB, make_tiny_model
from tests.test_eagle3 import AUX, random_draft

pytestmark = pytest.mark.slow

SPECULATORS = "speculators==0.9.0"
ENV = Path.home() / ".cache" / "medusa-peers" / "speculators-0.9.0-env"

CHECK = r"""
import json, sys
import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel

draft_dir, verifier_dir, reference = sys.argv[1:4]
model = SpeculatorModel.from_pretrained(draft_dir).eval()
ref = load_file(reference)
ids, features = ref["input_ids"], ref["features"]
T = ids.shape[1] - 1
captured = []
model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
with torch.no_grad():  # one step: fc(features at t) with the embedding of token t+1, causal, positions 0..T-1
    model(hidden_states=features[:, :T], input_ids=ids[:, 1:], document_ids=torch.zeros(1, T, dtype=torch.long),
          position_ids=torch.arange(T)[None], ttt_steps=1)
embed = load_file(verifier_dir + "/model.safetensors")["model.embed_tokens.weight"]
print(json.dumps({
    "class": type(model).__name__,
    "embed_is_verifiers": torch.equal(model.embed_tokens.weight, embed),
    "target_ids": (torch.arange(model.d2t.numel()) + model.d2t).tolist(),
    "max_abs_diff": (captured[0] - ref["logits"]).abs().max().item(),
}))
"""


def speculators_python() -> Path:
    """The cached venv's python, built on first use (one builder at a time)."""
    python = ENV / "bin" / "python"
    ENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ENV.parent / f"{ENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (ENV / ".ready").is_file():
            return python
        shutil.rmtree(ENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(ENV)], check=True)
        torch_pin = "torch==" + torch.__version__.split("+")[0]  # unpinned, pip fetches GBs of CUDA wheels
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", torch_pin, SPECULATORS],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if pip.returncode != 0:
            shutil.rmtree(ENV, ignore_errors=True)
            pytest.skip(f"pip could not install {SPECULATORS} from PyPI (offline?): {pip.stderr.strip()[-500:]}")
        # speculators depends on torchvision/torchaudio but never imports them; the wheels pip finds are CUDA builds
        # that fail to load beside the CPU torch, and transformers imports them whenever they are installed
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
        (ENV / ".ready").touch()
    return python


@torch.inference_mode()
def test_speculators_loads_our_eagle3_draft_and_computes_its_logits(tmp_path):
    target = make_tiny_model("llama")
    target.save_pretrained(tmp_path / "verifier")  # the loader reads its config and embeddings; no tokenizer needed
    draft = random_draft(target)
    save_eagle3(
        draft,
        tmp_path / "draft",
        format="speculators",
        verifier=str(tmp_path / "verifier"),
        verifier_architectures=["LlamaForCausalLM"],
        embed_tokens=target.get_input_embeddings().weight,
    )
    # without it in the file, speculators 0.9.0 (transformers 5) keeps uninitialised memory as the draft's embeddings
    assert "embed_tokens.weight" in load_file(str(tmp_path / "draft" / "model.safetensors"))
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 9, len(AUX) * HIDDEN, generator=torch.Generator().manual_seed(1))
    logits = draft.logits(unrolled_outputs(draft, target.get_input_embeddings(), features, ids, 1)[0])
    save_file({"input_ids": ids, "features": features, "logits": logits}, str(tmp_path / "reference.safetensors"))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [str(speculators_python()), "-c", CHECK]
        + [str(tmp_path / name) for name in ("draft", "verifier", "reference.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["class"] == "Eagle3DraftModel"
    assert report["embed_is_verifiers"]
    assert report["target_ids"] == draft.target_ids.tolist()
    assert report["max_abs_diff"] < 1e-5, report["max_abs_diff"]
