"""medusa: lossless speculative decoding for Hugging Face causal language models."""

import medusa.quiet  # noqa: F401 - first: torchao's import-time warnings, before transformers imports it
from medusa.config import MedusaConfig
from medusa.decode import DecodeStats, GenerateOutput
from medusa.heads import MedusaHeads, head_target_offset
from medusa.loading import load_base
from medusa.model import MedusaModel
from medusa.sampling import SamplingConfig
from medusa.tree import TreeSpec, build_buffers, load_tree

__all__ = [
    "MedusaConfig",
    "MedusaHeads",
    "MedusaModel",
    "DecodeStats",
    "GenerateOutput",
    "SamplingConfig",
    "TreeSpec",
    "build_buffers",
    "head_target_offset",
    "load_base",
    "load_tree",
]
__version__ = "0.1.0"
