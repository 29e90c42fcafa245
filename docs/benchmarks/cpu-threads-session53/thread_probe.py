"""Does decoding in another thread than the one that loaded the model cost speed, and can several threads decode at
once? The embedded model (fp32, its plan) answers Spec-Bench's first questions (greedy).
  threads: on the main thread, then in a worker thread (one, kept alive, as a web app's pool keeps it), then on the
           main thread again, twice over;
  release: on the main thread only, generate releasing its OpenMP pool (as shipped) and keeping it (the release
           replaced by a no-op), alternately, three rounds: what the release costs a thread that decodes alone;
           (both: two questions, 128 new tokens, planned and plain)
  batch: eight questions of 128 new tokens as one batched generate, on the main thread, in a worker thread, on the
           main thread again, twice over;
  together: four questions of 48 new tokens one after another, then in four threads at once: whether each thread's
           output is the one alone (a stack dump and exit after 240 s: before session 53's lock they had not ended).
    python docs/benchmarks/cpu-threads-session53/thread_probe.py QUESTIONS threads|release|batch|together  (root)"""

import faulthandler
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import medusa.runtime.threads as threads
from medusa import MedusaModel
from medusa.batch import left_padded
from medusa.questions import load_questions

torch.set_num_threads(2)
mode = sys.argv[2]
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][: {"together": 4, "batch": 8}.get(mode, 2)]
model = MedusaModel.from_pretrained(dtype="float32")
prompts = [
    model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    for q in questions
]


def run(i: int, proposer=None, new: int = 128):
    start = time.perf_counter()
    out = model.generate(
        prompts[i], max_new_tokens=new, do_sample=False, return_dict_in_generate=True, proposer=proposer
    )
    return out.stats.new_tokens, time.perf_counter() - start, out.sequences[0].tolist()


def rate(runs) -> float:
    return sum(r[0] for r in runs) / sum(r[1] for r in runs)


if mode == "threads":
    pool = ThreadPoolExecutor(1)
    for round_ in range(2):
        for where in ("main", "thread", "main again"):
            for proposer in (None, "plain"):
                runs = [
                    run(i, proposer) if where != "thread" else pool.submit(run, i, proposer).result() for i in (0, 1)
                ]
                print(f"round {round_} {where} {proposer or 'planned'}: {rate(runs):.1f} tok/s", flush=True)
elif mode == "release":
    release = threads.release_openmp_pool
    for round_ in range(3):
        for releasing in (False, True):
            threads.release_openmp_pool = release if releasing else (lambda: False)
            planned, plain = rate([run(i) for i in (0, 1)]), rate([run(i, "plain") for i in (0, 1)])
            print(f"{round_} {'release' if releasing else 'keep'} planned {planned:.1f} plain {plain:.1f}", flush=True)
elif mode == "batch":
    ids, mask = left_padded([p[0].tolist() for p in prompts], model.tokenizer.pad_token_id or 0)

    def batch_rate() -> float:
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=128, do_sample=False, return_dict_in_generate=True
        )
        return out.stats.new_tokens / (time.perf_counter() - start)

    pool = ThreadPoolExecutor(1)
    batch_rate()  # warm-up
    for round_ in range(2):
        print(f"{round_} main {batch_rate():.1f} worker {pool.submit(batch_rate).result():.1f} main {batch_rate():.1f}")
else:
    faulthandler.dump_traceback_later(240, exit=True)
    alone = [run(i, new=48)[2] for i in range(len(prompts))]
    together = [None] * len(prompts)
    callers = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(i, new=48)[2])) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    print("identical to alone:", [a == t for a, t in zip(alone, together)], flush=True)
