"""`medusa serve` under load: K clients at once, each asking Spec-Bench first turns one after another (greedy, not
streamed, max_tokens 128), against the app with requests batched (max_batch 16) and one at a time (max_batch 1), and
a peer's OpenAI-compatible server where one is given (llama.cpp's llama-server), in turns (the order reversed every
other round); completion tokens per second over all clients, and the mean seconds per request.
    python docs/benchmarks/cpu-serve-batching-session52/serve_load.py QUESTIONS DTYPE CLIENTS PER_CLIENT ROUNDS \
        [PEER_URL]
(from the repository root; CLIENTS e.g. 1,4,8; the embedded model and its heads, the plan as `medusa serve` loads
it)"""

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
from medusa.serve import MainThreadWorker, create_app

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


worker = (
    MainThreadWorker()
)  # as `medusa serve`: the model decodes on the main thread, the servers and clients elsewhere


def serve(max_batch: int, port: int):
    app = create_app(model, max_batch=max_batch, worker=worker)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def load(url: str, k: int, offset: int, count: int = per_client, extra: dict | None = None) -> dict:
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def client(c: int):
        tokens, seconds = 0, []
        for i in range(count):
            question = questions[(offset + c * count + i) % len(questions)]
            start = time.perf_counter()
            reply = api.chat.completions.create(
                model="any",
                messages=[{"role": "user", "content": question}],
                max_tokens=128,
                temperature=0,
                extra_body=extra,
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


def measure():
    for batch in (16, 1):
        serve(batch, 8700 + batch)
    targets = {"batched": "http://127.0.0.1:8716/v1", "one at a time": "http://127.0.0.1:8701/v1"}
    if len(sys.argv) > 6:
        targets["peer"] = sys.argv[6]
    for url in targets.values():  # warm-up: the first batches of each size on each server
        for k in (1, 4, 8):
            load(url, k, 1000, count=1)
    table = []
    for k in map(int, clients.split(",")):
        for r in range(rounds):
            for name in list(targets) if r % 2 == 0 else list(targets)[::-1]:
                extra = {"cache_prompt": False} if name == "peer" else None  # llama-server reuses a repeated prompt
                row = {"clients": k, "server": name, "round": r, **load(targets[name], k, r, extra=extra)}
                print(json.dumps(row), flush=True)
                table.append(row)
    for k in sorted({row["clients"] for row in table}):
        rates = {
            n: statistics.median(r["tok_s"] for r in table if r["clients"] == k and r["server"] == n) for n in targets
        }
        print(
            f"{k} clients: "
            + ", ".join(f"{n} {rate:.1f} tok/s" for n, rate in rates.items())
            + f"; batched / one at a time {rates['batched'] / rates['one at a time']:.2f}"
        )


measuring = threading.Thread(target=measure)
measuring.start()
worker.run_until(lambda: not measuring.is_alive())
