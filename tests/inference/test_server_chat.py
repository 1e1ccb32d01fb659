"""POST /v1/chat/completions on a 1-rank server through the openai client, sync and async: greedy
chat equals /v1/completions on the prompt the plain template documents, chat logprobs equal the
completion's, the same seed gives the same reply, and what is refused is refused by name. A bad
--chat-template file stops the server before the model loads."""

import asyncio
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.serving import Server, make_checkpoint

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def add(a, b):"},
]
# The same conversation as docs/inference.md's plain template writes it (not rendered by us).
PLAIN_PROMPT = "You write Python.\n\nUser: def add(a, b):\n\nAssistant:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(make_checkpoint(tmp_path_factory.mktemp("chat")))
    yield srv
    assert srv.stop() == [0]
    log = srv.procs[0].stderr.read()
    # The fixture tokenizer (GPT-2 BPE files) has no chat template: said once, at start.
    assert log.count("uses the built-in 'plain' template") == 1, log


@pytest.mark.slow
def test_openai_client_chat_matches_completions_on_the_rendered_prompt(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="megatron", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    same = client.completions.create(
        model="megatron", prompt=PLAIN_PROMPT, temperature=0, max_tokens=8, logprobs=2,
        stop=["\nUser:"],
    )  # fmt: skip
    assert choice.message.content == same.choices[0].text and reply.usage.completion_tokens
    assert choice.finish_reason == same.choices[0].finish_reason
    assert reply.usage.model_dump() == same.usage.model_dump()
    content = choice.logprobs.content
    assert [t.token for t in content] == same.choices[0].logprobs.tokens
    assert [t.logprob for t in content] == same.choices[0].logprobs.token_logprobs
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy: the argmax
    # max_completion_tokens, OpenAI's current name, is honoured; by default the reply may fill
    # the context (64 positions).
    short = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_completion_tokens=2
    )
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
    long = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    assert long.usage.total_tokens == 64 or long.choices[0].finish_reason == "stop"
    # Streamed: a role chunk, the content in pieces that join to the same reply, the
    # finish_reason last, then the usage chunk (stream_options.include_usage).
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MESSAGES, temperature=0, max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == choice.message.content and len(pieces) > 2
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == reply.usage.model_dump()
    # n: independent samples, numbered from 0; the same seed gives the same two.
    two = [
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=6, n=2, seed=7, temperature=1.0
        )
        for _ in range(2)
    ]
    assert [c.index for c in two[0].choices] == [0, 1]
    texts = [[c.message.content for c in r.choices] for r in two]
    assert texts[0] == texts[1] and two[0].usage.completion_tokens <= 12
    # Refused by name, in OpenAI's error shape, which the client raises as BadRequestError.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, n=17)
    assert e.value.body["param"] == "n"
    tool = [{"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": tool}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"


@pytest.mark.slow
def test_async_client_seeded_samples_repeat(server):
    async def ask(seed: int) -> str:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x") as client:
            reply = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=6, seed=seed, temperature=1.0
            )
            return reply.choices[0].message.content

    async def streamed(seed: int) -> str:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x") as client:
            stream = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=6, seed=seed, temperature=1.0,
                stream=True,
            )  # fmt: skip
            return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def four():
        return await asyncio.gather(ask(1), ask(1), ask(2), streamed(1))

    a, b, _, s = asyncio.run(four())
    assert a == b == s and server.alive()


@pytest.mark.slow
def test_a_bad_chat_template_file_stops_the_server_at_start(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n{% endfro %}\n")
    tool = str(ROOT / "tools" / "run_text_generation_server.py")
    cmd = [sys.executable, tool, "--load", str(tmp_path / "unused"), "--chat-template", str(bad)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"--chat-template {bad}" in done.stderr and "line 3" in done.stderr, done.stderr
