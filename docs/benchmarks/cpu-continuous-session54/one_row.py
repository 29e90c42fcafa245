"""One request at a time, as a single user of `medusa serve` asks: generate (the plan's single-sequence path) against
generate_continuously with that one row (what the server runs since session 54), the first six Spec-Bench questions
twice, the order alternated; tokens/s over all.
    python docs/benchmarks/cpu-continuous-session54/one_row.py QUESTIONS"""

import sys
import time

from medusa import MedusaModel
from medusa.batch import GenerationRequest
from medusa.questions import load_questions

model = MedusaModel.from_pretrained()
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][:6]


def chat(question: str):
    messages = [{"role": "user", "content": question}]
    return model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def alone(ids) -> int:
    return model.generate(ids, max_new_tokens=128, return_dict_in_generate=True).stats.new_tokens


def one_row(ids) -> int:
    given = [GenerationRequest(ids, max_new_tokens=128)]
    request = given[0]
    model.generate_continuously(lambda room: [given.pop()] if given else [])
    return request.result.result().stats.new_tokens


print("plan:", model.plan.engine, model.plan.proposer, len(model.plan.tree or []) + 1, "nodes", flush=True)
for way in (alone, one_row):  # warm-up
    way(chat(questions[0]))
totals = {alone: [0, 0.0], one_row: [0, 0.0]}
for round_ in range(2):
    for question in questions:
        ids = chat(question)
        for way in (alone, one_row) if round_ % 2 == 0 else (one_row, alone):
            start = time.perf_counter()
            totals[way][0] += way(ids)
            totals[way][1] += time.perf_counter() - start
print({way.__name__: round(tokens / seconds, 1) for way, (tokens, seconds) in totals.items()}, "tok/s", flush=True)
