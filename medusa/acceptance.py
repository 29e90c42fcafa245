"""Acceptance rules: (Candidates, VerifyOutput, SamplingConfig, generator) -> Acceptance. One signature, a registry.

Every rule returns the accepted root-to-node path and the new tokens: the accepted tree tokens after the root,
then one token from the target (the next root, "bonus"), so every step commits at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from medusa.propose import Candidates
from medusa.sampling import SamplingConfig
from medusa.verify import VerifyOutput


@dataclass(frozen=True)
class Acceptance:
    nodes: torch.Tensor  # (a + 1,) long: accepted node indices, root first (on the model's device)
    tokens: list[int]  # a + 1 new tokens: accepted tree tokens after the root, then the bonus token


def _with_sentinel(x: torch.Tensor) -> torch.Tensor:
    """Append one zero so leaf paths padded with index N gather something harmless."""
    return torch.cat([x, x.new_zeros(1)])


def greedy(candidates: Candidates, verified: VerifyOutput, sampling: SamplingConfig, generator=None) -> Acceptance:
    """Longest root-to-leaf path whose every token is the argmax of its parent's logits, plus that argmax at its end."""
    tree = candidates.tree
    predicted = verified.logits.argmax(-1)  # (N,)
    correct = _with_sentinel(candidates.tokens == predicted[tree.parent])  # (N + 1,); sentinel never correct
    lengths = correct[tree.leaf_paths[:, 1:]].long().cumprod(1).sum(1)  # (L,) accepted depth of each leaf path
    best = lengths.argmax()
    path = tree.leaf_paths[best]  # (D + 1,)
    packed = torch.cat([lengths[best].view(1), _with_sentinel(candidates.tokens)[path],
                        _with_sentinel(predicted)[path]]).tolist()  # the step's one host sync
    depth = tree.max_depth
    accepted, path_tokens, path_predicted = packed[0], packed[1: depth + 2], packed[depth + 2:]
    return Acceptance(nodes=path[: accepted + 1], tokens=path_tokens[1: accepted + 1] + [path_predicted[accepted]])


AcceptanceRule = Callable[[Candidates, VerifyOutput, SamplingConfig, "torch.Generator | None"], Acceptance]

ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {"greedy": greedy}


def get_rule(name: str) -> AcceptanceRule:
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {name!r}: use one of {sorted(ACCEPTANCE_RULES)}")
    return ACCEPTANCE_RULES[name]
