"""N-gram matching against the tokens so far: prompt lookup's guess, and the heads' copy guess.

Text repeats itself: names, code, quoted phrases, and a small model's own loops. What followed an earlier occurrence
of the last few tokens is then often what comes next. Prompt lookup proposes those continuations on their own (a tree
over every earlier match, medusa.prompt_lookup); heads with `copy_ngram` rank the latest one first among their own
guesses (see `copy_guesses`, `put_first`).
"""

from __future__ import annotations

import torch


def ngram_matches(tokens: torch.Tensor, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """tokens (T,) long -> where the continuations of the longest suffix seen before start, oldest first.

    Tries n = max_ngram down to min_ngram; for the first n whose last n tokens occurred earlier (with at least one
    token after them), returns the index just after each earlier occurrence; [] if none. A continuation may run into
    the suffix itself (repetitions are exactly what it should catch).
    """
    length = tokens.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # (T - n, n): windows with at least one token after them
        hits = (windows == tokens[length - n :]).all(1).nonzero()
        if hits.numel():
            return (hits[:, 0] + n).tolist()
    return []


def ngram_continuation(
    tokens: torch.Tensor, max_ngram: int, num_tokens: int, min_ngram: int = 1, latest: bool = False
) -> list[int]:
    """tokens (T,) long -> up to `num_tokens` ids: what followed an earlier occurrence of the last n tokens
    (`ngram_matches`), the earliest (transformers' prompt lookup rule) or with `latest` the most recent; [] if none."""
    starts = ngram_matches(tokens, max_ngram, min_ngram)
    if not starts:
        return []
    start = starts[-1 if latest else 0]
    return tokens[start : start + num_tokens].tolist()


# A single repeated token is a weak cue: on MT-bench answers its continuation was right less often than head 1 (0.42
# vs 0.46 top-1), so copies start at 2 tokens.
COPY_MIN_NGRAM = 2


def copy_chain(tokens: torch.Tensor, max_ngram: int, length: int) -> list[int]:
    """The heads' copy guesses for one step: tokens (T,) the prompt and output so far, the root last -> up to `length`
    ids, the copy for head k at index k: the continuation of the most recent earlier occurrence of the last
    max_ngram .. COPY_MIN_NGRAM tokens (recent repeats predict better than early ones)."""
    return ngram_continuation(tokens, max_ngram, length, min_ngram=COPY_MIN_NGRAM, latest=True)


def copy_guesses(chain: list[int] | torch.Tensor, head: int, paths: torch.Tensor | None) -> torch.Tensor:
    """Head `head`'s copy guess after each path: chain from `copy_chain` (or `chain_tensor`'s form of it), paths
    (P, head) tokens after the root (None for heads that do not read a path: one shared row) -> (P,) token ids, -1
    where there is none. Given a tensor chain it is pure tensor code (a CUDA graph can hold it).

    A head that reads its path gets the copy only on the path that follows the chain so far (further on, another
    path's context no longer matches); a head that reads no path guesses the same after every path.
    """
    if not isinstance(chain, torch.Tensor):
        chain = chain_tensor(chain, head + 1, None if paths is None else paths.device)
    rows = 1 if paths is None else paths.shape[0]
    guesses = chain[head].expand(rows)
    if paths is None or head == 0:
        return guesses.clone()
    follows = (paths == chain[:head]).all(1)  # chain[:head] holds no -1 wherever chain[head] does not
    return torch.where(follows, guesses, -1)


def chain_tensor(chain: list[int], length: int, device=None) -> torch.Tensor:
    """A copy chain (list) -> (length,) long tensor, -1 past its end."""
    padded = chain[:length] + [-1] * (length - len(chain[:length]))
    return torch.tensor(padded, dtype=torch.long, device=device)


def put_first(tokens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """tokens (P, W) a head's ranked guesses per row (distinct within a row), first (P,) a token to rank first in each
    row (-1: none) -> (P, W): that token, then the row's own guesses without it, cut to W."""
    rows, width = tokens.shape
    has = first >= 0
    merged = torch.cat([first[:, None], tokens], dim=1)  # (P, W + 1)
    duplicate = tokens == first[:, None]  # (P, W): at most one True per row
    # one column leaves each row: the guess that repeats the first token, else the last guess; column 0 without a copy
    drop = torch.where(duplicate.any(1), duplicate.int().argmax(1) + 1, torch.full_like(first, width))
    drop = torch.where(has, drop, torch.zeros_like(drop))
    column = torch.arange(width, device=tokens.device)[None, :]
    return merged.gather(1, column + (column >= drop[:, None]).long())  # the columns left, in order
