"""Dataclass configs for the training entry points: `--config file.yaml` plus `--section.key value` overrides.

Each YAML file has sections (`model`, `data`, `heads`, `training`); a script reads the sections it needs and
rejects keys that no dataclass declares, naming them, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class ModelConfig:
    base: str | None = None  # None: the embedded SmolLM2-135M-Instruct; else a Hub id, directory or .gguf
    dtype: str = "float32"


@dataclass
class DataConfig:
    sources: dict[str, int] = field(default_factory=lambda: {"bench:alpaca": 200})  # source -> prompts (-1: all)
    out_dir: str = "data/selfdistill"
    max_prompt_tokens: int = 768  # longer prompts are dropped
    max_new_tokens: int = 256
    batch_size: int = 16
    shard_size: int = 64  # prompts per shard on disk; the unit of resumption
    temperature: float = 0.7
    top_p: float = 0.95
    greedy_fraction: float = 0.5  # share of shards answered greedily (what greedy decoding will see)
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        if not self.sources:
            raise ValueError("data.sources is empty: name at least one prompt source")
        if self.batch_size <= 0 or self.shard_size <= 0 or self.max_new_tokens <= 0:
            raise ValueError("data.batch_size, data.shard_size and data.max_new_tokens must be positive")
        if not 0.0 <= self.greedy_fraction <= 1.0:
            raise ValueError(f"data.greedy_fraction must lie in [0, 1], got {self.greedy_fraction}")


def _coerce(value: str, annotation) -> object:
    """Parse a CLI override string with YAML, so numbers, bools, lists and dicts all work."""
    return yaml.safe_load(value)


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
        raw.setdefault(section, {})[key] = _coerce(value, None)
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
