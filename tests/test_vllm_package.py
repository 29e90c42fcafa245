"""vLLM's own Medusa classes load our `--format vllm` export.

vLLM is a GPU serving engine and cannot be installed here, so its wheel is downloaded from PyPI (no dependencies, not
installed) and the two files that define its Medusa draft are run from it unchanged:
`vllm/transformers_utils/configs/medusa.py` (`MedusaConfig`, what vLLM reads config.json with) and
`vllm/model_executor/models/medusa.py` (the `Medusa` module, its `load_weights` and `compute_logits`). What they import
from the rest of vLLM is stood in for by the few lines below: a tensor-parallel lm_head is a plain (V, H) weight on one
device, the logits processor a matmul, the default weight loader a copy. vLLM 0.32 is the last release with Medusa
(0.33 dropped it), so the version is pinned.

Checked: vLLM's config class reads our config (heads, layers, vocabulary sizes, the shared-lm_head flag), its
`load_weights` takes every tensor we write under a name it knows and leaves none of its parameters unloaded, and its
logits equal our heads' on the same hidden states: with one shared lm_head and a candidate subset (`token_map`,
logits outside it -inf) and with own projections.
"""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from medusa import MedusaModel
from medusa.heads_io import VLLM_WEIGHTS, export_model
from tests.conftest import make_heads, make_tiny_model

pytestmark = pytest.mark.slow

VLLM = "vllm==0.32.0"
FILES = {
    "vllm.transformers_utils.configs.medusa": "vllm/transformers_utils/configs/medusa.py",
    "vllm.model_executor.models.medusa": "vllm/model_executor/models/medusa.py",
}


@pytest.fixture(scope="module")
def vllm_sources(tmp_path_factory):
    """The two files, extracted from vLLM's wheel."""
    where = tmp_path_factory.mktemp("vllm")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d", str(where), VLLM],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheels = list(where.glob("vllm-*.whl"))
    if pip.returncode != 0 or not wheels:
        pytest.skip(f"pip could not download {VLLM} from PyPI (offline?): {pip.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return {name: wheel.read(path).decode() for name, path in FILES.items()}


class _ParallelLMHead(nn.Module):
    """vLLM's vocabulary-parallel lm_head on one device: a (V, H) weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "", **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)


class _LogitsProcessor:
    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0):
        self.scale = scale

    def __call__(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ lm_head.weight.T * self.scale


def _default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"vLLM's parameter: {tuple(param.shape)}, the file's: {tuple(loaded.shape)}"
    param.data.copy_(loaded)


def _stand_ins() -> dict[str, types.ModuleType]:
    def module(name: str, package: bool = False, **attributes) -> types.ModuleType:
        made = types.ModuleType(name)
        if package:
            made.__path__ = []
        made.__dict__.update(attributes)
        return made

    return {
        "vllm": module("vllm", package=True),
        "vllm.config": module("vllm.config", VllmConfig=object),
        "vllm.transformers_utils": module("vllm.transformers_utils", package=True),
        "vllm.transformers_utils.configs": module("vllm.transformers_utils.configs", package=True),
        "vllm.transformers_utils.utils": module(
            "vllm.transformers_utils.utils",
            without_trust_remote_code=lambda kwargs: {k: v for k, v in kwargs.items() if k != "trust_remote_code"},
        ),
        "vllm.model_executor": module("vllm.model_executor", package=True),
        "vllm.model_executor.layers": module("vllm.model_executor.layers", package=True),
        "vllm.model_executor.layers.logits_processor": module(
            "vllm.model_executor.layers.logits_processor", LogitsProcessor=_LogitsProcessor
        ),
        "vllm.model_executor.layers.vocab_parallel_embedding": module(
            "vllm.model_executor.layers.vocab_parallel_embedding", ParallelLMHead=_ParallelLMHead
        ),
        "vllm.model_executor.model_loader": module("vllm.model_executor.model_loader", package=True),
        "vllm.model_executor.model_loader.weight_utils": module(
            "vllm.model_executor.model_loader.weight_utils", default_weight_loader=_default_weight_loader
        ),
        "vllm.model_executor.models": module("vllm.model_executor.models", package=True),
        "vllm.model_executor.models.utils": module(
            "vllm.model_executor.models.utils", maybe_prefix=lambda prefix, name: f"{prefix}.{name}" if prefix else name
        ),
    }


@pytest.fixture
def vllm_medusa(vllm_sources, monkeypatch):
    """(vLLM's MedusaConfig, vLLM's Medusa), run from the downloaded sources over the stand-ins."""
    for name, stand_in in _stand_ins().items():
        monkeypatch.setitem(sys.modules, name, stand_in)
    loaded = []
    for name, source in vllm_sources.items():
        made = types.ModuleType(name)
        made.__package__ = name.rpartition(".")[0]
        made.__file__ = f"<{VLLM}>/{FILES[name]}"
        monkeypatch.setitem(sys.modules, name, made)
        exec(compile(source, made.__file__, "exec"), made.__dict__)
        loaded.append(made)
    return loaded[0].MedusaConfig, loaded[1].Medusa


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_vllm_medusa_classes_load_our_export(tmp_path, vllm_medusa, projection):
    vllm_config_class, vllm_model_class = vllm_medusa
    base = make_tiny_model("llama")
    heads = make_heads(num_heads=3, random=True, projection=projection, seed=7)
    if projection == "shared":  # with a candidate subset: vLLM keeps it as token_map + truncated_vocab_size
        heads.set_vocab_subset(torch.randperm(heads.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40])
    model = MedusaModel(base, heads)
    export = export_model(model, tmp_path / "vllm", "vllm", base_model_name_or_path="HuggingFaceTB/SmolLM2-135M")

    config = vllm_config_class.from_pretrained(str(export))
    assert (config.num_heads, config.num_hidden_layers) == (3, heads.config.num_layers)
    assert config.vocab_size == heads.config.vocab_size
    assert config.truncated_vocab_size == (40 if projection == "shared" else heads.config.vocab_size)
    assert bool(getattr(config, "original_lm_head", False)) == (projection == "shared")

    speculative = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=config))
    draft = vllm_model_class(vllm_config=types.SimpleNamespace(speculative_config=speculative))
    tensors = load_file(str(export / VLLM_WEIGHTS))
    loaded = draft.load_weights(iter(tensors.items()))
    # token_map becomes a parameter as it is read; load_weights reports the others
    assert loaded == set(dict(draft.named_parameters())) - {"token_map"}, "vLLM left parameters unloaded"
    assert (draft.token_map is not None) == (projection == "shared")

    with torch.no_grad():
        hidden = base(torch.tensor([[5, 17, 3, 44, 60, 2]]), output_hidden_states=True).hidden_states[-1][0]
        theirs = torch.stack(draft.compute_logits(draft(hidden)))  # (K, T, V)
        ours = model.heads(hidden, base.get_output_embeddings())
    if projection == "shared":
        subset = heads.vocab_subset
        torch.testing.assert_close(theirs[..., subset], ours[..., subset])
        outside = torch.ones(heads.config.vocab_size, dtype=torch.bool)
        outside[subset] = False
        assert torch.isneginf(theirs[..., outside]).all()
    else:
        torch.testing.assert_close(theirs, ours)
