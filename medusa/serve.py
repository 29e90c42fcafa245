"""An OpenAI-compatible HTTP server around one model: `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions`, whole or streamed as server-sent events (`medusa serve`, docs/serving.md).

The model decodes in a single worker thread, requests waiting in its queue in arrival order, so the event loop keeps
accepting (and refusing) requests while the model decodes. `medusa serve` makes the process's main thread that worker
(MainThreadWorker, the server in a thread of its own), where the model was loaded: measured faster under load than a
worker thread of its own (docs/serving.md). Requests decode by continuous batching: the one the worker reaches
decodes with the waiting ones behind it in one running batch that the next requests join between steps
(model.generate_continuously: each row as it would decode alone, with its own sampling, max_tokens, stop strings and
stream), and each is answered when its own row stops. A request with a seed decodes alone. A request the server
cannot honour exactly gets a 400 in OpenAI's error format naming the field and the fix; the server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import jinja2
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from transformers import StoppingCriteria, StoppingCriteriaList

from medusa.batch import GenerationRequest
from medusa.decode import stop_token_ids

# OpenAI fields that would change the output in ways this server does not produce: refused unless at these values
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logprobs": False,
    "top_logprobs": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "tools": [],
    "functions": [],  # an empty list and None leave them off alike
    "response_format": {"type": "text"},
}


class _Body(BaseModel):
    """The fields both endpoints take, with OpenAI's names; other fields are ignored (UNSUPPORTED ones checked).
    Each description completes "send <field> as ..." in the 400 a wrong value gets."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="a string (any: this server holds one model)")
    max_tokens: int | None = Field(None, ge=1, description="an integer >= 1")
    temperature: float | None = Field(None, ge=0, description="a number >= 0 (0: greedy)")
    top_p: float | None = Field(None, gt=0, le=1, description="a number in (0, 1]")
    top_k: int | None = Field(None, ge=0, description="an integer >= 0 (0: off; not OpenAI's, vLLM's extension)")
    stop: str | list[str] | None = Field(None, description="a string or a list of non-empty strings")
    stream: bool = Field(False, description="true or false")
    stream_options: dict | None = Field(None, description='an object such as {"include_usage": true}')
    seed: int | None = Field(None, description="an integer")


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[_TextPart] | None = None


class ChatBody(_Body):
    messages: list[_Message] = Field(
        min_length=1, description='a non-empty list of {"role": ..., "content": "text"} objects'
    )
    max_completion_tokens: int | None = Field(None, ge=1, description="an integer >= 1")


class CompletionBody(_Body):
    prompt: str = Field(min_length=1, description="a non-empty string (one prompt per request)")


class RequestError(Exception):
    """A request this server will not run as asked: a 400 with `message` (the problem and the fix)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _field(error: dict) -> str | None:
    """The request field a pydantic error is about (loc: ("body", field, ...)); None: the body as a whole."""
    return str(error["loc"][1]) if len(error["loc"]) > 1 and error["type"] != "json_invalid" else None


def _describe(error: dict) -> str:
    """One pydantic error -> what was wrong and what to send instead."""
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "decode error")
        return f"the request body is not valid JSON ({reason}): send a JSON object"
    name = _field(error)
    if name is None:
        return (
            f"the request body: {error['msg']}: send a JSON object of OpenAI's request fields, "
            "with Content-Type: application/json"
        )
    described = ChatBody.model_fields.get(name) or CompletionBody.model_fields.get(name)
    wanted = f": send {name} as {described.description}" if described and described.description else ""
    if error["type"] == "missing" and len(error["loc"]) == 2:
        return f"{name} is missing{wanted}"
    return f"{name}: {error['msg']} (got {json.dumps(error.get('input'), default=str)[:80]}){wanted}"


@dataclass
class _Job:
    """One checked request: what generate is called with and how its text is cut."""

    input_ids: torch.Tensor  # (1, T)
    max_tokens: int | None  # None: generate's default (the model's generation config, else 128 new tokens)
    stops: list[str]
    sampling: dict  # generate's do_sample / temperature / top_p / top_k (None: its defaults)
    seed: int | None
    stream: bool
    include_usage: bool
    end_ids: set[int]  # the model's end-of-sequence tokens: generate keeps the one it stops at, OpenAI does not
    cancelled: threading.Event = field(default_factory=threading.Event)  # a streaming client went away


class _Cancel(StoppingCriteria):
    """Ends a streamed generation once its client has gone, freeing the model for the queue."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set())


class _QueueStreamer:
    """transformers' streamer protocol (put/end) from the worker thread into an asyncio queue on the event loop:
    each put after the first (the prompt) is a list of new token ids. `close` (by the job, once it is done) ends the
    queue with None; `sent`: whether any token went."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen, self.sent = loop, queue, False, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, value.flatten().tolist())
            self.sent = True
        self.prompt_seen = True

    def end(self) -> None:
        pass

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string (OpenAI leaves it out; transformers' generate keeps it), and whether
    one was there."""
    ends = [text.find(stop) for stop in stops if stop in text]
    return (text[: min(ends)], True) if ends else (text, False)


class _TextStream:
    """Text deltas of a stream of new token ids: never a stop string, nor text that may yet begin one, nor half a
    character (a byte-level token may end inside one: the decoded text ends in U+FFFD until the rest comes)."""

    def __init__(self, tokenizer, stops: list[str], end_ids: set[int]):
        self.tokenizer, self.stops, self.end_ids, self.ids, self.sent = tokenizer, stops, end_ids, [], 0

    def add(self, ids: list[int]) -> str:
        self.ids += [i for i in ids if i not in self.end_ids]
        text, stopped = _cut(self.tokenizer.decode(self.ids, skip_special_tokens=True), self.stops)
        if not stopped:
            text = text.rstrip("\ufffd")
            held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        delta, self.sent = text[self.sent :], max(self.sent, len(text))
        return delta

    def rest(self, final_text: str) -> str:
        return final_text[self.sent :]


async def _until_none(queue: asyncio.Queue):
    while (item := await queue.get()) is not None:
        yield item


async def _steady(batches, chunk: int, interval: float):
    """As `medusa chat --steady` (medusa/cli/chat.py says why): `chunk` tokens every `interval` seconds, whatever
    the sizes of the verify steps' bursts; a chunk whose tokens are not there yet waits for them."""
    loop = asyncio.get_running_loop()
    pending, due = [], loop.time() + interval
    async for tokens in batches:
        pending += tokens
        while len(pending) >= chunk:
            await asyncio.sleep(max(0.0, due - loop.time()))
            yield pending[:chunk]
            pending, due = pending[chunk:], max(due + interval, loop.time())
    if pending:
        await asyncio.sleep(max(0.0, due - loop.time()))
        yield pending


def _sse(payload) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class MainThreadWorker(Executor):
    """An executor whose calls run one at a time in the thread that calls `run_until` (the main thread, where the model
    was loaded): the app's worker where the server runs in another thread (`medusa serve`)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args, kwargs))
        return future

    def run_until(self, stop: Callable[[], bool], poll: float = 0.1) -> None:
        """Run submitted calls, in order, until `stop()` holds (checked at least every `poll` seconds)."""
        while not stop():
            try:
                future, fn, args, kwargs = self.calls.get(timeout=poll)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - the caller's future carries it
                future.set_exception(error)
                if not isinstance(error, Exception):  # Ctrl-C (KeyboardInterrupt) ends the loop too
                    raise


def create_app(
    model,
    model_name: str = "medusa",
    steady: bool = False,
    chunk: int = 4,
    rate: float | None = None,
    max_batch: int = 16,
    worker: Executor | None = None,
):
    """A FastAPI app serving `model` (a MedusaModel, or any model with this library's `generate`, `base` and
    `tokenizer`) as `model_name`. steady: streams release `chunk` tokens at `rate` tokens/s (default: the plan's
    plain decoding rate, else 20), as `medusa chat --steady`. max_batch: the most requests decoded together (1: one at
    a time). worker: the one-at-a-time executor the model runs in (default: a thread of its own;
    `medusa serve` passes a MainThreadWorker run by the main thread, faster under load: docs/serving.md)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1 (1: one request at a time), got {max_batch!r}")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: load it with one (from_pretrained does) to serve text")
    window = getattr(model.base.config.get_text_config(), "max_position_embeddings", None)
    plan = getattr(model, "plan", None)
    rate = rate or (1000.0 / plan.plain_ms if plan is not None and plan.plain_ms else 20.0)
    # one request (or batch) on the model at a time
    worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-generate")
    app = FastAPI(title="medusa", description=__doc__)
    app.state.waiting = waiting = []  # (job, future, streamer or None) of requests the worker has not taken yet

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first: dict = {}  # the first error per field: a union (stop: str | list[str]) reports one per alternative
        for error in exc.errors():
            first.setdefault(_field(error), error)
        names = [name for name in first if name is not None]
        return _error(400, "; ".join(map(_describe, first.values())), names[0] if names else None)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return _error(400, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        served = "GET /v1/models, POST /v1/chat/completions and POST /v1/completions"
        return _error(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; this server serves {served}"
        )

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception):
        return _error(500, f"the server failed: {type(exc).__name__}: {exc}", kind="server_error")

    def check(body: _Body, input_ids: torch.Tensor, max_tokens: int | None) -> _Job:
        for name, off in UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value not in (None, off):
                raise RequestError(
                    f"{name}={value!r} is not supported by this server (one choice of plain text per request, decoded "
                    f"as the model's generate does: no penalties, log-probabilities or tools): leave {name} out",
                    name,
                )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if "" in stops:
            raise RequestError("stop holds an empty string, which would stop at once: leave it out", "stop")
        length = input_ids.shape[1]
        if window is not None and length + (max_tokens or 1) > window:
            asked = f" + max_tokens ({max_tokens})" if max_tokens else ""
            raise RequestError(
                f"the prompt ({length} tokens){asked} exceeds the model's context window of {window} tokens: "
                "shorten the prompt" + (" or lower max_tokens" if max_tokens else ""),
                "max_tokens" if max_tokens and length < window else None,
            )
        greedy = body.temperature == 0
        sampling = dict(
            do_sample=None if body.temperature is None else not greedy,
            temperature=None if greedy else body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        end_ids = stop_token_ids(model.base, tokenizer, None)
        return _Job(input_ids, max_tokens, stops, sampling, body.seed, body.stream, include_usage, end_ids)

    def generate(job: _Job, streamer=None):
        """In the worker thread, one job at a time."""
        if job.cancelled.is_set():  # its client left while it waited
            return None
        generator = None if job.seed is None else torch.Generator(model.device).manual_seed(job.seed)
        try:
            return model.generate(
                job.input_ids,
                max_new_tokens=job.max_tokens,
                stop_strings=job.stops or None,
                tokenizer=tokenizer,
                generator=generator,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([_Cancel(job.cancelled)]) if streamer else None,
                return_dict_in_generate=True,
                **job.sampling,
            )
        except (ValueError, TypeError) as error:  # generate names what it refuses and the way out
            raise RequestError(str(error)) from error

    waiting_lock = threading.Lock()

    def run_waiting() -> None:
        """In the worker thread (submitted once per waiting request): the oldest waiting request decodes alone where
        it has a seed, else with the requests waiting behind it, in one running batch that the next ones join as
        they come (decode_together), even when it waits alone: a request that comes a moment later joins it rather
        than waiting for it to end. A stream's queue ends when its request is done."""
        with waiting_lock:
            if not waiting:
                return
            alone = waiting.pop(0) if waiting[0][0].seed is not None else None
        if alone is None:
            decode_together()
        else:
            decode_alone(*alone)

    def decode_alone(job: _Job, future: Future, streamer) -> None:
        """One request by itself (generate): its answer or its error to its handler, its stream ended."""
        try:
            future.set_result((generate(job, streamer), 1))
        except Exception as error:  # noqa: BLE001 - handed to the request's handler
            future.set_exception(error)
        finally:
            if streamer is not None:
                streamer.close()

    def decode_together() -> None:
        """Continuous batching (model.generate_continuously): the waiting requests from the head of the queue join
        the running batch before each step, each with its own sampling, max_tokens, stops and stream, up to
        max_batch rows, until a seeded one is first in line (it waits for this batch to end: arrival order); each is
        answered when its own row stops. Where a step
        fails, the requests it held decode again one by one, but for streams that already sent text (they get the
        error)."""
        ended: list = []  # (job, future, streamer, request) of the requests a failed step ended

        def take(room: int) -> list[GenerationRequest]:
            with waiting_lock:
                taken = []
                while waiting and len(taken) < room and waiting[0][0].seed is None:
                    taken.append(waiting.pop(0))
            requests = []
            for job, future, streamer in taken:
                if job.cancelled.is_set():  # its client left while it waited
                    future.set_result((None, 1))
                    if streamer is not None:
                        streamer.close()
                    continue
                request = GenerationRequest(
                    job.input_ids,
                    max_new_tokens=job.max_tokens,
                    **job.sampling,
                    stop_strings=job.stops or None,
                    stopping_criteria=[_Cancel(job.cancelled)] if streamer else None,  # a client that left stops it
                    streamer=streamer,
                )
                request.result.add_done_callback(lambda _, asked=(job, future, streamer, request): answer(*asked))
                requests.append(request)
            return requests

        def answer(job, future, streamer, request) -> None:
            error = request.result.exception()
            if error is not None and request.started:  # a failed step: seen once generate_continuously raises
                ended.append((job, future, streamer, request))
                return
            if error is None:
                future.set_result((request.result.result(), request.rows))
            else:  # refused, as generate would refuse it: a 400 naming the fix, at once
                future.set_exception(RequestError(str(error)) if isinstance(error, (ValueError, TypeError)) else error)
            if streamer is not None:
                streamer.close()

        failed = None
        try:
            model.generate_continuously(take, max_batch=max_batch, tokenizer=tokenizer)
        except Exception as error:  # noqa: BLE001 - its requests decode again alone below, or are handed it
            failed = error
        finally:
            again = []
            for job, future, streamer, request in ended:
                if failed is not None and (streamer is None or not streamer.sent):
                    again.append((job, future, streamer))
                    continue
                future.set_exception(request.result.exception())
                if streamer is not None:
                    streamer.close()
        for job, future, streamer in again:
            decode_alone(job, future, streamer)

    def finish(job: _Job, out, rows: int = 1) -> tuple[str, str, dict]:
        """generate's output for the request (decoded with at most `rows` requests) -> (text, finish_reason, usage)."""
        new = out.sequences[0, job.input_ids.shape[1] :].tolist()
        said = [i for i in new if i not in job.end_ids]  # generate stops at the first end token: only the last
        text, stopped = _cut(tokenizer.decode(said, skip_special_tokens=True), job.stops)
        reason = "stop" if stopped or len(said) < len(new) else "length"
        usage = {
            "prompt_tokens": job.input_ids.shape[1],
            "completion_tokens": len(new),
            "total_tokens": job.input_ids.shape[1] + len(new),
            # not OpenAI's: tau, the request's new tokens per forward it took part in (prefill included)
            "medusa_tokens_per_step": out.stats.mean_accepted_tokens,
            "medusa_batch_rows": rows,  # not OpenAI's: the most requests decoded together with this one (itself too)
        }
        return text, reason, usage

    async def respond(job: _Job, chat: bool):
        loop = asyncio.get_running_loop()
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

        def choice(text: str | None, reason: str | None, delta: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            content = {} if text is None else {"content": text}
            said = {"delta": content} if delta else {"message": {"role": "assistant", **content}}
            return {"index": 0, **said, "finish_reason": reason, "logprobs": None}

        streamer = _QueueStreamer(loop, asyncio.Queue()) if job.stream else None
        future: Future = Future()
        with waiting_lock:
            waiting.append((job, future, streamer))
        worker.submit(run_waiting)
        done = asyncio.wrap_future(future)
        if not job.stream:
            text, reason, usage = finish(job, *await done)
            return {**head, "choices": [choice(text, reason)], "usage": usage}

        batches = _until_none(streamer.queue)
        first = await anext(batches, None)
        if first is None:  # generate ended before its first token: it refused the request (raised here: a 400)
            await done

        async def tokens():
            if first is not None:
                yield first
            async for batch in batches:
                yield batch

        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        async def events():
            try:
                if chat:  # OpenAI's first chunk names the role
                    yield _sse(
                        {**chunk_head, "choices": [{**choice(None, None, True), "delta": {"role": "assistant"}}]}
                    )
                text = _TextStream(tokenizer, job.stops, job.end_ids)
                async for ids in _steady(tokens(), chunk, chunk / rate) if steady else tokens():
                    if delta := text.add(ids):
                        yield _sse({**chunk_head, "choices": [choice(delta, None, True)]})
                final, reason, usage = finish(job, *await done)
                rest = text.rest(final)
                yield _sse({**chunk_head, "choices": [choice(rest if rest or not chat else None, reason, True)]})
                if job.include_usage:
                    yield _sse({**chunk_head, "choices": [], "usage": usage})
            except Exception as error:  # after the first token the status is sent: the stream carries the error
                refused = isinstance(error, RequestError)
                kind, param = ("invalid_request_error", error.param) if refused else ("server_error", None)
                message = str(error) if refused else f"generation failed: {type(error).__name__}: {error}"
                yield _sse({"error": {"message": message, "type": kind, "param": param, "code": None}})
            finally:
                job.cancelled.set()  # a client that left mid-stream stops generation at the next token
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "medusa"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [
            {
                "role": m.role,
                "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
            }
            for m in body.messages
        ]
        try:
            input_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise RequestError(f"the model's chat template refused the messages: {error}", "messages") from error
        return await respond(check(body, input_ids, body.max_completion_tokens or body.max_tokens), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        input_ids = tokenizer(body.prompt, return_tensors="pt")["input_ids"]
        return await respond(check(body, input_ids, body.max_tokens), chat=False)

    return app
