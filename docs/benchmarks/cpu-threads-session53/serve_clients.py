"""Running `medusa serve` commands under load, side by side: for each K, K clients at once against each server URL in
turn (the order reversed every other round), each client asking Spec-Bench first turns one after another (greedy, not
streamed unless --stream, max_tokens 128); completion tokens per second over all clients, median over the rounds
(streamed: and the mean seconds from asking to the first text).
    python docs/benchmarks/cpu-threads-session53/serve_clients.py QUESTIONS CLIENTS PER_CLIENT ROUNDS [--stream] \
        NAME=URL...
(CLIENTS e.g. 1,4; each URL a running server's /v1, e.g. llama.cpp's llama-server)"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from medusa.questions import load_questions

questions = [q["turns"][0] for q in load_questions(sys.argv[1])]
clients, per_client, rounds = [int(k) for k in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
stream = "--stream" in sys.argv[5:]
servers = dict(arg.split("=", 1) for arg in sys.argv[5:] if arg != "--stream")


first_text: list[float] = []  # streamed: seconds from asking to the first text, every request of the round


def completion_tokens(api, question: str) -> int:
    asked = dict(model="any", messages=[{"role": "user", "content": question}], max_tokens=128, temperature=0)
    asked["extra_body"] = {
        "cache_prompt": False
    }  # llama-server's prompt cache off, as ours has none (others ignore it)
    if not stream:
        return api.chat.completions.create(**asked).usage.completion_tokens
    start, chunks, waited = time.perf_counter(), [], None
    for chunk in api.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}):
        if waited is None and chunk.choices and chunk.choices[0].delta.content:
            waited = time.perf_counter() - start
        chunks.append(chunk)
    first_text.append(waited)
    return chunks[-1].usage.completion_tokens


def tokens_per_second(url: str, k: int, offset: int, count: int) -> float:
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def ask(c: int) -> int:
        return sum(completion_tokens(api, questions[(offset + c * count + i) % len(questions)]) for i in range(count))

    start = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        tokens = sum(pool.map(ask, range(k)))
    return tokens / (time.perf_counter() - start)


for url in servers.values():  # warm-up: each batch size's first steps
    for k in clients:
        tokens_per_second(url, k, 1000, 1)
for k in clients:
    rates, waits = {name: [] for name in servers}, {name: [] for name in servers}
    for r in range(rounds):
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            first_text.clear()
            rates[name].append(tokens_per_second(servers[name], k, 100 * r, per_client))
            waits[name] += first_text
    said = [f"{n} {statistics.median(v):.1f} tok/s" for n, v in rates.items()]
    if stream:
        said = [f"{s}, first text after {statistics.mean(waits[n]):.2f} s" for s, n in zip(said, servers)]
    print(f"{k} clients: " + "; ".join(said), flush=True)
