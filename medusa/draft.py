"""Classic speculative decoding (Leviathan et al. 2023, Algorithm 1): a small draft model proposes a chain of gamma
tokens, the target verifies them in one forward, `acceptance.speculative` keeps a prefix. Same loop as Medusa
(`medusa.decode.decode`): the draft model is just another Proposer.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import StaticCache

from medusa.decode import SpeculativeGenerator
from medusa.loading import BaseSource, load_base
from medusa.precision import load_target
from medusa.runtime import EagerEngine, engine_for, engines_set_aside
from medusa.sampling import SamplingConfig, greedy_tokens, target_probs
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

DRAFT_CACHE_HEADROOM = 128  # rows past what the first proposal needs, in a static draft cache (beyond: a new one)


class DraftProposer:
    """Any causal LM sharing the target's tokenizer drafts `gamma` tokens autoregressively on its own KV cache.

    It draws from its q, shaped by the same `sampling` as the target's p (argmax when greedy, q then a point mass),
    and returns the chain [root, d_1 .. d_gamma] with q in `Candidates.draft_probs`. The draft runs on an execution
    engine of its own (medusa.runtime; default eager): its cache keeps the committed tokens it has seen, and `observe`
    moves its length back to the tokens the target committed, so the draft never recomputes the shared prefix.
    """

    def __init__(
        self,
        draft,
        num_speculative_tokens: int,
        sampling: SamplingConfig,
        vocab_size: int,
        generator: torch.Generator | None = None,
        engine=None,
    ):
        self.draft, self.gamma, self.sampling, self.generator = draft, num_speculative_tokens, sampling, generator
        self.engine = engine or EagerEngine(draft)
        self.max_nodes = num_speculative_tokens + 1
        self.vocab_size = vocab_size  # the target's: q is cut or padded to it (same tokenizer, padded output layers)
        chain_spec = TreeSpec(chain(num_speculative_tokens))
        self.tree = build_buffers(chain_spec, num_speculative_tokens).to(draft.device)
        self._chains: dict[int, object] = {}  # P -> the chain buffers that feed P tokens in one forward
        self.cache = None
        self.rows: int | None = None  # the most rows self.cache holds (None: it grows, as a DynamicCache does)
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
        return torch.nn.functional.one_hot(greedy_tokens(logits), self.vocab_size).float()

    def _feed(self, tokens: torch.Tensor, past: int) -> torch.Tensor:
        """Run the draft over `tokens` (P,) written at rows past .. past + P -> the logits after the last."""
        if past == 0:
            return self.engine.prefill(self.cache, tokens[None]).logits
        if tokens.numel() not in self._chains:
            self._chains[tokens.numel()] = build_buffers(TreeSpec(chain(tokens.numel() - 1)), 1).to(tokens.device)
        self.engine.truncate(self.cache, past)  # rows past it hold rejected drafts
        return self.engine.verify(self.cache, Candidates(tokens, self._chains[tokens.numel()]), past).logits[-1]

    def _make_room(self, needed: int) -> None:
        """A cache with room for `needed` rows. A static one (its size fixed) that is full is replaced by a larger
        one, into which the committed tokens are fed again: once per size, as the sizes grow by steps."""
        if self.cache is None or (self.rows is not None and needed > self.rows):
            self.cache = self.engine.new_cache(needed + DRAFT_CACHE_HEADROOM)
            static = isinstance(self.cache, StaticCache)
            self.rows = max(layer.max_cache_len for layer in self.cache.layers) if static else None
            self.seen = 0

    @torch.inference_mode()
    def propose(self, state) -> Candidates:
        self._make_room(len(state.tokens) + self.gamma)
        fresh = torch.tensor(state.tokens[self.seen :], device=self.draft.device)  # committed, unseen, root last
        logits, past = self._feed(fresh, self.seen), len(state.tokens)
        self.seen = past
        tokens, probs = [], []
        for i in range(self.gamma):
            q = self._draft_probs(logits)  # (V,)
            token = torch.multinomial(q, 1, generator=self.generator)[0] if self.sampling.do_sample else q.argmax()
            tokens.append(token)
            probs.append(q)
            if i + 1 < self.gamma:
                logits = self._feed(token.view(1), past + i)  # stays on the device: no host sync per draft token
        self.drafted = torch.stack(tokens)  # (gamma,)
        draft_probs = torch.stack([torch.zeros_like(probs[0])] + probs)  # (N, V); the root row is unused
        return Candidates(
            tokens=torch.cat([state.root_token.view(1).to(self.drafted.device), self.drafted]),
            tree=self.tree,
            draft_probs=draft_probs,
        )

    def observe(self, state, accepted_tokens: list[int]) -> None:
        """Keep the cached draft tokens the target committed; the rows past them are overwritten by the next feed."""
        cached = self.drafted[:-1].tolist()  # the acceptance rule has synced already: this copy waits on nothing
        committed = state.tokens[self.seen :]
        keep = 0
        # The last committed token is always fed again (its logits were not kept), even when the draft guessed it:
        # a lossy rule (typical) may emit a rejected draft token as its bonus.
        while keep < min(len(cached), len(committed) - 1) and cached[keep] == committed[keep]:
            keep += 1
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


QUANTIZED_DRAFTS = ("int8",)  # draft="int8": the target itself, its linear weights in int8


def quantized_draft(target, scheme: str = "int8"):
    """The target with the weights of its linear layers quantized to int8 per output channel, activations left in
    the target's dtype (torchao's weight-only int8): a self-draft that shares the tokenizer and nearly every greedy
    choice with the target and reads a quarter of the bytes an fp32 forward reads. Its embedding is the target's.

    Only torch.compile can make it fast (the "inductor" engine on a CPU): eagerly, torchao converts each weight back
    per call, slower than the target. On a 2-core AVX2 CPU even the compiled int8 step was no faster than the fp32
    target's compiled one (docs/sampling.md)."""
    if scheme not in QUANTIZED_DRAFTS:
        raise ValueError(f"unknown quantized draft {scheme!r}: use one of {list(QUANTIZED_DRAFTS)}")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise ImportError(
            f"draft={scheme!r} quantizes a copy of the target with torchao, which is not installed: "
            "pip install 'medusa-spec[quant]' (or torchao)"
        ) from err
    with engines_set_aside(target):
        draft = copy.deepcopy(target)
    quantize_(draft, Int8WeightOnlyConfig())  # nn.Linear layers only: the copy's output layer, not its embedding
    draft.set_input_embeddings(target.get_input_embeddings())  # the copy's own would only duplicate it
    draft.name_or_path = f"{target.name_or_path} ({scheme} draft)"  # what progress lines call it
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


class TargetAndDraft(SpeculativeGenerator, nn.Module):
    """What a target paired with a draft of its own holds (DraftModel, medusa.eagle3.Eagle3Model): the target, what
    every output is exact for; the draft; the tokenizer; the tokens drafted per step (gamma), checked here."""

    def __init__(self, target, draft, tokenizer, num_speculative_tokens: int):
        super().__init__()
        if (
            isinstance(num_speculative_tokens, bool)
            or not isinstance(num_speculative_tokens, int)
            or num_speculative_tokens < 1
        ):
            raise ValueError(
                f"num_speculative_tokens must be a positive integer (gamma), got {num_speculative_tokens!r}"
            )
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = target.get_output_embeddings().weight.shape[0]

    @property
    def base(self):
        """The target: what plain `generate` runs, and what every output is exact for."""
        return self.target

    @property
    def device(self) -> torch.device:
        return self.target.device


class DraftModel(TargetAndDraft):
    """A target and a draft model behind `MedusaModel`'s `generate` (build with `MedusaModel.from_draft_model`).

    `generate(do_sample=True)` samples exactly from the target's distribution (acceptance "speculative");
    greedy output is token-for-token the target's greedy output.
    """

    default_sampling_rule = "speculative"  # Leviathan et al.: exact with the draft's q

    def __init__(self, target, draft, tokenizer=None, num_speculative_tokens: int = 5):
        super().__init__(target, draft, tokenizer, num_speculative_tokens)
        if draft.device != target.device:
            raise ValueError(
                f"the draft model is on {draft.device} and the target on {target.device}: put both on one device"
            )

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
        **hub,
    ) -> DraftModel:
        """Load both models (Hub id, directory, .gguf or model object: `medusa.loading.load_base`) and check them.
        `hub` (token, cache_dir, local_files_only) goes to transformers with both."""
        if draft is None:
            raise ValueError(
                "no draft model given: pass draft=<Hub id, directory, .gguf file or model> sharing the "
                f"target's tokenizer (e.g. a smaller model of the same family), '{EARLY_EXIT_PREFIX}N' "
                "for the target's own first N layers, 'int8' for the target with int8 weights, or an EAGLE-3 draft "
                "(the embedded SmolLM2's: 'embedded:smollm2-135m-instruct-eagle3')"
            )
        target_model, tokenizer = load_target(target, dtype=dtype, device=device, tokenizer=tokenizer, **hub)
        if isinstance(draft, str) and draft in QUANTIZED_DRAFTS:
            return cls(target_model, quantized_draft(target_model, draft), tokenizer, num_speculative_tokens)
        if isinstance(draft, str) and draft.startswith(EARLY_EXIT_PREFIX):
            count = draft[len(EARLY_EXIT_PREFIX) :]
            if not count.isdigit():
                raise ValueError(
                    f"draft={draft!r}: write '{EARLY_EXIT_PREFIX}N' with N the number of layers, e.g. "
                    f"'{EARLY_EXIT_PREFIX}8'"
                )
            return cls(target_model, early_exit_draft(target_model, int(count)), tokenizer, num_speculative_tokens)
        draft_model, draft_tokenizer = load_base(  # the draft computes as the target does
            draft, dtype=target_model.dtype, device=device or target_model.device, tokenizer=draft_tokenizer, **hub
        )
        check_same_vocabulary(tokenizer, draft_tokenizer, target_model, draft_model)
        return cls(target_model, draft_model, tokenizer, num_speculative_tokens)

    def _check_lengths(self, prompt_length: int, max_new_tokens: int) -> None:
        super()._check_lengths(prompt_length, max_new_tokens)
        seen = prompt_length + max_new_tokens + self.num_speculative_tokens  # the draft runs gamma tokens ahead
        window = getattr(self.draft.config.get_text_config(), "max_position_embeddings", None)
        if window is not None and seen > window:
            raise ValueError(
                f"the draft model would see up to prompt + max_new_tokens + num_speculative_tokens = {seen} tokens, "
                f"beyond its context window of {window}: shorten the prompt or lower max_new_tokens"
            )

    def make_proposer(
        self, proposer: str | None, tree, sampling: SamplingConfig, generator, engine=None
    ) -> DraftProposer:
        if proposer not in (None, "draft"):
            raise ValueError(f"a DraftModel proposes with its draft model, got proposer={proposer!r}: leave it unset")
        if tree is not None:
            raise ValueError(
                "a draft model proposes a chain; tree= applies to Medusa heads: set num_speculative_tokens "
                "in MedusaModel.from_draft_model instead"
            )
        # an engine of the target's kind, for the draft
        draft_engine = engine_for(self.draft, engine.name if engine is not None else self.default_engine)
        return DraftProposer(
            self.draft, self.num_speculative_tokens, sampling, self.vocab_size, generator, engine=draft_engine
        )
