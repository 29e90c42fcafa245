"""Milliseconds to the first new token and to the whole answer (128 tokens, greedy) in a fresh process, for six
Spec-Bench first turns from index START (200: summarisation, 400-1,100 tokens), through generate ("alone") and as
the only row of generate_continuously ("row", what `medusa serve` runs), after one warm-up call on the first of them.
    PYTHONPATH=CHECKOUT python docs/benchmarks/cpu-one-package-session55/first_token.py QUESTIONS START"""

import sys
import time

from medusa import MedusaModel
from medusa.batch import GenerationRequest
from medusa.questions import load_questions

model = MedusaModel.from_pretrained()
start = int(sys.argv[2])
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][start : start + 6]


class FirstToken:
    """A streamer noting when the first new tokens come (its first put is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


def chat(question: str):
    messages = [{"role": "user", "content": question}]
    return model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def alone(ids, streamer):
    model.generate(ids, max_new_tokens=128, streamer=streamer)


def row(ids, streamer):
    given = [GenerationRequest(ids, max_new_tokens=128, streamer=streamer)]
    model.generate_continuously(lambda room: [given.pop()] if given else [])


for way in (alone, row):
    way(chat(questions[0]), FirstToken())
for question in questions:
    ids, said = chat(question), []
    for way in (alone, row):
        streamer, begun = FirstToken(), time.perf_counter()
        way(ids, streamer)
        ended = time.perf_counter()
        said.append(f"{way.__name__} first {1000 * (streamer.at - begun):.0f} ms total {1000 * (ended - begun):.0f} ms")
    print(ids.shape[1], *said, flush=True)
