"""The decoding loop: prefill, then [propose -> verify -> accept -> commit] until a stop condition."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from medusa import kv_cache
from medusa.acceptance import AcceptanceRule, get_rule
from medusa.heads import base_features
from medusa.propose import Proposer
from medusa.sampling import SamplingConfig, select_token
from medusa.verify import verify


@dataclass
class DecodeState:
    cache: DynamicCache
    length: int  # tokens in the cache
    root_token: torch.Tensor  # 0-dim long: the target's next token, not yet in the cache
    last_hidden: torch.Tensor  # (H,): hidden state at the last cached position (the one that chose root_token)
    tokens: list[int]  # prompt + every token emitted so far (root_token included)
    # (n, H): hidden states of the positions the last prefill / commit added to the cache (last row: last_hidden);
    # what a heads' context layer reads. None: only last_hidden is known.
    new_hidden: torch.Tensor | None = None


@dataclass
class DecodeStats:
    steps: int = 0  # target forwards, prefill included
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify step (bonus included)
    proposed_lengths: list[int] = field(default_factory=list)  # depth of each verify step's candidates (gamma for a draft chain)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, when profiling

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
class GenerateOutput:
    sequences: torch.Tensor  # (1, prompt + new): like transformers' generate
    stats: DecodeStats


class _PhaseTimer:
    def __init__(self, stats: DecodeStats, enabled: bool, device: torch.device):
        self.stats, self.enabled, self.cuda = stats, enabled, device.type == "cuda"

    @contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.stats.timings[phase] = self.stats.timings.get(phase, 0.0) + time.perf_counter() - start


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, sampling: SamplingConfig, generator=None, feature_layers=()) -> DecodeState:
    """One ordinary forward over the prompt (1, T): fills the cache and chooses the first new token. The state's
    hidden states are what the heads read (with `feature_layers`, see medusa.heads.base_features)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True,
                logits_to_keep=1)
    root = select_token(out.logits[0, -1], sampling, generator)
    hidden = base_features(out.hidden_states, feature_layers)[0]  # (T, H) or (T, H * (1 + feature layers))
    return DecodeState(cache, input_ids.shape[1], root, hidden[-1], input_ids[0].tolist() + [int(root)], hidden)


def prepare_input_ids(input_ids, device) -> torch.Tensor:
    """A (1, T) tensor, a list of ids or a BatchEncoding -> (1, T) long tensor on `device` (shared by every generate)."""
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # BatchEncoding / dict
        input_ids = input_ids["input_ids"]
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate takes one sequence (shape (1, T)); got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: pass at least one token (e.g. from apply_chat_template)")
    return input_ids.to(device)


def stop_token_ids(base, tokenizer, eos_token_id) -> set[int]:
    """Stop ids: `eos_token_id` if given, else the base's generation config, else the tokenizer's eos."""
    if eos_token_id is None:
        eos_token_id = base.generation_config.eos_token_id
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def check_lengths(base, prompt_length: int, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    window = getattr(base.config.get_text_config(), "max_position_embeddings", None)
    if window is not None and prompt_length + max_new_tokens > window:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context window "
            f"of {window} tokens: shorten the prompt or lower max_new_tokens"
        )


class SpeculativeGenerator:
    """`generate` for every model that pairs a target (`self.base`) with a proposer: Medusa heads, a draft model.

    Subclasses provide `base`, `tokenizer`, `device` and `_make_proposer`; `default_sampling_rule` is the exact rule
    used when `do_sample=True` and no `acceptance` is named.
    """

    default_sampling_rule = "rejection"
    feature_layers: tuple | list = ()  # base layers the proposer reads besides the last (see medusa.heads.base_features)

    def _make_proposer(self, proposer: str | None, tree, sampling: SamplingConfig, generator) -> Proposer:
        raise NotImplementedError

    def _check_lengths(self, prompt_length: int, max_new_tokens: int) -> None:
        check_lengths(self.base, prompt_length, max_new_tokens)

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 128,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        acceptance: str | None = None,
        proposer: str | None = None,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        tree: list[list[int]] | str | None = None,
        eos_token_id: int | list[int] | None = None,
        streamer=None,
        generator: torch.Generator | None = None,
        profile: bool = False,
    ) -> GenerateOutput:
        """Speculative generation for one sequence. Greedy output equals the base model's greedy `generate`;
        `do_sample=True` samples exactly from its distribution (unless `acceptance="typical"`, which is lossy).

        input_ids: (1, T) tensor, a list of ids, or the BatchEncoding `apply_chat_template(..., return_tensors="pt")`
        gives. Sampling settings follow transformers (temperature, top_k, top_p; `generator` seeds the draws).
        """
        input_ids = prepare_input_ids(input_ids, self.device)
        self._check_lengths(input_ids.shape[1], max_new_tokens)
        sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                  posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)
        rule = get_rule(acceptance or (self.default_sampling_rule if do_sample else "greedy"))
        return decode(
            self.base, self._make_proposer(proposer, tree, sampling, generator), rule, input_ids,
            max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_token_ids(self.base, self.tokenizer, eos_token_id),
            streamer=streamer, generator=generator, profile=profile, feature_layers=self.feature_layers,
        )


def _stop_index(tokens: list[int], stop_ids: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop_ids), None)


@torch.inference_mode()
def decode(
    model,
    proposer: Proposer,
    rule: AcceptanceRule,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop_ids: set[int],
    streamer=None,
    generator: torch.Generator | None = None,
    profile: bool = False,
    feature_layers=(),
) -> GenerateOutput:
    """input_ids (1, T) -> GenerateOutput. Callers validate inputs (see MedusaModel.generate). `feature_layers`:
    the base layers whose features the decode state carries besides the last hidden state (what the heads read)."""
    stats = DecodeStats()
    timer = _PhaseTimer(stats, profile, input_ids.device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with timer("prefill"):
        state = prefill(model, input_ids, sampling, generator, feature_layers)
    stats.steps = 1
    new: list[int] = []

    def emit(tokens: list[int]) -> bool:
        """Append tokens up to max_new_tokens and the first stop token (kept, as transformers does); True when done."""
        room = max_new_tokens - len(new)
        stop = _stop_index(tokens[:room], stop_ids)
        kept = tokens[: room if stop is None else stop + 1]
        new.extend(kept)
        if streamer is not None and kept:
            streamer.put(torch.tensor(kept))
        return stop is not None or len(new) >= max_new_tokens

    done = emit([int(state.root_token)])
    while not done:
        with timer("propose"):
            candidates = proposer.propose(state)
        with timer("verify"):
            verified = verify(model, state.cache, candidates, state.length, feature_layers)
        with timer("accept"):
            accepted = rule(candidates, verified, sampling, generator)
        with timer("commit"):
            kv_cache.commit(state.cache, state.length, accepted.nodes)
            state.length += accepted.nodes.numel()
            state.new_hidden = verified.hidden[accepted.nodes]
            state.last_hidden = state.new_hidden[-1]
            state.root_token = torch.tensor(accepted.tokens[-1], device=input_ids.device)
            state.tokens.extend(accepted.tokens)
            proposer.observe(state, accepted.tokens)
        stats.steps += 1
        stats.accepted_lengths.append(len(accepted.tokens))
        stats.proposed_lengths.append(candidates.tree.max_depth)
        done = emit(accepted.tokens)
    if streamer is not None:
        streamer.end()
    stats.new_tokens = len(new)
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    return GenerateOutput(sequences=sequences, stats=stats)
