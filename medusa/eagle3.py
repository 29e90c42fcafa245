"""The EAGLE-3 drafter (Li et al. 2025): one decoder layer of the target's family that drafts from three of the
target's layers (low, middle, high) fused by `fc`, then from its own output and the embedding of the token it drafted;
its output layer covers a draft vocabulary (the most frequent target tokens, mapped back by `d2t`).

At an anchor position t the draft reads fc(target features at t) and the embedding of token t+1 and predicts token
t+2; step j of a chain reads step j-1's output and the token it drafted, at position t+j. Its KV cache keeps the rows
computed from the target's own features (committed positions) and, while it drafts, one row per drafted token.

The layer is transformers' own (built from the target's config), with its q/k/v projections widened to read the
embedding and the hidden state side by side; nothing of the family's forward is written here. Stored in the
speculators format that vLLM loads (medusa.eagle3_io).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel, DynamicCache, PretrainedConfig

from medusa.draft import TargetAndDraft
from medusa.dynamic_tree import DEFAULT_TOPK, Level, cut_tree, keep_best, rank_copies_first, surviving_parents
from medusa.ngram import copy_chain
from medusa.plan import DRAFT_PROPOSER, Planned
from medusa.propose import Compiled, PlainProposer
from medusa.runtime import compiled_module, int8_copy, with_cache
from medusa.sampling import SamplingConfig, greedy_tokens, target_probs
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")  # read [embedding, hidden]: twice the hidden size
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# A drafted tree also tries the heads' copy guess (medusa.ngram: what followed the most recent earlier occurrence of
# the last 4..2 tokens) first where there is one: a draft's tokens per step at 6 nodes on held-out self-instruct
# prompts 1.57 -> 2.29 (session 62's: docs/benchmarks/cpu-eagle3-shipped-session63), 1.85 -> 2.51 (session 64's)
COPY_NGRAM = 4
MAX_STEP_ROWS = 64  # the most rows a compiled draft step takes at once (a tree level's nodes, newly committed rows)

logger = logging.getLogger(__name__)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers, as indices into transformers' `hidden_states` (0: the embeddings, i: the
    output of layer i): the residual stream entering layers 2, L/2 and L-3."""
    return [2, num_layers // 2, num_layers - 3]


def layer_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The target's text config cut to the one layer the draft holds."""
    config = copy.deepcopy(target_config.get_text_config())
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    config.use_cache = True
    return config


class Eagle3Draft(nn.Module):
    """The draft network. `forward` runs the layer; `logits` maps its output to the draft vocabulary; `target_ids`
    maps draft-vocabulary indices to the target's token ids. The token embeddings are the target's (not held here)."""

    def __init__(self, config: PretrainedConfig, aux_layers: list[int], draft_vocab_size: int, target_vocab_size: int):
        super().__init__()
        config = layer_config(config)
        hidden = config.hidden_size
        if len(aux_layers) < 1:
            raise ValueError("an EAGLE-3 draft reads at least one target layer (aux_layers); EAGLE-3 uses three")
        if not 1 <= draft_vocab_size <= target_vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [1, {target_vocab_size}], got {draft_vocab_size}")
        self.config, self.aux_layers = config, list(aux_layers)
        self.gradient_checkpointing = False  # training.gradient_checkpointing (medusa/train/eagle3.py)
        # transformers builds the family's layer, norm and rotary embedding; the embeddings are the target's, so a
        # one-row table stands in for them while building
        shell = AutoModel.from_config(
            _one_row_vocabulary(config), attn_implementation="sdpa", dtype=torch.get_default_dtype()
        )
        layer = shell.layers[0]
        missing = [part for part in LAYER_PARTS if not hasattr(layer, part)]
        if missing or any(not hasattr(layer.self_attn, name) for name in ATTENTION_INPUTS):
            raise ValueError(
                f"an EAGLE-3 draft is built from a decoder layer with {LAYER_PARTS} and q/k/v projections: "
                f"{type(layer).__name__} lacks {missing or ATTENTION_INPUTS}: use a llama-, qwen2- or gemma-like target"
            )
        for name in ATTENTION_INPUTS:
            old = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.fc = nn.Linear(len(aux_layers) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = shell.norm
        self.rotary_emb = shell.rotary_emb
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # target id of draft index i: i + d2t[i]; t2d[token]: whether the draft vocabulary holds it
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(target_vocab_size, dtype=torch.bool))
        self.set_vocabulary(torch.arange(draft_vocab_size))

    def set_vocabulary(self, token_ids: torch.Tensor) -> None:
        """The target ids the draft vocabulary holds, ascending (draft index i -> token_ids[i])."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != self.d2t.numel() or not bool((token_ids[1:] > token_ids[:-1]).all()):
            raise ValueError(f"the draft vocabulary takes {self.d2t.numel()} distinct target ids in ascending order")
        if int(token_ids[0]) < 0 or int(token_ids[-1]) >= self.t2d.numel():
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.t2d.numel()})")
        token_ids = token_ids.to(self.d2t.device)
        self.d2t.copy_(token_ids - torch.arange(token_ids.numel(), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """(V_draft,) the target token id of each draft index."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(..., len(aux_layers) * H) target features -> (..., H): what step 0 reads as its hidden state."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, hidden, token_embeds, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """hidden, token_embeds (B, T, H); position_ids (B, T); attention_mask (B, 1, T, K) additive over the K rows
        the cache holds after this call -> the layer's output (B, T, H), the next step's hidden state."""
        layer = self.layers[0]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        inputs = torch.cat([layer.input_layernorm(token_embeds.to(hidden.dtype)), layer.hidden_norm(hidden)], dim=-1)
        attended, _ = layer.self_attn(
            hidden_states=inputs,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **with_cache(layer.self_attn, cache),
        )
        hidden = hidden + attended
        mlp = lambda h: layer.mlp(layer.post_attention_layernorm(h))
        if self.gradient_checkpointing and torch.is_grad_enabled():
            # the MLP's activations are recomputed in backward; the attention is not (it appends to `cache`, and a
            # recompute would append again)
            return hidden + checkpoint(mlp, hidden, use_reentrant=False)
        return hidden + mlp(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) layer output -> (..., V_draft) logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))


def _one_row_vocabulary(config: PretrainedConfig) -> PretrainedConfig:
    config = copy.deepcopy(config)
    config.vocab_size = 1
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.tie_word_embeddings = False
    return config


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, K) bool, True where a query may attend -> (1, 1, T, K) additive mask."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def unrolled_visibility(length: int, step: int, device=None) -> torch.Tensor:
    """Training-time test: which rows the queries of step `step` see, anchors 0..length-1.

    Rows are the cache after steps 0..step, each `length` rows (anchor-major within a step). The query of anchor a
    at step j sees step 0's rows of anchors <= a (computed from the target's features, as in decoding) and, from
    each step 1..j, the row of its own anchor (the tokens it drafted before): what its cache holds when it drafts.
    -> (length, (step + 1) * length) bool."""
    anchors = torch.arange(length, device=device)
    causal = anchors[None, :] <= anchors[:, None]
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class DraftStep(nn.Module):
    """The draft over T new rows after the P rows its KV cache holds, the cache handed in and the new rows' keys and
    values handed back: a function of its inputs, so that it compiles ahead of time (`compile_draft_step`).

    hidden, embeds (T, H); positions (T,); past_visible (T, P) and new_visible (T, T) bool, the rows each query sees;
    keys, values (P, kv_heads, head_dim) -> (output (T, H): the next step's hidden state; the draft's float32
    log-probabilities (T, V_draft), or the last row's alone (1, V_draft) without `every_row`, as a prompt's feed needs
    (normalised here, where it costs no call of its own: sampling and ranking read them as logits); the new rows' keys
    and values (T, kv_heads, head_dim))."""

    def __init__(self, draft: Eagle3Draft, every_row: bool = True):
        super().__init__()
        self.draft, self.every_row = draft, every_row

    def forward(self, hidden, embeds, positions, past_visible, new_visible, keys, values):
        cache = DynamicCache()
        cache.update(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], 0)
        mask = additive_mask(torch.cat([past_visible, new_visible], dim=1), hidden.dtype)
        output = self.draft(hidden[None], embeds[None], positions[None], mask, cache)[0]
        past, rows = keys.shape[0], cache.layers[0]
        new_keys, new_values = (x[0, :, past:].transpose(0, 1) for x in (rows.keys, rows.values))
        logits = self.draft.logits(output if self.every_row else output[-1:])
        return output, logits.float().log_softmax(-1), new_keys, new_values


def kv_shape(draft: Eagle3Draft) -> tuple[int, int]:
    """(kv_heads, head_dim) of the draft's attention."""
    return draft.config.num_key_value_heads, draft.layers[0].self_attn.head_dim


def compile_draft_step(draft: Eagle3Draft, progress: bool = True) -> Compiled | None:
    """`DraftStep` compiled ahead of time on a CPU (runtime.compiled_module: once on this machine and draft, seconds;
    loaded from the cache after) for 1..MAX_STEP_ROWS new rows after at least one cached row: eagerly, a draft step's
    few dozen small operations cost more in calls than in arithmetic. None where compiling fails (a warning says why;
    the draft then runs eagerly, computing the same)."""
    step = DraftStep(draft).eval()
    dtype, size = draft.fc.weight.dtype, draft.config.hidden_size
    rows, past = 2, 3  # neither 0 nor 1, which export would specialise on
    kv = (past, *kv_shape(draft))
    example = (
        torch.zeros(rows, size, dtype=dtype),
        torch.zeros(rows, size, dtype=dtype),
        torch.arange(past, past + rows),
        torch.ones(rows, past, dtype=torch.bool),
        torch.eye(rows, dtype=torch.bool),
        torch.zeros(kv, dtype=dtype),
        torch.zeros(kv, dtype=dtype),
    )
    new = torch.export.Dim("rows", min=1, max=MAX_STEP_ROWS)
    cached = torch.export.Dim("past", min=1, max=max(draft.config.max_position_embeddings, 2 * MAX_STEP_ROWS))
    shapes = ({0: new}, {0: new}, {0: new}, {0: new, 1: cached}, {0: new, 1: new}, {0: cached}, {0: cached})
    try:
        runner = compiled_module(step, example, shapes, "eagle3-step", "the EAGLE-3 draft", progress)
    except Exception as err:  # noqa: BLE001 - any failure leaves the eager step, which computes the same
        logger.warning("the EAGLE-3 draft could not be compiled (%s: %s); it runs eagerly", type(err).__name__, err)
        return None
    return Compiled(runner, step, MAX_STEP_ROWS)


class Eagle3Proposer:
    """Drafts with an Eagle3Draft after the target's root token: a chain of `depth` tokens, or with `num_nodes` a tree
    of that many nodes (root included) at most `depth` deep, EAGLE-2's search: each level runs the draft once over the
    nodes that can still make the cut (their ancestors' rows visible to each, as a tree mask), expands each into its
    `topk` likeliest tokens and keeps the best by the product of the draft's probabilities along the path. With
    `copy_ngram` the node that follows the copy chain (medusa.ngram.copy_chain) ranks its copy guess first, scored as
    the heads score theirs (medusa.dynamic_tree.copy_first).

    Each call first feeds the draft the positions the target committed since the previous call (their features from
    `state.new_hidden`, columns `feature_columns`), dropping the rows it drafted then. A chain draws from the draft's
    q shaped by `sampling` (argmax when greedy) and hands q to the acceptance rule, so the "speculative" rule keeps
    sampling exact; a tree is a deterministic set of guesses, exact under the "rejection" rule. Greedy output is the
    target's whatever the draft says. `compiled`: `compile_draft_step`'s, used wherever it takes the rows.
    """

    def __init__(
        self,
        draft: Eagle3Draft,
        embed_tokens: nn.Module,
        feature_columns: slice,
        depth: int,
        sampling: SamplingConfig,
        vocab_size: int,
        generator: torch.Generator | None = None,
        num_nodes: int | None = None,
        topk: int = DEFAULT_TOPK,
        copy_ngram: int = 0,
        compiled: Compiled | None = None,
    ):
        if num_nodes is not None and (num_nodes < 2 or topk < 1):
            raise ValueError(f"an EAGLE-3 tree needs num_nodes >= 2 and topk >= 1, got {num_nodes} and {topk}")
        self.draft, self.embed_tokens, self.columns = draft, embed_tokens, feature_columns
        self.depth, self.sampling, self.vocab_size, self.generator = depth, sampling, vocab_size, generator
        self.num_nodes, self.topk, self.copy_ngram = num_nodes, topk, copy_ngram
        self.max_nodes = depth + 1 if num_nodes is None else num_nodes
        self.tree = build_buffers(TreeSpec(chain(depth)), depth).to(draft.d2t.device)
        self.target_ids = draft.target_ids  # once: each level maps its draft tokens through it
        self.compiled_step = compiled
        self.eager_steps = {every_row: DraftStep(draft, every_row) for every_row in (True, False)}
        # the draft's KV cache, (keys, values) x capacity x (kv_heads, head_dim): its first `rows` rows are filled
        self.kv = torch.zeros(2, 0, *kv_shape(draft), dtype=draft.fc.weight.dtype, device=draft.d2t.device)
        self.rows = 0
        self.seen = 0  # committed positions whose rows (from the target's features) the cache holds
        self._unread: list[torch.Tensor] = []  # features of positions committed since, oldest first

    def _step(
        self, hidden, tokens, positions, past_visible, new_visible, every_row: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft over (T, H) hidden states and the (T,) tokens after them at `positions`, seeing the cached
        rows `past_visible` (T, rows) and each other's `new_visible` (T, T); their rows join the cache. -> (outputs
        (T, H), the draft's float32 log-probabilities (T, V_draft); without `every_row` at least the last row's)."""
        count = hidden.shape[0]
        if self.compiled_step is not None and self.rows and count <= MAX_STEP_ROWS:
            step = self.compiled_step
        else:  # a prompt (no rows cached yet) or more rows than the package takes
            step = self.eager_steps[every_row]
        keys, values = self.kv[0, : self.rows], self.kv[1, : self.rows]
        output, log_probs, new_keys, new_values = step(
            hidden, self.embed_tokens(tokens), positions, past_visible, new_visible, keys, values
        )
        if self.rows + count > self.kv.shape[1]:  # grow by doubling: a copy now and then, not every step
            grown = self.kv.new_zeros(2, 2 * (self.rows + count), *self.kv.shape[2:])
            grown[:, : self.rows] = self.kv[:, : self.rows]
            self.kv = grown
        self.kv[0, self.rows : self.rows + count] = new_keys
        self.kv[1, self.rows : self.rows + count] = new_values
        self.rows += count
        return output, log_probs

    def _draw(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(V_draft,) draft log-probabilities -> (target token id, q over the target's vocabulary or None when
        greedy)."""
        if not self.sampling.do_sample:
            return self.target_ids[greedy_tokens(log_probs)], None
        full = log_probs.new_full((self.vocab_size,), float("-inf"), dtype=torch.float32)
        full[self.target_ids] = log_probs
        q = target_probs(full, self.sampling)
        return torch.multinomial(q, 1, generator=self.generator)[0], q

    @torch.inference_mode()
    def propose(self, state) -> Candidates:
        if state.new_hidden is None:
            raise ValueError("an EAGLE-3 draft reads the target's features: the decode state must carry new_hidden")
        # the positions the last step committed (state.new_hidden), after those of steps without guesses (skip)
        features = torch.cat([*self._unread, state.new_hidden])[-(state.length - self.seen) :, self.columns]
        self._unread = []
        self.rows = self.seen  # the rows drafted last time go
        following = torch.tensor(state.tokens[self.seen + 1 : state.length + 1], device=features.device)
        count, device = following.numel(), features.device
        hidden, log_probs = self._step(
            self.draft.fuse(features),
            following,
            torch.arange(self.seen, self.seen + count, device=device),
            torch.ones((count, self.rows), dtype=torch.bool, device=device),
            torch.ones((count, count), dtype=torch.bool, device=device).tril(),
            every_row=False,
        )
        hidden, log_probs = hidden[-1:], log_probs[-1:]
        self.seen = state.length
        if self.num_nodes is not None:
            return self._tree(state, hidden, log_probs)
        tokens, probs = [], []
        for step in range(self.depth):
            token, q = self._draw(log_probs[-1])
            tokens.append(token)
            probs.append(q)
            if step + 1 < self.depth:
                hidden, log_probs = self._step(
                    hidden,
                    token.view(1),
                    torch.tensor([state.length + step], device=device),
                    torch.ones((1, self.rows), dtype=torch.bool, device=device),
                    torch.ones((1, 1), dtype=torch.bool, device=device),
                )
        drafted = torch.stack(tokens)
        draft_probs = None
        if self.sampling.do_sample:
            draft_probs = torch.stack([torch.zeros_like(probs[0])] + probs)  # (N, V); the root row is unused
        return Candidates(
            tokens=torch.cat([state.root_token.view(1).to(drafted.device), drafted]),
            tree=self.tree,
            draft_probs=draft_probs,
        )

    def _tree(self, state, hidden: torch.Tensor, log_probs: torch.Tensor) -> Candidates:
        """The dynamic tree from the root's output `hidden` (1, H) and its draft `log_probs` (the class docstring)."""
        device = hidden.device
        root, budget = state.root_token.view(1).to(device), self.num_nodes - 1
        beam = [0.0]  # the kept nodes' path scores; the root: log 1
        paths: list[tuple[int, ...]] = [()]  # the kept nodes' tokens after the root
        copies = copy_chain(torch.tensor(state.tokens), self.copy_ngram, self.depth) if self.copy_ngram else []
        sees = torch.zeros((1, 0), dtype=torch.bool, device=device)  # which drafted rows each kept node sees
        committed = torch.ones((budget, self.seen), dtype=torch.bool, device=device)
        levels: list[Level] = []
        for depth in range(self.depth):
            if depth:  # run the level's nodes that can still have a child in the cut
                count = surviving_parents(beam, levels, budget)
                if count == 0:
                    break
                beam, paths = beam[:count], paths[:count]
                parents = torch.tensor(levels[-1].parents[:count], device=device)
                ancestors, itself = sees[parents], torch.eye(count, dtype=torch.bool, device=device)
                hidden, log_probs = self._step(
                    hidden[parents],
                    torch.tensor(levels[-1].tokens[:count], device=device),
                    torch.full((count,), state.length + depth - 1, device=device),
                    torch.cat([committed[:count], ancestors], dim=1),
                    itself,
                )
                sees = torch.cat([ancestors, itself], dim=1)
            top_logp, top_index = log_probs.topk(min(self.topk, budget, log_probs.shape[-1]), dim=-1)
            rows_logp, rows_tokens = top_logp.tolist(), self.target_ids[top_index].tolist()
            rank_copies_first(paths, rows_tokens, rows_logp, copies, depth)
            levels.append(keep_best(beam, rows_logp, rows_tokens, budget))
            beam = levels[-1].scores
            paths = [paths[p] + (t,) for p, t in zip(levels[-1].parents, levels[-1].tokens)]
        return cut_tree(root, levels, budget)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass

    def skip(self, state) -> None:
        """A step without guesses (medusa.guard): the positions it commits are read with the next proposal's."""
        self._unread.append(state.new_hidden)

    def forget(self, rows: int) -> None:
        """Read the last `rows` committed positions again at the next proposal (the plan times steady steps at one
        decode state: medusa.plan)."""
        self.seen = max(self.seen - rows, 0)


class Eagle3Model(Planned, TargetAndDraft):
    """A target and an EAGLE-3 draft behind `MedusaModel`'s `generate` (build with `MedusaModel.from_draft_model`
    and an EAGLE-3 draft): a chain of `num_speculative_tokens` a step, or with `num_nodes` a dynamic tree that deep.
    Greedy output is the target's greedy output; `do_sample=True` samples exactly from its distribution (acceptance
    "speculative" with the draft's q for a chain, "rejection" for a tree).

    With a plan (`calibrate`, medusa.plan) `generate` runs on the plan's engine and, unless `num_nodes` was given,
    drafts the plan's tree size (or decodes plainly where no size pays here), guarded online (medusa.guard). The
    plan weighs the tree sizes whose tokens per step were decoded on held-out prompts (`decoded_taus`, kept in the
    draft's directory by `medusa accuracy --taus --eagle3 DIR --heads-dir`); without them it keeps the draft's own
    proposal on the fastest engine, guarded. Its trees also try the copy guess (`copy_ngram`, COPY_NGRAM by
    default; 0: none); decoded taus apply only to the setting they were decoded with (`from_draft_model`)."""

    def __init__(
        self,
        target,
        draft: Eagle3Draft,
        tokenizer=None,
        num_speculative_tokens: int = 5,
        num_nodes: int | None = None,
        topk: int = DEFAULT_TOPK,
        int8: bool | None = None,
        copy_ngram: int = COPY_NGRAM,
    ):
        super().__init__(target, draft.to(target.device), tokenizer, num_speculative_tokens)
        if copy_ngram < 0:
            raise ValueError(
                f"copy_ngram takes the longest n-gram to match (2 or more; 0: no copy guess), got {copy_ngram}"
            )
        self.num_nodes, self.topk, self.copy_ngram = num_nodes, topk, copy_ngram
        self.decoded_taus: dict | None = None  # tokens per step of its trees on held-out prompts (medusa.plan)
        text = target.config.get_text_config()
        if draft.config.hidden_size != text.hidden_size:
            raise ValueError(
                f"the EAGLE-3 draft reads hidden states of size {draft.config.hidden_size} but the target's are "
                f"{text.hidden_size}: use a draft trained on this target"
            )
        if max(draft.aux_layers) >= text.num_hidden_layers:
            raise ValueError(
                f"the EAGLE-3 draft reads the target's layers {draft.aux_layers} but the target has "
                f"{text.num_hidden_layers}: use a draft trained on this target"
            )
        if draft.t2d.numel() != self.vocab_size:
            raise ValueError(
                f"the EAGLE-3 draft maps a vocabulary of {draft.t2d.numel()} tokens but the target has "
                f"{self.vocab_size}: use a draft trained on this target"
            )
        # on a CPU the draft proposes on int8 weights, as the heads do (runtime.int8_copy): a quarter of the bytes
        # each draft step reads; the target verifies every guess, so outputs do not change
        int8 = target.device.type == "cpu" if int8 is None else int8
        self.proposal_draft = int8_copy(self.draft) if int8 else self.draft
        self.feature_layers = list(draft.aux_layers)
        self.compiled_step: Compiled | None | bool = None  # prepare_proposal's; False where there is none

    def prepare_proposal(self, engine) -> None:
        """Where `engine` compiles the target ahead of time (the inductor engine on a CPU), compile the draft's step
        too (seconds, once on this machine and draft; loaded after): every later call drafts with it."""
        if getattr(engine, "ahead_of_time", False) and self.compiled_step is None:
            on_cpu = self.device.type == "cpu"
            self.compiled_step = on_cpu and compile_draft_step(self.proposal_draft) or False

    @property
    def default_sampling_rule(self) -> str:
        """Exact for what proposes by default: a chain hands the draft's q to "speculative"; a tree's guesses are a
        deterministic set, exact under "rejection"."""
        return "speculative" if self._tree_size(None) is None else "rejection"

    def _tree_size(self, tree) -> int | None:
        """The nodes (root included) of the tree the draft grows for `tree` (see make_proposer); None: a chain."""
        if tree is not None:
            return len(tree) + 1
        if self.num_nodes is None and self.plan is not None and self.plan.proposer == DRAFT_PROPOSER and self.plan.tree:
            return len(self.plan.tree) + 1
        return self.num_nodes

    def make_proposer(self, proposer: str | None, tree, sampling: SamplingConfig, generator, engine=None):
        """The draft's proposal: a dynamic tree of `num_nodes` nodes, else the plan's size (guarded online), else a
        chain of `num_speculative_tokens`. `proposer="plain"` decodes without guesses; `tree`, a list of rank paths,
        asks for a dynamic tree of as many nodes as it has paths, plus the root (the draft picks the tokens; a plan's
        trees are named so, as the heads' dynamic proposer takes its size from a tree)."""
        if proposer not in (None, DRAFT_PROPOSER, "plain"):
            raise ValueError(
                f"an EAGLE-3 model proposes with its draft, got proposer={proposer!r}: leave it unset, or 'plain'"
            )
        if tree is not None and (not isinstance(tree, (list, tuple)) or not tree):
            raise ValueError(
                f"an EAGLE-3 draft grows its own trees: tree= takes a list of rank paths (their count sizes the tree), "
                f"got {tree!r}; or set num_nodes in MedusaModel.from_draft_model"
            )
        chosen_by_plan = proposer is None and tree is None and self.plan is not None
        if chosen_by_plan:
            proposer = self.plan.proposer
        if proposer == "plain":
            return PlainProposer(self.device)
        self.prepare_proposal(engine)
        hidden = self.draft.config.hidden_size
        built = Eagle3Proposer(
            self.proposal_draft,
            self.target.get_input_embeddings(),
            slice(hidden, None),  # base_features puts the last hidden state first, then the aux layers
            self.num_speculative_tokens,
            sampling,
            self.vocab_size,
            generator,
            num_nodes=self._tree_size(tree),
            topk=self.topk,
            copy_ngram=self.copy_ngram,
            compiled=self.compiled_step or None,
        )
        if not chosen_by_plan:
            return built
        return self.guarded(built)


def unrolled_outputs(
    draft: Eagle3Draft, embed_tokens: nn.Module, features, input_ids, steps: int
) -> list[torch.Tensor]:
    """Training-time test over whole sequences: features (B, T, F) at the aux layers, input_ids (B, T) -> for each
    step j < `steps`, the layer's output (B, T-1, H) at every anchor a, which predicts token a + j + 2.

    Step j reads step j-1's outputs and the true token a + j + 1 (the target's own answer: what the chain holds where
    the target accepts it) and sees what `unrolled_visibility` says, so each anchor computes exactly what decoding
    computes there (tests/test_eagle3.py checks it). Past the sequence's end the token is 0; those outputs are
    not scored."""
    anchors = input_ids.shape[1] - 1
    hidden = draft.fuse(features[:, :anchors])
    positions = torch.arange(anchors, device=input_ids.device)[None]
    padded = torch.nn.functional.pad(input_ids, (0, steps))
    cache, outputs = DynamicCache(), []
    for step in range(steps):
        embeds = embed_tokens(padded[:, 1 + step : 1 + step + anchors])
        mask = additive_mask(unrolled_visibility(anchors, step, input_ids.device), hidden.dtype)
        hidden = draft(hidden, embeds, positions + step, mask, cache)
        outputs.append(hidden)
    return outputs
