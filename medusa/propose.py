"""Proposers: state -> Candidates (tokens arranged as a tree). The interface, the static-tree Medusa proposer and the
plain one. The dynamic tree, prompt lookup and the draft model's proposer live in their own modules; medusa.proposers
names those a MedusaModel builds by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from medusa.heads import tokens_read
from medusa.ngram import chain_tensor, copy_chain, copy_guesses, put_first
from medusa.runtime import (
    Int8Weight,
    StepGraph,
    can_int8,
    can_prepack,
    compiled_module,
    pack,
    packed_linear,
    upload_ids,
)
from medusa.tree import Candidates, TreeBuffers, TreeSpec, build_buffers

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    max_nodes: int  # the most nodes (root included) a proposal holds: sizes a static KV cache

    def propose(self, state) -> Candidates:
        """Guess tokens after `state.root_token`, arranged as a tree rooted at it."""

    def observe(self, state, accepted_tokens: list[int]) -> None:
        """Learn what the target committed this step (e.g. to roll back a draft model's cache)."""


@dataclass(frozen=True)
class CandidateProjection:
    """The heads' vocabulary projection as used for proposing: built once per model, maybe cheaper than the base's.

    Candidates only need a ranking, not exact logits, so the projection may use a lower precision and a subset of
    frequent tokens; the target still verifies every candidate, so outputs do not change.
    """

    weight: torch.Tensor  # (V', H) shared or (K, V', H) own
    token_ids: torch.Tensor | None  # (V',) candidate index -> token id; None: the full vocabulary
    packed: torch.Tensor | None = None  # a shared weight pre-packed for oneDNN (CPU; medusa.runtime.pack), else None
    int8: Int8Weight | None = None  # a shared weight in int8, else None

    @classmethod
    def build(
        cls, heads, lm_head, dtype: torch.dtype, int8: bool = False, most_frequent: int | None = None
    ) -> CandidateProjection:
        """`int8`: rank on int8 weights (medusa.runtime.Int8Weight) where the CPU kernel takes the shape.
        `most_frequent`: rank only that many of the heads' vocabulary subset, its first (training orders it most
        frequent first: medusa.train.data.frequent_tokens); heads without a subset rank the whole vocabulary."""
        weight = heads.candidate_weight(lm_head).detach()
        subset = getattr(heads, "vocab_subset", None)
        if most_frequent is not None and subset is not None:
            weight, subset = weight[..., :most_frequent, :], subset[:most_frequent]
        weight = weight.to(dtype).contiguous()
        if int8 and weight.dim() == 2 and can_int8(weight.device, weight.shape[1]):
            return cls(weight, subset, int8=Int8Weight.of(weight))
        packed = pack(weight) if weight.dim() == 2 and can_prepack(weight.device, dtype) else None
        return cls(weight, subset, packed)

    def logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """(K, H) -> (K, V') logits over the candidate vocabulary."""
        if self.weight.dim() == 2:
            return self.head_logits(0, head_hidden)
        return torch.einsum("kh,kvh->kv", head_hidden.to(self.weight.dtype), self.weight[: head_hidden.shape[0]])

    def head_logits(self, head: int, head_hidden: torch.Tensor) -> torch.Tensor:
        """(P, H) rows of one head -> (P, V') logits over the candidate vocabulary."""
        if self.int8 is not None:
            return self.int8.linear(head_hidden)
        weight = self.weight if self.weight.dim() == 2 else self.weight[head]
        if self.packed is not None:
            return packed_linear(head_hidden.to(weight.dtype), self.packed, weight.shape[0])
        return head_hidden.to(weight.dtype) @ weight.T

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor it ranks with, by name (a packed copy aside: it is the weight's)."""
        int8 = {"int8": self.int8.quantized, "int8_scales": self.int8.scales} if self.int8 is not None else {}
        ids = {"token_ids": self.token_ids} if self.token_ids is not None else {}
        return {"weight": self.weight, **ids, **int8}

    def token(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.token_ids is None else self.token_ids[index]


@dataclass(frozen=True)
class TreeLevel:
    """The nodes of one depth of a static tree, for heads whose guesses depend on the path (condition_on_path)."""

    nodes: torch.Tensor  # (n,) node indices at this depth
    ranks: torch.Tensor  # (n,) which rank of its parent's guesses each node holds
    parent_rows: torch.Tensor  # (n,) row of the node's parent in `parent_paths`
    parent_paths: torch.Tensor  # (P, depth - 1) node indices of each distinct parent's path after the root
    width: int  # ranks needed: max(ranks) + 1


def tree_levels(tree: TreeBuffers) -> list[TreeLevel]:
    """Per depth: the nodes, their ranks and their parents' paths (static trees: `candidate_index` gives ranks)."""
    parent, depth, index = (t.tolist() for t in (tree.parent.cpu(), tree.depth.cpu(), tree.candidate_index.cpu()))
    head_start = [1 + sum(tree.topk_per_head[:k]) for k in range(len(tree.topk_per_head))]
    levels = []
    for d in range(1, max(depth, default=0) + 1):
        nodes = [i for i in range(tree.num_nodes) if depth[i] == d]
        parents = list(dict.fromkeys(parent[i] for i in nodes))  # distinct, in node order
        paths = []
        for p in parents:
            path = []
            while p != 0:
                path.append(p)
                p = parent[p]
            paths.append(path[::-1])
        ranks = [index[i] - head_start[d - 1] for i in nodes]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=tree.parent.device)  # noqa: E731
        levels.append(
            TreeLevel(
                as_tensor(nodes),
                as_tensor(ranks),
                as_tensor([parents.index(parent[i]) for i in nodes]),
                as_tensor(paths).reshape(len(parents), d - 1),
                max(ranks) + 1,
            )
        )
    return levels


class ContextRead(nn.Module):
    """The heads' context layer over B rows' new positions, from their states (keys, values, seen: ContextLayer's
    `past`, seen (B,)): new_hidden (B, T, F) and the embeddings of the tokens after them (B, T, H), row b's last
    counts[b] (B,) of them its own (right-aligned) -> its output at each row's last position (B, H), and their next
    states. What each step's proposal reads first (`MedusaProposer.read_rows`)."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, new_hidden, following_embeddings, keys, values, seen, counts) -> tuple[torch.Tensor, ...]:
        past = (keys, values, seen)
        features, past = self.heads.contextualise(new_hidden, following_embeddings, past, counts)
        return features[:, -1], *past


class PathLogits(nn.Module):
    """Head `head` after each of P paths: what the heads read at each path's row (P, H) and the embeddings of the
    tokens the head reads after it (P, tokens_read, H: the root, then the path; none for plain heads) -> (P, V')
    logits over the candidate vocabulary (`MedusaProposer.path_logits`)."""

    def __init__(self, heads, projection: CandidateProjection, head: int):
        super().__init__()
        self.heads, self.projection, self.head = heads, projection, head
        # the projection's tensors as buffers too, so that a compiled package's key (every weight) covers them
        for name, tensor in projection.tensors().items():
            self.register_buffer(f"projection_{name}", tensor, persistent=False)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        rows = self.heads.run_head_on_embeddings(self.head, hidden, embedded)
        return self.projection.head_logits(self.head, rows)


@dataclass(frozen=True)
class ProposalModules:
    """What a MedusaProposer computes its guesses with, eagerly (`eager_modules`) or compiled ahead of time on a CPU
    (`compile_proposal`): the same arithmetic either way."""

    context_read: object  # ContextRead's call, None for heads without a context layer
    path_logits: list  # PathLogits' call per head


def eager_modules(heads, projection: CandidateProjection) -> ProposalModules:
    read = ContextRead(heads) if heads.context is not None else None
    return ProposalModules(read, [PathLogits(heads, projection, k) for k in range(heads.config.num_heads)])


class Compiled:
    """A module's forward as an AOTInductor package (runtime.compiled_module) for 1 .. `most` rows of its first
    input, the module itself beyond: the eager heads are a few hundred small operations a step whose calls cost more
    than their arithmetic on a CPU (docs/engines.md)."""

    def __init__(self, runner, module: nn.Module, most: int):
        self.runner, self.module, self.most = runner, module, most

    def __call__(self, *inputs: torch.Tensor):
        if inputs[0].shape[0] > self.most:
            return self.module(*inputs)
        # the package was compiled for contiguous inputs; a state it returned may be a view of a wider tensor
        outputs = self.runner(*(x.contiguous() for x in inputs))  # as the module returns them
        return tuple(outputs) if isinstance(outputs, list) else outputs


MAX_PATHS = 256  # the most paths of one depth a compiled head takes at once (a batch's rows' nodes at that depth)
MAX_READ_ROWS = 64  # the most rows (sequences of a batch) a compiled context read takes at once


def compile_proposal(heads, projection: CandidateProjection, progress: bool = True) -> ProposalModules | None:
    """`eager_modules` compiled ahead of time on a CPU (once on this machine, seconds each; loaded from the cache
    after): the context read, and path heads (plain heads' logits come from `head_logits`); None where compiling
    fails (a warning says why; the proposal then runs eagerly: a step must not fail for want of it)."""
    eager = eager_modules(heads, projection)
    dtype = next(heads.parameters()).dtype
    size = heads.config.hidden_size
    dim = lambda most: torch.export.Dim("rows", min=1, max=most)  # noqa: E731
    rows, positions = 2, 3  # neither 0 nor 1, which export would specialise on
    try:
        read = None
        if eager.context_read is not None:
            context = heads.context
            keys, values, _ = context.empty_past("cpu", dtype, batch=rows)
            new_hidden = torch.zeros(rows, positions, size * (1 + context.feature_layers), dtype=dtype)
            seen, counts = torch.tensor([7, 9]), torch.tensor([positions, 1])
            example = (new_hidden, torch.zeros(rows, positions, size, dtype=dtype), keys, values, seen, counts)
            batch = dim(MAX_READ_ROWS)
            read_rows = {0: batch, 1: torch.export.Dim("positions", min=1, max=context.window)}
            shapes = (read_rows, read_rows, {0: batch}, {0: batch}, {0: batch}, {0: batch})
            runner = compiled_module(
                eager.context_read, example, shapes, "context-read", "the heads' context read", progress
            )
            read = Compiled(runner, eager.context_read, MAX_READ_ROWS)
        paths = list(eager.path_logits)
        for k, module in enumerate(eager.path_logits if heads.config.condition_on_path else []):
            example = (
                torch.zeros(rows, size, dtype=dtype),
                torch.zeros(rows, tokens_read(heads.config, k), size, dtype=dtype),
            )
            path_rows = dim(MAX_PATHS)
            shapes = ({0: path_rows}, {0: path_rows})
            runner = compiled_module(module, example, shapes, f"head-{k}", f"head {k}", progress)
            paths[k] = Compiled(runner, module, MAX_PATHS)
    except Exception as err:  # noqa: BLE001 - any failure leaves the eager modules, which compute the same
        logger.warning("the heads could not be compiled (%s: %s); they run eagerly", type(err).__name__, err)
        return None
    return ProposalModules(read, paths)


class MedusaProposer:
    """Top-s tokens of each head, read from the last committed hidden state, placed by a static tree.

    Path heads (`condition_on_path`) guess each node's children from that node's own path, one depth at a time.
    Heads with `copy_ngram` rank their copy guess (medusa.ngram) first.
    """

    def __init__(
        self,
        heads,
        projection: CandidateProjection,
        tree: TreeBuffers,
        embed_tokens=None,
        graphs: dict | None = None,
        modules: ProposalModules | None = None,
    ):
        """`modules`: what computes the guesses (`compile_proposal`'s), else `eager_modules`."""
        if len(tree.topk_per_head) > heads.config.num_heads:
            raise ValueError(f"tree needs {len(tree.topk_per_head)} heads, the model has {heads.config.num_heads}")
        if heads.config.condition_on_next_token and embed_tokens is None:
            raise ValueError(
                "these heads read the next token's embedding: pass embed_tokens (the base's input embeddings)"
            )
        width = max(tree.topk_per_head, default=0)
        if width > projection.weight.shape[-2]:
            raise ValueError(
                f"the tree asks for rank {width - 1} of a head, but the heads rank only "
                f"{projection.weight.shape[-2]} candidate tokens: use ranks below that"
            )
        self.heads, self.projection, self.tree, self.embed_tokens = heads, projection, tree, embed_tokens
        self.max_nodes = tree.num_nodes
        self.used_heads = max((k + 1 for k, s in enumerate(tree.topk_per_head) if s), default=0)
        self.by_path = heads.config.condition_on_path  # children depend on their parent's path
        self.levels = tree_levels(tree) if self.by_path else []
        self.modules = modules or eager_modules(heads, projection)
        self._context = None  # the context layer's state after the positions read so far (see `read`)
        self._seen = 0  # how many positions that is
        self._context_read = None  # its output at the last of them
        self._unread: list[torch.Tensor] = []  # hidden states of positions committed by steps without guesses
        self._no_copies = torch.full((heads.config.num_heads,), -1, dtype=torch.long, device=tree.parent.device)
        # the step's CUDA graphs, shared through `graphs` with later proposers of the same heads and tree: a graph
        # replays this proposer's own computation (its tree tensors, kept alive by the graph's bound method)
        graphs = {} if graphs is None else graphs
        tree_key = (
            str(tree.parent.device),
            tree.topk_per_head,
            *(tuple(t.tolist()) for t in (tree.parent, tree.depth, tree.candidate_index)),
        )
        parts = (id(heads), id(embed_tokens))
        self._guess = graphs.setdefault(
            ("guess", *parts, id(projection), tree_key), StepGraph(self.guess, "the heads' proposal")
        )
        self._read_graph = graphs.setdefault(("read", *parts), StepGraph(self.read_rows, "the context layer's read"))

    def read(self, state) -> torch.Tensor:
        """(H,): what the heads read this step: the last hidden state, or for heads with a context layer its output
        there, after feeding it the positions committed since the previous step (`state.new_hidden`, each with
        the token after it). Call once per step, before proposing."""
        return self.read_batch([self], [state])[0]

    def read_batch(self, proposers: list[MedusaProposer], states) -> list[torch.Tensor]:
        """`read` for each of `proposers` (a batch's rows: proposers of these heads, each with its own context state)
        at its state in `states`, their context layer's reads in one call of it."""
        if self.heads.context is None:
            return [state.last_hidden for state in states]
        reads = [None] * len(states)
        rows = []  # (index, new positions' hidden states, the tokens after them, the state before them)
        for i, (proposer, state) in enumerate(zip(proposers, states)):
            if state.new_hidden is None:
                raise ValueError(
                    "these heads have a context layer: the decode state must carry new_hidden, the hidden "
                    "states of the positions each step commits"
                )
            if proposer._seen == state.length:  # already read this step
                reads[i] = proposer._context_read
                continue
            new_hidden = torch.cat([*proposer._unread, state.new_hidden]) if proposer._unread else state.new_hidden
            count = new_hidden.shape[0]
            if proposer._seen + count != state.length:
                raise RuntimeError(
                    f"the context layer has read {proposer._seen} positions, the cache holds {state.length} and the "
                    f"steps since added {count}: call read (or skip) once per step"
                )
            keys, values, seen = proposer._context or self.heads.context.empty_past(new_hidden.device, new_hidden.dtype)
            # Only the last row's output and the last window - 1 rows' keys and values are kept, and a row's keys
            # and values depend on that row alone: rows before the last `window` reach neither (a prompt is read in
            # 64 rows)
            reach = min(count, self.heads.context.window)
            rows.append((i, new_hidden[count - reach :], state.tokens[-reach:], (keys, values, seen + count - reach)))
        if not rows:
            return reads
        # the rows' new positions right-aligned in one (B, T, F) block; the padding in front is read by none of them
        width, first = max(len(row[1]) for row in rows), rows[0][1]
        new_hidden = first.new_zeros(len(rows), width, first.shape[-1])
        following = [0] * (len(rows) * width)
        for b, (_, hidden, tokens, _) in enumerate(rows):
            new_hidden[b, width - len(hidden) :] = hidden
            following[(b + 1) * width - len(tokens) : (b + 1) * width] = tokens
        following = upload_ids(following, first.device).view(len(rows), width)
        counts = upload_ids([len(row[1]) for row in rows], first.device)
        keys, values, seen = (torch.cat(parts) if len(rows) > 1 else parts[0] for parts in zip(*(r[3] for r in rows)))
        # a step's few positions: a CUDA graph per shape on a GPU; a prompt's (or skipped steps') as they are
        fresh = any(proposers[row[0]]._context is None for row in rows)
        read = self.read_rows if fresh or width > self.tree.max_depth + 1 else self._read_graph
        features, keys, values, seen = read(new_hidden, following, keys, values, seen, counts)
        for b, (i, *_) in enumerate(rows):
            proposer = proposers[i]
            proposer._context = (keys[b : b + 1], values[b : b + 1], seen[b : b + 1])
            proposer._context_read = reads[i] = features[b]
            proposer._seen, proposer._unread = states[i].length, []
        return reads

    def read_rows(self, new_hidden, following, keys, values, seen, counts) -> tuple[torch.Tensor, ...]:
        """ContextRead over B rows' `new_hidden` (B, T, F) and the tokens after them (B, T), right-aligned, row b's
        last counts[b] its own. Pure tensor code with fixed shapes for (B, T) (a CUDA graph on a GPU:
        `_read_graph`)."""
        return self.modules.context_read(new_hidden, self.embed_tokens(following), keys, values, seen, counts)

    def skip(self, state) -> None:
        """A step without guesses (medusa.guard): the positions it committed are kept for the context layer to read
        with the next guessing step's, in one call (a read costs about the same for 1 row as for 16: 4.0 and 9.4 ms
        on the AVX2 CPU), so that plain steps inside a guarded call cost what plain decoding costs."""
        if self.heads.context is not None and state.new_hidden is not None:
            self._unread.append(state.new_hidden)

    def step_copies(self, state) -> list[int]:
        """This step's copy guesses, one per head (fewer, or none, where the context holds no match); [] when the
        heads do not copy."""
        if not self.heads.config.copy_ngram:
            return []
        return copy_chain(torch.tensor(state.tokens), self.heads.config.copy_ngram, self.heads.config.num_heads)

    def path_logits(self, hidden: torch.Tensor, roots: torch.Tensor, head: int, paths: torch.Tensor) -> torch.Tensor:
        """Head `head`'s logits after each of P paths: what the heads read at each path's row (P, H), its root (P,),
        the path (P, head) token ids after the root -> (P, V'). Rows that read no path give equal rows."""
        count = tokens_read(self.heads.config, head)  # any: embed_tokens is there (checked on building)
        following = torch.cat([roots.view(-1, 1), paths], dim=1)  # (P, head + 1)
        embedded = (
            self.embed_tokens(following[:, :count]) if count else hidden.new_empty(paths.shape[0], 0, hidden.shape[-1])
        )
        return self.modules.path_logits[head](hidden, embedded)

    def head_logits(self, hidden: torch.Tensor, next_token: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden (H,), next_token () its following token (the root) -> (K_used, V') over the candidate vocabulary
        (map with `.projection.token`): the first `num_heads` heads (default: those the tree uses)."""
        embedding = self.embed_tokens(next_token) if self.heads.config.condition_on_next_token else None
        count = self.used_heads if num_heads is None else num_heads
        return self.projection.logits(torch.stack([self.heads.run_head(k, hidden, embedding) for k in range(count)]))

    @torch.inference_mode()
    def propose(self, state) -> Candidates:
        copies = self.step_copies(state)
        if self.heads.config.copy_ngram:
            copies = upload_ids(chain_tensor(copies, self.heads.config.num_heads), state.root_token.device)
        else:
            copies = self._no_copies
        hidden = self.read(state) if self.used_heads or self.by_path else state.last_hidden
        return Candidates(tokens=self._guess(hidden, state.root_token, copies), tree=self.tree)

    def guess(self, hidden: torch.Tensor, root: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
        """What the heads read (H,), the root token () and the copy guesses (K,) (-1 where none; `chain_tensor`) ->
        the tree's tokens (N,). Pure tensor code with the tree's fixed shapes: a CUDA graph on a GPU (`_guess`)."""
        if self.by_path:
            tokens = root.view(1).repeat(self.tree.num_nodes)  # (N,) filled depth by depth
            for head, level in enumerate(self.levels):
                paths = tokens[level.parent_paths]  # (P, head)
                count = paths.shape[0]
                logits = self.path_logits(hidden.expand(count, -1), root.view(1).expand(count), head, paths)
                top = self.projection.token(torch.topk(logits, level.width, dim=-1).indices)  # (P, width)
                if self.heads.config.copy_ngram:
                    top = put_first(top, copy_guesses(copies, head, paths))
                tokens[level.nodes] = top[level.parent_rows, level.ranks]
            return tokens
        tree, parts = self.tree, [root.view(1)]
        if self.used_heads:
            logits = self.head_logits(hidden, root)
            width = max(tree.topk_per_head)
            top = self.projection.token(torch.topk(logits, width, dim=-1).indices)  # (K_used, width) token ids
            if self.heads.config.copy_ngram:
                guesses = torch.cat([copy_guesses(copies, k, None) for k in range(self.used_heads)])  # (K_used,)
                top = put_first(top, guesses)
            parts += [top[k, :s] for k, s in enumerate(tree.topk_per_head[: self.used_heads]) if s]
        return torch.cat(parts)[tree.candidate_index]

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass


class PlainProposer:
    """No guesses: the root alone, so each step commits one token. Plain decoding on the same engine and loop, the
    baseline a speculative method has to beat there."""

    max_nodes = 1

    def __init__(self, device: torch.device):
        self.tree = build_buffers(TreeSpec([]), 1).to(device)

    def propose(self, state) -> Candidates:
        return Candidates(tokens=state.root_token.view(1), tree=self.tree)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass


def build_medusa_proposer(model, tree: TreeBuffers) -> MedusaProposer:
    embed = model.base.get_input_embeddings() if model.heads.config.condition_on_next_token else None
    heads = getattr(model, "proposal_heads", model.heads)
    return MedusaProposer(
        heads,
        model.candidate_projection,
        tree,
        embed,
        getattr(model, "step_graphs", None),
        getattr(model, "compiled_proposal", None) or None,
    )
