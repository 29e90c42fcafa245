"""transformers' `custom_generate` hook for a heads directory or Hub repo: with it, a transformers user decodes with
the heads without changing their code beyond one argument,

    model = AutoModelForCausalLM.from_pretrained(base)
    out = model.generate(**inputs, custom_generate="org/heads", trust_remote_code=True)

transformers runs `custom_generate/generate.py` from the repo (a copy in its module cache, so the file names where the
heads are: the repo id, or the directory's absolute path) with the model it was called on; ours loads the heads onto
that model once and calls MedusaModel.generate, which returns what transformers' generate returns."""

from __future__ import annotations

from pathlib import Path

HOOK_DIR = "custom_generate"
REQUIREMENTS = "medusa-spec\n"  # transformers checks these are installed before it runs the hook

_TEMPLATE = '''"""Medusa heads for transformers' generate (written by medusa's save_pretrained / push_to_hub):

    model.generate(**inputs, custom_generate=<this repo>, trust_remote_code=True)

decodes with the heads at HEADS on the model it is called on; the output is what its own generate returns (greedy: the
same tokens). Needs `pip install medusa-spec`."""

HEADS = {heads!r}
REVISION = {revision!r}
_attached = {{}}  # id(model) -> the MedusaModel around it, built on the first call


def generate(model, **kwargs):
    from medusa import MedusaModel

    medusa = _attached.get(id(model))
    if medusa is None or medusa.base is not model:
        medusa = _attached[id(model)] = MedusaModel.from_pretrained(HEADS, base=model, revision=REVISION)
    # transformers passes every generate argument, unset ones as None
    return medusa.generate(**{{name: value for name, value in kwargs.items() if value is not None}})
'''


def write_hook(directory: Path, heads: str, revision: str | None = None) -> None:
    """Write `custom_generate/` into the heads folder `directory`; `heads`: where users will load the heads from (a
    Hub repo id, or the folder's final absolute path), `revision` the Hub revision."""
    hook = Path(directory) / HOOK_DIR
    hook.mkdir(exist_ok=True)
    (hook / "generate.py").write_text(_TEMPLATE.format(heads=heads, revision=revision))
    (hook / "requirements.txt").write_text(REQUIREMENTS)
