"""`medusa serve` under load: K clients at once, each asking Spec-Bench first turns one after another (greedy, not
streamed, max_tokens 128), against the app with requests batched (max_batch 16) and one at a time (max_batch 1), the
two alternating; completion tokens per second over all clients, and the mean seconds per request.
    python docs/benchmarks/cpu-serve-batching-session52/serve_load.py QUESTIONS DTYPE CLIENTS(1,4,8) PER_CLIENT ROUNDS
(from the repository root; the embedded model and its heads, the plan as `medusa serve` loads it)"""

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch
import uvicorn

from medusa import MedusaModel
from medusa.questions import load_questions
from medusa.serve import create_app

torch.set_num_threads(2)
questions_path, dtype, clients, per_client, rounds = (
    sys.argv[1],
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    int(sys.argv[5]),
)
questions = [q["turns"][0] for q in load_questions(questions_path)]
model = MedusaModel.from_pretrained(dtype=dtype)


def serve(max_batch: int, port: int):
    server = uvicorn.Server(uvicorn.Config(create_app(model, max_batch=max_batch), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def load(url: str, k: int, offset: int, count: int = per_client) -> dict:
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def client(c: int):
        tokens, seconds = 0, []
        for i in range(count):
            question = questions[(offset + c * count + i) % len(questions)]
            start = time.perf_counter()
            reply = api.chat.completions.create(
                model="any", messages=[{"role": "user", "content": question}], max_tokens=128, temperature=0
            )
            seconds.append(time.perf_counter() - start)
            tokens += reply.usage.completion_tokens
        return tokens, seconds

    start = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        results = list(pool.map(client, range(k)))
    wall = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    latencies = [s for _, ss in results for s in ss]
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "mean_request_s": statistics.mean(latencies)}


servers = {batch: serve(batch, 8700 + batch) for batch in (16, 1)}
for batch in servers:  # warm-up: the first batches of each size on each app
    for k in (1, 4, 8):
        load(f"http://127.0.0.1:{8700 + batch}/v1", k, 1000, count=1)
table = []
for k in map(int, clients.split(",")):
    for r in range(rounds):
        for batch in (16, 1) if r % 2 == 0 else (1, 16):
            row = {"clients": k, "max_batch": batch, "round": r, **load(f"http://127.0.0.1:{8700 + batch}/v1", k, r)}
            print(json.dumps(row), flush=True)
            table.append(row)
for k in sorted({row["clients"] for row in table}):
    rates = {
        b: statistics.median(r["tok_s"] for r in table if r["clients"] == k and r["max_batch"] == b) for b in (1, 16)
    }
    print(
        f"{k} clients: one at a time {rates[1]:.1f} tok/s, batched {rates[16]:.1f} tok/s, "
        f"ratio {rates[16] / rates[1]:.2f}"
    )
