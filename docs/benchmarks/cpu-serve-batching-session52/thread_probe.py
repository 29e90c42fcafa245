"""Does decoding in a second thread cost speed? The embedded model (fp32, its plan) answers Spec-Bench's first two
questions (128 new tokens, greedy), planned and plain, on the main thread, then in a worker thread, twice over; then
llama-completion F32 on the same prompts (llama.cpp's own timings; the GGUF made from the shipped Q4_1 file by
`llama-quantize --allow-requantize ... F32`, at /tmp/gguf/smollm2-F32.gguf).
    python docs/benchmarks/cpu-serve-batching-session52/thread_probe.py QUESTIONS   (from the repository root)"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from medusa import MedusaModel, llama_cpp
from medusa.questions import load_questions

torch.set_num_threads(2)
questions = [q["turns"][0] for q in load_questions(sys.argv[1])][:2]
model = MedusaModel.from_pretrained(dtype="float32")
tokenizer = model.tokenizer
prompts = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    for q in questions
]


def run(i: int, proposer=None):
    start = time.perf_counter()
    out = model.generate(
        prompts[i], max_new_tokens=128, do_sample=False, return_dict_in_generate=True, proposer=proposer
    )
    return out.stats.new_tokens, time.perf_counter() - start, out.stats.mean_accepted_tokens


for i in range(2):  # warm-up
    run(i)
pool = ThreadPoolExecutor(1)
for round_ in range(2):
    for where in ("main", "thread"):
        for proposer in (None, "plain"):
            runs = [run(i, proposer) if where == "main" else pool.submit(run, i, proposer).result() for i in range(2)]
            tokens, seconds = sum(r[0] for r in runs), sum(r[1] for r in runs)
            print(
                f"round {round_} {where} {proposer or 'planned'}: {tokens} tokens {seconds:.2f} s "
                f"{tokens / seconds:.1f} tok/s tau {[round(r[2], 2) for r in runs]}",
                flush=True,
            )
peer = [llama_cpp.generate("/tmp/gguf/smollm2-F32.gguf", tokenizer.decode(p[0]), 128, 2) for p in prompts]
tokens, seconds = sum(r.n_new_tokens for r in peer), sum(r.seconds for r in peer)
print(f"llama-completion F32: {tokens} tokens {seconds:.2f} s {tokens / seconds:.1f} tok/s")
