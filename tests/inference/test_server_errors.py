"""Client errors of the generation server are 400s naming the problem, never 500s (issue 36):
a lone surrogate, JSON nested 100,000 deep, a 100,000-digit integer, a chat template that runs
away; a 408 only when the body did not arrive; one log line per request; generation ended by
the context says so, and end-of-document never shows in the text.

The real HTTP app (http_app.build_app on uvicorn with http_guard's protocol, the Scheduler,
ops and generation) on 127.0.0.1, in this process, with a scripted model in place of the
transformer so every answer is known and the module runs in a few seconds."""

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.inference import chat_template
from megatron.inference.chat_template import ChatTemplate
from megatron.inference.generation import SamplingParams
from megatron.inference.http_guard import Limits, guarded_protocol
from megatron.inference.ops import Leader, Model
from megatron.inference.session import complete, context_note
from tests.helpers.serving import fixture_tokenizer

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed ('.[serve]')")

POSITIONS, VOCAB = 32, 8192
BODY_TIMEOUT = 1.0
TEMPLATE = (  # the built-in plain one, unless the first message asks for a runaway
    "{% if messages[0].content == 'range' %}{% for i in range(10**9) %}x{% endfor %}{% endif %}"
    "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + chat_template.PLAIN
)


class ScriptedEngine:
    """Stands in for the transformer: always " x", except that a prompt starting with "end"
    gets end-of-document at position 5."""

    device = torch.device("cpu")
    vocab_size = VOCAB

    def __init__(self, tokenizer, positions: int = POSITIONS):
        self.model = SimpleNamespace(cfg=SimpleNamespace(max_positions=positions))
        (self.x,), (self.end,), self.eod = tokenizer.tokenize(" x"), tokenizer.tokenize("end"), 0

    def new_caches(self, batch: int, length: int) -> dict:
        return {}

    def flag_from_rank0(self, flag: bool) -> bool:  # one rank: its own
        return flag

    def next_token_logits(self, tokens, positions, caches) -> torch.Tensor:
        caches.setdefault("first", tokens[:, 0].clone())  # the first window starts each prompt
        logits = torch.zeros(tokens.size(0), VOCAB)  # (b, V)
        logits[:, self.x] = 1.0
        ending = (caches["first"] == self.end) & (positions[:, -1] + 1 >= 5)
        logits[ending, self.eod] = 2.0
        return logits


@pytest.fixture(scope="module")
def server():
    from megatron.inference.http_app import Scheduler, build_app

    tokenizer = fixture_tokenizer()
    model = Model(ScriptedEngine(tokenizer), tokenizer)
    scheduler = Scheduler(Leader(model, torch.device("cpu")))
    lines: list[str] = []
    limits = Limits(body_timeout=BODY_TIMEOUT)
    template = ChatTemplate(TEMPLATE, "the test's template", ("\nUser:",))
    app = build_app(scheduler, model, "m", limits, chat_template=template, log=lines.append)

    blocking = threading.Event()

    @app.post("/block")  # holds the event loop, as a long synchronous step would
    async def block():
        blocking.set()
        time.sleep(2 * BODY_TIMEOUT)
        return {}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=guarded_protocol(limits), log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    port = sock.getsockname()[1]
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, lines=lines, blocking=blocking)
    srv.should_exit = True
    thread.join(10)
    scheduler.close()


def _post(srv, path: str, content: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=content, timeout=30)


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    r = _post(server, "/v1/completions", b'{"prompt": ["ok", "a\\ud800"], "max_tokens": 2}')
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt[1]", r.text
    assert "lone UTF-16 surrogate at character 1" in err["message"], r.text
    chat = b'{"messages": [{"role": "user", "content": "\\udc00"}]}'
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    r = httpx.put(server.url + "/api", content=b'{"prompts": ["\\ud800"]}')
    assert r.status_code == 400 and "'prompts[0]' holds a lone" in r.json()["error"], r.text


def test_json_nested_100000_deep_is_a_400(server):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post(server, "/v1/completions", deep)
    assert r.status_code == 400 and "nested more deeply" in r.json()["error"]["message"], r.text
    r = httpx.put(server.url + "/api", content=deep)
    assert r.status_code == 400 and "nested more deeply" in r.json()["error"], r.text


def test_a_100000_digit_integer_is_a_400(server):
    r = _post(server, "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"1" * 100_000 + b"}")
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "an integer of more than 4300 digits" in message, r.text


def test_a_chat_template_that_runs_away_is_a_400_within_its_bound(server, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    for content, words in (("range", "Range too big"), ("loop", "ran for more than 0.5 s")):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        start = time.monotonic()
        r = _post(server, "/v1/chat/completions", json.dumps(body).encode())
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages", r.text
        assert "the test's template" in err["message"] and words in err["message"], r.text
        assert time.monotonic() - start < 3, content
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", json.dumps(ok).encode()).status_code == 200


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_408_only_when_the_body_did_not_arrive(server):
    # A body that arrived while the event loop was held past --body-timeout: it is read.
    body = b'{"prompt": "x", "max_tokens": 1}' + b" " * 2_000_000  # 2 MB: many reads
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    hold = b"POST /block HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    with (
        socket.create_connection(("127.0.0.1", server.port)) as sock,
        socket.create_connection(("127.0.0.1", server.port)) as blocker,
    ):
        sock.sendall(head.encode())  # its route starts waiting for the body, then
        time.sleep(0.1)
        blocker.sendall(hold)  # the event loop is held for 2 s
        assert server.blocking.wait(10)
        threading.Thread(target=sock.sendall, args=(body,), daemon=True).start()
        answer = _answer(sock)
        assert _answer(blocker).startswith(b"HTTP/1.1 200")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    # A body that stops coming: 408, saying how much came.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        sock.sendall(b'{"prompt":')
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"10 of 100 bytes came" in answer, answer
    assert time.monotonic() - start < BODY_TIMEOUT + 1.5


def _logged(srv, request) -> str:
    """The one log line of `request()` (written once its response is complete, so the lines
    of earlier requests may still come: wait until none does)."""
    before = -1
    while before != len(srv.lines):
        before = len(srv.lines)
        time.sleep(0.2)
    request()
    for _ in range(100):
        if len(srv.lines) > before:
            (line,) = srv.lines[before:]
            return line
        time.sleep(0.02)
    raise AssertionError(f"no log line; the last: {srv.lines[-3:]}")


def test_each_request_is_logged_in_one_line(server):
    def completion():
        assert _post(server, "/v1/completions", b'{"prompt": "hello", "max_tokens": 3}').is_success

    line = _logged(server, completion)
    assert line.startswith("[server] POST /v1/completions 200 1+3 tokens ") and line.endswith(" ms")

    async def streamed():
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": "hello you", "max_tokens": 4, "stream": True}
            r = await client.post(server.url + "/v1/completions", json=body)
            assert r.text.endswith("data: [DONE]\n\n")

    assert "POST /v1/completions 200 2+4 tokens" in _logged(server, lambda: asyncio.run(streamed()))
    api = {"prompts": ["hi"], "tokens_to_generate": 2}
    line = _logged(server, lambda: httpx.put(server.url + "/api", json=api))
    assert "PUT /api 200 ?+2 tokens" in line, line
    line = _logged(server, lambda: _post(server, "/v1/completions", b'{"prompt": 5}'))
    assert "POST /v1/completions 400 - " in line and "'prompt' must be" in line, line
    assert "GET /nope 404 - " in _logged(server, lambda: httpx.get(server.url + "/nope"))


def test_generation_ended_by_the_context_says_so_and_never_shows_eod(server):
    r = httpx.put(server.url + "/api", json={"prompts": ["end it"], "tokens_to_generate": 8})
    answer = r.json()
    assert r.status_code == 200 and answer["tokens"][0][-1] == 0, answer  # end-of-document
    assert answer["text"] == [" x x x"], answer  # and no <|endoftext|>
    chat = {"messages": [{"role": "user", "content": "hi"}]}  # the reply may fill the context
    r = _post(server, "/v1/chat/completions", json.dumps(chat).encode())
    assert r.json()["choices"][0]["finish_reason"] == "length", r.text
    # The generation tools: the context (here 32 positions) ends a request for 100 tokens.
    tokenizer = fixture_tokenizer()
    engine = ScriptedEngine(tokenizer)
    results = complete(engine, tokenizer, ["hello", "end"], SamplingParams(100, greedy=True))
    assert results[0]["finish_reason"] == "length" and len(results[0]["tokens"]) == 31
    assert "stopped at the context length (32 positions) after 31 of 100" in results[0]["note"]
    assert results[1]["finish_reason"] == "stop" and "note" not in results[1]
    assert "endoftext" not in results[1]["text"]
    assert context_note(results, "FIX").startswith("note: 1 of 2 generations stopped at")
