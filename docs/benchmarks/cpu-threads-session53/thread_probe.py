"""Does decoding in another thread than the one that loaded the model cost speed? The embedded model (fp32, its plan)
answers Spec-Bench's first two questions (128 new tokens, greedy), planned and plain.
  threads: on the main thread, then in a worker thread (one, kept alive, as a web app's pool keeps it), then on the
           main thread again, twice over;
  release: on the main thread only, generate releasing its OpenMP pool (as shipped) and keeping it (the release
           replaced by a no-op), alternately, three rounds: what the release costs a thread that decodes alone.
    python docs/benchmarks/cpu-threads-session53/thread_probe.py QUESTIONS threads|release   (from the repo root)"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import medusa.runtime.threads as threads
from medusa import MedusaModel
from medusa.questions import load_questions

torch.set_num_threads(2)
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][:2]
model = MedusaModel.from_pretrained(dtype="float32")
prompts = [
    model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    for q in questions
]


def run(i: int, proposer=None):
    start = time.perf_counter()
    out = model.generate(
        prompts[i], max_new_tokens=128, do_sample=False, return_dict_in_generate=True, proposer=proposer
    )
    return out.stats.new_tokens, time.perf_counter() - start


def rate(runs) -> float:
    return sum(r[0] for r in runs) / sum(r[1] for r in runs)


if sys.argv[2] == "threads":
    pool = ThreadPoolExecutor(1)
    for round_ in range(2):
        for where in ("main", "thread", "main again"):
            for proposer in (None, "plain"):
                runs = [
                    run(i, proposer) if where != "thread" else pool.submit(run, i, proposer).result() for i in (0, 1)
                ]
                print(f"round {round_} {where} {proposer or 'planned'}: {rate(runs):.1f} tok/s", flush=True)
else:
    release = threads.release_openmp_pool
    for round_ in range(3):
        for releasing in (False, True):
            threads.release_openmp_pool = release if releasing else (lambda: False)
            planned, plain = rate([run(i) for i in (0, 1)]), rate([run(i, "plain") for i in (0, 1)])
            print(f"{round_} {'release' if releasing else 'keep'} planned {planned:.1f} plain {plain:.1f}", flush=True)
