"""What one sequence's decoding holds and yields: its state (what proposers read), its statistics, the output
`generate` returns, and which of a step's tokens it keeps. Shared by the loop (medusa.decode) and the batch
(medusa.batch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class DecodeState:
    cache: object  # the engine's KV cache (medusa.runtime): transformers' DynamicCache or StaticCache
    length: int  # tokens in the cache
    root_token: torch.Tensor  # 0-dim long: the target's next token, not yet in the cache
    last_hidden: torch.Tensor  # (H,): hidden state at the last cached position (the one that chose root_token)
    tokens: list[int]  # prompt + every token emitted so far (root_token included)
    # (n, H): hidden states of the positions the last prefill / commit added to the cache (last row: last_hidden);
    # what a heads' context layer reads. None: only last_hidden is known.
    new_hidden: torch.Tensor | None = None
    root_logits: torch.Tensor | None = None  # (V,): the target's logits that chose root_token (after the prefill)

    def advance(self, accepted, hidden: torch.Tensor, device: torch.device) -> None:
        """A verify step's `accepted` path (medusa.acceptance.Acceptance) joins the cache: its positions' `hidden`
        states (the verify's, per node) are what the heads read next, its last token the next root (on `device`)."""
        self.length += accepted.nodes.numel()
        self.new_hidden = hidden[accepted.nodes]
        self.last_hidden = self.new_hidden[-1]
        self.root_token = torch.tensor(accepted.tokens[-1], device=device)
        self.tokens.extend(accepted.tokens)


@dataclass
class DecodeStats:
    steps: int = 0  # target forwards, prefill included
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify step (bonus included)
    proposed_lengths: list[int] = field(
        default_factory=list
    )  # depth of each verify step's candidates (gamma for a draft chain)
    verified_nodes: list[int] = field(default_factory=list)  # nodes each verify step ran, root included
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, when profiling

    def add(self, other: DecodeStats) -> None:
        """Count `other`'s forwards, tokens and steps in these (sequences decoded one after another, or batches)."""
        self.steps += other.steps
        self.new_tokens += other.new_tokens
        self.accepted_lengths += other.accepted_lengths
        self.proposed_lengths += other.proposed_lengths
        self.verified_nodes += other.verified_nodes

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: new tokens per target forward (plain decoding: 1.0)."""
        return self.new_tokens / max(self.steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted guesses / guesses the rule reached (the accepted ones, plus the first rejected one if any).

        For a draft chain this is the per-token acceptance rate of Leviathan et al. (its maximum-likelihood estimate),
        the alpha in E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha). Accepted / proposed would understate
        it: guesses after the first rejection are never tested. For a tree it is the rate along the accepted path.
        """
        accepted = sum(n - 1 for n in self.accepted_lengths)
        reached = sum(min(n, depth) for n, depth in zip(self.accepted_lengths, self.proposed_lengths))
        return accepted / reached if reached else 0.0

    @property
    def accepted_length_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_lengths).items()))


@dataclass
class GenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' generate output (`sequences`: (1, prompt + new); `scores` / `logits` when asked: one (1, V)
    float32 tensor per new token) with this library's DecodeStats. An integer index gives a sequence, as on the
    tensor transformers' generate returns by default: `tokenizer.decode(out[0])`."""

    stats: DecodeStats | None = None

    def __getitem__(self, key):
        return self.sequences[key] if isinstance(key, int) else super().__getitem__(key)


def take_new(
    tokens: list[int], prompt: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int], stop_when=None
) -> tuple[list[int], bool]:
    """Of a step's `tokens`, those a sequence keeps after `prompt + new`: up to max_new_tokens, to the first stop token
    or the first token after which `stop_when(ids (1, T))` holds (both kept, as transformers does).
    -> (kept tokens, whether the sequence is done)."""
    room = max_new_tokens - len(new)
    stop = next((i for i, t in enumerate(tokens[:room]) if t in stop_ids), None)
    kept = tokens[: room if stop is None else stop + 1]
    if stop_when is not None:
        first = next((i for i in range(len(kept)) if stop_when(torch.tensor([prompt + new + kept[: i + 1]]))), None)
        if first is not None:
            kept, stop = kept[: first + 1], first
    return kept, stop is not None or len(new) + len(kept) >= max_new_tokens
