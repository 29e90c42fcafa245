"""The decoding loop: prefill, then [propose -> verify -> accept -> commit] until a stop condition."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers import GenerationConfig

from medusa import generate_args
from medusa.acceptance import AcceptanceRule, get_rule
from medusa.batch import BatchDecoding, decode_batch, padded, split_padded
from medusa.prompt_lookup import PromptLookupProposer
from medusa.propose import PlainProposer, Proposer
from medusa.runtime import EagerEngine, batch_engine, engine_for, runs_the_target
from medusa.sampling import SamplingConfig, select_token, shape_logits
from medusa.sequence import DecodeState, DecodeStats, GenerateOutput, take_new


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
def prefill(
    model,
    input_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator=None,
    feature_layers=(),
    *,
    engine=None,
    max_length: int | None = None,
) -> DecodeState:
    """One ordinary forward over the prompt (1, T): fills the cache and chooses the first new token. The state's
    hidden states are what the heads read (with `feature_layers`, see medusa.heads.base_features). `engine` runs the
    forward (default: eager, on `model`); `max_length`: the most rows its cache will hold (default: the prompt)."""
    engine = engine or EagerEngine(model)
    cache = engine.new_cache(max_length or input_ids.shape[1])
    out = engine.prefill(cache, input_ids, feature_layers)
    root = select_token(out.logits, sampling, generator)
    hidden = out.hidden  # (T, H) or (T, H * (1 + feature layers))
    tokens = input_ids[0].tolist() + [int(root)]
    return DecodeState(cache, input_ids.shape[1], root, hidden[-1], tokens, hidden, root_logits=out.logits)


def prepare_input_ids(input_ids, device, vocab_size: int | None = None, attention_mask=None) -> torch.Tensor:
    """A (1, T) tensor, a list of ids or a BatchEncoding -> (1, T) long tensor on `device` (shared by every generate).

    Ids must be integers in [0, vocab_size); an attention mask (given, or inside the BatchEncoding) must be all ones:
    one unpadded sequence."""
    if hasattr(input_ids, "keys"):  # BatchEncoding / dict
        if "input_ids" not in input_ids:
            raise ValueError(f"a dict of inputs needs 'input_ids'; got keys {sorted(input_ids.keys())}")
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError(
                f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor: pass the ids "
                "the tokenizer returns (e.g. tokenizer(text, return_tensors='pt')['input_ids'])"
            )
    elif isinstance(input_ids, (list, tuple)):
        flat = input_ids[0] if input_ids and isinstance(input_ids[0], (list, tuple)) else input_ids
        bad = next((x for x in flat if isinstance(x, bool) or not isinstance(x, int)), None)
        if bad is not None:
            raise TypeError(f"input_ids must be integer token ids, got {type(bad).__name__} {bad!r}")
    else:
        raise TypeError(
            f"input_ids must be a tensor, a list of ids or the tokenizer's output, got {type(input_ids).__name__}"
        )
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        raise ValueError(
            "the attention_mask pads the prompt (it holds zeros): generate takes one unpadded sequence; "
            "drop the padding (or the batch) before calling it"
        )
    if (
        input_ids.numel()
        and vocab_size is not None
        and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size)
    ):
        raise ValueError(
            f"input_ids hold ids outside the model's vocabulary [0, {vocab_size}): min "
            f"{int(input_ids.min())}, max {int(input_ids.max())}; encode the prompt with the model's tokenizer"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids must be one sequence (T,) / (1, T) or a left-padded batch (B, T); got shape "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: pass at least one token (e.g. from apply_chat_template)")
    return input_ids.to(device)


def batch_rows(input_ids, attention_mask=None) -> list[torch.Tensor] | None:
    """Several prompts, or one left-padded (a (B, T) tensor and its attention mask, as transformers' batched generate
    takes them) -> each row's tokens (1, T_b), its left padding removed; None for one unpadded sequence."""
    if hasattr(input_ids, "keys"):
        attention_mask = input_ids.get("attention_mask") if attention_mask is None else attention_mask
        input_ids = input_ids.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None
    padded = attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all())
    return split_padded(input_ids, attention_mask) if input_ids.shape[0] > 1 or padded else None


def stop_token_ids(base, tokenizer, eos_token_id) -> set[int]:
    """Stop ids: `eos_token_id` if given, else the base's generation config, else the tokenizer's eos."""
    return set(end_token_ids(base, tokenizer, eos_token_id))


def end_token_ids(base, tokenizer, eos_token_id) -> list[int]:
    """stop_token_ids in the order given: the first is what transformers pads finished rows with."""
    if eos_token_id is None:
        eos_token_id = base.generation_config.eos_token_id
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple, set)) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise TypeError(
            f"eos_token_id must be a token id, a list of ids or a tensor of ids, got {eos_token_id!r} "
            "(a string? use tokenizer.convert_tokens_to_ids)"
        )
    return list(ids)


def check_lengths(base, prompt_length: int, max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    window = getattr(base.config.get_text_config(), "max_position_embeddings", None)
    if window is not None and prompt_length + max_new_tokens > window:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context window "
            f"of {window} tokens: shorten the prompt or lower max_new_tokens"
        )


class BatchLayout(NamedTuple):
    """How a batch decodes (SpeculativeGenerator.batch_layout): on `engine`, its rows together or one at a time, with
    `proposer` and `tree`; `expected_tau`: what the plan expects that tree to accept a step, where it chose it."""

    engine: str
    one_at_a_time: bool
    proposer: str | None
    tree: object
    expected_tau: float | None = None


class SpeculativeGenerator:
    """`generate` for every model that pairs a target (`self.base`) with a proposer: Medusa heads, a draft model.

    Subclasses provide `base`, `tokenizer`, `device` and `make_proposer`; `default_sampling_rule` is the exact rule
    used when `do_sample=True` and no `acceptance` is named.
    """

    default_sampling_rule = "rejection"
    feature_layers: (
        tuple | list
    ) = ()  # base layers the proposer reads besides the last (see medusa.heads.base_features)
    default_engine = "eager"  # how the target runs (medusa.runtime); `engine=` in generate overrides it

    def engine(self, name: str | None = None):
        """The execution engine `name` (default: `default_engine`) for the target, built once and kept."""
        return engine_for(self.base, name or self.default_engine)

    def make_proposer(self, proposer: str | None, tree, sampling: SamplingConfig, generator, engine=None) -> Proposer:
        """The proposer for one call; `engine`: the engine the target runs on in it (medusa.runtime.Engine; a draft
        model runs on one of the same kind)."""
        raise NotImplementedError

    def prepare_proposal(self, engine) -> None:
        """Make ready what proposes in calls whose target runs on `engine` (MedusaModel compiles its heads where the
        engine compiles ahead of time); nothing here."""

    def batch_layout(self, lengths: list[int], max_new_tokens: int, engine: str | None, proposer, tree) -> BatchLayout:
        """How a batch of prompts of `lengths` tokens decodes `max_new_tokens` each. Here: together on `engine`, else
        on runtime.batch_engine's; proposer and tree as given (MedusaModel's plan chooses them per batch size by
        timing: medusa.plan.batch_choice)."""
        return BatchLayout(engine or batch_engine(self.base), False, proposer, tree)

    def observe_batch(self, layout: BatchLayout, stats: DecodeStats) -> None:
        """What a batch decoded under `layout` accepted (MedusaModel keeps it for later layouts)."""

    def _generate_batch(
        self, rows, settings, sampling, rule, proposer, tree, generator, engine, stopping_criteria, streamer, tokenizer
    ) -> GenerateOutput:
        """Several prompts (each (1, T_b)) decoded together (medusa.batch), or one at a time where that is faster;
        `streamer`: None or one per row."""
        if streamer is not None and (not isinstance(streamer, (list, tuple)) or len(streamer) != len(rows)):
            raise ValueError(
                f"several prompts stream with a list of one streamer per row ({len(rows)} here; None for a row not "
                "streamed): a transformers streamer takes one sequence"
            )
        if settings.output_scores or settings.output_logits:
            raise ValueError("output_scores / output_logits take one sequence for now: pass one prompt at a time")
        lengths = [row.shape[1] for row in rows]
        layout = self.batch_layout(lengths, settings.max_new_tokens, engine, proposer, tree)
        plan_chose_trees = proposer is None and tree is None
        engine, proposer, tree = layout.engine, layout.proposer, layout.tree
        ends = end_token_ids(self.base, tokenizer, settings.eos_token_id)
        pad = settings.pad_token_id
        if pad is None:  # as transformers: the (first) end-of-sequence token
            pad = ends[0] if ends else 0
        stop_when = generate_args.stopping(stopping_criteria, settings.stop_strings, tokenizer)
        if layout.one_at_a_time:
            out = self._generate_rows_alone(
                rows, settings, sampling, rule, proposer, tree, generator, engine, set(ends), stop_when, pad, streamer
            )
            self.observe_batch(layout, out.stats)
            return out
        target, eager = self.engine(engine), self.engine("eager")  # eager: what a row's draft model runs on
        self.prepare_proposal(target)  # the rows' heads compiled where the batch's target is
        out = decode_batch(
            target,
            lambda: self.make_proposer(proposer, tree, sampling, generator, engine=eager),
            rule,
            rows,
            max_new_tokens=settings.max_new_tokens,
            sampling=sampling,
            stop_ids=set(ends),
            stop_when=stop_when,
            generator=generator,
            feature_layers=self.feature_layers,
            pad_token_id=pad,
            streamers=streamer,
            # rows that finished leave the rest a larger tree each, as continuous batching re-budgets them
            on_rows_left=self.budget_trees if plan_chose_trees else None,
        )
        self.observe_batch(layout, out.stats)
        return out

    def _generate_rows_alone(
        self, rows, settings, sampling, rule, proposer, tree, generator, engine, stop_ids, stop_when, pad, streamers
    ) -> GenerateOutput:
        """A batch's rows decoded one after another on `engine` as single sequences (exact as each is), returned as
        decode_batch returns a batch; `steps` counts every row's target forwards."""
        stats, new = DecodeStats(), []
        for row, streamer in zip(rows, streamers or [None] * len(rows)):
            out = self._decode_one(
                row, settings, sampling, rule, proposer, tree, generator, engine, stop_ids, stop_when, streamer=streamer
            )
            new.append(out.sequences[0, row.shape[1] :].tolist())
            stats.add(out.stats)
        return GenerateOutput(sequences=padded(rows, new, pad), stats=stats)

    def _decode_one(
        self, input_ids, settings, sampling, rule, proposer, tree, generator, engine, stop_ids, stop_when, **options
    ) -> GenerateOutput:
        """One sequence (1, T) decoded on `engine` (medusa.decode.decode; `options`: its streamer, profile and
        output_scores / output_logits)."""
        target = self.engine(engine)
        built = self.make_proposer(proposer, tree, sampling, generator, engine=target)
        lookup = getattr(built, "inner", built)  # a guarded proposer's own
        plan = getattr(self, "plan", None)
        if isinstance(lookup, PromptLookupProposer) and plan is not None:  # its trees sized by what they cost here
            lookup.chain_ms = plan.chain_ms(target.name, lookup.num_tokens)
        planned = plan is not None and proposer is None and tree is None and lookup is not built
        sized = plan.at_context(input_ids.shape[-1] + settings.max_new_tokens // 2) if planned else None
        if sized is not None and target.name == plan.engine:  # the plan's own trees, guarded
            nodes, built.expected_step_ms, built.plain_ms = sized  # the guard judges by this context's steps
            lookup.budget(nodes)  # a long context: the tree that pays there (medusa.plan.LONG_CONTEXT)
        return decode(
            self.base,
            built,
            rule,
            input_ids,
            max_new_tokens=settings.max_new_tokens,
            sampling=sampling,
            stop_ids=stop_ids,
            stop_when=stop_when,
            generator=generator,
            feature_layers=self.feature_layers,
            engine=target,
            **options,
        )

    def compute_transition_scores(self, sequences, scores, beam_indices=None, normalize_logits: bool = False):
        """transformers' `compute_transition_scores` on the target: each new token's score from generate's
        `output_scores` (log-probabilities with `normalize_logits=True`)."""
        return self.base.compute_transition_scores(sequences, scores, beam_indices, normalize_logits)

    def _check_lengths(self, prompt_length: int, max_new_tokens: int) -> None:
        check_lengths(self.base, prompt_length, max_new_tokens)

    @runs_the_target  # from any thread, one call at a time, at full speed (medusa.runtime.threads)
    def generate(
        self,
        input_ids=None,
        generation_config: GenerationConfig | None = None,
        *,
        attention_mask=None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        stopping_criteria=None,
        stop_strings: str | list[str] | None = None,
        streamer=None,
        return_dict_in_generate: bool | None = None,
        output_scores: bool | None = None,
        output_logits: bool | None = None,
        acceptance: str | None = None,
        proposer: str | None = None,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        tree: list[list[int]] | str | None = None,
        generator: torch.Generator | None = None,
        profile: bool = False,
        engine: str | None = None,
        inputs=None,
        tokenizer=None,
        **transformers_kwargs,
    ) -> GenerateOutput | torch.Tensor:
        """Speculative generation, called as transformers' `generate` is. Greedy output equals the base model's
        greedy `generate`; `do_sample=True` samples exactly from its distribution (unless `acceptance="typical"`,
        which is lossy).

        input_ids: (1, T) tensor, a list of ids, or the tokenizer's output (`generate(**tokenizer(text,
        return_tensors="pt"))`); several prompts as a left-padded (B, T) tensor with its attention_mask (medusa.batch:
        each row as it would decode alone; decoded together, or one at a time where the plan finds that faster).
        Generation settings (max_new_tokens, max_length, do_sample, temperature, top_k, top_p, eos_token_id,
        stop_strings) come with transformers' precedence: this call, then `generation_config`, then the base's
        generation config, then transformers' defaults (see medusa.generate_args; with no length set anywhere, 128
        new tokens). `stopping_criteria` and `streamer` are transformers' (several prompts: a list of one streamer per
        row, None for a row not streamed). Returns what transformers' generate
        returns: the sequences tensor (1, prompt + new), or with `return_dict_in_generate=True` a GenerateOutput
        (`.sequences`, `.stats`: steps, tau, acceptance; `.scores` / `.logits` with `output_scores` /
        `output_logits`). `generator` seeds the draws.
        `proposer="plain"` decodes one token a step on the same engine (no guesses); `engine` picks how the target
        runs: "eager" (the exact reference), "compiled" (static cache, pre-packed weights), "inductor" (static
        cache, torch.compile; compiled when the engine is built, minutes in each new process) or "inductor_onednn"
        (the same, a tree's GEMMs on oneDNN); see medusa.runtime.
        As in transformers, the prompt may come as `inputs`, and `tokenizer` (default: the model's) reads
        `stop_strings` and the end-of-sequence token.
        """
        generate_args.refuse_unknown(transformers_kwargs)
        if inputs is not None and input_ids is not None:
            raise ValueError("generate got both inputs and input_ids: pass the prompt once (either name)")
        input_ids = inputs if input_ids is None else input_ids
        tokenizer = tokenizer or self.tokenizer
        if input_ids is None:
            raise ValueError(
                "generate needs input_ids: the prompt's token ids (or **tokenizer(text, return_tensors='pt'))"
            )
        vocab = self.base.get_input_embeddings().num_embeddings
        rows = batch_rows(input_ids, attention_mask)
        if rows is not None:  # several prompts: each validated as one, decoded together (medusa.batch)
            rows = [prepare_input_ids(row, self.device, vocab_size=vocab) for row in rows]
            input_ids = (input_ids["input_ids"] if hasattr(input_ids, "keys") else input_ids).to(self.device)
        else:
            input_ids = prepare_input_ids(input_ids, self.device, vocab_size=vocab, attention_mask=attention_mask)
            if isinstance(streamer, (list, tuple)):
                raise ValueError("one prompt streams with one streamer: pass the streamer itself, not a list")
        settings = generate_args.resolve(
            self.base,
            input_ids.shape[1],
            generation_config,
            dict(
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos_token_id,
                stop_strings=stop_strings,
                return_dict_in_generate=return_dict_in_generate,
                output_scores=output_scores,
                output_logits=output_logits,
                **transformers_kwargs,
            ),
            posterior_threshold,
            posterior_alpha,
        )
        self._check_lengths(input_ids.shape[1], settings.max_new_tokens)
        sampling = settings.sampling
        rule = get_rule(acceptance or (self.default_sampling_rule if sampling.do_sample else "greedy"))
        if rows is not None:
            out = self._generate_batch(
                rows,
                settings,
                sampling,
                rule,
                proposer,
                tree,
                generator,
                engine,
                stopping_criteria,
                streamer,
                tokenizer,
            )
            # the padding's ids as given, as transformers returns them
            width = max(row.shape[1] for row in rows)  # the batch's own padding: to its longest prompt
            out.sequences = torch.cat([input_ids, out.sequences[:, width:]], dim=1)
            return out if settings.return_dict_in_generate else out.sequences
        out = self._decode_one(
            input_ids,
            settings,
            sampling,
            rule,
            proposer,
            tree,
            generator,
            engine,
            stop_token_ids(self.base, tokenizer, settings.eos_token_id),
            generate_args.stopping(stopping_criteria, settings.stop_strings, tokenizer),
            streamer=streamer,
            profile=profile,
            output_scores=settings.return_dict_in_generate and settings.output_scores,
            output_logits=settings.return_dict_in_generate and settings.output_logits,
        )
        return out if settings.return_dict_in_generate else out.sequences

    @runs_the_target  # one call at a time on the target, from any thread (medusa.runtime.threads)
    def generate_continuously(
        self,
        take,
        *,
        max_batch: int = 16,
        generation_config: GenerationConfig | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        acceptance: str | None = None,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        proposer: str | None = None,
        tree: list[list[int]] | str | None = None,
        engine: str | None = None,
        tokenizer=None,
    ) -> DecodeStats:
        """Continuous batching: decodes the prompts `take(room)` hands over (a list of at most `room`
        medusa.batch.GenerationRequest), up to `max_batch` rows at once, each exactly as generate decodes it alone
        (greedy: the same tokens; sampling: the same distribution). `take` is called before every step; the requests
        it gives join the running batch there (prefilled together, then stepping with the rest:
        medusa.batch.BatchDecoding.admit), and each request's `result` gets its output as soon as its own row stops,
        so a short answer never waits for a long one and a new prompt never waits for the batch to end. Returns the
        stats of all rows once none is left and `take` gives none. Each request's max_new_tokens and sampling settings
        (do_sample, temperature, top_p, top_k) override the call's where it sets them, so greedy and sampled rows
        share a batch; its stop strings, stopping criteria and streamer are its own; generation_config, eos_token_id
        and acceptance (with its posterior settings) are the call's for every row. A request generate would refuse
        gets that error in its `result` (its `started` False) and the rest go on; if a step fails, every request
        still decoding gets the error, which is raised. The engine is the one the plan lays out for the first
        requests (or `engine`); each request's proposer and tree are the plan's for the rows it joins (or `proposer`
        and `tree`)."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        tokenizer = tokenizer or self.tokenizer
        vocab = self.base.get_input_embeddings().num_embeddings
        shared = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)  # (SAMPLING)
        shared.update(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        ends = end_token_ids(self.base, tokenizer, eos_token_id)
        batch, live, stats, laid_out = None, [], DecodeStats(), 0  # laid_out: the rows the trees were sized for
        joining: list = []
        try:
            while True:
                if batch is not None and not batch.active:  # every row stopped: the next ones start a new batch
                    stats.add(batch.stats)
                    batch, laid_out = None, 0
                room = max_batch - (len(batch.active) if batch is not None else 0)
                given = take(room) if room > 0 else []
                if len(given) > room:
                    raise ValueError(f"take(room) gave {len(given)} requests where room was {room}: give at most room")
                ready = []  # (request, its prompt (1, T), its settings, its stopping rule)
                for request in given:
                    try:
                        prompt = prepare_input_ids(request.input_ids, self.device, vocab_size=vocab)
                        asked = dict(shared, max_new_tokens=request.max_new_tokens, stop_strings=request.stop_strings)
                        asked.update({k: getattr(request, k) for k in SAMPLING if getattr(request, k) is not None})
                        settings = generate_args.resolve(
                            self.base, prompt.shape[1], generation_config, asked, posterior_threshold, posterior_alpha
                        )
                        self._check_lengths(prompt.shape[1], settings.max_new_tokens)
                        stop_when = generate_args.stopping(request.stopping_criteria, settings.stop_strings, tokenizer)
                    except (ValueError, TypeError) as error:  # its own refusal; the others go on
                        request.result.set_exception(error)
                        continue
                    ready.append((request, prompt, settings, stop_when))
                if not ready and batch is None:
                    return stats
                if ready:
                    joining = [request for request, *_ in ready]  # (a failing prefill hands them its error)
                    for request in joining:
                        request.started = True
                    batch, rows = self._join(batch, ready, acceptance, proposer, tree, engine, ends)
                    live += list(zip(rows, joining))
                    joining = []
                    live = _deliver(live)
                if batch.active:
                    if len(batch.active) != laid_out and proposer is None and tree is None:
                        self.budget_trees(batch)
                        laid_out = len(batch.active)
                    batch.step()
                    live = _deliver(live)
        except BaseException as error:
            for request in [request for _, request in live] + joining:
                if not request.result.done():
                    request.result.set_exception(error)
            raise

    def budget_trees(self, batch) -> None:
        """Continuous batching, as the batch's rows change: what their proposers guess a step (MedusaModel sizes
        dynamic trees by the plan); nothing here."""

    def _join(self, batch, ready, acceptance, proposer, tree, engine, ends):
        """Requests `ready` (request, prompt, settings, stopping rule) as rows of `batch` (a new one where it is
        None, on the engine the plan lays out for them) -> (the batch, their rows)."""
        prompts = [prompt for _, prompt, _, _ in ready]
        samplings = [settings.sampling for _, _, settings, _ in ready]
        lengths = [p.shape[1] for p in prompts] + ([] if batch is None else [r.state.length for r in batch.active])
        longest_new = max(settings.max_new_tokens for _, _, settings, _ in ready)
        named = None if batch is None else batch.engine.name
        layout = self.batch_layout(lengths, longest_new, engine or named, proposer, tree)
        target, eager = self.engine(layout.engine), self.engine("eager")  # eager: what a row's draft model runs on
        self.prepare_proposal(target)

        def proposing(sampling):
            return lambda: self.make_proposer(layout.proposer, layout.tree, sampling, None, engine=eager)

        makers = [proposing(sampling) for sampling in samplings]
        rules = [get_rule(acceptance or (self.default_sampling_rule if s.do_sample else "greedy")) for s in samplings]
        each = dict(
            max_new_tokens=[settings.max_new_tokens for _, _, settings, _ in ready],
            sampling=samplings,
            stop_when=[stop_when for *_, stop_when in ready],
            streamers=[request.streamer for request, *_ in ready],
        )
        if batch is not None:
            return batch, batch.admit(prompts, makers, rules, **each)
        pad = ready[0][2].pad_token_id
        batch = BatchDecoding(
            target,
            makers,
            rules,
            prompts,
            stop_ids=set(ends),
            feature_layers=self.feature_layers,
            pad_token_id=(ends[0] if ends else 0) if pad is None else pad,
            **each,
        )
        return batch, batch.rows


def _deliver(live: list) -> list:
    """Of the rows decoding for continuous batching's requests (row, request), those still decoding; each that
    stopped hands its output to its request."""
    still = []
    for row, request in live:
        if row.done:
            request.rows = row.most_rows or 1
            request.result.set_result(row.output())
        else:
            still.append((row, request))
    return still


# generate's sampling settings, which a continuous batch's requests may each set (medusa.batch.GenerationRequest)
SAMPLING = ("do_sample", "temperature", "top_p", "top_k")


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
    stop_when=None,
    streamer=None,
    generator: torch.Generator | None = None,
    profile: bool = False,
    feature_layers=(),
    engine=None,
    output_scores: bool = False,
    output_logits: bool = False,
) -> GenerateOutput:
    """input_ids (1, T) -> GenerateOutput. Callers validate inputs (see MedusaModel.generate). `feature_layers`:
    the base layers whose features the decode state carries besides the last hidden state (what the heads read).
    `stop_when(ids (1, T)) -> bool`: a stopping criterion checked after every new token (transformers' criteria).
    `engine` runs the target (medusa.runtime; default: eager on `model`). `output_logits` / `output_scores`: keep the
    target's logits behind each new token, raw / processed as transformers' are (the verify computes them anyway)."""
    engine = engine or EagerEngine(model)
    stats = DecodeStats()
    timer = _PhaseTimer(stats, profile, input_ids.device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    with timer("prefill"):
        # the cache's most rows: the prompt, every new token and one proposal's nodes beyond them
        rows = input_ids.shape[1] + max_new_tokens + proposer.max_nodes
        state = prefill(model, input_ids, sampling, generator, feature_layers, engine=engine, max_length=rows)
    stats.steps = 1
    new: list[int] = []
    keep_logits = output_scores or output_logits
    new_logits: list[torch.Tensor] = []  # (V,) float32 per new token, when kept

    prompt = input_ids[0].tolist()  # what a stopping criterion sees before the new tokens

    def emit(tokens: list[int], logits: torch.Tensor | None) -> bool:
        """Append tokens (and the logits rows that chose them) up to max_new_tokens and the first stop token (kept, as
        transformers does); True when done."""
        kept, done = take_new(tokens, prompt, new, max_new_tokens, stop_ids, stop_when)
        new.extend(kept)
        if keep_logits:
            new_logits.extend(logits[: len(kept)].to(torch.float32, copy=True).unbind())  # engines reuse buffers
        if streamer is not None and kept:
            streamer.put(torch.tensor(kept))
        return done

    done = emit([int(state.root_token)], state.root_logits[None] if keep_logits else None)
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    while not done:
        with timer("propose"):
            candidates = proposer.propose(state)
            if window is not None and state.length + candidates.tree.max_depth >= window:
                # the tree would reach positions past the context window (learned positions crash there): near
                # the end, verify the root alone
                candidates = PlainProposer(state.root_token.device).propose(state)
        with timer("verify"):
            verified = engine.verify(state.cache, candidates, state.length, feature_layers)
        with timer("accept"):
            accepted = rule(candidates, verified, sampling, generator)
        with timer("commit"):
            engine.commit(state.cache, state.length, accepted.nodes)
            state.advance(accepted, verified.hidden, input_ids.device)
            proposer.observe(state, accepted.tokens)
        stats.steps += 1
        stats.accepted_lengths.append(len(accepted.tokens))
        stats.proposed_lengths.append(candidates.tree.max_depth)
        stats.verified_nodes.append(candidates.tree.num_nodes)
        done = emit(accepted.tokens, verified.logits[accepted.nodes] if keep_logits else None)
    if streamer is not None:
        streamer.end()
    stats.new_tokens = len(new)
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    logits = tuple(row[None] for row in new_logits)
    return GenerateOutput(
        sequences=sequences,
        stats=stats,
        logits=logits if output_logits else None,
        scores=tuple(_processed(row, sampling) for row in logits) if output_scores else None,
    )


def _processed(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """What transformers' generate reports as a token's score: its logits after the warpers (temperature, top-k,
    top-p) when sampling, the logits as they are when greedy (no processor applies)."""
    return shape_logits(logits, sampling) if sampling.do_sample else logits
