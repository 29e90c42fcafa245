"""Classic speculative decoding (Leviathan et al. 2023, Algorithm 1): a small draft model proposes a chain of gamma
tokens, the target verifies them in one forward, `acceptance.speculative` keeps a prefix. Same loop as Medusa
(`medusa.decode.decode`): the draft model is just another Proposer.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from medusa.decode import SpeculativeGenerator
from medusa.loading import BaseSource, load_base
from medusa.propose import Candidates
from medusa.sampling import SamplingConfig, target_probs
from medusa.tree import TreeSpec, build_buffers, chain


class DraftProposer:
    """Any causal LM sharing the target's tokenizer drafts `gamma` tokens autoregressively on its own KV cache.

    It draws from its q, shaped by the same `sampling` as the target's p (argmax when greedy, q then a point mass),
    and returns the chain [root, d_1 .. d_gamma] with q in `Candidates.draft_probs`. `observe` crops its cache back
    to the tokens the target committed, so the draft never recomputes the shared prefix.
    """

    def __init__(
        self,
        draft,
        num_speculative_tokens: int,
        sampling: SamplingConfig,
        vocab_size: int,
        generator: torch.Generator | None = None,
    ):
        self.draft, self.gamma, self.sampling, self.generator = draft, num_speculative_tokens, sampling, generator
        self.max_nodes = num_speculative_tokens + 1
        self.vocab_size = vocab_size  # the target's: q is cut or padded to it (same tokenizer, padded output layers)
        chain_spec = TreeSpec(chain(num_speculative_tokens))
        self.tree = build_buffers(chain_spec, num_speculative_tokens).to(draft.device)
        self.cache = DynamicCache(config=draft.config)
        self.seen = 0  # committed tokens (a prefix of state.tokens) whose K/V are in self.cache
        self.drafted: torch.Tensor | None = None  # (gamma,): the last proposal; all but the last are in the cache too

    def _draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits (V_draft,) -> q (V,) over the target's vocabulary."""
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            logits = logits[: self.vocab_size]  # rows past the tokenizer: padding the target cannot emit
        elif extra > 0:
            logits = torch.cat([logits, logits.new_full((extra,), float("-inf"))])
        if self.sampling.do_sample:
            return target_probs(logits, self.sampling)
        return torch.nn.functional.one_hot(logits.argmax(), self.vocab_size).float()

    @torch.inference_mode()
    def propose(self, state) -> Candidates:
        fresh = torch.tensor(
            [state.tokens[self.seen :]], device=self.draft.device
        )  # (1, P): committed, unseen, root last
        self.seen = len(state.tokens)
        tokens, probs = [], []
        for _ in range(self.gamma):
            logits = self.draft(input_ids=fresh, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
            q = self._draft_probs(logits[0, -1])  # (V,)
            token = torch.multinomial(q, 1, generator=self.generator)[0] if self.sampling.do_sample else q.argmax()
            tokens.append(token)
            probs.append(q)
            fresh = token.view(1, 1)  # stays on the device: no host sync per draft token
        self.drafted = torch.stack(tokens)  # (gamma,)
        draft_probs = torch.stack([torch.zeros_like(probs[0])] + probs)  # (N, V); the root row is unused
        return Candidates(
            tokens=torch.cat([state.root_token.view(1).to(self.drafted.device), self.drafted]),
            tree=self.tree,
            draft_probs=draft_probs,
        )

    def observe(self, state, accepted_tokens: list[int]) -> None:
        """Keep the cached draft tokens the target committed; drop the rest (state.tokens already holds the step)."""
        cached = self.drafted[:-1].tolist()  # the acceptance rule has synced already: this copy waits on nothing
        committed = state.tokens[self.seen :]
        keep = 0
        # The last committed token is always fed again (its logits were not kept), even when the draft guessed it:
        # a lossy rule (typical) may emit a rejected draft token as its bonus.
        while keep < min(len(cached), len(committed) - 1) and cached[keep] == committed[keep]:
            keep += 1
        if keep < len(cached):
            self.cache.crop(keep - len(cached))  # a negative count removes that many rows from the end
        self.seen += keep


EARLY_EXIT_PREFIX = "early-exit:"


def early_exit_draft(target, num_layers: int):
    """The target's first `num_layers` decoder layers, then its own final norm and lm_head, as a causal LM.

    A draft with no weights of its own (self-speculative decoding, as in Draft & Verify and LayerSkip): every module
    is the target's, so it costs no memory and shares the tokenizer by construction. Untrained for early exit, its
    guesses are rough; it is the draft one always has.
    """
    decoder = target.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(target).__name__} keeps no `layers` list in its decoder: early exit needs one")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < len(layers):
        raise ValueError(
            f"an early-exit draft needs 1 <= num_layers < {len(layers)} (the target's layers), got {num_layers!r}"
        )
    config = copy.deepcopy(target.config)
    text_config = config.get_text_config()
    text_config.num_hidden_layers = num_layers
    if getattr(text_config, "layer_types", None):
        text_config.layer_types = text_config.layer_types[:num_layers]

    with torch.device("meta"):  # the skeleton allocates nothing: every part is the target's below
        draft = type(target)(config)
    draft_decoder = draft.get_decoder()
    for name, child in decoder.named_children():
        setattr(draft_decoder, name, layers[:num_layers] if name == "layers" else child)  # a new ModuleList
    for name, child in target.named_children():
        if child is not decoder:
            setattr(draft, name, child)
    for owner, source in ((draft_decoder, decoder), (draft, target)):  # tensors held directly, not by a child
        for name, tensor in [*source.named_parameters(recurse=False), *source.named_buffers(recurse=False)]:
            setattr(owner, name, tensor)
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"early exit could not share {left[:3]} with the target {type(target).__name__}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def check_same_vocabulary(tokenizer, draft_tokenizer, target, draft) -> None:
    """Refuse a draft that does not share the target's tokenizer: its token ids would mean other strings."""
    if tokenizer is not draft_tokenizer:
        vocab, draft_vocab = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if vocab != draft_vocab:
            differ = sorted(set(vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])[:3]
            raise ValueError(
                f"the draft model's tokenizer differs from the target's ({len(draft_vocab)} vs {len(vocab)} tokens; "
                f"e.g. (token, id) {differ} is in one but not the other): speculative decoding needs both models to "
                "share one tokenizer. Use a smaller model of the target's family as the draft (same tokenizer), or "
                "pass draft_tokenizer= if the draft's own tokenizer files are wrong"
            )
    rows = {
        name: model.get_output_embeddings().weight.shape[0] for name, model in (("target", target), ("draft", draft))
    }
    if rows["target"] != rows["draft"] and min(rows.values()) < len(tokenizer):
        raise ValueError(
            f"the target's output layer has {rows['target']} rows and the draft's {rows['draft']}, "
            f"but the tokenizer has "
            f"{len(tokenizer)} tokens: one model cannot score every token; use a draft with the target's vocabulary"
        )


class DraftModel(SpeculativeGenerator, nn.Module):
    """A target and a draft model behind `MedusaModel`'s `generate` (build with `MedusaModel.from_draft_model`).

    `generate(do_sample=True)` samples exactly from the target's distribution (acceptance "speculative");
    greedy output is token-for-token the target's greedy output.
    """

    default_sampling_rule = "speculative"  # Leviathan et al.: exact with the draft's q

    def __init__(self, target, draft, tokenizer=None, num_speculative_tokens: int = 5):
        super().__init__()
        if (
            isinstance(num_speculative_tokens, bool)
            or not isinstance(num_speculative_tokens, int)
            or num_speculative_tokens < 1
        ):
            raise ValueError(
                f"num_speculative_tokens must be a positive integer (gamma), got {num_speculative_tokens!r}"
            )
        if draft.device != target.device:
            raise ValueError(
                f"the draft model is on {draft.device} and the target on {target.device}: put both on one device"
            )
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = target.get_output_embeddings().weight.shape[0]

    @classmethod
    def load(
        cls,
        target: BaseSource = None,
        draft: BaseSource = None,
        *,
        num_speculative_tokens: int = 5,
        dtype=None,
        device=None,
        tokenizer=None,
        draft_tokenizer=None,
    ) -> DraftModel:
        """Load both models (Hub id, directory, .gguf or model object: `medusa.loading.load_base`) and check them."""
        if draft is None:
            raise ValueError(
                "no draft model given: pass draft=<Hub id, directory, .gguf file or model> sharing the "
                f"target's tokenizer (e.g. a smaller model of the same family), or '{EARLY_EXIT_PREFIX}N' "
                "for the target's own first N layers"
            )
        target_model, tokenizer = load_base(target, dtype=dtype, device=device, tokenizer=tokenizer)
        if isinstance(draft, str) and draft.startswith(EARLY_EXIT_PREFIX):
            count = draft[len(EARLY_EXIT_PREFIX) :]
            if not count.isdigit():
                raise ValueError(
                    f"draft={draft!r}: write '{EARLY_EXIT_PREFIX}N' with N the number of layers, e.g. "
                    f"'{EARLY_EXIT_PREFIX}8'"
                )
            return cls(target_model, early_exit_draft(target_model, int(count)), tokenizer, num_speculative_tokens)
        draft_model, draft_tokenizer = load_base(
            draft, dtype=dtype, device=device or target_model.device, tokenizer=draft_tokenizer
        )
        check_same_vocabulary(tokenizer, draft_tokenizer, target_model, draft_model)
        return cls(target_model, draft_model, tokenizer, num_speculative_tokens)

    @property
    def base(self):
        """The target: what plain `generate` runs, and what every output is exact for."""
        return self.target

    @property
    def device(self) -> torch.device:
        return self.target.device

    def _check_lengths(self, prompt_length: int, max_new_tokens: int) -> None:
        super()._check_lengths(prompt_length, max_new_tokens)
        seen = prompt_length + max_new_tokens + self.num_speculative_tokens  # the draft runs gamma tokens ahead
        window = getattr(self.draft.config.get_text_config(), "max_position_embeddings", None)
        if window is not None and seen > window:
            raise ValueError(
                f"the draft model would see up to prompt + max_new_tokens + num_speculative_tokens = {seen} tokens, "
                f"beyond its context window of {window}: shorten the prompt or lower max_new_tokens"
            )

    def _make_proposer(self, proposer: str | None, tree, sampling: SamplingConfig, generator) -> DraftProposer:
        if proposer not in (None, "draft"):
            raise ValueError(f"a DraftModel proposes with its draft model, got proposer={proposer!r}: leave it unset")
        if tree is not None:
            raise ValueError(
                "a draft model proposes a chain; tree= applies to Medusa heads: set num_speculative_tokens "
                "in MedusaModel.from_draft_model instead"
            )
        return DraftProposer(self.draft, self.num_speculative_tokens, sampling, self.vocab_size, generator)
