"""Plain decoding where guessing stops paying, online: a proposer wrapper that decodes plainly while it does not.

The plan (medusa.plan) expects a speedup on average text; a given answer may be unpredictable (a list of random
names, a language the heads never saw). Over each window of speculative steps the guard compares their milliseconds
per token with a plain step's, measured in this call: the plan's calibrated figure (scaled by how this call's
guessing steps compare with the plan's) only says whether a window wins or loses by so much that measuring is not
needed. A window loses only past plain decoding by LOSS_MARGIN; one within PROBE_MARGIN of that is judged after
PROBE plain steps timed here: a calibration taken on a busy machine once made a plan's plain step 40% slower than
the same machine's plain decoding later, and a guard trusting it kept a 0.83x tree. The call's first step is left
out (heads with a context layer read the whole prompt in it). When guessing lost, the next `backoff` steps decode
plainly (the root alone); then guessing is tried again, the backoff doubling after each losing retry. Only the
guesses change, never the acceptance rule: lossless.
"""

from __future__ import annotations

import statistics
import time

from medusa.propose import PlainProposer
from medusa.tree import Candidates

WINDOW = 8  # speculative steps per verdict
BACKOFF = 16  # plain steps after a losing window; doubled after each losing retry, reset by a winning window
PROBE = 4  # plain steps timed to judge a window the plan's figure cannot decide
PROBE_MARGIN = 1.25  # a window this much faster (slower) per token than the plan's plain estimate wins (loses) as is
# A window loses when its ms per token exceed plain decoding's by more than this share: one window's tau is noisy,
# and on text where guessing pays a window just past plain is mostly noise (a replay of Spec-Bench's steps through
# this guard: docs/benchmarks/plan-decoded-taus-session40)
LOSS_MARGIN = 0.2


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
        self.plain_ms = plain_step_ms  # the plan's plain step; this call's own plain steps replace it once timed
        self.plain_left = 0  # plain steps still to take
        self.fallbacks = 0  # windows lost so far in this call
        self._plain_steps: list[float] = []
        self._window = [0.0, 0, 0]  # speculative ms, tokens, steps
        self._start, self._guessing = 0.0, True
        self._first = True  # the call's first step: also the context layer reading the whole prompt, not timed
        self._held: float | None = None  # a window's ms per token, waiting for the probe's plain steps

    @property
    def losing_ms(self) -> float:
        """ms per token past which a window loses: plain decoding's (this call's, once timed) and the margin."""
        return self.plain_ms * (1 + LOSS_MARGIN)

    def propose(self, state) -> Candidates:
        self._start = time.perf_counter()
        self._guessing = self.plain_left == 0
        if self._guessing:
            return self.inner.propose(state)
        self.plain_left -= 1
        skip = getattr(self.inner, "skip", None)
        if skip is not None:  # e.g. a context layer keeps the committed positions to read later
            skip(state)
        return self.plain.propose(state)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        step_ms = 1000 * (time.perf_counter() - self._start)
        if not self._guessing:
            self._plain_steps.append(step_ms)
            self.plain_ms = statistics.median(self._plain_steps[-32:])
            if self.plain_left == 0 and self._held is not None:  # the probe is done: judge the window it was for
                self._judge(self._held)
                self._held = None
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
        ms_per_token = window[0] / window[1]
        if self._plain_steps:
            self._judge(ms_per_token)
        else:
            # no plain step of this call timed yet: the plan's, scaled as this call's guessing steps compare with
            # the plan's (a larger cache, a longer context or a busier machine slow both alike)
            estimate = self.losing_ms  # the plan's figure
            if self.expected_step_ms:
                estimate *= window[0] / window[2] / self.expected_step_ms
            if ms_per_token * PROBE_MARGIN <= estimate:
                self.backoff = self.first_backoff
            elif ms_per_token >= estimate * PROBE_MARGIN:
                self._judge(ms_per_token)  # a loss: the plain steps it leads to are timed
            else:  # too close to call on a figure from another moment: time plain steps here first
                self.plain_left, self._held = PROBE, ms_per_token
        self._window = [0.0, 0, 0]

    def _judge(self, ms_per_token: float) -> None:
        """A window's verdict against plain decoding's milliseconds per token (a plain step commits one)."""
        if ms_per_token > self.losing_ms:
            self.plain_left, self.fallbacks = self.backoff, self.fallbacks + 1
            self.backoff *= 2
        else:
            self.backoff = self.first_backoff
