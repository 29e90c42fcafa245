"""MedusaConfig: what a heads directory declares about itself, validated on construction."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from medusa.fileio import atomic_write_text
from medusa.ngram import COPY_MIN_NGRAM

FORMAT_VERSION = 1
CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"
PROJECTIONS = ("shared", "own")  # shared: reuse the base lm_head; own: one [V, H] matrix per head


def _is_int(value) -> bool:
    """An integer and not a bool (JSON true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class MedusaConfig:
    # Errors name a field "MedusaConfig.x"; the training config's heads section says "heads.x".
    _section: ClassVar[str] = ""
    # The base's sizes. None only while the training config's heads section is read: training fills them in from the
    # base (a saved medusa_config.json always holds both).
    hidden_size: int | None = None
    vocab_size: int | None = None  # the base's vocabulary (lm_head rows); filled in like hidden_size
    num_heads: int = 4  # heads, one per position guessed beyond the base's own next token
    num_layers: int = 1  # residual blocks per head
    projection: str = "shared"  # shared: reuse the base lm_head; own: one [V, H] matrix per head
    base_model_name_or_path: str | None = None  # the base the heads were trained on (training fills it in)
    revision: str | None = None  # that base's revision: training records a Hub base's commit (else null)
    tree: list[list[int]] | None = None  # default tree for these heads (rank paths, see medusa.tree)
    # Candidates come only from these most frequent tokens (ids stored with the weights): the heads' vocabulary
    # projection is then that much cheaper, and exactness is untouched because the target verifies every guess.
    vocab_subset_size: int | None = None
    # Heads also read the embedding of the target's own next token (the tree root), see MedusaHeads. Not part of
    # the official Medusa layout: such heads export to vLLM / TGI only if they do not use it.
    condition_on_next_token: bool = False
    # Head k (k >= 1) also reads the embeddings of the k tokens its path holds after the root: at decode time a
    # node's children come from its own path (Hydra's sequential heads), in training the target's tokens. Needs
    # condition_on_next_token. Medusa-only layout, like it.
    condition_on_path: bool = False
    # > 0: the heads read a context layer's output (causal attention over this many recent positions' hidden states
    # and next tokens, see medusa.heads.ContextLayer) instead of one position's hidden state. Needs
    # condition_on_next_token. Medusa-only layout.
    context_window: int = 0
    # The context layer also reads the residual stream after these base layers (0 = the embeddings), besides the
    # last hidden state: EAGLE-3's fused low / middle / high-level features. Needs context_window. Medusa-only layout.
    feature_layers: list[int] = field(default_factory=list)
    # > 0: each head ranks first the token that followed the most recent earlier occurrence of the last copy_ngram
    # .. 2 tokens (its copy guess, see medusa.ngram), before its own guesses. Weights are untouched: this is how the
    # heads' guesses are ranked when proposing and when scored. 0 = off.
    copy_ngram: int = 0
    format_version: int = FORMAT_VERSION  # the medusa_config.json layout; newer than this medusa is refused
    extra: dict = field(default_factory=dict)  # free-form provenance (training run, data), never read by code

    def _name(self, name: str) -> str:
        return f"{self._section or 'MedusaConfig'}.{name}"

    def _ref(self, name: str) -> str:
        """A field named inside another field's message: bare in MedusaConfig's, "heads.x" in the section's."""
        return f"{self._section}.{name}" if self._section else name

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_heads"):
            value = getattr(self, name)
            if (value is not None or name == "num_heads") and (not _is_int(value) or value <= 0):
                raise ValueError(f"{self._name(name)} must be a positive integer, got {value!r}")
        if not _is_int(self.format_version):
            raise ValueError(f"{self._name('format_version')} must be an integer, got {self.format_version!r}")
        for name in ("base_model_name_or_path", "revision"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{self._name(name)} must be a string or null, got {getattr(self, name)!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"{self._name('extra')} must be an object, got {self.extra!r}")
        if not _is_int(self.num_layers) or self.num_layers < 0:
            raise ValueError(f"{self._name('num_layers')} must be >= 0, got {self.num_layers!r}")
        for name in ("condition_on_next_token", "condition_on_path"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{self._name(name)} must be true or false, got {getattr(self, name)!r}")
        if self.condition_on_path and not self.condition_on_next_token:
            raise ValueError(
                f"{self._name('condition_on_path')} needs {self._ref('condition_on_next_token')}: a path "
                "starts at the root token (set both)"
            )
        if not _is_int(self.context_window) or self.context_window < 0:
            raise ValueError(f"{self._name('context_window')} must be an integer >= 0, got {self.context_window!r}")
        if self.context_window and not self.condition_on_next_token:
            raise ValueError(
                f"{self._name('context_window')} needs {self._ref('condition_on_next_token')}: the context "
                "layer reads each position's next token (set both)"
            )
        if (
            not isinstance(self.feature_layers, list)
            or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.feature_layers)
            or len(set(self.feature_layers)) != len(self.feature_layers)
        ):
            raise ValueError(
                f"{self._name('feature_layers')} must be a list of distinct layer indices >= 0, got "
                f"{self.feature_layers!r}"
            )
        if self.feature_layers and not self.context_window:
            raise ValueError(
                f"{self._name('feature_layers')} needs {self._ref('context_window')} > 0: the context layer "
                "is what reads the extra layers' features"
            )
        if (
            not isinstance(self.copy_ngram, int)
            or isinstance(self.copy_ngram, bool)
            or not (self.copy_ngram == 0 or self.copy_ngram >= COPY_MIN_NGRAM)
        ):
            raise ValueError(
                f"{self._name('copy_ngram')} must be 0 (off) or an integer >= {COPY_MIN_NGRAM} (the longest "
                f"suffix matched), got {self.copy_ngram!r}"
            )
        if self.projection not in PROJECTIONS:
            raise ValueError(f"{self._name('projection')} must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.vocab_subset_size is not None and (
            not _is_int(self.vocab_subset_size)
            or self.vocab_subset_size < 1
            or (self.vocab_size is not None and self.vocab_subset_size > self.vocab_size)
        ):
            raise ValueError(
                f"{self._name('vocab_subset_size')} must lie in [1, vocab_size], got {self.vocab_subset_size}"
            )
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"heads format_version {self.format_version} is newer than this medusa ({FORMAT_VERSION}): "
                "upgrade medusa"
            )
        if self.tree is not None:
            from medusa.tree import TreeSpec  # validates ranks and depth against num_heads

            TreeSpec(self.tree, num_heads=self.num_heads)

    def save(self, directory: str | os.PathLike) -> None:
        atomic_write_text(Path(directory) / CONFIG_NAME, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> MedusaConfig:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: not a medusa heads directory (expected {CONFIG_NAME} + {WEIGHTS_NAME})"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}): the heads config is corrupt") from err
        if not isinstance(raw, dict):
            raise ValueError(
                f"{path} holds {type(raw).__name__} {raw!r}, not an object of heads settings: the heads "
                "config is corrupt; re-save the heads"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known keys: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.name in ("hidden_size", "vocab_size") and f.name not in raw)
        if missing:
            raise ValueError(f"{path} lacks {missing}: the heads config is incomplete; re-save the heads")
        try:
            return cls(**raw)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
