"""Never slower than plain decoding, online: a proposer wrapper that decodes plainly while guessing does not pay.

The plan (medusa.plan) expects a speedup on average text; a given answer may be unpredictable (a list of random
names, a language the heads never saw). Over each window of speculative steps the guard compares their milliseconds
per token with a plain step's: measured in this call once it has decoded plainly, else the plan's calibrated figure,
scaled by how this call's guessing steps compare with the plan's. The call's first step is left out (heads with a
context layer read the whole prompt in it). When guessing lost, the next `backoff` steps decode plainly (the root
alone); then guessing is tried again, the backoff doubling after each losing retry. Only the guesses change, never
the acceptance rule: lossless.
"""

from __future__ import annotations

import statistics
import time

from medusa.propose import Candidates, PlainProposer

WINDOW = 8  # speculative steps per verdict
BACKOFF = 16  # plain steps after a losing window; doubled after each losing retry, reset by a winning window


class GuardedProposer:
    """Wraps a proposer; times each step from propose to observe (propose, verify, accept, commit)."""

    def __init__(
        self,
        inner,
        plain_step_ms: float,
        device,
        window: int = WINDOW,
        backoff: int = BACKOFF,
        expected_step_ms: float | None = None,
    ):
        self.inner, self.plain = inner, PlainProposer(device)
        self.expected_step_ms = expected_step_ms  # the plan's guessing step, timed beside its plain one
        self.max_nodes = inner.max_nodes
        self.window, self.first_backoff, self.backoff = window, backoff, backoff
        self.plain_ms = plain_step_ms  # the yardstick; this call's own plain steps replace it once there are some
        self.plain_left = 0  # plain steps still to take
        self.fallbacks = 0  # windows lost so far in this call
        self._plain_steps: list[float] = []
        self._window = [0.0, 0, 0]  # speculative ms, tokens, steps
        self._start, self._guessing = 0.0, True
        self._first = True  # the call's first step: also the context layer reading the whole prompt, not timed

    def propose(self, state) -> Candidates:
        self._start = time.perf_counter()
        self._guessing = self.plain_left == 0
        if self._guessing:
            return self.inner.propose(state)
        self.plain_left -= 1
        skip = getattr(self.inner, "skip", None)
        if skip is not None:  # e.g. a context layer still reads every committed position
            skip(state)
        return self.plain.propose(state)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        step_ms = 1000 * (time.perf_counter() - self._start)
        if not self._guessing:
            self._plain_steps.append(step_ms)
            self.plain_ms = statistics.median(self._plain_steps[-32:])
            return
        self.inner.observe(state, accepted_tokens)
        if self._first:  # its cost grows with the prompt, not with guessing: it had made the first verdict a loss
            self._first = False
            return
        window = self._window
        window[0] += step_ms
        window[1] += len(accepted_tokens)
        window[2] += 1
        if window[2] < self.window:
            return
        yardstick = self.plain_ms
        if not self._plain_steps and self.expected_step_ms:
            # no plain step of this call timed yet: the plan's, scaled as this call's guessing steps compare with
            # the plan's (a larger cache, a longer context or a busier machine slow both alike)
            yardstick *= window[0] / window[2] / self.expected_step_ms
        if window[0] / window[1] > yardstick:  # more milliseconds per token than plain decoding
            self.plain_left, self.fallbacks = self.backoff, self.fallbacks + 1
            self.backoff *= 2
        else:
            self.backoff = self.first_backoff
        self._window = [0.0, 0, 0]
