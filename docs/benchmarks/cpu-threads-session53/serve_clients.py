"""Running `medusa serve` commands under load, side by side: for each K, K clients at once against each server URL in
turn (the order reversed every other round), each client asking Spec-Bench first turns one after another (greedy, not
streamed, max_tokens 128); completion tokens per second over all clients, median over the rounds.
    python docs/benchmarks/cpu-threads-session53/serve_clients.py QUESTIONS CLIENTS PER_CLIENT ROUNDS NAME=URL...
(CLIENTS e.g. 1,4; each URL a running server's /v1)"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from medusa.questions import load_questions

questions = [q["turns"][0] for q in load_questions(sys.argv[1])]
clients, per_client, rounds = [int(k) for k in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
servers = dict(arg.split("=", 1) for arg in sys.argv[5:])


def tokens_per_second(url: str, k: int, offset: int, count: int) -> float:
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def ask(c: int) -> int:
        asked = [questions[(offset + c * count + i) % len(questions)] for i in range(count)]
        return sum(
            api.chat.completions.create(
                model="any", messages=[{"role": "user", "content": q}], max_tokens=128, temperature=0
            ).usage.completion_tokens
            for q in asked
        )

    start = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        tokens = sum(pool.map(ask, range(k)))
    return tokens / (time.perf_counter() - start)


for url in servers.values():  # warm-up: each batch size's first steps
    for k in clients:
        tokens_per_second(url, k, 1000, 1)
for k in clients:
    rates = {name: [] for name in servers}
    for r in range(rounds):
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            rates[name].append(tokens_per_second(servers[name], k, 100 * r, per_client))
    print(f"{k} clients: " + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in rates.items()), flush=True)
