"""The FastAPI server on 127.0.0.1 with TP = 2 gloo ranks, through real HTTP clients (httpx
and the openai package): OpenAI completions with logprobs / echo / stop / seed, Megatron's
PUT /api, /health, 50 concurrent requests, bad input of every kind, a client that hangs up;
and the bounded queue on its own."""

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.serving import CFG, Server, convert, make_checkpoint

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[serve]')")
pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")


def _tokenizer():
    from megatron.data.tokenizers import build_tokenizer

    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_size=CFG.vocab_size,
        vocab_file=str(MMAP / "vocab.json"),
        merge_file=str(MMAP / "merges.txt"),
    )


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the same weights in one plain process."""
    model = GPTModel(CFG, BuildContext(seed=5))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :, : CFG.vocab_size].float()
    lp = logits.log_softmax(-1)[:-1]
    return lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpt = make_checkpoint(root / "tp1")
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
    ids = _tokenizer().tokenize(prompt)
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
    ({"prompt": "x", "n": 2}, "n", "'n'"),
    ({"prompt": "x", "stream": True}, "stream", "'stream'"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown fields"),
    ({"prompt": "x " * 500_000}, "max_tokens", "context of 64"),  # a 1 MB prompt
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
