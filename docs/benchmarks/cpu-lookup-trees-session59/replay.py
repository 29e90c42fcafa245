"""Replay prompt lookup on a benchmark's greedy outputs, exactly: a greedy answer is the same whatever is guessed, so
the guesses and what the target takes of them follow from the answer alone. Tokens per step of the shipped lookup
(a tree over every earlier match) and its speed over plain decoding under a verify cost curve ({tokens: ms}, from
../cpu-no-heads-session58/curve.py), sized by that curve and, as without a plan, at its full 10 guesses.

    PYTHONPATH=CHECKOUT python replay.py RAW_JSONL CURVE_JSON [BASE]   (BASE: the benchmark's --base, for its tokenizer)

Session 58's chain rules on the same answers and curves: ../cpu-no-heads-session58/replay.txt.
"""

import json
import sys
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from medusa.loading import resolve_base_path
from medusa.prompt_lookup import NUM_TOKENS, PromptLookupProposer
from medusa.questions import encode_conversation, load_questions

raw, curve_path = sys.argv[1], sys.argv[2]
curve = {int(n): ms for n, ms in json.loads(open(curve_path).read()).items()}
tokenizer = AutoTokenizer.from_pretrained(resolve_base_path(sys.argv[3] if len(sys.argv) > 3 else None))
questions = {q["question_id"]: q for q in load_questions("/work/shared/bench_data/spec_bench_question.jsonl")}
answers = []  # (prompt ids, greedy answer ids): first turns
for line in open(raw):
    record = json.loads(line)
    if record["method"] == "baseline":
        prompt = [{"role": "user", "content": questions[record["question_id"]]["turns"][0]}]
        answers.append((encode_conversation(tokenizer, prompt), record["turns"][0]["output_ids"]))


def taken(candidates, answer: list[int]) -> int:
    """How many guesses the target takes: the tree walked along the answer."""
    tokens, parent = candidates.tokens.tolist(), candidates.tree.parent.tolist()
    node, right = 0, 0
    while right < len(answer):
        child = next((i for i in range(1, len(tokens)) if parent[i] == node and tokens[i] == answer[right]), None)
        if child is None:
            break
        node, right = child, right + 1
    return right


def replay(chain_ms) -> tuple[float, float, float]:
    steps = tokens = 0
    ms = 0.0
    for prompt, answer in answers:
        lookup, seq, done = PromptLookupProposer(torch.device("cpu"), chain_ms=chain_ms), prompt + answer[:1], 1
        while done < len(answer):
            state = SimpleNamespace(tokens=seq, root_token=torch.tensor(seq[-1]))
            candidates = lookup.propose(state)
            step = answer[done : done + taken(candidates, answer[done:]) + 1]
            lookup.observe(state, step)
            seq, done = seq + step, done + len(step)
            steps, tokens, ms = steps + 1, tokens + len(step), ms + curve[candidates.tree.num_nodes]
    return tokens / steps, tokens * curve[1] / ms


print(f"{len(answers)} answers, {curve_path}")
for name, chain_ms in (("sized (shipped)", [curve[1 + g] for g in range(NUM_TOKENS + 1)]), ("10 guesses", None)):
    tau, speed = replay(chain_ms)
    print(f"tree, {name}: {tau:.3f} tokens per step, {speed:.3f}x plain decoding")
