"""The config of the training entry points: `--config file.yaml` plus `--section.key value` overrides.

One YAML file holds four sections (`model`, `data`, `heads`, `training`); train/generate_data.py reads model and
data, train/train.py all four. draccus decodes the merged YAML into the dataclasses below: every value must have its
field's type (strictly: the string "no" is no bool, "16" no int), and a field's comment is its `--help` text. Keys no
dataclass declares are refused with their dotted path, so a typo never silently falls back to a default; ranges are
checked in each `__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import draccus
import torch
import yaml
from draccus.utils import DecodingError, ParsingError

from medusa.config import MedusaConfig
from medusa.loading import resolve_dtype
from medusa.train.losses import CHUNK_TOKENS


# draccus would turn the string "no" into False, True into 1 and 123 into "123": a YAML slip must be refused instead.
def _strict_bool(raw):
    if not isinstance(raw, bool):
        raise ValueError(f"must be true or false, got {raw!r}")
    return raw


def _strict_int(raw):
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"must be an integer, got {raw!r}")
    return raw


def _number(raw):
    """Floats, ints and numeric strings (YAML 1.1 reads `1e-3`, without a dot, as a string)."""
    try:
        if isinstance(raw, bool):
            raise TypeError
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number, got {raw!r}") from None


def _strict_str(raw):
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {raw!r}")
    return raw


for _type, _decode in ((bool, _strict_bool), (int, _strict_int), (float, _number), (str, _strict_str)):
    draccus.decode.register(_type, _decode)


QUANTIZE = ("none", "int8")


@dataclass
class ModelConfig:
    base: str | None = None  # null: the embedded SmolLM2-135M-Instruct; else a Hub id, directory or .gguf
    dtype: str = "float32"  # the base's weights: float32, bfloat16 or float16
    device: str = "auto"  # where generate_data runs the base: auto (cuda when there is one, else cpu), cpu, cuda:N
    # Training only: the frozen base's decoder layers in none (model.dtype) or int8 (torchao weight-only: about half
    # of bf16's memory; its hidden states differ slightly). The lm_head and embeddings keep model.dtype
    quantize: str = "none"

    def __post_init__(self):
        resolve_dtype(self.dtype)  # names the valid choices
        if self.quantize not in QUANTIZE:
            raise ValueError(
                f"model.quantize must be one of {QUANTIZE}, got {self.quantize!r} (int8: torchao weight-only int8 "
                "for the frozen base's decoder layers)"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from None

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


ANSWER_ENGINES = ("medusa", "transformers")  # what generate_data answers with (data.engine)


@dataclass
class DataConfig:
    # Prompt source -> prompts: a count (-1: all) or a "start:stop" slice of the source's shuffled prompts
    sources: dict[str, int | str] = field(default_factory=lambda: {"bench:alpaca": 200})
    out_dir: str = "data/selfdistill"  # where generate_data writes its shards and training reads them
    extra_dirs: list[str] = field(default_factory=list)  # more data directories training reads after out_dir
    max_shards: int | None = None  # generate only the first N shards of the mix (null: all of it)
    max_prompt_tokens: int = 768  # longer prompts are dropped
    max_new_tokens: int = 256  # the longest answer generated
    batch_size: int = 16  # prompts answered together
    shard_size: int = 64  # prompts per shard on disk; the unit of resumption
    temperature: float = 0.7  # sampled shards' temperature
    top_p: float = 0.95  # sampled shards' nucleus
    greedy_fraction: float = 0.5  # share of shards answered greedily (what greedy decoding will see)
    dtype: str = "bfloat16"  # the base's dtype while generating
    # What answers: "medusa" (this library's batched generate: every row as the base alone would decode it, laid out
    # by the plan; the figures are in docs/training.md) or "transformers" (the base's own generate)
    engine: str = "medusa"
    # Heads the medusa engine guesses with (a directory, Hub id or embedded: name); null: the shipped heads on the
    # embedded default base; on any other base (no heads to guess with yet) plain decoding laid out by medusa's plan
    heads: str | None = None
    seed: int = 0  # shuffles the prompt mix and seeds sampling
    # Multi-turn data: this share of conversations (spread evenly) gets a second user turn, a follow-up from
    # follow_ups, and the target answers it too (stored as the first turn and as the whole exchange)
    second_turn_fraction: float = 0.0
    follow_ups: list[str] | None = None  # the second turns' user messages (null: DEFAULT_FOLLOW_UPS)
    # false: write the prompts alone, through the chat template, without generating: prefill-priced data that only
    # training.prompt_tokens trains on, against the base's own distribution
    answer: bool = True
    # true: each prompt's response is its source's own answer (Alpaca's output, GSM8K's answer), not one the target
    # generates: Medusa-1's original recipe (ShareGPT answers), data in seconds; train it with training.distill so the
    # heads still learn the base's distribution over that text
    reference_answers: bool = False

    def __post_init__(self):
        if self.reference_answers and not self.answer:
            raise ValueError(
                "data.reference_answers gives every prompt its source's answer, data.answer false asks for "
                "prompts alone: set one of them"
            )
        if self.reference_answers and self.second_turn_fraction:
            raise ValueError(
                "data.second_turn_fraction needs the target to answer the follow-ups, which reference answers "
                "cannot: set data.reference_answers false or second_turn_fraction 0"
            )
        if not self.answer and self.second_turn_fraction:
            raise ValueError(
                "data.second_turn_fraction needs answers to follow up on: set data.answer true, or "
                "second_turn_fraction 0 for prompt-only data"
            )
        for name in ("second_turn_fraction", "greedy_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"data.{name} must lie in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"data.top_p must lie in (0, 1], got {self.top_p}: 1 keeps every token")
        if self.temperature <= 0:
            raise ValueError(
                f"data.temperature must be > 0, got {self.temperature}: greedy shards come from "
                "data.greedy_fraction, not a zero temperature"
            )
        if self.follow_ups is not None and (not self.follow_ups or not all(f.strip() for f in self.follow_ups)):
            raise ValueError("data.follow_ups must be a non-empty list of non-empty strings (or null for the defaults)")
        if not self.sources:
            raise ValueError("data.sources is empty: name at least one prompt source")
        for name in ("batch_size", "shard_size", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be positive, got {getattr(self, name)}")
        if self.max_shards is not None and self.max_shards <= 0:
            raise ValueError(f"data.max_shards must be positive or null (all shards), got {self.max_shards}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if not self.out_dir:
            raise ValueError("data.out_dir is empty: name the directory of the data shards")
        if self.engine not in ANSWER_ENGINES:
            raise ValueError(f"data.engine must be one of {ANSWER_ENGINES}, got {self.engine!r}")
        if self.heads is not None and self.engine != "medusa":
            raise ValueError(
                f"data.heads guess for the medusa engine; data.engine is {self.engine!r}: set data.engine medusa or "
                "data.heads null"
            )
        resolve_dtype(self.dtype)


@dataclass
class HeadsConfig(MedusaConfig):
    """The heads section is the heads' own config (medusa_config.json), peft's LoraConfig pattern: the saved config
    is this section with what training fills in from the base (FILLED_IN). Any MedusaConfig field is an option."""

    _section: ClassVar[str] = "heads"
    # A heads directory to start from (e.g. Medusa-1 heads before Medusa-2): it supplies every field this section
    # does not name
    init_from: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.num_layers == 0 and self.projection == "shared":
            raise ValueError(
                "heads.num_layers 0 with projection 'shared' leaves nothing to train: "
                "use num_layers >= 1 or projection 'own'"
            )


# MedusaConfig fields training fills in (from the base and the run), so the heads section may not set them. revision:
# the commit a Hub base was loaded at (medusa.loading.hub_commit), null for a directory or GGUF file.
FILLED_IN = ("hidden_size", "vocab_size", "base_model_name_or_path", "revision", "format_version", "extra")

MIXED_PRECISION = ("auto", "bf16", "no")
REPORT_TO = ("none", "wandb")
SHARD = ("none", "fsdp")
BATCH_UNITS = ("sequences", "tokens")


@dataclass
class TrainingConfig:
    output_dir: str = "runs/heads"  # the final heads directory (medusa_config.json + medusa_heads.safetensors)
    checkpoint_dir: str | None = None  # default: runs/checkpoints/<name of output_dir>
    cache_dir: str = "runs/hidden_cache"  # precomputed base hidden states, one file per (data, base) pair
    lr: float = 1e-3  # heads (official Medusa-1: 1e-3)
    weight_decay: float = 0.0  # AdamW's, on weight matrices only
    warmup_steps: int = 0  # linear warmup, then a cosine schedule
    max_steps: int | None = None  # wins over epochs when set
    epochs: int = 1  # passes over the training conversations (when max_steps is null)
    batch_size: int = 8  # per process and micro-step, in batch_unit
    # sequences | tokens: pack conversations up to batch_size positions (with precompute_hidden, the positions the
    # heads read: response + num_heads + 1; otherwise whole conversations)
    batch_unit: str = "sequences"
    grad_accum: int = 1  # micro-steps per optimizer step
    max_length: int = 1024  # conversations are truncated to this many tokens
    max_grad_norm: float | None = 1.0  # gradient clipping (null: none)
    eval_every: int = 100  # optimizer steps between evaluations (0: only at the start and the end)
    eval_conversations: int = 64  # held out by a hash of their tokens: the same ones whatever the seed
    head_decay: float = 0.8  # head k's cross-entropy weighs heads_coefficient * head_decay**k
    heads_coefficient: float = 1.0  # the heads' loss against the base's KL (Medusa-2)
    # With heads.vocab_subset_size, the loss's softmax runs over the candidate tokens only: what proposing ranks,
    # several times cheaper than the whole vocabulary
    loss_over_candidates: bool = True
    seed: int = 0  # data order, initialisation and dropout
    report_to: str = "none"  # none | wandb (offline unless WANDB_MODE says otherwise)
    wandb_project: str = "medusa"  # the wandb project (report_to wandb)
    run_name: str | None = None  # the wandb run's name
    log_every: int = 10  # optimizer steps between loss lines
    save_every: int = 500  # optimizer steps between checkpoints (0: none before the end)
    keep_checkpoints: int = 2  # the newest N (>= 2) checkpoints are kept
    precompute_hidden: bool = True  # frozen base: run it once over the data, reuse its hidden states every epoch
    precompute_batch_tokens: int = 8192  # padded tokens per base forward while precomputing
    mixed_precision: str = "auto"  # auto (bf16 where the hardware has it) | bf16 | no
    chunk_tokens: int = CHUNK_TOKENS  # rows per vocabulary-projection chunk: bounds the [rows, V] logits in memory
    # Medusa-2: LoRA on the base, trained with the heads; the base keeps its distribution through a KL term
    medusa2: bool = False
    lora_r: int = 16  # LoRA rank (Medusa-2)
    lora_alpha: int = 32  # LoRA scale numerator (Medusa-2)
    lora_dropout: float = 0.05  # LoRA dropout (Medusa-2)
    lora_target_modules: str | list[str] = "all-linear"  # peft's shorthand for every linear layer but lm_head
    lora_lr: float = 1e-4  # the adapters move slower than the heads
    kl_weight: float = 1.0  # the base's KL to its frozen self (Medusa-2)
    save_dtype: str | None = None  # store the final heads in this dtype (e.g. bfloat16: half the file); null: fp32
    # Heads learn the base's whole next-token distribution (KL, soft targets) instead of the data's one token;
    # held-out evaluation still scores the data's tokens. Needs heads.projection shared
    distill: bool = False
    # Also train on every prompt position of the training conversations, against the base's own distribution there
    # (needs distill): prefill-priced data, no generation. Held-out evaluation still scores responses only
    prompt_tokens: bool = False
    # Recompute activations in backward instead of keeping them (less memory, about one more forward of compute):
    # the LoRA-adapted base's layers (Medusa-2) or the EAGLE-3 draft's MLP and per-step loss. Medusa-1 keeps no
    # activations of its frozen base, so there it is refused
    gradient_checkpointing: bool = False
    # none | fsdp: shard the base, heads and adapters over the processes with torch's FSDP2 (CPU and GPU);
    # `accelerate launch --use_fsdp` sets it. Heads need precompute_hidden false (hidden states from the sharded
    # base); an EAGLE-3 draft always reads them online
    shard: str = "none"

    def __post_init__(self):
        for name in ("lr", "weight_decay", "head_decay", "heads_coefficient", "lora_lr", "kl_weight"):
            _check_range(self, name, minimum=0)
        if self.max_grad_norm is not None:
            _check_range(self, "max_grad_norm", minimum=0)
        for name in (
            "batch_size",
            "grad_accum",
            "max_length",
            "log_every",
            "precompute_batch_tokens",
            "chunk_tokens",
            "lora_r",
            "lora_alpha",
            "epochs",
        ):
            _check_range(self, name, minimum=1)
        for name in ("warmup_steps", "eval_every", "eval_conversations", "save_every", "seed"):
            _check_range(self, name, minimum=0)
        if self.max_steps is not None:
            _check_range(self, "max_steps", minimum=1)
        if self.keep_checkpoints < 2:  # accelerate prunes before it writes: a kill mid-save must leave one
            raise ValueError(
                f"training.keep_checkpoints must be >= 2, got {self.keep_checkpoints}: the oldest is "
                "deleted before the next is written, so one alone would not survive a kill during a save"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"training.lora_dropout must lie in [0, 1), got {self.lora_dropout}")
        if self.lr == 0:
            raise ValueError("training.lr is 0: the heads would not move")
        for name, choices in (
            ("batch_unit", BATCH_UNITS),
            ("mixed_precision", MIXED_PRECISION),
            ("report_to", REPORT_TO),
            ("shard", SHARD),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"training.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.prompt_tokens and not self.distill:
            raise ValueError(
                "training.prompt_tokens needs training.distill: true (a prompt's tokens are not the base's "
                "own, so the heads learn the base's distribution there, not the prompt's next token)"
            )
        if self.medusa2 and self.precompute_hidden:
            raise ValueError(
                "training.precompute_hidden needs a frozen base, but medusa2 adapts it with LoRA: "
                "set training.precompute_hidden false for Medusa-2"
            )
        if self.save_dtype is not None:
            resolve_dtype(self.save_dtype)
        if not self.output_dir:
            raise ValueError("training.output_dir is empty: name the directory the heads are written to")


def _check_range(cfg, name: str, minimum: float) -> None:
    if getattr(cfg, name) < minimum:
        raise ValueError(f"training.{name} must be >= {minimum}, got {getattr(cfg, name)!r}")


@dataclass
class Eagle3Config:
    """An EAGLE-3 draft instead of heads (train/eagle3.py): `training` still sets the steps, rates, lengths and
    where the draft and its checkpoints go; the heads section is ignored."""

    enabled: bool = False  # train an EAGLE-3 draft (medusa.eagle3) rather than Medusa heads
    aux_layers: list[int] | None = None  # the target layers fc reads (transformers' hidden_states index); null:
    # EAGLE-3's [2, L // 2, L - 3]
    draft_vocab_size: int = 8192  # the most frequent response tokens of the training data
    ttt_steps: int = 5  # training-time test: steps the draft is unrolled over its own outputs
    step_decay: float = 0.8  # step j's loss weighs step_decay**j (EAGLE-3's)
    speculative_tokens: int = 5  # the chain length recorded in the saved config (what vLLM drafts)
    # also score prompt positions against the target's distribution there (prompt-only data, data.answer false,
    # becomes usable); answers alone otherwise
    prompt_tokens: bool = False
    # the target's features at aux_layers and its last hidden state computed once over the data and kept under
    # training.cache_dir (bf16, (1 + len(aux_layers)) x hidden size per token: 4.6 kB for SmolLM2), instead of a target
    # forward per conversation every epoch; online (false) holds nothing on disk, as large data on a GPU wants
    cache_features: bool = False
    # start from this draft's weights and vocabulary (a directory in either layout, `embedded:<name>` or a Hub repo)
    # instead of fresh ones: more data or more steps for a trained draft; its layers must agree, and a larger
    # draft_vocab_size grows its vocabulary by the data's most frequent tokens it lacks (never shrinks it)
    init_from: str | None = None

    def __post_init__(self):
        if self.ttt_steps < 1:
            raise ValueError(f"eagle3.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"eagle3.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"eagle3.step_decay must lie in (0, 1], got {self.step_decay}")


@dataclass
class Config:
    """A whole config file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)

    def __post_init__(self):
        # (an EAGLE-3 draft reads the target's hidden states online: precompute_hidden is for heads)
        if self.training.shard == "fsdp" and self.training.precompute_hidden and not self.eagle3.enabled:
            raise ValueError(
                "training.shard fsdp shards the base, but precompute_hidden runs the whole base in every process: "
                "set training.precompute_hidden false (hidden states computed online by the sharded base)"
            )
        if self.training.gradient_checkpointing and not (self.training.medusa2 or self.eagle3.enabled):
            raise ValueError(
                "training.gradient_checkpointing recomputes what backward needs of a network that trains, but "
                "Medusa-1's base is frozen (no gradient flows through it, nothing of it is kept): use it with "
                "training.medusa2 true or eagle3.enabled true, or drop it"
            )


def load_config(config_path: str | None, overrides: list[str] = ()) -> Config:
    """YAML plus `--section.key value` overrides (values read as YAML) -> a validated Config."""
    raw: dict = {}
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(
                f"{path} holds {type(raw).__name__}, not sections: write `section:` lines (model, data, "
                "heads, training)"
            )
    raw = {name: values or {} for name, values in raw.items()}  # an empty section is all defaults
    it = iter(overrides)
    for flag in it:
        if not flag.startswith("--") or "." not in flag:
            raise ValueError(f"override {flag!r} must look like --section.key value (e.g. --training.max_steps 100)")
        section, key = flag[2:].split(".", 1)
        try:
            value = next(it)
        except StopIteration:
            raise ValueError(f"override {flag} has no value") from None
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ValueError(f"section {section!r} must be a mapping of keys, got {raw[section]!r}")
        raw[section][key] = yaml.safe_load(value)  # numbers, bools, lists, dicts
    _refuse_unknown(raw, config_path)
    if raw.get("heads", {}).get("init_from"):
        # the heads to start from supply every field the section does not name
        found = dataclasses.asdict(MedusaConfig.load(raw["heads"]["init_from"]))
        raw["heads"] = {**{k: v for k, v in found.items() if k not in FILLED_IN}, **raw["heads"]}
    try:
        return draccus.decode(Config, raw)
    except DecodingError as err:
        raise ValueError(_type_error(err, raw)) from None
    except ParsingError as err:  # a __post_init__ refused a value: its message names it
        raise (err.__cause__ or err) from None


def _type_error(err: DecodingError, raw: dict) -> str:
    """draccus's error -> "section.key must be <what the decoders above ask>, got <value>"."""
    value, hint = raw, Config
    for key in err.key_path:
        value = value.get(key) if isinstance(value, dict) else None
        hint = typing.get_type_hints(hint)[key] if dataclasses.is_dataclass(hint) else hint
    wanted = list(dict.fromkeys(re.findall(r"must be (.+?), got", err.message))) or [f"a {hint}"]
    return f"{'.'.join(err.key_path)} must be {' or '.join(wanted)}, got {value!r}"


def _refuse_unknown(raw: dict, config_path: str | None) -> None:
    where = f"{config_path}: " if config_path else ""
    sections = typing.get_type_hints(Config)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ValueError(f"{where}unknown section(s) {unknown}; known sections: {sorted(sections)}")
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ValueError(f"{where}section {name!r} must be a mapping of keys, got {values!r}")
        known = {f.name for f in dataclasses.fields(sections[name])}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{where}unknown key(s) {unknown} in section {name!r} ({', '.join(f'{name}.{k}' for k in unknown)}); "
                f"known keys: {sorted(known - set(FILLED_IN))}"
            )
        filled = sorted(set(values) & set(FILLED_IN)) if name == "heads" else []
        if filled:
            raise ValueError(
                f"{where}heads.{filled[0]} is filled in by training (from the base and the run): drop it "
                "from the heads section"
            )


def parse_args(description: str, argv: list[str] | None = None, extra=None) -> tuple[argparse.Namespace, Config]:
    """`--config x.yaml` plus overrides -> (namespace, Config). `--help` lists every option with its comment."""
    parser = argparse.ArgumentParser(
        description=description, add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file with sections model, data, heads, training")
    parser.add_argument("-h", "--help", action="store_true", help="list every option and exit")
    if extra:
        extra(parser)
    args, rest = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        print("\nAny option below overrides the YAML as --section.key value:")
        options = draccus.argparsing.ArgumentParser(Config).parser.format_help()
        print(options[options.index("\nModelConfig") :] if "\nModelConfig" in options else options)
        sys.exit(0)
    return args, load_config(args.config, rest)
