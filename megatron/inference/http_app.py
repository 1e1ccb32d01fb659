"""The HTTP side of the generation server (rank 0 only): FastAPI routes on uvicorn, a bounded
queue, and one worker thread that runs the queued operations on every rank in order.

Why FastAPI + uvicorn rather than Flask: one asyncio event loop holds any number of waiting
clients without a thread each, and notices a client that hung up (the request is dropped
from the queue if it has not started; a running one finishes on every rank and its answer is
discarded, so the ranks never fall out of step; a streamed one is stopped on every rank after
the next step). The model runs one operation at a time anyway: every rank must take part in
each forward pass.

    PUT /api              Megatron's request (megatron_api.parse_request) -> {"text", "tokens"}
    POST /v1/completions  OpenAI's completions (openai_api) -> a text_completion, or with
                          "stream": true server-sent events (openai_stream)
    POST /v1/chat/completions  OpenAI's chat (chat): the template's prompt, then as completions
                          (streamed: each completion chunk as chat.completion.chunk)
    GET /health           {"status": "ok", "queued": n}, 200 while the worker is alive
    GET /v1/models        the one model, for clients that list models first

A request's client errors are 4xx naming the problem (a body that is no JSON a request can be:
megatron_api.read_json; a chat template that fails or runs away: chat_template), never 500s;
each request is one line on rank 0's stderr (http_log).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from concurrent.futures import Future

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from megatron.inference import chat, openai_api, openai_stream
from megatron.inference.chat_template import ChatTemplate, resolve
from megatron.inference.http_guard import WAITING_ON_CLIENT, ApiKey, Limits
from megatron.inference.http_log import RequestLog, note_error, note_tokens
from megatron.inference.megatron_api import BadRequest, check_length, parse_request
from megatron.inference.ops import Leader
from megatron.inference.streaming import TokenStream

MAX_BODY_BYTES = 8 << 20  # a larger body gets 413 before it is read in full
QUEUE_SIZE = 64  # requests running or waiting; more get 503 with Retry-After
DISCONNECT_POLL_S = 0.25


class Busy(RuntimeError):
    """The queue of waiting requests is full; the client should retry later (503)."""


class Scheduler:
    """At most QUEUE_SIZE operations wait; one thread runs them in order on every rank."""

    def __init__(self, leader: Leader):
        self.leader = leader
        self.jobs: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread = threading.Thread(target=self._work, name="generation", daemon=True)
        self.thread.start()

    def submit(self, op: str, args: dict, stream: TokenStream | None = None) -> Future:
        """Queue an operation; a streamed one sends its steps, then {"end": result} or
        {"error": message}, to `stream`."""
        future: Future = Future()
        try:
            self.jobs.put_nowait((op, args, future, stream))
        except queue.Full:
            raise Busy(f"{QUEUE_SIZE} requests are already queued") from None
        return future

    def _work(self) -> None:
        while True:
            op, args, future, stream = self.jobs.get()
            if op == "stop":
                try:
                    self.leader.stop()
                    future.set_result(None)
                except Exception as e:  # noqa: BLE001 - a rank is gone: say so, do not hang
                    future.set_exception(e)
                return
            if not future.set_running_or_notify_cancel():
                continue  # the client hung up before its turn: no rank runs it
            try:
                result = self.leader.run(op, args, stream)
            except Exception as e:  # noqa: BLE001 - answered as a 500 to that client only
                if stream is not None:  # the client learns it from its stream
                    print(f"[server] streamed {op} failed: {e!r}", file=sys.stderr)
                    stream.put({"error": str(e)})
                future.set_exception(e)
                continue
            if stream is not None:
                stream.put({"end": result})
            future.set_result(result)

    def close(self) -> None:
        """Cancel what waits, let the running operation finish, then stop the other ranks."""
        while True:
            try:
                self.jobs.get_nowait()[2].cancel()
            except queue.Empty:
                break
        done: Future = Future()
        self.jobs.put(("stop", None, done, None))
        done.result()
        self.thread.join()


def _megatron_error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _openai_error(status: int, message: str, field=None, headers=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = openai_api.error_body(message, field, kind)
    return JSONResponse(body, status_code=status, headers=headers)


class _Unread(Exception):
    """The body was not read: too large (413), too slow (408), or its client left (499)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def _read_body(request: Request, timeout: float) -> bytes:
    """The body, refusing (413) more than MAX_BODY_BYTES whatever Content-Length says, and (408)
    one still not in after `timeout` seconds while the server waits on the client (a slow-drip
    client; http_guard.WAITING_ON_CLIENT: what the server read but had no turn to take yet
    arrived in time)."""
    too_large = _Unread(413, f"the body must be at most {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise too_large
    waiting_on_client = request.scope.get("state", {}).get(WAITING_ON_CLIENT, lambda: True)
    loop = asyncio.get_running_loop()
    deadline, body, pending = loop.time() + timeout, bytearray(), None
    of = f" of {declared}" if declared is not None else ""
    while True:
        pending = pending or asyncio.ensure_future(request.receive())
        done, _ = await asyncio.wait({pending}, timeout=max(deadline - loop.time(), 0))
        if not done:
            if not waiting_on_client():  # the server is behind, not the client
                deadline = loop.time() + DISCONNECT_POLL_S
                continue
            pending.cancel()
            message = (
                f"the body did not arrive within {timeout:g} s (the server's --body-timeout): "
                f"{len(body)}{of} bytes came"
            )
            raise _Unread(408, message)
        message, pending = pending.result(), None
        if message["type"] == "http.disconnect":
            raise _Unread(499, f"the client left after {len(body)}{of} bytes of the body")
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise too_large
        if not message.get("more_body", False):
            return bytes(body)


async def _wait(request: Request, future: Future):
    """The operation's result; None if the client hung up first (its job is cancelled)."""
    waiting = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            future.cancel()  # dropped if not started; a running one finishes, unheard
            return None


async def stream_events(request: Request, stream: TokenStream, on_end=None):
    """The stream's events up to its last; ends early if the client hung up. `on_end`: called
    with the result of the "end" event."""
    while True:
        try:
            event = await asyncio.wait_for(stream.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return
            continue
        if "end" in event and on_end is not None:
            on_end(event["end"])
        yield event
        if "end" in event or "error" in event:
            return


def sse_response(future: Future, stream: TokenStream, chunks) -> StreamingResponse:
    """Server-sent events: each dict of `chunks` (made from the stream's events, e.g. by
    openai_stream.completion_chunks), then [DONE]. However the response ends (done, or the
    client hung up and the events or the write stopped), the operation is dropped from the
    queue if it has not started, and stopped on every rank after its next step if it has."""

    async def body():
        try:
            async for chunk in chunks:
                yield openai_stream.sse(chunk)
            yield openai_stream.DONE
        finally:
            stream.cancel()
            future.cancel()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


def _noted(request: Request, error) -> str:
    """The error's message, also noted for the request's log line."""
    note_error(request, str(error))
    return str(error)


def _note_usage(request: Request, args: dict, results: list[dict]) -> None:
    counts = openai_api.usage(args, results)
    note_tokens(request, counts["prompt_tokens"], counts["completion_tokens"])


def build_app(
    scheduler: Scheduler,
    model,
    model_name: str,
    limits: Limits | None = None,
    api_key: str | None = None,
    chat_template: ChatTemplate | None = None,
    log=None,
) -> FastAPI:
    """The routes; `model` (ops.Model) gives the tokenizer and context for validation. With an
    `api_key`, every route but /health needs it (http_guard.ApiKey). `chat_template`: the
    resolved template of /v1/chat/completions (None: chat_template.resolve's choice). `log`:
    where each request's line goes (http_log.RequestLog; None: stderr)."""
    limits = limits or Limits()
    template = chat_template or resolve(None, model.tokenizer)
    app = FastAPI(title="megatron-3d", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(RequestLog, write=log)  # outermost: a 401 is logged too
    _add_megatron_routes(app, scheduler, model, model_name, limits)
    _add_openai_routes(app, scheduler, model, model_name, limits, template)
    return app


_BUSY = {"Retry-After": "2"}
_CLOSE = {"Connection": "close"}  # after a 408 / 413 the rest of the body is not wanted


def _add_megatron_routes(app: FastAPI, scheduler: Scheduler, model, model_name, limits) -> None:
    """/health, /v1/models and Megatron's own PUT /api."""
    tokenizer = model.tokenizer

    @app.get("/health")
    async def health():
        alive = scheduler.thread.is_alive()
        body = {"status": "ok" if alive else "worker stopped", "queued": scheduler.jobs.qsize()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "owned_by": "megatron-3d"}
        return {"object": "list", "data": [card]}

    @app.api_route("/api", methods=["PUT", "POST"])
    async def megatron_api(request: Request):
        try:
            body = await _read_body(request, limits.body_timeout)
            req = await asyncio.to_thread(parse_request, body)
            await asyncio.to_thread(check_length, req, tokenizer, model.max_positions)
            result = await _wait(request, scheduler.submit("generate", req))
        except _Unread as e:
            return _megatron_error(e.status, _noted(request, e), _CLOSE)
        except BadRequest as e:
            return _megatron_error(400, _noted(request, e))
        except Busy as e:
            return _megatron_error(503, _noted(request, f"{e}; retry in a few seconds"), _BUSY)
        except Exception as e:  # noqa: BLE001 - answer this client, keep serving the rest
            print(f"[server] generation failed: {e!r}", file=sys.stderr)
            return _megatron_error(500, _noted(request, f"generation failed: {e}"))
        if result is None:
            return JSONResponse({}, 499)
        note_tokens(request, None, sum(len(t) for t in result["tokens"]))
        return JSONResponse(result)


def _add_openai_routes(
    app: FastAPI, scheduler: Scheduler, model, model_name, limits, template
) -> None:
    """/v1/completions and /v1/chat/completions (openai_api, chat)."""
    tokenizer = model.tokenizer
    vocab = model.engine.vocab_size

    async def openai_route(request: Request, parse, respond, chunks_of, what: str):
        """/v1/completions and /v1/chat/completions: `parse` (bytes -> completion_args' dict),
        `respond` (the body from ops.complete's results), `chunks_of` (a stream's
        text_completion chunks -> the chunks to send)."""
        try:
            body = await _read_body(request, limits.body_timeout)
            args = await asyncio.to_thread(parse, body)
            if args["stream"]:
                stream = TokenStream()
                future = scheduler.submit("complete", args, stream)
                events = stream_events(request, stream, lambda r: _note_usage(request, args, r))
                chunks = openai_stream.completion_chunks(args, events, tokenizer)
                return sse_response(future, stream, chunks_of(chunks))
            results = await _wait(request, scheduler.submit("complete", args))
            if results is None:
                return JSONResponse({}, 499)
            _note_usage(request, args, results)
            return respond(args, results, tokenizer)
        except _Unread as e:
            return _openai_error(e.status, _noted(request, e), headers=_CLOSE)
        except openai_api.FieldError as e:
            return _openai_error(400, _noted(request, e), e.field)
        except Busy as e:
            return _openai_error(
                503, _noted(request, f"{e}; retry in a few seconds"), headers=_BUSY
            )
        except Exception as e:  # noqa: BLE001 - answer this client, keep serving the rest
            print(f"[server] {what} failed: {e!r}", file=sys.stderr)
            return _openai_error(500, _noted(request, f"{what} failed: {e}"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        def parse(body: bytes) -> dict:
            return openai_api.completion_args(
                body, tokenizer, model.max_positions, vocab, model_name
            )

        respond = openai_api.completion_response
        return await openai_route(request, parse, respond, lambda c: c, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        def parse(body: bytes) -> dict:
            return chat.chat_args(body, tokenizer, model.max_positions, vocab, template, model_name)

        return await openai_route(
            request, parse, chat.chat_response, chat.chat_chunks, "chat completion"
        )
