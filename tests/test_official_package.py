"""The official FasterDecoding package (`medusa-llm` on PyPI) loads our `--format medusa` export.

It is installed from PyPI into a fresh virtual environment (its package is called `medusa` too, so it never goes into
ours); its dependencies come from the running interpreter's site-packages through a .pth file, and it runs with
`python -I` from a directory outside the repository, as in test_wheel.py, so our own `medusa` is not on its path.

Which of its code runs: its `MedusaConfig.from_pretrained` reads our config.json; its `MedusaModel.from_pretrained`
is tried first, but under transformers 5 it fails building the base through its own copy of an old llama
(`modeling_llama_kv`: `rope_scaling["type"]`). Then its `MedusaModel.__init__` runs unchanged on a transformers
Llama base (it builds `medusa_head` and copies the base lm_head into every head), the head loading of its
`from_pretrained` is repeated line for line (`torch.load` of medusa_lm_head.pt, `load_state_dict(strict=False)`),
and its `forward` computes the heads' logits. `strict=False` would ignore misnamed keys silently, so every loaded
tensor is compared with ours, and the logits with our heads' on the same base.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch
from safetensors.torch import load_file

from medusa import MedusaModel
from medusa.heads_io import export_model, official_state_dict
from tests.conftest import make_heads, make_tiny_model, tiny_tokenizer

pytestmark = pytest.mark.slow

PACKAGE = "medusa-llm==0.1"
IDS = [[5, 17, 3, 44, 60, 2, 9, 31]]

# Runs in the fresh environment: argv = export dir, where to write the loaded tensors; prints one JSON line.
CHECK = f"""
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import medusa
from medusa.model.medusa_model import MedusaConfig, MedusaModel

export, out = sys.argv[1:3]
try:
    model, ran, keys = MedusaModel.from_pretrained(export), "from_pretrained", None
except Exception as err:  # its modeling_llama_kv under transformers 5
    ran = f"__init__ and from_pretrained's head loading (from_pretrained failed: {{type(err).__name__}}: {{err}})"
    config = MedusaConfig.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path)
    model = MedusaModel(base, config.medusa_num_heads, config.medusa_num_layers, config.base_model_name_or_path)
    state = torch.load(os.path.join(export, "medusa_lm_head.pt"), map_location=base.device)
    result = model.medusa_head.load_state_dict(state, strict=False)
    keys = {{"missing": result.missing_keys, "unexpected": result.unexpected_keys}}
with torch.inference_mode():
    logits = model(input_ids=torch.tensor({IDS}))
heads = {{k: v.contiguous() for k, v in model.medusa_head.state_dict().items()}}
save_file({{**heads, "logits": logits.contiguous()}}, out)
print(json.dumps({{"medusa_file": medusa.__file__, "ran": ran, "keys": keys}}))
"""


def _run(args, cwd, timeout=300):
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_official_medusa_package_loads_our_export(tmp_path):
    base_dir, env, elsewhere = tmp_path / "base", tmp_path / "env", tmp_path / "elsewhere"
    base = make_tiny_model("llama")
    base.save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)  # its __init__ loads the base's tokenizer
    # own projections, random: unlike a shared one, they differ from what its __init__ copies in from the base
    model = MedusaModel(base, make_heads(num_heads=3, random=True, projection="own", seed=5))
    export = export_model(model, tmp_path / "official", "medusa", base_model_name_or_path=str(base_dir))

    venv.EnvBuilder(with_pip=False).create(env)  # the running pip installs into it
    python = env / "bin" / "python"
    pip = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-cache-dir", "-q", PACKAGE],
        cwd=tmp_path,
    )
    if pip.returncode != 0:
        pytest.skip(f"pip could not install {PACKAGE} from PyPI (offline?): {pip.stderr.strip()[-500:]}")
    env_site = _run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (env / env_site / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))

    elsewhere.mkdir()
    check = _run([python, "-I", "-c", CHECK, export, tmp_path / "loaded.safetensors"], cwd=elsewhere)
    assert check.returncode == 0, check.stderr[-3000:]
    report = json.loads(check.stdout.strip().splitlines()[-1])
    assert report["medusa_file"].startswith(str(env.resolve())), report  # theirs, not this checkout's
    print("official medusa-llm ran:", report["ran"])
    if report["keys"] is not None:
        assert report["keys"] == {"missing": [], "unexpected": []}, report["keys"]

    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    logits = loaded.pop("logits")
    expected = official_state_dict(model.heads)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        hidden = base(torch.tensor(IDS), output_hidden_states=True).hidden_states[-1]
        ours = model.heads(hidden, base.get_output_embeddings())
    torch.testing.assert_close(logits, ours)
