"""`medusa serve` (medusa/serve.py, medusa/cli/serve.py): the official `openai` client against a uvicorn server in
a background thread, around a tiny random model with a character-level tokenizer (one token, one character)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import make_heads, make_tiny_model, tiny_tokenizer

import medusa.cli
from medusa import MedusaModel
from medusa.serve import create_app

HELLO = [{"role": "user", "content": "hello"}]


@contextmanager
def serving(app):
    """The app on a free port of 127.0.0.1, in a thread: -> its /v1 URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
    return MedusaModel(make_tiny_model("llama"), make_heads(random=True), tiny_tokenizer())


@pytest.fixture(scope="module")
def url(model):
    with serving(create_app(model, model_name="tiny")) as url:
        yield url


def chat_ids(model, messages) -> torch.Tensor:
    return model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def direct(model, input_ids, **kwargs) -> tuple[str, object]:
    """What model.generate itself says for the prompt: (new text, its output)."""
    out = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
    return model.tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True), out


def test_models_lists_the_served_name(url):
    assert [m.id for m in client(url).models.list().data] == ["tiny"]


def test_greedy_chat_equals_direct_generate(model, url):
    expected, out = direct(model, chat_ids(model, HELLO), max_new_tokens=24, do_sample=False)
    reply = client(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0)
    assert len(expected) >= 20  # a character per token (pad tokens decode to nothing)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    prompt = chat_ids(model, HELLO).shape[1]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt,
        24,
        prompt + 24,
    )
    assert reply.usage.medusa_tokens_per_step == pytest.approx(out.stats.mean_accepted_tokens)


def test_max_completion_tokens_wins_over_max_tokens(model, url):
    expected, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=5, do_sample=False)
    reply = client(url).chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=30, max_completion_tokens=5, temperature=0
    )
    assert reply.choices[0].message.content == expected and reply.usage.completion_tokens == 5


def test_streamed_chat_adds_up_to_the_whole_answer(model, url):
    expected, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=30, do_sample=False)
    chunks = list(
        client(url).chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one piece


def test_streams_end_with_done(url):
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_completions_equal_direct_generate_streamed_or_not(model, url):
    ids = model.tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    expected, _ = direct(model, ids, max_new_tokens=20, do_sample=False)
    api = client(url)
    whole = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.object == "text_completion" and whole.usage.prompt_tokens == ids.shape[1]
    stream = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_the_text_before_them(model, url):
    """generate keeps the stop string (as transformers does); the API leaves it out (as OpenAI does)."""
    full, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=40, do_sample=False)
    stop = full[12:14]
    cut = full.index(stop)
    kept, out = direct(model, chat_ids(model, HELLO), max_new_tokens=40, do_sample=False, stop_strings=[stop])
    assert kept.endswith(stop) and kept[: -len(stop)] == full[:cut]
    api = client(url)
    for stops in (stop, [stop, "never-there"]):
        reply = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, temperature=0, stop=stops)
        assert reply.choices[0].message.content == full[:cut] and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == out.stats.new_tokens < 40
    chunks = list(
        api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_end_token_stops_with_reason_stop_and_stays_out_of_the_text(model, url, monkeypatch):
    full, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=30, do_sample=False)
    end = full[10]  # a character token: not special, so only its being the end token keeps it out
    monkeypatch.setattr(model.base.generation_config, "eos_token_id", model.tokenizer.convert_tokens_to_ids(end))
    api = client(url)
    reply = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, temperature=0)
    assert reply.choices[0].message.content == full[: full.index(end)]
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == full.index(end) + 1
    chunks = list(api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[: full.index(end)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_repeat_generate_with_that_generator(model, url):
    expected, _ = direct(
        model,
        chat_ids(model, HELLO),
        max_new_tokens=20,
        do_sample=True,
        temperature=1.5,
        top_p=0.9,
        generator=torch.Generator().manual_seed(7),
    )
    api = client(url)
    asked = dict(model="tiny", messages=HELLO, max_tokens=20, temperature=1.5, top_p=0.9)
    assert api.chat.completions.create(**asked, seed=7).choices[0].message.content == expected
    other = [api.chat.completions.create(**asked, seed=seed).choices[0].message.content for seed in (8, 9)]
    assert expected not in other


def test_twenty_concurrent_requests_complete_one_at_a_time(model, url, monkeypatch):
    prompts = [f"question {i}" for i in range(20)]
    expected = [
        direct(model, chat_ids(model, [{"role": "user", "content": p}]), max_new_tokens=8, do_sample=False)[0]
        for p in prompts
    ]
    running, most = [0], [0]
    lock = threading.Lock()

    def counting(call):
        def counted(*args, **kwargs):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                time.sleep(0.01)  # widen the window two calls would overlap in
                return call(*args, **kwargs)
            finally:
                with lock:
                    running[0] -= 1

        return counted

    monkeypatch.setattr(model, "generate", counting(model.generate))
    monkeypatch.setattr(model, "generate_continuously", counting(model.generate_continuously))
    api = client(url)

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": prompts[i]}]
        if i % 2:  # half of them streamed
            chunks = api.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        return (
            api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    assert answers == expected
    assert most[0] == 1


def streamed(api, **asked):
    """A streamed chat request's reply, read as a whole one is (text, finish reason, usage)."""
    chunks = list(api.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    said = SimpleNamespace(message=SimpleNamespace(content=text), finish_reason=reason)
    return SimpleNamespace(choices=[said], usage=chunks[-1].usage)


def asked_while_busy(model, app, requests: list[tuple[str, dict]], refuse_batches: bool | str = False):
    """Each (prompt, chat options; streamed where they hold stream=True) asked in turn while a streamed seeded
    request holds the model: all of them waiting, in that order, before it is let go. -> (the requests each
    decoding call took, in order: 1 for a generate, all it took for a generate_continuously; the replies).
    refuse_batches: generate_continuously fails once it has taken its requests ("after a token": once its streamed
    ones have each sent a token)."""
    calls, entered, release = [], threading.Event(), threading.Event()
    generate, continuously = model.generate, model.generate_continuously

    def held(*args, **kwargs):
        calls.append([args[0]])
        if len(calls) == 1:
            entered.set()
            release.wait(60)
        return generate(*args, **kwargs)

    def together(take, **kwargs):
        taken = []
        calls.append(taken)

        def counted(room):
            given = take(room)
            taken.extend(given)
            return given

        if not refuse_batches:
            return continuously(counted, **kwargs)
        for request in counted(kwargs["max_batch"]):
            if request.streamer is not None and refuse_batches == "after a token":
                request.streamer.put(torch.tensor([[1]]))
                request.streamer.put(torch.tensor([5]))
        failed = ValueError("no batches today")
        for request in taken:  # as generate_continuously fails a step: its requests started
            request.started = True
            request.result.set_exception(failed)
        raise failed

    with serving(app) as url, ThreadPoolExecutor(len(requests) + 1) as pool:
        api = client(url)
        model.generate, model.generate_continuously = held, together
        try:
            busy = pool.submit(  # seeded: it decodes alone (generate), the others wait for it
                lambda: list(
                    api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, stream=True, seed=1)
                )
            )
            assert entered.wait(60)
            replies, deadline = [], time.monotonic() + 60
            for p, o in requests:  # in this order: each waiting before the next is asked
                asked = partial(streamed, api) if o.get("stream") else api.chat.completions.create
                options = {k: v for k, v in o.items() if k != "stream"}
                replies.append(pool.submit(asked, model="tiny", messages=[{"role": "user", "content": p}], **options))
                while len(app.state.waiting) < len(replies):
                    assert time.monotonic() < deadline, "the requests did not reach the server"
                    time.sleep(0.005)
            release.set()
            busy.result()
            answered = [reply.result() for reply in replies]
            return [len(taken) for taken in calls], answered
        finally:
            release.set()
            del model.generate, model.generate_continuously


def alone(model, prompt: str, max_tokens: int, stop=None, seed=None) -> tuple[str, int]:
    """A request's text and token count as generate gives them for it alone (greedy, or sampled at 1.5 with seed)."""
    options = {"do_sample": False}
    if seed is not None:
        options = {"do_sample": True, "temperature": 1.5, "generator": torch.Generator().manual_seed(seed)}
    ids = chat_ids(model, [{"role": "user", "content": prompt}])
    text, out = direct(model, ids, max_new_tokens=max_tokens, stop_strings=stop, **options)
    cut = min([text.index(s) for s in stop or [] if s in text], default=len(text))
    return text[:cut], out.stats.new_tokens


def test_requests_waiting_together_decode_as_one_batch_each_as_it_would_alone(model):
    """Requests that wait while the model is busy decode together, whatever their settings (here 4 greedy ones of 8
    tokens, two of them streamed, 2 of 12 tokens with a stop string one of them meets, one streamed, and one sampled),
    each reply what it is alone (text, finish reason, tokens); a seeded one, and the streamed one that kept the model
    busy, decode alone."""
    prompts = [f"question {i}" for i in range(4)] + ["hello", "what is 2 + 2?", "sampled", "seeded"]
    full = [alone(model, p, 12)[0] for p in prompts[4:6]]
    stop = next(full[0][k : k + 2] for k in range(2, 10) if full[0][k : k + 2] not in full[1])  # row 4's, not row 5's
    greedy, stopping = dict(max_tokens=8, temperature=0), dict(max_tokens=12, temperature=0, stop=[stop])
    asks = [greedy, {**greedy, "stream": True}, greedy, {**greedy, "stream": True}, {**stopping, "stream": True}]
    asks += [stopping, dict(max_tokens=8, temperature=1.5), dict(max_tokens=8, temperature=1.5, seed=3)]
    expected = [alone(model, p, a["max_tokens"], a.get("stop"), a.get("seed")) for p, a in zip(prompts, asks)]
    assert len(expected[4][0]) < len(expected[5][0]) and expected[5][1] == 12  # one stops early, one runs on

    rows, replies = asked_while_busy(model, create_app(model, model_name="tiny"), list(zip(prompts, asks)))
    assert rows == [1, 7, 1]
    for reply, (text, tokens), ask in zip(replies, expected, asks):
        if ask == asks[6]:  # sampled without a seed: its own draws
            assert 1 <= reply.usage.completion_tokens <= 8
            continue
        assert reply.choices[0].message.content == text
        assert reply.usage.completion_tokens == tokens
        assert reply.choices[0].finish_reason == ("stop" if ask.get("stop") and len(text) < tokens else "length")
    assert [reply.usage.model_extra["medusa_batch_rows"] for reply in replies] == [7] * 7 + [1]


def test_a_model_without_trained_heads_serves_requests_together_each_as_it_would_alone(tmp_path, monkeypatch):
    """`medusa serve --heads none`: from_base's plan (prompt lookup on its engine); requests that wait decode
    together, each reply the base's own greedy answer."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    noheads = MedusaModel.from_base(make_tiny_model("qwen2"), tokenizer=tiny_tokenizer(), plan="auto")
    assert noheads.plan.proposer == "prompt_lookup"
    prompts = ["hello hello hello", "what is 2 + 2?", "a b c a b c"]
    greedy = dict(max_tokens=16, temperature=0)
    rows, replies = asked_while_busy(noheads, create_app(noheads, model_name="tiny"), [(p, greedy) for p in prompts])
    assert rows == [1, 3]
    for reply, prompt in zip(replies, prompts):
        ids = chat_ids(noheads, [{"role": "user", "content": prompt}])
        expected = noheads.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        text = noheads.tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
        assert reply.choices[0].message.content == text


def test_a_main_thread_worker_runs_the_model_on_the_thread_that_runs_it(model):
    """`medusa serve`'s layout: the server in a thread, every generate (whole or streamed) on the main thread."""
    from medusa.serve import MainThreadWorker

    expected, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=4, do_sample=False)
    worker, threads, replies = MainThreadWorker(), [], []
    generate, continuously = model.generate, model.generate_continuously
    model.generate = lambda *args, **kwargs: threads.append(threading.current_thread()) or generate(*args, **kwargs)
    model.generate_continuously = lambda *args, **kwargs: (
        threads.append(threading.current_thread()) or continuously(*args, **kwargs)
    )

    def ask(url):
        api = client(url)
        asked = dict(model="tiny", messages=HELLO, max_tokens=4, temperature=0)
        replies.append(api.chat.completions.create(**asked).choices[0].message.content)
        replies.append(
            "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**asked, stream=True))
        )

    try:
        with serving(create_app(model, model_name="tiny", worker=worker)) as url:
            asker = threading.Thread(target=ask, args=(url,))
            asker.start()
            worker.run_until(lambda: not asker.is_alive(), poll=0.01)
    finally:
        del model.generate, model.generate_continuously
    # (the streamed request may join the first one's call: it can arrive before that call has seen no more waiting)
    assert replies == [expected, expected] and threads and set(threads) == {threading.main_thread()}


def test_max_batch_bounds_a_batch_and_a_failed_batch_decodes_each_request_alone(model):
    prompts = [f"question {i}" for i in range(5)]
    expected = [alone(model, p, 6)[0] for p in prompts]
    requests = [(p, dict(max_tokens=6, temperature=0)) for p in prompts]
    rows, replies = asked_while_busy(model, create_app(model, model_name="tiny", max_batch=2), requests)
    assert rows == [1, 5]  # one running batch took them all, two rows at a time
    assert [r.choices[0].message.content for r in replies] == expected
    assert max(r.usage.model_extra["medusa_batch_rows"] for r in replies) == 2
    # a batch that fails: each of its requests decodes alone, and is answered
    rows, replies = asked_while_busy(model, create_app(model, model_name="tiny"), requests, refuse_batches=True)
    assert rows == [1, 5, 1, 1, 1, 1, 1]
    assert [r.choices[0].message.content for r in replies] == expected
    assert {r.usage.model_extra["medusa_batch_rows"] for r in replies} == {1}
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        create_app(model, max_batch=0)


def test_a_batch_failing_after_its_streams_sent_text_ends_them_with_the_error_and_decodes_the_rest_alone(model):
    requests = [(p, dict(max_tokens=6, temperature=0, stream=s)) for p, s in [("a", True), ("b", False), ("c", True)]]
    with pytest.raises(openai.APIError, match="no batches today"):  # a stream that sent text cannot start again
        asked_while_busy(model, create_app(model, model_name="tiny"), requests[:1] * 2, refuse_batches="after a token")
    requests = [requests[1], requests[1]]  # the whole ones are answered, each decoded alone
    rows, replies = asked_while_busy(model, create_app(model, model_name="tiny"), requests, "after a token")
    assert rows == [1, 2, 1, 1] and [r.choices[0].message.content for r in replies] == [alone(model, "b", 6)[0]] * 2


BAD_REQUESTS = [  # (body, what the message must name)
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "send a JSON object"),
    (b"{}", "messages is missing"),
    (b'{"messages": []}', "send messages as a non-empty list"),
    (b'{"messages": "hello"}', "messages: Input should be a valid list"),
    (b'{"messages": [{"content": "hi"}]}', "messages: Field required"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n=2 is not supported"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "send max_tokens as an integer >= 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}', "max_tokens: Input should be"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": 3}', "send stop as a string or a list"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop holds an empty string"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', "logprobs=True is not supported"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}', "presence_penalty=0.5"),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * 600 + b'"}]}', "exceeds the model's context window"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}', "shorten the prompt or lower max_tokens"),
]


@pytest.mark.parametrize("body, named", BAD_REQUESTS, ids=[named for _, named in BAD_REQUESTS])
def test_a_bad_request_gets_a_400_naming_the_problem_and_the_server_goes_on(model, url, body, named):
    response = httpx.post(
        f"{url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error"
    expected, _ = direct(model, chat_ids(model, HELLO), max_new_tokens=3, do_sample=False)
    reply = client(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, temperature=0)
    assert reply.choices[0].message.content == expected


def test_bad_completion_requests_and_unknown_paths(url):
    api = client(url)
    with pytest.raises(openai.BadRequestError, match="prompt is missing"):
        api.post("/completions", body={"max_tokens": 3}, cast_to=httpx.Response)
    with pytest.raises(openai.BadRequestError, match="echo=True is not supported"):
        api.completions.create(model="tiny", prompt="hi", max_tokens=3, echo=True)
    with pytest.raises(openai.BadRequestError, match="send prompt as a non-empty string"):
        api.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3)
    response = httpx.get(f"{url}/embeddings", timeout=60)
    assert response.status_code == 404 and "POST /v1/chat/completions" in response.json()["error"]["message"]


def test_what_generate_refuses_becomes_a_400_with_its_message(model, url, monkeypatch):
    def refusing(*args, **kwargs):
        raise ValueError("generate does not support this: pass that instead")

    def refusing_each(take, **kwargs):  # generate_continuously hands each request its own refusal
        for request in take(kwargs["max_batch"]):
            request.result.set_exception(ValueError("generate does not support this: pass that instead"))

    monkeypatch.setattr(model, "generate", refusing)
    monkeypatch.setattr(model, "generate_continuously", refusing_each)
    api = client(url)
    for stream, seed in [(False, None), (True, None), (False, 1), (True, 1)]:  # seeded: alone, through generate
        with pytest.raises(openai.BadRequestError, match="pass that instead"):
            api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, stream=stream, seed=seed)
    monkeypatch.undo()
    assert api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3).choices[0].message.content


def test_a_client_leaving_mid_stream_frees_the_model(model, url, monkeypatch):
    made = []  # the requests the model took
    continuously = model.generate_continuously

    def recording(take, **kwargs):
        return continuously(lambda room: made.extend(given := take(room)) or given, **kwargs)

    monkeypatch.setattr(model, "generate_continuously", recording)
    body = {"messages": HELLO, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if '"content"' in line)  # a token arrived: it is generating
    reply = client(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
    assert len(made) == 2 and made[0].result.result(timeout=30).stats.new_tokens < 400  # the first ended early


def test_steady_streams_release_fixed_chunks_at_the_rate(model):
    chunk, rate, tokens = 3, 100.0, 30
    ids = chat_ids(model, HELLO)
    expected, out = direct(model, ids, max_new_tokens=tokens, do_sample=False)
    new = out.sequences[0, ids.shape[1] :].tolist()
    # never the verify steps' burst sizes: `chunk` tokens each (a pad token among them decodes to nothing)
    steady = [model.tokenizer.decode(new[i : i + chunk], skip_special_tokens=True) for i in range(0, tokens, chunk)]
    with serving(create_app(model, model_name="tiny", steady=True, chunk=chunk, rate=rate)) as url:
        start = time.perf_counter()
        chunks = list(
            client(url).chat.completions.create(
                model="tiny", messages=HELLO, max_tokens=tokens, temperature=0, stream=True
            )
        )
        seconds = time.perf_counter() - start
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == expected
    assert pieces == [piece for piece in steady if piece]
    assert seconds >= 0.9 * tokens / rate  # the pace, not the model's speed


def test_the_command_loads_the_model_from_its_flags_and_serves_it(model, monkeypatch):
    loaded, ran = {}, {}

    def from_pretrained(path=None, **kwargs):
        loaded.update(path=path, **kwargs)
        return model

    class Server:  # uvicorn's, run in a thread by the command: here it returns at once, and the command with it
        def __init__(self, config):
            ran.update(app=config.app, host=config.host, port=config.port)

        def run(self):
            ran["thread"] = threading.current_thread()
            self.started, self.should_exit = True, False
            os.kill(os.getpid(), signal.SIGTERM)  # as `docker stop`: the command's handler asks the server to stop
            deadline = time.monotonic() + 30
            while not self.should_exit and time.monotonic() < deadline:
                time.sleep(0.01)
            ran["stopped"] = self.should_exit

    monkeypatch.setattr(MedusaModel, "from_pretrained", from_pretrained)
    monkeypatch.setattr(uvicorn, "Server", Server)
    handler = signal.getsignal(signal.SIGTERM)
    medusa.cli.main(["serve", "--heads", "h", "--dtype", "float32", "--engine", "eager", "--port", "8123"])
    assert ran["thread"] is not threading.main_thread()  # the main thread runs the model's worker
    assert ran["stopped"] and signal.getsignal(signal.SIGTERM) is handler  # stopped by SIGTERM; handler restored
    monkeypatch.undo()  # uvicorn's own Server again, to serve the app
    assert loaded == dict(path="h", base=None, dtype="float32", device=None, engine="eager")
    assert ran["host"] == "127.0.0.1" and ran["port"] == 8123
    with serving(ran["app"]) as url:  # named after the heads' base (the tiny heads name none)
        assert [m.id for m in client(url).models.list().data] == ["medusa"]


def test_the_commands_max_batch_reaches_the_app_and_below_one_is_refused(model, monkeypatch, capsys):
    import medusa.cli.serve
    import medusa.serve

    made = {}
    monkeypatch.setattr(MedusaModel, "from_pretrained", lambda path=None, **kwargs: model)
    monkeypatch.setattr(medusa.serve, "create_app", lambda model, **kwargs: made.update(kwargs))
    calibrated = []
    monkeypatch.setattr(medusa.cli.serve, "calibrate_batches", lambda model, rows: calibrated.append(rows))
    started = type("Server", (), {"run": lambda self: None, "started": True})
    monkeypatch.setattr(uvicorn, "Server", lambda config: started())
    medusa.cli.main(["serve", "--max-batch", "3"])
    assert made["max_batch"] == 3 and isinstance(made["worker"], medusa.serve.MainThreadWorker)
    assert calibrated == [3]  # the plan's layouts for up to 3 rows timed before the server listens
    failed = type("Server", (), {"run": lambda self: None, "started": False})  # e.g. its port in use
    monkeypatch.setattr(uvicorn, "Server", lambda config: failed())
    with pytest.raises(SystemExit, match="the server did not start on 127.0.0.1:8000"):
        medusa.cli.main(["serve"])
    with pytest.raises(SystemExit):
        medusa.cli.main(["serve", "--max-batch", "0"])
    assert "--max-batch must be >= 1" in capsys.readouterr().err


def test_the_command_without_fastapi_names_the_extra_before_loading_a_model(monkeypatch):
    def from_pretrained(*args, **kwargs):
        raise AssertionError("the model loaded before the missing package was found")

    monkeypatch.setattr(MedusaModel, "from_pretrained", from_pretrained)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi raises ImportError
    monkeypatch.delitem(sys.modules, "medusa.serve")
    with pytest.raises(SystemExit, match=r"fastapi is missing\): pip install 'medusa-spec\[serve\]'"):
        medusa.cli.main(["serve"])


def test_import_medusa_leaves_the_server_packages_out():
    code = "import sys, medusa; print(sorted({'fastapi', 'uvicorn', 'medusa.serve'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_embedded_model_through_the_server_says_what_generate_says():
    model = MedusaModel.from_pretrained()
    messages = [{"role": "user", "content": "Name three primary colours."}]
    ids = chat_ids(model, messages)
    direct(model, ids, max_new_tokens=8, do_sample=False)  # warm-up
    start = time.perf_counter()
    expected, out = direct(model, ids, max_new_tokens=48, do_sample=False)
    direct_rate = out.stats.new_tokens / (time.perf_counter() - start)
    with serving(create_app(model)) as url:
        api = client(url)
        start = time.perf_counter()
        reply = api.chat.completions.create(model="medusa", messages=messages, max_tokens=48, temperature=0)
        served_rate = reply.usage.completion_tokens / (time.perf_counter() - start)
    assert reply.choices[0].message.content == expected and len(expected) > 20
    assert reply.usage.completion_tokens == out.stats.new_tokens
    print(
        f"\nembedded model, {out.stats.new_tokens} tokens: direct generate {direct_rate:.1f} tok/s, "
        f"through the server {served_rate:.1f} tok/s"
    )


def test_a_main_thread_worker_hands_errors_to_their_caller_and_stops_on_ctrl_c():
    from medusa.serve import MainThreadWorker

    worker, calls = MainThreadWorker(), []
    failed = worker.submit(lambda: 1 / 0)
    done = worker.submit(lambda: calls.append("ran") or 7)
    worker.run_until(lambda: done.done(), poll=0.01)
    assert isinstance(failed.exception(), ZeroDivisionError) and done.result() == 7 and calls == ["ran"]

    def interrupt():
        raise KeyboardInterrupt

    interrupted = worker.submit(interrupt)
    deadline = time.monotonic() + 5
    with pytest.raises(KeyboardInterrupt):
        worker.run_until(lambda: time.monotonic() > deadline, poll=0.01)
    assert isinstance(interrupted.exception(), KeyboardInterrupt)
