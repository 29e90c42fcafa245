"""GNU OpenMP's per-thread pools (medusa/runtime/threads.py): the library's entry points end the calling thread's pool
when they return, so a model loaded on one thread decodes on another at full speed (the speed itself is measured in
docs/benchmarks/cpu-threads-session53/, not here)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import make_heads, make_tiny_model, tiny_tokenizer

import medusa.runtime.threads as threads
from medusa import MedusaModel

GNU_OPENMP = bool(threads._pause_functions())


def in_thread(function):
    """function() run in a new thread, its result or error brought back."""
    box = {}

    def run():
        try:
            box["result"] = function()
        except BaseException as error:  # noqa: BLE001 - raised again in the caller
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not GNU_OPENMP or not os.path.isdir("/proc/self/task"), reason="GNU OpenMP on Linux only")
def test_releasing_ends_the_calling_threads_pool_and_keeps_its_thread_count():
    before = torch.get_num_threads()

    def start_a_pool_then_release():
        torch.set_num_threads(2)
        alone = os_threads()
        torch.ones(1 << 22).exp_()  # a parallel region: the pool's second thread starts
        with_pool = os_threads()
        released = threads.release_openmp_pool()
        deadline = time.monotonic() + 5
        while os_threads() > alone and time.monotonic() < deadline:
            time.sleep(0.01)
        return alone, with_pool, released, os_threads(), torch.get_num_threads()

    try:
        alone, with_pool, released, after, num_threads = in_thread(start_a_pool_then_release)
    finally:
        torch.set_num_threads(before)
    assert with_pool > alone, "the parallel region started no pool thread: the test proves nothing"
    assert released and after == alone, (alone, with_pool, after)
    assert num_threads == 2  # the thread's setting outlives its pool


def test_generate_and_the_loaders_release_the_callers_pool_even_when_they_raise(monkeypatch):
    released = []
    monkeypatch.setattr(threads, "release_openmp_pool", lambda: released.append(threading.get_ident()))
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True), tiny_tokenizer())
    ids = torch.tensor([[1, 5, 9, 12]])

    ident = in_thread(lambda: (model.generate(ids, max_new_tokens=4, engine="eager"), threading.get_ident())[1])
    assert released == [ident]

    released.clear()
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(None)
    assert released == [threading.get_ident()]

    released.clear()
    loaded = MedusaModel.from_base(make_tiny_model("qwen2"), tokenizer=tiny_tokenizer(), num_heads=2)
    assert isinstance(loaded, MedusaModel) and released == [threading.get_ident()]


def test_calls_from_several_threads_run_one_at_a_time_each_as_it_would_alone():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True), tiny_tokenizer())
    prompts = [torch.tensor([[1, 5 + i, 9, 12 + i]]) for i in range(3)]
    alone = [model.generate(p, max_new_tokens=6, engine="eager").tolist() for p in prompts]
    running, most = [0], [0]
    forward = model.base.forward

    def slow_forward(*args, **kwargs):  # each forward lingers, so that calls running at once would overlap here
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.005)
        try:
            return forward(*args, **kwargs)
        finally:
            running[0] -= 1

    model.base.forward = slow_forward
    results = [None] * len(prompts)

    def ask(i: int):
        results[i] = model.generate(prompts[i], max_new_tokens=6, engine="eager").tolist()

    try:
        callers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    finally:
        del model.base.forward
    assert most[0] == 1 and results == alone
