"""A process as `medusa serve` or a benchmark starts one: load the embedded model, warm its plan's engine for calls
of up to 2,048 rows (batches too), then generate 128 tokens greedily for six short Spec-Bench first turns and four
long ones (summarisation, 400-1,100 tokens); seconds until ready, resident memory, tokens/s. Run once per checkout,
alternated:
    PYTHONPATH=CHECKOUT python docs/benchmarks/cpu-one-package-session55/processes.py QUESTIONS NAME"""

import sys
import time

t0 = time.perf_counter()
from medusa import MedusaModel  # noqa: E402
from medusa.questions import load_questions  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


model = MedusaModel.from_pretrained()
model.engine("inductor").warm_up(max_length=2048, batches=True)
ready = time.perf_counter() - t0
questions = [q["turns"][0] for q in load_questions(sys.argv[1])]


def chat(question: str):
    messages = [{"role": "user", "content": question}]
    return model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


model.generate(chat(questions[0]), max_new_tokens=16)  # warm-up
rates = {}
for name, chosen in (("short", questions[0:6]), ("long", questions[200:204])):
    tokens = seconds = 0
    for question in chosen:
        ids, start = chat(question), time.perf_counter()
        tokens += model.generate(ids, max_new_tokens=128, return_dict_in_generate=True).stats.new_tokens
        seconds += time.perf_counter() - start
    rates[name] = round(tokens / seconds, 1)
print(sys.argv[2], f"ready {ready:.1f} s", f"rss {rss_mb():.0f} MB", rates, "tok/s", flush=True)
