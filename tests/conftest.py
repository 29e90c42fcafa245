"""Tiny randomly initialised models of several families (seconds on CPU) and the real embedded model (slow)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from medusa import MedusaConfig, MedusaHeads, MedusaModel

# from_pretrained calibrates a plan by default; tests choose engine and tree themselves (tests/test_plan.py asks
# for plan="auto"), so timing noise never changes what they decode.
os.environ.setdefault("MEDUSA_PLAN", "off")
# Plans made in tests leave torch.compile out (minutes of compiling); tests/test_engine.py tests the inductor engine.
os.environ.setdefault("MEDUSA_COMPILE", "0")
# Half-precision tests run on every CPU of this machine kind, AVX2-only ones too, where a user asking for bf16 is
# refused (slower than fp32 there); tests/test_precision.py checks that refusal with this unset.
os.environ.setdefault("MEDUSA_ALLOW_EMULATED_BF16", "1")
# Under pytest-xdist (make test: a worker per core), each worker takes its share of the cores: torch's default of
# every core per process would have the workers' thread pools contend. The processes a test starts (the notebook's
# kernel, the CLI, accelerate, the wheel's venv) inherit the share through OMP_NUM_THREADS: with every core each, their
# OpenMP threads would spin waiting for the core another worker holds, several times slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))

VOCAB, HIDDEN = 96, 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "gemma": lambda: GemmaConfig(**_COMMON, head_dim=16),
}
FAMILIES = sorted(TINY_CONFIGS)
# Sliding-window attention, a window far shorter than the tests' sequences: Gemma 3 (a full layer after a sliding one),
# Qwen2 with `use_sliding_window` (layers typed, every one sliding), Mistral (no layer types: one mask for all)
WINDOW = 8
SLIDING_CONFIGS = {
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "qwen2": lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
}


def make_tiny_model(family: str, seed: int = 0, dtype=torch.float32, sliding: bool = False):
    """A tiny randomly initialised model of `family` (TINY_CONFIGS; `sliding`: SLIDING_CONFIGS)."""
    torch.manual_seed(seed)
    config = (SLIDING_CONFIGS if sliding else TINY_CONFIGS)[family]()
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def make_heads(
    num_heads: int = 4,
    random: bool = False,
    projection: str = "shared",
    seed: int = 1,
    num_layers: int = 1,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    condition_on_next_token: bool = False,
    condition_on_path: bool = False,
) -> MedusaHeads:
    """Untrained heads (identity blocks), or random ones whose guesses are often wrong (exercise rejection paths)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(
        MedusaConfig(
            hidden_size=hidden,
            vocab_size=vocab,
            num_heads=num_heads,
            num_layers=num_layers,
            projection=projection,
            condition_on_next_token=condition_on_next_token or condition_on_path,
            condition_on_path=condition_on_path,
        )
    )
    if random:
        for p in heads.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return heads


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level: <pad> + the 95 printable ASCII characters = the tiny models' 96 ids; with a chat template."""
    chars = [chr(i) for i in range(32, 127)]
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tokenizer


def save_tiny_checkpoint(directory: Path, family: str = "llama") -> tuple[Path, Path]:
    """A tiny base (with tokenizer) and random heads saved as directories: (base_dir, heads_dir)."""
    base_dir, heads_dir = directory / "base", directory / "heads"
    base = make_tiny_model(family)
    base.save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    MedusaModel(base, make_heads(random=True)).save_pretrained(heads_dir)
    return base_dir, heads_dir


def run_together(target, names: tuple[str, ...] = ("first", "second")) -> None:
    """Call target(name) in one thread per name, all started before any is joined (for the locks of one-time work:
    flock locks are per open file, so threads contend for them as processes do)."""
    threads = [threading.Thread(target=target, args=(name,), name=name) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.fixture(params=FAMILIES)
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default with untrained heads (loads from the safetensors cache after the first time)."""
    return MedusaModel.from_base()


CONTEXT_WINDOW = 5  # the context layer of context_heads


def context_heads(window: int = CONTEXT_WINDOW, path: bool = True, seed: int = 1, feature_layers=()) -> MedusaHeads:
    """Random heads of the shipped kind (a context layer, conditioned on the next token and the path), every map
    non-zero, so the context layer is far from the identity."""
    torch.manual_seed(seed)
    heads = MedusaHeads(
        MedusaConfig(
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            num_heads=3,
            condition_on_next_token=True,
            condition_on_path=path,
            context_window=window,
            feature_layers=list(feature_layers),
        )
    )
    for name, p in heads.named_parameters():
        if "norm" not in name:  # the context layer's smaller, so that its attention does not saturate
            torch.nn.init.normal_(p, std=0.05 if name.startswith("context.") else 0.3)
    return heads
