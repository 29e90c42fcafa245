"""Replay prompt lookup on a benchmark's greedy outputs, exactly: a greedy answer is the same whatever is guessed, so
the guesses and what the target takes of them follow from the answer alone. Each chain policy's tokens per step and
its speed over plain decoding under a verify cost curve ({tokens: ms}, from curve.py).

    PYTHONPATH=CHECKOUT python replay.py RAW_JSONL CURVE_JSON [BASE]   (BASE: the benchmark's --base, for its tokenizer)

CHECKOUT: session 58's main (09066d8). From session 59 prompt lookup proposes trees, which this chain replay does not
walk: ../cpu-lookup-trees-session59/replay.py replays those.
"""

import json
import sys
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from medusa.loading import resolve_base_path
from medusa.prompt_lookup import NUM_TOKENS, PRIOR_RIGHT, PromptLookupProposer
from medusa.questions import encode_conversation, load_questions

raw, curve_path = sys.argv[1], sys.argv[2]
curve = {int(n): ms for n, ms in json.loads(open(curve_path).read()).items()}
chain_ms = [curve[1 + g] for g in range(NUM_TOKENS + 1)]
tokenizer = AutoTokenizer.from_pretrained(resolve_base_path(sys.argv[3] if len(sys.argv) > 3 else None))
questions = {q["question_id"]: q for q in load_questions("/work/shared/bench_data/spec_bench_question.jsonl")}
answers = []  # (prompt ids, greedy answer ids): first turns
for line in open(raw):
    record = json.loads(line)
    if record["method"] == "baseline":
        prompt = [{"role": "user", "content": questions[record["question_id"]]["turns"][0]}]
        answers.append((encode_conversation(tokenizer, prompt), record["turns"][0]["output_ids"]))


class EvenPrior(PromptLookupProposer):
    """Every depth starts from PRIOR_RIGHT, worth 2 guesses (the rule first tried)."""

    def chain_length(self) -> int:
        best, best_speed, reach, expected = 1, 0.0, 1.0, 1.0
        for length in range(1, self.num_tokens + 1):
            reach *= (self._right[length] + 2 * PRIOR_RIGHT) / (self._tries[length] + 2)
            expected += reach
            if expected / self.chain_ms[length] > best_speed:
                best, best_speed = length, expected / self.chain_ms[length]
        return best


def replay(make) -> tuple[float, float]:
    steps = tokens = 0
    ms = 0.0
    for prompt, answer in answers:
        lookup, seq, done = make(), prompt + answer[:1], 1  # the prefill's token is the first root
        while done < len(answer):
            state = SimpleNamespace(tokens=seq, root_token=torch.tensor(seq[-1]))
            guess = lookup.propose(state).tokens[1:].tolist()
            right = 0
            while right < len(guess) and done + right < len(answer) and guess[right] == answer[done + right]:
                right += 1
            taken = answer[done : done + right + 1]
            lookup.observe(state, taken)
            seq, done = seq + taken, done + len(taken)
            steps, tokens, ms = steps + 1, tokens + len(taken), ms + curve[1 + len(guess)]
    return tokens / steps, tokens * curve[1] / ms


def report(name: str, make) -> None:
    tau, speed = replay(make)
    print(f"{name}: {tau:.3f} tokens per step, {speed:.3f}x plain decoding")


cpu = torch.device("cpu")
print(f"{len(answers)} answers, {curve_path}")
for length in (1, 2, 3, 4, 6, 8, 10):
    report(f"chains of {length:2d}", lambda length=length: PromptLookupProposer(cpu, num_tokens=length))
report("sized, even prior per depth", lambda: EvenPrior(cpu, chain_ms=chain_ms))
report("sized (shipped)", lambda: PromptLookupProposer(cpu, chain_ms=chain_ms))
