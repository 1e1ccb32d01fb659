"""The FastAPI server on 127.0.0.1 with TP = 2 gloo ranks, through real HTTP clients (httpx,
the openai package, curl): OpenAI completions (and chat) with logprobs / echo / stop / seed / n /
best_of, streamed (server-sent events) and not, Megatron's PUT /api, /health, 50 concurrent
requests, bad input of every kind, clients that hang up (also mid-stream); and the bounded
queue on its own."""

import asyncio
import dataclasses
import json
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.paths import ROOT
from tests.helpers.serving import CFG, Server, convert, fixture_tokenizer, make_checkpoint

# Room for a stream long enough that stopping it early is plain to see.
LONG = dataclasses.replace(CFG, max_position_embeddings=2048)

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the same weights in one plain process."""
    model = GPTModel(LONG, BuildContext(seed=5))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :, : CFG.vocab_size].float()
    lp = logits.log_softmax(-1)[:-1]
    return lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpt = make_checkpoint(root / "tp1", LONG)
    convert(
        ["--load", ckpt, "--save", str(root / "tp2"), "--target-tensor-model-parallel-size", "2"]
    )
    srv = Server(str(root / "tp2"), world=2)
    yield srv
    codes = srv.stop()
    assert codes == [0, 0], codes  # SIGTERM to rank 0 stops both ranks cleanly


def _post(srv, body, path="/v1/completions", **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, timeout=120, **kw)


@pytest.mark.slow
def test_openai_completions_logprobs_echo_stop_seed(server):
    openai = pytest.importorskip("openai", reason="openai is not installed ('.[serve]')")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "def add(a, b):"
    ids = fixture_tokenizer().tokenize(prompt)
    # What lm-eval's local-completions sends for loglikelihood: echo, logprobs, ids as prompt.
    scored = client.completions.create(
        model="megatron", prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=1, seed=1
    )
    assert [c.index for c in scored.choices] == [0, 1]
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(ids) and lp.text_offset[0] == 0
    torch.testing.assert_close(
        torch.tensor(lp.token_logprobs[1:]), _reference_logprobs(ids), rtol=1e-4, atol=1e-4
    )
    for token_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= token_lp  # argmax is the top entry
    # Greedy generation with logprobs; /v1 and PUT /api agree on greedy text.
    greedy = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
    api = httpx.put(server.url + "/api", json={"prompts": [prompt], "tokens_to_generate": 6})
    assert api.status_code == 200 and api.json()["text"][0] == greedy.choices[0].text
    assert greedy.usage.completion_tokens == 6 and greedy.choices[0].finish_reason == "length"
    # A stop string cuts the text before it.
    text = greedy.choices[0].text
    stop = text[len(text) // 2 :][:3]
    cut = client.completions.create(
        model="m", prompt=prompt, max_tokens=6, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    # Sampling: the same seed gives the same text, per request.
    sample = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "top_k": 50, "top_p": 0.9}
    a, b = (_post(server, {**sample, "seed": 3}).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    many = _post(server, {**sample, "prompt": ["x = 1", "import os", "class A:"], "seed": 3})
    assert many.status_code == 200 and len(many.json()["choices"]) == 3
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


BAD = [
    (b"{not json", None, "not JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"prompt": 5}, "prompt", "'prompt'"),
    ({"prompt": ""}, "prompt", "'prompt'"),
    ({"prompt": [[1, -4]]}, "prompt", "ids in"),
    ({"prompt": [[10**12]]}, "prompt", "ids in"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens", "'max_tokens'"),
    ({"prompt": "x", "temperature": -1}, "temperature", "'temperature'"),
    ({"prompt": "x", "temperature": 1e-300}, "temperature", "'temperature'"),
    ({"prompt": "x", "top_p": 0}, "top_p", "'top_p'"),
    ({"prompt": "x", "top_k": 1.5}, "top_k", "'top_k'"),
    ({"prompt": "x", "logprobs": 100}, "logprobs", "'logprobs'"),
    ({"prompt": "x", "seed": -2}, "seed", "'seed'"),
    ({"prompt": "x", "echo": "yes"}, "echo", "'echo'"),
    ({"prompt": "x", "stop": [1]}, "stop", "'stop'"),
    ({"prompt": "x", "n": 17}, "n", "[1, 16]"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "at least 'n'"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of", "'stream'"),
    ({"prompt": "x", "stream": "yes"}, "stream", "'stream'"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "'stream'"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown fields"),
    ({"prompt": "x " * 500_000}, "prompt", "context of 2048"),  # a 1 MB prompt
]


@pytest.mark.slow
def test_bad_input_gets_a_4xx_naming_the_field_and_never_hurts_the_ranks(server):
    for body, field, words in BAD:
        r = _post(server, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and words in err["message"], (
            str(body)[:60],
            r.text[:200],
        )
    temperature = b'{"prompt": "x", "temperature": NaN}'
    assert _post(server, temperature).json()["error"]["param"] == "temperature"
    assert _post(server, b"x" * (9 << 20)).status_code == 413  # over the body limit
    assert (
        httpx.put(server.url + "/api", content=b'{"prompts": ["x"], "top_p": 2}').status_code == 400
    )
    assert httpx.get(server.url + "/nope").status_code == 404
    # A client that hangs up while its long request waits or runs.
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            body = json.dumps({"prompt": "def", "max_tokens": 60, "temperature": 0}).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            s.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + body)
    ok = _post(server, {"prompt": "x = ", "max_tokens": 2})
    assert ok.status_code == 200 and server.alive()


@pytest.mark.slow
def test_50_concurrent_requests_all_complete(server):
    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [{"prompt": f"x = {i}", "max_tokens": 3, "seed": i} for i in range(50)]
            return await asyncio.gather(
                *(client.post(server.url + "/v1/completions", json=b) for b in bodies)
            )

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 50
    assert all(r.json()["choices"][0]["text"] for r in answers)
    assert server.alive()


def _boundary_stop(pieces: list[str]) -> str:
    """A stop string whose first occurrence in the text straddles two tokens: the last character
    of one and the first of the next (a stream must hold the first back)."""
    text = "".join(pieces)
    end = 0
    for a, b in zip(pieces[:-1], pieces[1:], strict=True):
        end += len(a)
        stop = a[-1:] + b[:1]
        if len(stop) == 2 and text.find(stop) == end - 1:
            return stop
    raise AssertionError(f"no stop string straddles two tokens of {pieces}")


@pytest.mark.slow
def test_streams_through_the_openai_client_and_curl(server):
    openai = pytest.importorskip("openai", reason="openai is not installed ('.[serve]')")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0}
    plain = client.completions.create(**ask, logprobs=2)
    chunks = list(
        client.completions.create(
            **ask, logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    *tokens, last, use = chunks
    assert len({c.id for c in chunks}) == 1 and {c.object for c in chunks} == {"text_completion"}
    assert len(tokens) == 10 and all(c.choices[0].finish_reason is None for c in tokens)
    assert "".join(c.choices[0].text for c in tokens) == plain.choices[0].text
    assert (last.choices[0].text, last.choices[0].finish_reason) == ("", "length")
    assert use.choices == [] and use.usage == plain.usage  # OpenAI's include_usage
    want = plain.choices[0].logprobs
    got = [c.choices[0].logprobs for c in tokens]
    assert [g.tokens[0] for g in got] == want.tokens and [g.text_offset[0] for g in got] == (
        want.text_offset
    )
    torch.testing.assert_close(
        torch.tensor([g.token_logprobs[0] for g in got]), torch.tensor(want.token_logprobs)
    )
    # A stop string across two tokens: its first character is held back, then dropped.
    stop = _boundary_stop(want.tokens)
    text = plain.choices[0].text
    cut = client.completions.create(**ask, stop=stop).choices[0]
    streamed = list(client.completions.create(**ask, stop=stop, stream=True))
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    # Echo: the prompt is the first chunk.
    echoed = list(client.completions.create(**ask, echo=True, stream=True))
    assert echoed[0].choices[0].text == ask["prompt"]
    # The raw stream, as curl -N shows it: `data: {json}` events, then `data: [DONE]`.
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    raw = subprocess.run(
        [
            "curl",
            "-sN",
            "-D",
            "-",
            server.url + "/v1/completions",
            "-d",
            json.dumps({**ask, "stream": True}),
        ]
        + ["-H", "Content-Type: application/json"],
        capture_output=True,
        timeout=120,
    )
    head, _, body = raw.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream" in head.lower()
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], body[-200:]
    parsed = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-2])
    assert "".join(p["choices"][0]["text"] for p in parsed) == text and len(parsed) == 11


@pytest.mark.slow
def test_n_samples_best_of_async_streams_and_chat(server):
    openai = pytest.importorskip("openai", reason="openai is not installed ('.[serve]')")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "m", "prompt": ["x = 1", "import"], "max_tokens": 6, "seed": 11}
    first = client.completions.create(**ask, n=3, logprobs=0)
    assert [c.index for c in first.choices] == list(range(6))  # prompt-major
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in client.completions.create(**ask, n=3).choices]
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3  # independent samples
    assert first.usage.prompt_tokens == sum(
        len(fixture_tokenizer().tokenize(p)) for p in ask["prompt"]
    )
    # best_of 3 draws the same three samples and keeps the one of highest mean log-probability.
    best = client.completions.create(**ask, best_of=3)
    for p, choice in enumerate(best.choices):
        group = first.choices[3 * p : 3 * p + 3]
        means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in group]
        assert choice.index == p and choice.text == group[means.index(max(means))].text

    async def stream_both():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out: dict[int, list] = {}
        finish = {}
        async for chunk in await aclient.completions.create(**ask, n=3, stream=True):
            for c in chunk.choices:
                out.setdefault(c.index, []).append(c.text)
                finish[c.index] = c.finish_reason
        await aclient.close()
        return out, finish

    out, finish = asyncio.run(stream_both())
    assert ["".join(out[i]) for i in range(6)] == texts  # the same samples, streamed
    assert all(finish[i] in ("stop", "length") for i in range(6))
    # Chat on the TP = 2 server: the plain template's prompt (no template in the GPT-2 files),
    # streamed and not, n samples, equal to the completion of the rendered prompt.
    messages = [{"role": "user", "content": "import"}]
    plain = {"prompt": "User: import\n\nAssistant:", "stop": ["\nUser:"]}
    same = client.completions.create(model="m", **plain, max_tokens=6, n=2, seed=5)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6, n=2, seed=5)
    assert [c.message.content for c in chat.choices] == [c.text for c in same.choices]
    pieces: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, n=2, seed=5, stream=True
    ):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    assert [pieces[0], pieces[1]] == [c.message.content for c in chat.choices]


def _sse_events(sock: socket.socket, count: int) -> bytes:
    """Read from `sock` until `count` server-sent events have arrived."""
    got = b""
    while got.count(b"data: ") < count:
        part = sock.recv(4096)
        assert part, got
        got += part
    return got


@pytest.mark.slow
def test_a_client_hanging_up_mid_stream_stops_the_generation_on_every_rank(server):
    greedy = {"prompt": "def", "temperature": 0}
    before = _post(server, {**greedy, "max_tokens": 20}).json()["choices"][0]["text"]
    started = time.monotonic()
    assert _post(server, {**greedy, "max_tokens": 200}).status_code == 200
    steps_200 = time.monotonic() - started  # what 200 steps cost on this machine now
    body = json.dumps({**greedy, "max_tokens": 2000, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + body)
        assert b"text/event-stream" in _sse_events(s, 2)
    hung_up = time.monotonic()
    # Left running, the 2000 steps would hold the ranks for about 10 x steps_200. Stopped, the
    # next request (20 steps) runs at once, and gives the same text: every rank left the loop
    # after the same step.
    again = _post(server, {**greedy, "max_tokens": 20}).json()["choices"][0]["text"]
    waited = time.monotonic() - hung_up
    assert again == before and waited < steps_200, (waited, steps_200)
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "queued": 0}
    assert server.alive()


class _SlowLeader:
    def __init__(self):
        self.ran, self.release = [], threading.Event()

    def run(self, op, args, stream=None):
        self.release.wait(10)
        self.ran.append(args["i"])
        return args["i"]

    def stop(self):
        self.ran.append("stop")


def test_queue_is_bounded_skips_cancelled_jobs_and_stops_the_ranks_last():
    from megatron.inference.http_app import QUEUE_SIZE, Busy, Scheduler

    leader = _SlowLeader()
    scheduler = Scheduler(leader)
    futures = [scheduler.submit("score", {"i": 0})]
    time.sleep(0.2)  # the worker takes job 0 and blocks in it
    futures += [scheduler.submit("score", {"i": i}) for i in range(1, QUEUE_SIZE + 1)]
    with pytest.raises(Busy):
        scheduler.submit("score", {"i": -1})
    assert futures[1].cancel()  # its client hung up before its turn
    leader.release.set()
    assert [f.result(10) for f in futures[2:5]] == [2, 3, 4]
    scheduler.close()
    assert 1 not in leader.ran and leader.ran[-1] == "stop" and leader.ran[0] == 0


class _StreamingLeader:
    def run(self, op, args, stream=None):
        stream.put({"row": 0, "token": 1, "text": "a"})
        if args["fail"]:
            raise RuntimeError("boom")
        return ["result"]

    def stop(self):
        pass


def test_a_streamed_job_ends_with_its_result_or_its_error_after_its_steps():
    from megatron.inference.http_app import Scheduler
    from megatron.inference.streaming import TokenStream

    scheduler = Scheduler(_StreamingLeader())

    async def events(fail: bool) -> list:
        stream = TokenStream()
        future = scheduler.submit("complete", {"fail": fail}, stream)
        got = [await asyncio.wait_for(stream.events.get(), 10) for _ in range(2)]
        assert stream.events.empty() and not future.cancelled()
        return got

    assert asyncio.run(events(False)) == [{"row": 0, "token": 1, "text": "a"}, {"end": ["result"]}]
    assert asyncio.run(events(True))[1] == {"error": "boom"}
    scheduler.close()


def test_training_and_the_inference_tools_import_no_web_framework_or_lm_eval():
    import subprocess
    import sys

    code = (
        "import sys, pretrain_gpt2, megatron.training.loop, megatron.inference.server, "
        "megatron.inference.evaluate_cli, megatron.inference.generate_cli\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'lm_eval', 'openai') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout
