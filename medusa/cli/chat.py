"""`medusa chat`: a streaming chat in the terminal (or from a pipe: one user turn per line) with the chat template.

After each answer it prints tokens/s and tau (tokens per target forward) to stderr, so stdout holds only the text.

`--steady` streams at a constant pace in fixed-size chunks. Speculative decoding emits a burst of tokens per verify
step, and the burst sizes (accepted lengths) follow how predictable the text is: anyone who sees packet sizes or
timing learns something about what is said (Wei et al. 2024, "Privacy Risks of Speculative Decoding in Large Language
Models"). A steady stream shows only the pace; `--leak-report` prints how much the emission timing still correlates
with the accepted lengths (see `leak_report`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import deque

import torch
from transformers import TextStreamer

from medusa.cli import NO_HEADS_HELP, load_model


class EmissionLog:
    """What an observer of the stream sees: (time, tokens) per emission, and for each token the accepted length of
    the verify step that produced it."""

    def __init__(self):
        self.emissions: list[tuple[float, int]] = []

    def record(self, n: int) -> None:
        self.emissions.append((time.perf_counter(), n))


class BurstStreamer:
    """Passes tokens on as generate produces them: one emission per verify step (its accepted tokens)."""

    def __init__(self, inner, log: EmissionLog):
        self.inner, self.log, self.prompt_seen = inner, log, False

    def put(self, value: torch.Tensor) -> None:
        self.inner.put(value)
        if not self.prompt_seen:  # generate first puts the prompt
            self.prompt_seen = True
            return
        self.log.record(value.numel())

    def end(self) -> None:
        self.inner.end()


class SteadyStreamer:
    """Releases `chunk` tokens every `interval` seconds, whatever generate's bursts were. Tokens wait in a queue; if
    generation falls behind the pace, the next chunk waits for its tokens (a stall an observer can see: choose a pace
    the plan's plain decoding sustains)."""

    def __init__(self, inner, log: EmissionLog, chunk: int, interval: float):
        self.inner, self.log, self.chunk, self.interval = inner, log, chunk, interval
        self.queue: deque[int] = deque()
        self.prompt_seen = self.done = False
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._pace, daemon=True)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            self.inner.put(value)
            self.thread.start()
            return
        with self.ready:
            self.queue.extend(value.flatten().tolist())
            self.ready.notify()

    def end(self) -> None:
        with self.ready:
            self.done = True
            self.ready.notify()
        self.thread.join()
        self.inner.end()

    def _pace(self) -> None:
        due = time.perf_counter() + self.interval
        while True:
            with self.ready:
                self.ready.wait_for(lambda: len(self.queue) >= self.chunk or self.done)
                if not self.queue and self.done:
                    return
                tokens = [self.queue.popleft() for _ in range(min(self.chunk, len(self.queue)))]
            time.sleep(max(0.0, due - time.perf_counter()))
            self.inner.put(torch.tensor(tokens))
            self.log.record(len(tokens))
            due = max(due + self.interval, time.perf_counter())


def leak_report(log: EmissionLog, accepted_lengths: list[int]) -> dict:
    """How much of the accepted lengths an observer of the stream recovers.

    Each token is paired with the accepted length of its verify step and with what the observer saw for it: the
    size of the emission that carried it and the gap before that emission. Pearson correlations near 0 leak little;
    a burst stream's sizes ARE the accepted lengths (correlation 1)."""
    steps = [1] + list(accepted_lengths)  # the prefill chose the first token alone
    per_token_accepted = [n for n in steps for _ in range(n)]
    sizes, gaps, previous = [], [], None
    for when, n in log.emissions:
        gap = 0.0 if previous is None else when - previous
        previous = when
        sizes += [n] * n
        gaps += [gap] * n
    count = min(len(per_token_accepted), len(sizes))

    def corr(a, b):
        a, b = a[:count], b[:count]
        if count < 3 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
            return 0.0
        return statistics.correlation(a, b)

    return {
        "emissions": len(log.emissions),
        "size_corr": corr(sizes, per_token_accepted),
        "gap_corr": corr(gaps, per_token_accepted),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="medusa chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--heads", default=None, help=f"heads directory (default: the shipped SmolLM2 heads); {NO_HEADS_HELP}"
    )
    parser.add_argument("--base", default=None, help="base model (default: the one the heads name)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--steady", action="store_true", help="stream at a constant pace in fixed-size chunks")
    parser.add_argument("--chunk", type=int, default=4, help="tokens per chunk with --steady")
    parser.add_argument(
        "--rate", type=float, default=None, help="tokens/s with --steady (default: the plan's plain decoding rate)"
    )
    parser.add_argument(
        "--leak-report",
        action="store_true",
        help="print how much the stream's timing correlates with the accepted lengths",
    )
    args = parser.parse_args(argv)
    if args.chunk < 1 or (args.rate is not None and args.rate <= 0):
        parser.error("--chunk must be >= 1 and --rate > 0")

    model = load_model(args.heads, base=args.base)
    rate = args.rate or (1000.0 / model.plan.plain_ms if model.plan is not None and model.plan.plain_ms else 20.0)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        log, text = EmissionLog(), TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer = SteadyStreamer(text, log, args.chunk, args.chunk / rate) if args.steady else BurstStreamer(text, log)
        start = time.perf_counter()
        out = model.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            do_sample=args.temperature is not None,
            temperature=args.temperature or 1.0,
            return_dict_in_generate=True,
        )
        seconds = time.perf_counter() - start
        stats = out.stats
        answer = model.tokenizer.decode(out.sequences[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        report = (
            f"[{stats.new_tokens} tokens, {stats.new_tokens / seconds:.1f} tok/s, tau {stats.mean_accepted_tokens:.2f}"
        )
        if args.leak_report:
            leak = leak_report(log, stats.accepted_lengths)
            report += f", size corr {leak['size_corr']:.2f}, gap corr {leak['gap_corr']:.2f}"
        print(report + "]", file=sys.stderr, flush=True)
