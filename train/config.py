"""Dataclass configs for the training entry points: `--config file.yaml` plus `--section.key value` overrides.

Each YAML file has sections (`model`, `data`, `heads`, `training`); a script reads the sections it needs and
rejects keys that no dataclass declares, naming them, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from medusa.loading import resolve_dtype


@dataclass
class ModelConfig:
    base: str | None = None  # None: the embedded SmolLM2-135M-Instruct; else a Hub id, directory or .gguf
    dtype: str = "float32"
    device: str = "auto"  # where generate_data runs the base: auto (cuda when there is one, else cpu), cpu, cuda:N

    def __post_init__(self):
        resolve_dtype(self.dtype)  # names the valid choices
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from None

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass
class DataConfig:
    # source -> prompts: a count (-1: all) or a "start:stop" slice of the source's shuffled prompts
    sources: dict[str, int | str] = field(default_factory=lambda: {"bench:alpaca": 200})
    out_dir: str = "data/selfdistill"
    extra_dirs: list[str] = field(default_factory=list)  # more data directories training reads after out_dir
    max_shards: int | None = None  # generate only the first N shards of the mix (None: all of it)
    max_prompt_tokens: int = 768  # longer prompts are dropped
    max_new_tokens: int = 256
    batch_size: int = 16
    shard_size: int = 64  # prompts per shard on disk; the unit of resumption
    temperature: float = 0.7
    top_p: float = 0.95
    greedy_fraction: float = 0.5  # share of shards answered greedily (what greedy decoding will see)
    dtype: str = "bfloat16"
    seed: int = 0
    # Multi-turn data: this share of conversations (spread evenly) gets a second user turn, a follow-up from
    # `follow_ups` (None: DEFAULT_FOLLOW_UPS), and the target answers it too. Such a conversation is stored twice:
    # as its first turn, and as the whole exchange with the second answer as its response.
    second_turn_fraction: float = 0.0
    follow_ups: list[str] | None = None
    # false: write the prompts alone, through the chat template, without generating (tokenising only, no model
    # run): prefill-priced data that only training.prompt_tokens trains on, against the base's own distribution.
    answer: bool = True

    def __post_init__(self):
        _check_bool(self, "data", "answer")
        if not self.answer and self.second_turn_fraction:
            raise ValueError("data.second_turn_fraction needs answers to follow up on: set data.answer true, or "
                             "second_turn_fraction 0 for prompt-only data")
        if not 0.0 <= self.second_turn_fraction <= 1.0:
            raise ValueError(f"data.second_turn_fraction must lie in [0, 1], got {self.second_turn_fraction}")
        if self.follow_ups is not None and (not self.follow_ups or not all(isinstance(f, str) and f.strip()
                                                                            for f in self.follow_ups)):
            raise ValueError("data.follow_ups must be a non-empty list of non-empty strings (or null for the defaults)")
        if not self.sources:
            raise ValueError("data.sources is empty: name at least one prompt source")
        if self.batch_size <= 0 or self.shard_size <= 0 or self.max_new_tokens <= 0:
            raise ValueError("data.batch_size, data.shard_size and data.max_new_tokens must be positive")
        if self.max_shards is not None and self.max_shards <= 0:
            raise ValueError(f"data.max_shards must be positive or null (all shards), got {self.max_shards}")
        if not 0.0 <= self.greedy_fraction <= 1.0:
            raise ValueError(f"data.greedy_fraction must lie in [0, 1], got {self.greedy_fraction}")


@dataclass
class HeadsConfig:
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    projection: str = "shared"  # shared: reuse the frozen base lm_head (train blocks only); own: one [V, H] per head
    init_from: str | None = None  # a heads directory to start from (e.g. Medusa-1 heads before Medusa-2)
    # Propose only from the N most frequent response tokens of the training data (cheaper head projection at
    # decode time; exactness is untouched). None: the whole vocabulary.
    vocab_subset_size: int | None = None
    # With a subset, the loss's softmax runs over the candidate tokens only: what proposing ranks, several times
    # cheaper than the whole vocabulary.
    loss_over_candidates: bool = True
    # Heads also read the embedding of the target's next token (the tree root): more accurate guesses, but a
    # layout only medusa serves (see MedusaHeads).
    condition_on_next_token: bool = False
    # Head k also reads the k tokens of its path after the root (Hydra's sequential heads); needs the above.
    condition_on_path: bool = False
    # > 0: a context layer (causal attention over this many recent positions, then an MLP) between the base's hidden
    # states and the heads; needs condition_on_next_token. 0: the heads read one position's hidden state.
    context_window: int = 0
    # Base layers whose residual stream the context layer reads besides the last hidden state (EAGLE-3's fused
    # features; 0 = the embeddings); needs context_window.
    feature_layers: list[int] = field(default_factory=list)
    # > 0: the saved heads rank their copy guess first (the token after the most recent earlier occurrence of the
    # last copy_ngram .. 2 tokens; see medusa.ngram). Not trained: written to the heads' config. 0 = off.
    copy_ngram: int = 0

    def __post_init__(self):
        from medusa.config import PROJECTIONS

        for name in ("loss_over_candidates", "condition_on_next_token", "condition_on_path"):
            _check_bool(self, "heads", name)
        if self.condition_on_path and not self.condition_on_next_token:
            raise ValueError("heads.condition_on_path needs heads.condition_on_next_token: true (a path starts at the "
                             "root token)")
        _check_int(self, "heads", "num_heads", minimum=1)
        _check_int(self, "heads", "num_layers", minimum=0)
        _check_int(self, "heads", "context_window", minimum=0)
        _check_int(self, "heads", "copy_ngram", minimum=0)
        if self.context_window and not self.condition_on_next_token:
            raise ValueError("heads.context_window needs heads.condition_on_next_token: true (the context layer reads "
                             "each position's next token)")
        if self.feature_layers and not self.context_window:
            raise ValueError("heads.feature_layers needs heads.context_window > 0 (the context layer reads them)")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"heads.projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.vocab_subset_size is not None:
            _check_int(self, "heads", "vocab_subset_size", minimum=1)
        if self.num_layers == 0 and self.projection == "shared":
            raise ValueError("heads.num_layers 0 with projection 'shared' leaves nothing to train: "
                             "use num_layers >= 1 or projection 'own'")


MIXED_PRECISION = ("auto", "bf16", "no")
REPORT_TO = ("none", "wandb")
BATCH_UNITS = ("sequences", "tokens")


@dataclass
class TrainingConfig:
    output_dir: str = "runs/heads"  # the final heads directory (medusa_config.json + medusa_heads.safetensors)
    checkpoint_dir: str | None = None  # default: runs/checkpoints/<name of output_dir>
    cache_dir: str = "runs/hidden_cache"  # precomputed base hidden states, one file per (data, base) pair
    lr: float = 1e-3  # heads (official Medusa-1: 1e-3)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_steps: int | None = None  # wins over epochs when set
    epochs: int = 1
    batch_size: int = 8  # per process and micro-step, in batch_unit
    batch_unit: str = "sequences"  # sequences | tokens: pack conversations up to batch_size positions (with
    # precompute_hidden, the positions the heads read: response + num_heads + 1; otherwise whole conversations)
    grad_accum: int = 1
    max_length: int = 1024  # conversations are truncated to this many tokens
    max_grad_norm: float | None = 1.0
    eval_every: int = 100  # optimizer steps between evaluations (0: only at the start and the end)
    eval_conversations: int = 64  # held out by a hash of their tokens: the same ones whatever the seed
    head_decay: float = 0.8  # head k's cross-entropy weighs heads_coefficient * head_decay**k
    heads_coefficient: float = 1.0
    seed: int = 0
    report_to: str = "none"  # none | wandb (offline unless WANDB_MODE says otherwise)
    wandb_project: str = "medusa"
    run_name: str | None = None
    log_every: int = 10
    save_every: int = 500  # optimizer steps between checkpoints (0: none before the end)
    keep_checkpoints: int = 2
    precompute_hidden: bool = True  # frozen base: run it once over the data, reuse its hidden states every epoch
    precompute_batch_tokens: int = 8192  # padded tokens per base forward while precomputing
    mixed_precision: str = "auto"  # auto (bf16 where the hardware has it) | bf16 | no
    chunk_tokens: int = 2048  # rows per vocabulary-projection chunk: bounds the [rows, V] logits in memory
    # Medusa-2: LoRA on the base, trained with the heads; the base keeps its distribution through a KL term.
    medusa2: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str | list[str] = "all-linear"  # peft's shorthand for every linear layer but lm_head
    lora_lr: float = 1e-4  # the adapters move slower than the heads
    kl_weight: float = 1.0
    save_dtype: str | None = None  # store the final heads in this dtype (e.g. bfloat16: half the file); None keeps fp32
    # Heads learn the base's whole next-token distribution (KL, soft targets) instead of the data's one token;
    # held-out evaluation still scores the data's tokens. Needs heads.projection shared.
    distill: bool = False
    # Also train on every prompt position of the training conversations, against the base's own distribution there
    # (the prompt's tokens are not the base's, so this needs distill): prefill-priced data, no generation. The
    # hidden-state cache then holds whole conversations. Held-out evaluation still scores responses only.
    prompt_tokens: bool = False

    def __post_init__(self):
        for name in ("lr", "weight_decay", "head_decay", "heads_coefficient", "lora_dropout", "lora_lr", "kl_weight"):
            _check_float(self, name, minimum=0.0)
        if self.max_grad_norm is not None:
            _check_float(self, "max_grad_norm", minimum=0.0)
        for name in ("batch_size", "grad_accum", "max_length", "log_every", "keep_checkpoints",
                     "precompute_batch_tokens", "chunk_tokens", "lora_r", "lora_alpha", "epochs"):
            _check_int(self, "training", name, minimum=1)
        for name in ("warmup_steps", "eval_every", "eval_conversations", "save_every", "seed"):
            _check_int(self, "training", name, minimum=0)
        if self.max_steps is not None:
            _check_int(self, "training", "max_steps", minimum=1)
        if self.lr == 0:
            raise ValueError("training.lr is 0: the heads would not move")
        if self.batch_unit not in BATCH_UNITS:
            raise ValueError(f"training.batch_unit must be one of {BATCH_UNITS}, got {self.batch_unit!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"training.mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"training.report_to must be one of {REPORT_TO}, got {self.report_to!r}")
        for name in ("distill", "prompt_tokens"):
            _check_bool(self, "training", name)
        if self.prompt_tokens and not self.distill:
            raise ValueError("training.prompt_tokens needs training.distill: true (a prompt's tokens are not the base's "
                             "own, so the heads learn the base's distribution there, not the prompt's next token)")
        if self.medusa2 and self.precompute_hidden:
            raise ValueError("training.precompute_hidden needs a frozen base, but medusa2 adapts it with LoRA: "
                             "set training.precompute_hidden false for Medusa-2")
        if self.save_dtype is not None:
            resolve_dtype(self.save_dtype)
        if not self.output_dir:
            raise ValueError("training.output_dir is empty: name the directory the heads are written to")


def _check_bool(cfg, section: str, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{name} must be true or false, got {value!r}")


def _check_int(cfg, section: str, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{section}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(cfg, name: str, minimum: float) -> None:
    """Accept ints and numeric strings (YAML reads `1e-3` without a dot as a string) and store a float."""
    value = getattr(cfg, name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"training.{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or number < minimum:
        raise ValueError(f"training.{name} must be a number >= {minimum}, got {value!r}")
    setattr(cfg, name, number)


def load_sections(config_path: str | None, overrides: list[str], sections: dict[str, type]) -> dict[str, object]:
    """Build one dataclass per section from YAML plus `--section.key value` overrides; reject unknown keys."""
    raw: dict = {}
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
    for name in raw:
        if name not in sections and name not in ALL_SECTIONS:
            raise ValueError(f"{config_path}: unknown section {name!r}; known sections: {sorted(ALL_SECTIONS)}")
    it = iter(overrides)
    for flag in it:
        if not flag.startswith("--") or "." not in flag:
            raise ValueError(f"override {flag!r} must look like --section.key value (e.g. --training.max_steps 100)")
        section, key = flag[2:].split(".", 1)
        try:
            value = next(it)
        except StopIteration:
            raise ValueError(f"override {flag} has no value") from None
        raw.setdefault(section, {})[key] = yaml.safe_load(value)  # numbers, bools, lists, dicts
    built = {}
    for name, cls in sections.items():
        values = raw.get(name) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in section {name!r}; known keys: {sorted(known)}")
        built[name] = cls(**values)
    return built


def parse_args(description: str, sections: dict[str, type], argv: list[str] | None = None, extra=None):
    """`--config x.yaml` plus overrides -> (namespace, {section: dataclass})."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML file with sections " + ", ".join(sections))
    if extra:
        extra(parser)
    args, rest = parser.parse_known_args(argv)
    return args, load_sections(args.config, rest, sections)


# Every section any entry point understands (a file may hold sections another script reads).
ALL_SECTIONS = {"model", "data", "heads", "training"}
