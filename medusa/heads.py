"""Medusa heads: hidden [..., H] -> per-head hidden [K, ..., H] -> logits [K, ..., V]. No base model inside."""

from __future__ import annotations

import torch
from torch import nn

from medusa.config import MedusaConfig


def head_target_offset(head: int) -> int:
    """How far ahead head `head` (0-based) predicts from the position whose hidden state it reads.

    The base lm_head at position t predicts token t+1; head 0 predicts t+2, head k predicts t+k+2.
    """
    return head + 2


def storage_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors for a safetensors file: floating ones cast to `dtype` when given, integer ones (the
    candidate token ids) never, since a half-precision float cannot hold every id of a large vocabulary."""
    return {
        k: v.detach().to(device="cpu", dtype=dtype if dtype and v.is_floating_point() else v.dtype).contiguous()
        for k, v in state.items()
    }


def following_tokens(input_ids: torch.Tensor, count: int) -> torch.Tensor:
    """input_ids (..., T) -> (..., T, count): the tokens at t+1 .. t+count for each position t (0 past the end).

    What a head reading position t is conditioned on: the root (t+1), then for path heads the tokens after it.
    """
    length = input_ids.shape[-1]
    out = input_ids.new_zeros((*input_ids.shape, count))
    for j in range(count):
        if j + 1 < length:
            out[..., : length - j - 1, j] = input_ids[..., j + 1 :]
    return out


def tokens_read(config: MedusaConfig, head: int) -> int:
    """How many tokens after its position head `head` reads: 0 (plain), 1 (the root), or head + 1 (its path)."""
    if config.condition_on_path:
        return head + 1
    return 1 if config.condition_on_next_token else 0


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised so a fresh block is exactly the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class ContextLayer(nn.Module):
    """Causal self-attention over the last `window` positions, then an MLP, on the base's last hidden states.

    Medusa heads read one position's hidden state; this layer lets them read the recent context too (Hydra++'s prefix
    attention, EAGLE's input): position j's input is its hidden state plus a map of the embedding of the token after
    it, so the layer sees the (hidden state, next token) pairs of everything committed so far. Both residual branches
    end in zero-initialised maps: a fresh layer is the identity, and fresh heads on it equal heads without it.
    Attention is local (a window) so training on cached spans and decoding see the same thing, and its cache stays
    small. Positions are rotary-encoded (only distances matter). With `feature_layers` > 0 the input also holds that
    many earlier layers' features after the last hidden state (see `base_features`), each RMS-normalised and then
    mapped to the input through one more zero-initialised map.
    """

    HEAD_DIM = 64

    def __init__(self, hidden_size: int, window: int, feature_layers: int = 0):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"a context layer needs an even hidden size (rotary positions), got {hidden_size}")
        self.window = window
        self.num_attention_heads = hidden_size // self.HEAD_DIM if hidden_size % self.HEAD_DIM == 0 else 1
        self.head_dim = hidden_size // self.num_attention_heads
        self.next_token_map = nn.Linear(hidden_size, hidden_size, bias=False)
        self.feature_layers = feature_layers
        if feature_layers:  # per-layer scales: residual streams of different depths differ in size
            self.feature_norm_weight = nn.Parameter(torch.ones(feature_layers, hidden_size))
            self.feature_map = nn.Linear(feature_layers * hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.feature_map.weight)
        self.attention_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.attention_out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.mlp_in = nn.Linear(hidden_size, 4 * hidden_size)
        self.mlp_out = nn.Linear(4 * hidden_size, hidden_size)
        for linear in (self.next_token_map, self.attention_out, self.mlp_out):
            nn.init.zeros_(linear.weight)
        nn.init.zeros_(self.mlp_out.bias)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def empty_past(self, device, dtype, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state of `batch` rows before any position: `forward`'s past, all padding, with a count per row (0)."""
        keys = torch.zeros(batch, self.num_attention_heads, self.window - 1, self.head_dim, device=device, dtype=dtype)
        return keys, torch.zeros_like(keys), torch.zeros(batch, dtype=torch.long, device=device)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, D), positions (B or 1, T) -> x with rotary position encoding."""
        angles = positions.to(torch.float32)[:, None, :, None] * self.inv_freq  # (B or 1, 1, T, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x[..., 0::2], x[..., 1::2]
        return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embedding: torch.Tensor,
        past: tuple | None = None,
        counts: torch.Tensor | None = None,
    ):
        """hidden (B, T, H * (1 + feature_layers)), next_embedding (B, T, H): positions that follow the `past` ones
        -> (features (B, T, H), past).

        past: what the previous call returned, None at the start: (keys, values (B, heads, window - 1, D) of the last
        window - 1 positions, zero-padded in front while fewer were seen, and the number of positions seen so far,
        an int, a 0-dim tensor or one per row (B,)).
        counts (B,): row b's positions are its last counts[b] (rows of a batch read different numbers of positions:
        each right-aligned, the padding before read by no position and kept by no state; its features are
        meaningless); None: all T. Needs `past`.
        """
        size = next_embedding.shape[-1]
        if hidden.shape[-1] != size * (1 + self.feature_layers):
            raise ValueError(
                f"the context layer reads the last hidden state and {self.feature_layers} feature layers "
                f"({size * (1 + self.feature_layers)} values per position), got {hidden.shape[-1]}: "
                "take the base's hidden states with medusa.runtime.base_features(..., feature_layers)"
            )
        hidden, extra = hidden[..., :size], hidden[..., size:]
        batch, length, _ = hidden.shape
        keys, values, seen = past if past is not None else (None, None, 0)
        x = hidden + self.next_token_map(next_embedding.to(hidden.dtype))
        if self.feature_layers:
            extra = nn.functional.rms_norm(extra.unflatten(-1, (self.feature_layers, size)), (size,), eps=1e-6)
            x = x + self.feature_map((extra * self.feature_norm_weight).flatten(-2))
        q, k, v = (
            self.qkv(self.attention_norm(x))
            .view(batch, length, 3, self.num_attention_heads, self.head_dim)
            .permute(2, 0, 3, 1, 4)
        )  # each (B, heads, T, D)
        # each row's positions (B or 1, T); `seen` may be a tensor (no host sync), one per row
        per_row = torch.as_tensor(seen, device=hidden.device).reshape(-1, 1)
        steps = torch.arange(length, device=hidden.device)
        padding = 0 if counts is None else (length - counts)[:, None]  # right-aligned rows' padding slots
        positions = per_row - padding + steps  # a padding slot repeats a kept position: it is never seen
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        key_positions, key_real = positions, (steps >= padding).expand(positions.shape[0], -1)
        if keys is not None:
            k, v = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
            kept = per_row - keys.shape[2] + torch.arange(keys.shape[2], device=hidden.device)
            key_positions = torch.cat([kept.expand(positions.shape[0], -1), positions], dim=1)
            key_real = torch.cat([key_real.new_ones(key_real.shape[0], keys.shape[2]), key_real], dim=1)
        elif counts is not None:
            raise ValueError("rows of different counts are read after a state (past): start from empty_past")
        distance = positions[:, :, None] - key_positions[:, None, :]  # (B or 1, T, P + T)
        # the state's padding sits before position 0; a padding slot sees only itself (no query sees nothing)
        visible = (distance >= 0) & (distance < self.window) & (key_positions >= 0)[:, None] & key_real[:, None]
        if counts is not None:
            visible = visible | ((distance == 0) & ~key_real[:, None])
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None])
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, size))
        x = x + self.mlp_out(nn.functional.silu(self.mlp_in(self.mlp_norm(x))))
        # a later position sees at most window - 1 earlier ones: keep that many, zero-padded in front while fewer
        # have been seen (their positions are negative: never visible), so every step's state has one shape
        keep = self.window - 1
        if k.shape[2] < keep:
            k, v = (nn.functional.pad(t, (0, 0, keep - t.shape[2], 0)) for t in (k, v))
        if counts is None:
            return x, (k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :], seen + length)
        # row b keeps its last `keep` real slots: the state's from counts[b] on, then its own after its padding
        slot = torch.arange(keep, device=hidden.device) + counts[:, None]  # (B, keep)
        slot = torch.where(slot < keep, slot, slot + length - counts[:, None])
        index = slot[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        return x, (k.gather(2, index), v.gather(2, index), seen + counts)


class MedusaHeads(nn.Module):
    """K heads of L residual blocks each, and either K own projections or the base model's shared lm_head.

    With `config.condition_on_next_token` each head also reads the base's input embedding of the token that follows
    the hidden state's position (at decode time the tree root: the target's own next token, known before the heads
    run), through a zero-initialised linear map added to the hidden state. Fresh conditioned heads therefore equal
    plain ones, and training learns how much the next token tells about the ones after it (the Hydra / EAGLE input).
    With `config.condition_on_path` head k also reads the embeddings of the k tokens between the root and the token
    it guesses (its path in the tree), each through its own zero-initialised map: Hydra's sequential heads.
    """

    def __init__(self, config: MedusaConfig, base_lm_head: nn.Linear | None = None):
        super().__init__()
        if config.hidden_size is None or config.vocab_size is None:
            raise ValueError(
                "MedusaConfig.hidden_size and vocab_size are unset: fill them in from the base "
                "(its hidden size and lm_head rows) before building heads"
            )
        self.config = config
        # Distinct ResBlock instances per head and layer (repeating one instance would tie their weights).
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        if config.condition_on_next_token:
            self.next_token_maps = nn.ModuleList(
                nn.Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(config.num_heads)
            )
            for linear in self.next_token_maps:
                nn.init.zeros_(linear.weight)
        else:
            self.next_token_maps = None
        if config.condition_on_path:  # path_token_maps[k][j]: head k's map of the path token j + 1 after the root
            self.path_token_maps = nn.ModuleList(
                nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(k))
                for k in range(config.num_heads)
            )
            for maps in self.path_token_maps:
                for linear in maps:
                    nn.init.zeros_(linear.weight)
        else:
            self.path_token_maps = None
        self.context = (
            ContextLayer(config.hidden_size, config.context_window, len(config.feature_layers))
            if config.context_window
            else None
        )
        if config.projection == "own":
            self.projections = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if base_lm_head is not None:
                for proj in self.projections:
                    proj.weight.data.copy_(base_lm_head.weight.data)
        else:
            self.projections = None
        if config.vocab_subset_size:
            # (V',) token ids candidates may come from; set from training-data frequencies (see set_vocab_subset)
            self.register_buffer("vocab_subset", torch.arange(config.vocab_subset_size))

    def set_vocab_subset(self, token_ids: torch.Tensor) -> None:
        """Restrict candidates to `token_ids` (V',), e.g. the most frequent response tokens of the training data."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() == 0 or token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise ValueError(f"vocab subset ids must lie in [0, {self.config.vocab_size}) and not be empty")
        self.config.vocab_subset_size = token_ids.numel()
        self.register_buffer("vocab_subset", token_ids.to(next(iter(self.blocks.parameters()), token_ids).device))

    def candidate_weight(self, lm_head: nn.Module) -> torch.Tensor:
        """(V', H) shared or (K, V', H) own projection rows of the candidate vocabulary."""
        subset = getattr(self, "vocab_subset", None)
        weight = lm_head.weight if self.projections is None else torch.stack([p.weight for p in self.projections])
        return weight if subset is None else weight[..., subset, :]

    def contextualise(
        self,
        hidden: torch.Tensor,
        next_embedding: torch.Tensor | None,
        past: tuple | None = None,
        counts: torch.Tensor | None = None,
    ):
        """(B, T, H) hidden states of consecutive positions (and the embeddings of the tokens after them) -> what the
        heads read there, and the context layer's state for the positions that follow (see ContextLayer, also for
        `counts`). Heads without a context layer read the hidden states themselves."""
        if self.context is None:
            return hidden, None
        if next_embedding is None:
            raise ValueError(
                "these heads have a context layer: pass next_embedding, the base's input embeddings of "
                "the token after each position"
            )
        return self.context(hidden, next_embedding, past, counts)

    def run_head(
        self,
        head: int,
        hidden: torch.Tensor,
        next_embedding: torch.Tensor | None = None,
        path_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (..., H) -> (..., H): head `head`'s transformed hidden state before projection.

        next_embedding (..., H): the base's input embedding of the token after each position; required when the
        heads are conditioned on it (`config.condition_on_next_token`), ignored otherwise.
        path_embeddings (..., head, H) or more tokens: embeddings of the tokens after that one (the path from the
        root); head k reads the first k. Required for k >= 1 when `config.condition_on_path`, ignored otherwise.
        """
        if self.next_token_maps is not None:
            if next_embedding is None:
                raise ValueError(
                    "these heads read the next token (condition_on_next_token): pass next_embedding, the "
                    "base's input embedding of the token after each position"
                )
            hidden = hidden + self.next_token_maps[head](next_embedding.to(hidden.dtype))
        if self.path_token_maps is not None and head > 0:
            if path_embeddings is None or path_embeddings.shape[-2] < head:
                raise ValueError(
                    f"head {head} reads the {head} path token(s) after the root (condition_on_path): pass "
                    "path_embeddings (..., >= head, H), the embeddings of the tokens after the next one"
                )
            for j, linear in enumerate(self.path_token_maps[head]):
                hidden = hidden + linear(path_embeddings[..., j, :].to(hidden.dtype))
        return self.blocks[head](hidden)

    def run_head_on_tokens(
        self, head: int, hidden: torch.Tensor, following: torch.Tensor | None, embed_tokens: nn.Module | None
    ) -> torch.Tensor:
        """`run_head` given token ids: following (..., >= tokens_read, long) ids after each position (see
        `following_tokens`; None for plain heads), embedded with `embed_tokens` (the base's input embeddings)."""
        count = tokens_read(self.config, head)
        if not count:
            return self.run_head(head, hidden)
        if embed_tokens is None:
            raise ValueError(
                "these heads read the tokens after each position: pass embed_tokens (the base's input embeddings)"
            )
        return self.run_head_on_embeddings(head, hidden, embed_tokens(following[..., :count]))

    def run_head_on_embeddings(self, head: int, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """`run_head` given the embeddings of the tokens it reads after each position: embedded (..., count, H), count
        `tokens_read` (0 for plain heads: the root, then the path)."""
        if not embedded.shape[-2]:
            return self.run_head(head, hidden)
        return self.run_head(head, hidden, embedded[..., 0, :], embedded[..., 1:, :])

    def head_hidden(
        self,
        hidden: torch.Tensor,
        next_embedding: torch.Tensor | None = None,
        path_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (..., H) -> (K, ..., H): every head's `run_head`."""
        return torch.stack([self.run_head(k, hidden, next_embedding, path_embeddings) for k in range(len(self.blocks))])

    def project(self, head_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(K, ..., H) -> (K, ..., V). With a shared lm_head all heads go through one matmul."""
        if self.projections is None:
            return lm_head(head_hidden)
        return torch.stack([proj(h) for proj, h in zip(self.projections, head_hidden)])

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        next_embedding: torch.Tensor | None = None,
        path_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V)."""
        return self.project(self.head_hidden(hidden, next_embedding, path_embeddings), lm_head)
