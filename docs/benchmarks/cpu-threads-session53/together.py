"""Several threads calling generate on one model at once: the embedded model (fp32, its plan) answers Spec-Bench's first
four questions (48 new tokens, greedy) one after another, then in four threads at once; whether each thread's output
is the one alone. A stack dump and exit after 240 s (before session 53's lock, the threads had not finished then).
    python docs/benchmarks/cpu-threads-session53/together.py QUESTIONS   (from the repository root)"""

import faulthandler
import sys
import threading

from medusa import MedusaModel
from medusa.questions import load_questions

faulthandler.dump_traceback_later(240, exit=True)
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][:4]
model = MedusaModel.from_pretrained(dtype="float32")
prompts = [
    model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    for q in questions
]
alone = [model.generate(p, max_new_tokens=48, do_sample=False)[0].tolist() for p in prompts]
together, errors = [None] * len(prompts), []


def ask(i: int) -> None:
    try:
        together[i] = model.generate(prompts[i], max_new_tokens=48, do_sample=False)[0].tolist()
    except Exception as error:  # noqa: BLE001 - reported below
        errors.append(repr(error)[:300])


callers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
for caller in callers:
    caller.start()
for caller in callers:
    caller.join()
print("identical to alone:", [a == t for a, t in zip(alone, together)], "errors:", errors, flush=True)
