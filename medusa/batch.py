"""Several prompts in one `generate` (left-padded, with an attention mask, as transformers takes them): every row
decodes exactly as it would alone, and the target reads its weights once per step for all rows.

Layout (padded blocks, as SGLang's): one cache of (rows, heads, positions, head_dim) per layer in which row b keeps
its committed tokens contiguous from position 0 (the prompt's left padding included, masked forever) to `lengths[b]`;
a step writes row b's candidates at `lengths[b]` onward and commits its accepted path in place there, so rows that
accept different numbers of tokens never leave gaps and the padding does not grow. Each row has its own proposer and
tree (padded to the batch's largest with nodes that see only themselves), its own acceptance and stop; rows whose
proposers can propose together do (`propose_rows`: the dynamic tree's heads run once per depth for all rows); a
finished row leaves the batch (its cache rows are dropped), so it stops costing work. The engine runs the batch's
forwards (Engine.batch_forward): eagerly, as the target is or with the compiled engine's pre-packed weights, or on a
CPU through the inductor engine's batch package (each row's tokens written at its own length). Where decoding the rows
one at a time is faster, the plan does that instead (medusa.plan.batch_choice).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from medusa.acceptance import get_rule
from medusa.guard import GuardedProposer
from medusa.runtime import VerifyOutput, layer_masks
from medusa.sampling import SamplingConfig, select_token
from medusa.sequence import DecodeState, DecodeStats, GenerateOutput, take_new

# Rows prefill together while padding them to their group's longest prompt adds at most this share of their own
# tokens (prefill_groups): padding costs as much as a token, a forward of its own costs a pass over the weights
PREFILL_SLACK = 1.25
# A prompt of at least this many tokens prefills alone, as one sequence's does (Engine.prefill_row): its products are
# compute-bound already, so rows together save nothing, where one sequence's prefill attends causally (a batch's
# explicit mask makes attention cover every key) and runs a sliding-window model's prompt in chunks (docs/engines.md)
ALONE_FROM = 512


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts' token ids -> (B, T) ids left-padded with `pad_token_id` to the longest, and their attention mask (1:
    token, 0: padding): a batched generate's input (split_padded reads it back)."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return input_ids, attention_mask


def split_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """(B, T) ids and their mask (1: token, 0: padding) -> each row's tokens (1, T_b). Padding must be on the left, as
    transformers asks of decoder-only models: right padding would put the prompt's end before the padding."""
    if attention_mask is None:
        return [row[None] for row in input_ids]
    mask = torch.as_tensor(attention_mask, device=input_ids.device).bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}: pass both")
    rows = []
    for ids, keep in zip(input_ids, mask):
        real = int(keep.sum())
        if real == 0:
            raise ValueError("a row of the batch is all padding: give every row at least one token")
        if not bool(keep[-real:].all()):
            raise ValueError(
                "the batch is right-padded (or has holes): pad on the left, as transformers asks of decoder-only "
                "models (tokenizer.padding_side = 'left')"
            )
        rows.append(ids[-real:][None])
    return rows


@dataclass
class GenerationRequest:
    """One prompt for continuous batching (SpeculativeGenerator.generate_continuously): its token ids ((1, T) or a
    list), at most `max_new_tokens` new tokens, its sampling (do_sample, temperature, top_p, top_k), each None for
    the call's settings (as generate's), its stop strings and transformers stopping criteria, its streamer
    (transformers' protocol). `result` gets what generate returns for
    this prompt alone (a GenerateOutput, as with return_dict_in_generate=True: `.sequences` (1, T + new) and the
    row's own `.stats`) as soon as its row stops, or the error that refused it (`started` False: generate would
    refuse it too) or that failed the batch it was in (`started` True)."""

    input_ids: torch.Tensor | list[int]
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_strings: str | list[str] | None = None
    stopping_criteria: list | None = None
    streamer: object = None
    result: Future = field(default_factory=Future)
    rows: int = 0  # the most rows it decoded with, itself included (set with the result)
    started: bool = False  # whether it joined a batch (set before its prefill)


class _Row:
    """One prompt's decoding: its state as the proposers read it, its proposer, its limits (max_new_tokens and
    stop_when, as decode_batch's), its sampling and acceptance rule, its new tokens, its streamer and what its steps
    accepted."""

    def __init__(self, prompt: torch.Tensor, proposer, max_new_tokens: int, stop_when, sampling, rule, streamer=None):
        self.prompt, self.proposer, self.streamer = prompt, proposer, streamer
        self.max_new_tokens, self.stop_when, self.sampling, self.rule = max_new_tokens, stop_when, sampling, rule
        self.prompt_ids: list[int] = prompt[0].tolist()  # what a stopping criterion sees before the new tokens
        self.new: list[int] = []
        self.state: DecodeState | None = None
        self.pad = 0  # cache positions before the prompt (padding its forward's masks hide), set by its prefill
        self.done = False
        self.stats = DecodeStats(steps=1)  # its own: its prefill, then each step it took part in
        self.most_rows = 0  # the most rows it stepped with (itself included)

    def output(self) -> GenerateOutput:
        """This row alone, as generate returns one sequence: its prompt and new tokens (1, T + new), its stats."""
        self.stats.new_tokens = len(self.new)
        new = torch.tensor([self.new], dtype=torch.long, device=self.prompt.device)
        return GenerateOutput(sequences=torch.cat([self.prompt, new], dim=1), stats=self.stats)


def _mask(rows: list[_Row], lengths: list[int], trees, width: int, n: int, dtype, device) -> torch.Tensor:
    """(B, 1, n, width) additive mask: row b's queries see its committed tokens (not its padding) and, among this
    step's n positions, their tree ancestors; padding nodes see only themselves."""
    hidden = torch.finfo(dtype).min
    mask = torch.full((len(rows), 1, n, width), hidden, dtype=dtype, device=device)
    for b, (row, length, tree) in enumerate(zip(rows, lengths, trees)):
        mask[b, 0, :, row.pad : length] = 0
        visible = torch.eye(n, dtype=torch.bool, device=device)
        visible[: tree.num_nodes, : tree.num_nodes] = tree.visible.to(device)
        mask[b, 0, :, length : length + n] = torch.where(visible, 0.0, hidden).to(dtype)
    return mask


@torch.inference_mode()
def decode_batch(
    engine,
    make_proposer,
    rule,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    sampling,
    stop_ids: set[int],
    stop_when=None,
    generator=None,
    feature_layers=(),
    pad_token_id: int,
    streamers=None,
    on_rows_left=None,
) -> GenerateOutput:
    """prompts: each row's tokens (1, T_b) -> GenerateOutput with `sequences` (B, T + new) as transformers' batched
    generate returns them (but for the left padding's ids: `pad_token_id` here, generate puts back those given): the
    prompts left-padded to one width T, the new tokens after, rows that stopped early padded on the right with
    `pad_token_id`. `engine` runs the target (medusa.runtime's); `make_proposer()` gives a fresh proposer per row.
    `streamers`: one per row (None: that row is not streamed), each fed as transformers feeds one: the row's prompt,
    then its new tokens as they are kept, then `end()` when the row stops. `on_rows_left(batch)`: called before a
    step whenever rows finished since the last (the rows left may afford larger trees: MedusaModel.budget_trees)."""
    batch = BatchDecoding(
        engine,
        make_proposer,
        rule,
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_ids=stop_ids,
        stop_when=stop_when,
        generator=generator,
        feature_layers=feature_layers,
        pad_token_id=pad_token_id,
        streamers=streamers,
    )
    rows = len(prompts)  # (a row whose first token ended it left before the first step)
    while batch.active:
        if on_rows_left is not None and len(batch.active) < rows:
            on_rows_left(batch)
            rows = len(batch.active)
        batch.step()
    return batch.output()


class BatchDecoding:
    """A batch's decoding (decode_batch's arguments; make_proposer, rule, max_new_tokens, sampling and stop_when each
    one for every row or a list of one per row): prefilled when made, one step (every active row's propose, the
    batched verify, each row's acceptance, the commit) per `step()` while `active` holds rows; `admit` adds rows to it
    between steps (continuous batching: SpeculativeGenerator.generate_continuously). `rows`: every row it took, in
    order."""

    @torch.inference_mode()
    def __init__(
        self,
        engine,
        make_proposer,
        rule,
        prompts,
        *,
        max_new_tokens,
        sampling,
        stop_ids,
        stop_when=None,
        generator=None,
        feature_layers=(),
        pad_token_id,
        streamers=None,
    ):
        self.engine, self.generator = engine, generator
        self.dtype = engine.model.dtype
        self.stop_ids, self.feature_layers, self.pad_token_id = stop_ids, feature_layers, pad_token_id
        self.device = prompts[0].device
        self.rows: list[_Row] = []
        self.stats = DecodeStats(steps=1)
        rows = self._new_rows(prompts, make_proposer, rule, max_new_tokens, sampling, stop_when, streamers)
        # prefill: every row's prompt left-padded to `width`, written at positions 0 .. width - 1 (a group of rows of
        # like lengths in one forward, padded only to the group's longest: prefill_groups)
        width = max(p.shape[1] for p in prompts)
        # (a step writes every row's tokens at its length onward, as many as the largest tree's nodes)
        cache = engine.new_rows_cache(width + max(r.max_new_tokens for r in rows) + _most_nodes(rows) + 1)
        cache.start(len(rows))
        for group in prefill_groups([row.prompt.shape[1] for row in rows]):
            self._prefill([rows[b] for b in group], cache, group, width)
        cache.advance(width)
        self.cache = cache
        self.active = [row for row in rows if not self._emit(row, [int(row.state.root_token)])]
        _leave(cache, rows, self.active)

    def _new_rows(self, prompts, make_proposer, rule, max_new_tokens, sampling, stop_when, streamers) -> list[_Row]:
        """Rows for `prompts`: make_proposer, rule, max_new_tokens, sampling and stop_when are each one for every row
        or a list of one per row."""
        each = [v if isinstance(v, list) else [v] * len(prompts) for v in (make_proposer, max_new_tokens, stop_when)]
        each += [v if isinstance(v, list) else [v] * len(prompts) for v in (sampling, rule)]
        each.append(streamers or [None] * len(prompts))
        rows = [
            _Row(p, _unguarded(make()), most, stop, how, accept, streamer)
            for p, make, most, stop, how, accept, streamer in zip(prompts, *each)
        ]
        for row in rows:
            if row.streamer is not None:
                row.streamer.put(row.prompt.cpu())
        self.rows += rows
        return rows

    @torch.inference_mode()
    def admit(
        self, prompts, make_proposer, rule, *, max_new_tokens, sampling, stop_when=None, streamers=None
    ) -> list[_Row]:
        """Rows joining the batch between steps (each prompt (1, T_b); make_proposer, rule, max_new_tokens, sampling
        and stop_when one for all or one per row; a streamer per row or None): prefilled in groups of like lengths on
        their own, placed after the active rows in the cache (grown where a row would not fit), then stepping with
        the others -> the new rows (`done` where their first token ended them)."""
        rows = self._new_rows(prompts, make_proposer, rule, max_new_tokens, sampling, stop_when, streamers)
        before = list(self.active)
        self._fit(rows)
        cache = self.cache
        cache.add_rows(len(rows))
        for group in prefill_groups([row.prompt.shape[1] for row in rows]):
            longest = max(rows[b].prompt.shape[1] for b in group)
            slots = [len(before) + b for b in group]
            self._prefill([rows[b] for b in group], cache, slots, longest)
            for slot in slots:
                cache.lengths[slot] = longest
        joined = [row for row in rows if not self._emit(row, [int(row.state.root_token)])]
        _leave(cache, before + rows, before + joined)
        self.active = before + joined
        return rows

    @property
    def budgeted(self) -> list[_Row]:
        """The active rows whose proposers take a node budget (dynamic trees)."""
        return [row for row in self.active if hasattr(row.proposer, "budget")]

    def budget_trees(self, num_nodes: int) -> None:
        """The active rows that propose dynamic trees propose `num_nodes` nodes a step from now on (1: plainly), as
        the plan lays out a batch of their number (continuous batching: as rows join and leave)."""
        for row in self.budgeted:
            row.proposer.budget(num_nodes)
        self._fit([])

    def _fit(self, joining: list[_Row]) -> None:
        """Grow the cache where the active rows and `joining` (not prefilled yet) may not fit it: a larger allocation,
        the active rows copied into it. Each row ends by its prompt's end and its max_new_tokens (the joining ones'
        prompts end at their group's longest), and a step writes every row's tokens there onward, as many as the
        largest tree's nodes."""
        cache, rows = self.cache, self.active + joining
        if not rows:
            return
        longest = max((row.prompt.shape[1] for row in joining), default=0)
        ends = [row.pad + row.prompt.shape[1] + row.max_new_tokens for row in self.active]
        need = max(ends + [longest + row.max_new_tokens for row in joining]) + _most_nodes(rows) + 1
        if need > cache.max_rows:
            larger = self.engine.new_rows_cache(need)
            larger.start(len(cache.lengths))
            larger.place(list(range(len(cache.lengths))), cache.cache.layers, max(cache.lengths), 0)
            larger.lengths[:] = cache.lengths
            self.cache = larger

    def _prefill(self, group: list[_Row], cache, slots: list[int], end: int) -> None:
        """The prompts of `group` into cache rows `slots`, each ending at position `end`: a lone prompt as one
        sequence's prefill runs it (bit for bit what decoding it alone starts from), rows together in one forward
        (_prefill_together); each row's state."""
        longest = max(row.prompt.shape[1] for row in group)
        if len(group) == 1:
            out = self.engine.prefill_row(cache, slots[0], end - longest, group[0].prompt, self.feature_layers)
            logits, features = out.logits[None, None], out.hidden[None]
        else:
            logits, features = self._prefill_together(group, cache, slots, end, longest)
        for i, row in enumerate(group):
            root = select_token(logits[i, -1], row.sampling, self.generator)
            hidden = features[i, longest - row.prompt.shape[1] :]
            row.pad = end - row.prompt.shape[1]
            row.state = DecodeState(None, row.prompt.shape[1], root, hidden[-1], row.prompt_ids + [int(root)], hidden)

    def _prefill_together(self, group: list[_Row], cache, slots: list[int], end: int, longest: int):
        """One forward over the prompts of `group`, left-padded to `longest`, into cache rows `slots` so that each
        prompt ends at position `end` (directly where the group is the whole batch and fills its width, else through a
        scratch cache placed there) -> the logits after each prompt (B, 1, V), what heads read at each position (B,
        longest, F)."""
        device, dtype = self.device, self.dtype
        whole = len(group) == len(cache.lengths) and longest == end  # (the batch's cache was started for every row)
        target = cache if whole else cache.scratch(longest + 1)
        if not whole:
            target.start(len(group))
        ids = torch.full((len(group), longest), self.pad_token_id, dtype=torch.long, device=device)
        real = torch.zeros((len(group), longest), dtype=torch.bool, device=device)
        for i, row in enumerate(group):
            ids[i, longest - row.prompt.shape[1] :] = row.prompt[0]
            real[i, longest - row.prompt.shape[1] :] = True
        causal = torch.ones((longest, longest), dtype=torch.bool, device=device).tril()
        visible = causal[None] & real[:, None, :]
        visible |= torch.eye(longest, dtype=torch.bool, device=device)  # padding queries see themselves: no empty rows
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        # each prompt's token t lies at column t + its padding (a sliding window counts positions)
        mask = layer_masks(self.engine.model.config, mask, positions, [longest - row.prompt.shape[1] for row in group])
        # the next token's logits only: the prompts' own would cost a (B, T, V) projection
        out = self.engine.batch_forward(target, ids, mask, positions, self.feature_layers, logits_to_keep=1)
        if not whole:
            cache.place(slots, target.cache.layers, longest, end - longest)
        return out

    def _emit(self, row: _Row, tokens: list[int]) -> bool:
        kept, done = take_new(tokens, row.prompt_ids, row.new, row.max_new_tokens, self.stop_ids, row.stop_when)
        row.new.extend(kept)
        self.stats.new_tokens += len(kept)  # every row's, as they come
        row.done = done
        if row.streamer is not None:
            if kept:
                row.streamer.put(torch.tensor(kept))
            if done:
                row.streamer.end()
        return done

    @torch.inference_mode()
    def step(self) -> None:
        active, cache, device, stats = self.active, self.cache, self.device, self.stats
        candidates = propose_rows([row.proposer for row in active], [row.state for row in active])
        n = max(c.tree.num_nodes for c in candidates)
        tokens = torch.full((len(active), n), self.pad_token_id, dtype=torch.long, device=device)
        positions = torch.zeros((len(active), n), dtype=torch.long, device=device)
        for b, (row, c) in enumerate(zip(active, candidates)):
            tokens[b, : c.tree.num_nodes] = c.tokens
            positions[b, : c.tree.num_nodes] = row.state.length + c.tree.depth.to(device)
        trees = [c.tree for c in candidates]
        mask = _mask(active, cache.lengths, trees, max(cache.lengths) + n, n, self.dtype, device)
        mask = layer_masks(self.engine.model.config, mask, positions, [row.pad for row in active])
        logits, features = self.engine.batch_forward(cache, tokens, mask, positions, self.feature_layers)
        stats.steps += 1
        still, kept = [], []
        for b, (row, c) in enumerate(zip(active, candidates)):
            size = c.tree.num_nodes
            verified = VerifyOutput(logits[b, :size], features[b, :size])
            accepted = row.rule(c, verified, row.sampling, self.generator)
            kept.append(accepted.nodes)
            row.state.advance(accepted, verified.hidden, device)
            row.proposer.observe(row.state, accepted.tokens)
            row.most_rows = max(row.most_rows, len(active))
            row.stats.steps += 1
            for each in (stats, row.stats):
                each.accepted_lengths.append(len(accepted.tokens))
                each.proposed_lengths.append(c.tree.max_depth)
                each.verified_nodes.append(size)
            if not self._emit(row, accepted.tokens):
                still.append(row)
        cache.commit(kept)
        _leave(cache, active, still)
        self.active = still

    def output(self) -> GenerateOutput:
        sequences = padded([row.prompt for row in self.rows], [row.new for row in self.rows], self.pad_token_id)
        return GenerateOutput(sequences=sequences, stats=self.stats)


def propose_rows(proposers: list, states: list) -> list:
    """Each row's candidates: together where rows' proposers propose a batch at once (`propose_batch`, as the dynamic
    tree's do: one head call for all rows whose `batch_key` is one), else one row after another (rows that joined a
    running batch may have another tree than the rows before them)."""
    candidates, together = [None] * len(proposers), {}
    for b, proposer in enumerate(proposers):
        if hasattr(proposer, "propose_batch"):
            together.setdefault((type(proposer), proposer.batch_key), []).append(b)
        else:
            candidates[b] = proposer.propose(states[b])
    for (kind, _), rows in together.items():
        for b, proposed in zip(rows, kind.propose_batch([proposers[b] for b in rows], [states[b] for b in rows])):
            candidates[b] = proposed
    return candidates


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Which rows of prompts of `lengths` tokens prefill in one forward (row indices, in order): rows of like
    lengths, padded to the longest of their group, while the group's padded tokens stay within PREFILL_SLACK of its
    own (a batch's rows padded to its longest prompt would pay that prompt in every row; a forward per row pays its
    fixed cost once per row); a prompt of ALONE_FROM tokens or more alone."""
    groups: list[list[int]] = []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        group = groups[-1] if groups else []
        tokens = sum(lengths[i] for i in group) + lengths[b]
        together = group and lengths[group[0]] < ALONE_FROM
        if together and (len(group) + 1) * lengths[group[0]] <= PREFILL_SLACK * tokens:
            group.append(b)
        else:
            groups.append([b])
    return [sorted(group) for group in groups]


def padded(prompts: list[torch.Tensor], new: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Each prompt (1, T_b) and its new tokens -> (B, T + longest) as transformers' batched generate returns them:
    prompts left-padded to the longest, new tokens after, rows that ended early padded on the right."""
    width, longest = max(p.shape[1] for p in prompts), max(map(len, new))
    device = prompts[0].device
    sequences = torch.full((len(prompts), width + longest), pad_token_id, dtype=torch.long, device=device)
    for b, (prompt, tokens) in enumerate(zip(prompts, new)):
        sequences[b, width - prompt.shape[1] : width] = prompt[0]
        sequences[b, width : width + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
    return sequences


def _leave(cache, before: list[_Row], after: list[_Row]) -> None:
    """Drop the cache rows of the rows that finished (from `before` to `after`, order kept): they cost no more work."""
    if len(after) < len(before) and after:
        cache.keep([i for i, row in enumerate(before) if row in after])


def _most_nodes(rows: list[_Row]) -> int:
    return max(row.proposer.max_nodes for row in rows)


def _unguarded(proposer):
    """The plan's online guard times one sequence's steps against plain decoding; a batch's steps are another
    measure, so rows propose without it."""
    return proposer.inner if isinstance(proposer, GuardedProposer) else proposer


@torch.inference_mode()
def time_batch_verify(
    engine, rows: int, nodes: list[int], context: int, repeats: int, seed: int = 0
) -> dict[int, float]:
    """Median ms of one batched verify as decode_batch runs it on `engine`, for each count in `nodes`: `rows`
    sequences of `context` cached tokens, each verifying that many tokens (a chain) in one forward of the target. The
    cache is not advanced, so every forward sees the same lengths; the counts are interleaved within each repeat, so
    drifts in machine load hit them alike."""
    model, most = engine.model, max(nodes)
    device, dtype = model.device, model.dtype
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, context + most), generator=torch.Generator().manual_seed(seed)).to(device)
    cache = engine.new_rows_cache(context + most + 1)
    cache.start(rows)
    allowed = torch.ones((context + most, context + most), dtype=torch.bool, device=device).tril()
    mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None].expand(rows, 1, -1, -1)
    positions = torch.arange(context + most, device=device)[None].expand(rows, -1)
    engine.batch_forward(
        cache, ids[:, :context], mask[:, :, :context, :context], positions[:, :context], logits_to_keep=1
    )
    cache.advance(context)
    times: dict[int, list[float]] = {n: [] for n in nodes}
    for _ in range(repeats + 1):  # the first round warms up
        for n in nodes:
            end = context + n
            start = time.perf_counter()
            engine.batch_forward(cache, ids[:, context:end], mask[:, :, context:end, :end], positions[:, context:end])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[n].append(1000 * (time.perf_counter() - start))
    return {n: statistics.median(t[1:]) for n, t in times.items()}


@torch.inference_mode()
def time_batch_step(
    engine, make_proposer, rows: int, context: int, steps: int, feature_layers=(), seed: int = 0
) -> float:
    """Median ms of one step of a batch's decoding as a whole (every row's propose, the batched verify, each row's
    acceptance, the commit: what a verify's timing leaves out) for `rows` rows of `context` cached tokens, over
    `steps` steps after one that warms up; rows stay in the batch throughout. `feature_layers`: what the proposers
    read (decode_batch's). The rows are prefilled with a few random tokens and then padded on the left to `context`
    (a step attends over padding as over tokens; a real prefill of many long rows would cost seconds)."""
    model = engine.model
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (1, 8), generator=generator).to(model.device) for _ in range(rows)]
    made = [make_proposer() for _ in range(rows)]
    batch = BatchDecoding(
        engine,
        lambda: made.pop(),
        get_rule("greedy"),
        prompts,
        # room in the cache for `context` and every step's nodes, and no row reaches its end
        max_new_tokens=context + (steps + 1) * max(p.max_nodes for p in made) + 1,
        sampling=SamplingConfig(),
        stop_ids=set(),
        feature_layers=feature_layers,
        pad_token_id=0,
    )
    # each row now sits behind `context` - 8 positions of padding: attended over (and masked) as a prompt's would be
    batch.cache.lengths[:] = [context] * rows
    for row in batch.rows:
        row.pad = context - row.prompt.shape[1]
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        batch.step()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[1:])


@torch.inference_mode()
def time_batch_prefill(engine, rows: int, context: int, repeats: int = 2, seed: int = 0) -> float:
    """Median ms per token of a batch's prefill as BatchDecoding runs it on `engine`: `rows` rows of `context` tokens
    in one forward (padding costs as much as a token: a group of rows prefills rows x its longest prompt,
    prefill_groups)."""
    model = engine.model
    device = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, context), generator=torch.Generator().manual_seed(seed)).to(device)
    causal = torch.ones((context, context), dtype=torch.bool, device=device).tril()
    mask = torch.where(causal, 0.0, torch.finfo(model.dtype).min).to(model.dtype)[None, None].expand(rows, 1, -1, -1)
    positions = torch.arange(context, device=device)[None].expand(rows, -1)
    cache = engine.new_rows_cache(context + 1)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        cache.start(rows)
        start = time.perf_counter()
        engine.batch_forward(cache, ids, mask, positions, logits_to_keep=1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - start) / (rows * context))
    return statistics.median(times[1:])
