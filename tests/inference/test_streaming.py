"""Streamed completions in one process (no server): text is held back while it may still become
a stop string or a whole character, a streamed request gives the plain request's texts and
log-probabilities, n samples and best_of, a cancel stops generation, and the chunks and the
server-sent-event framing the openai client reads."""

import asyncio
import json

import pytest
import torch

from megatron import mpu
from megatron.inference import openai_api, openai_stream
from megatron.inference.engine import InferenceModel
from megatron.inference.ops import Model, complete
from megatron.inference.streaming import RowText
from megatron.model.context import BuildContext
from megatron.models.gpt.model import build_model
from tests.helpers.serving import CFG, fixture_tokenizer, lean_to_eod


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    state = mpu.single_process_state()
    chunks = build_model(CFG, BuildContext(state, seed=5))
    return Model(InferenceModel(chunks, state, CFG.vocab_size, CFG.hidden_size), tokenizer)


@pytest.fixture(scope="module")
def eod_model(tokenizer):
    """The model of `model`, leaning to end-of-document (it ends about half the positions)."""
    state = mpu.single_process_state()
    chunks = build_model(CFG, BuildContext(state, seed=5))
    lean_to_eod(chunks[0].state_dict())
    return Model(InferenceModel(chunks, state, CFG.vocab_size, CFG.hidden_size), tokenizer)


def _feed(tokenizer, text: str, stops: list[str], max_tokens: int = 1000, eod: bool = False):
    row, deltas = RowText(tokenizer, stops, max_tokens), []
    for t in tokenizer.tokenize(text) + ([tokenizer.eod] if eod else []):
        deltas.append(row.add(t))
        if row.finish:
            break
    return deltas, row.finish


@pytest.mark.parametrize(
    "text, stops, expected, finish",
    [
        ("x = foo(bar) + 1", ["(bar)"], "x = foo", "stop"),
        ("x = foo(bar) + 1", ["(baz", "o("], "x = fo", "stop"),
        ("x = foo(b", ["(bar"], "x = foo(b", "stop"),  # a stop's start, then the document ends
        ("caf\u00e9 \U0001f642 ok", [], "caf\u00e9 \U0001f642 ok", "stop"),  # split characters
    ],
)
def test_row_text_never_sends_what_may_still_change(tokenizer, text, stops, expected, finish):
    deltas, got = _feed(tokenizer, text, stops, eod=True)
    assert "".join(deltas) == expected and got == finish
    sent = ""
    for d in deltas:  # every delta extends a prefix of the final text: nothing is taken back
        sent += d
        assert expected.startswith(sent) and "\ufffd" not in d
    deltas, got = _feed(tokenizer, "one two three four", [], max_tokens=2)
    assert "".join(deltas) == "one two" and got == "length"


class _Stream:
    """What rank 0's TokenStream does, without an event loop; cancels after `after` events."""

    def __init__(self, after: int | None = None):
        self.events, self.after = [], after

    def put(self, event):
        self.events.append(event)

    @property
    def cancelled(self):
        return self.after is not None and len(self.events) >= self.after


def _args(model, **req):
    body = json.dumps({"max_tokens": 12, "seed": 4, **req}).encode()
    return openai_api.completion_args(body, model.tokenizer, CFG.max_positions, CFG.vocab_size)


def _texts(events, rows):
    texts = {r: "" for r in range(rows)}
    finish = {}
    for e in events:
        if "prompt" in e:
            assert texts[e["row"]] == "", "the prompt comes first"
        texts[e["row"]] += e.get("text", "")
        if "finish_reason" in e:
            assert e["row"] not in finish, "one finish per row"
            finish[e["row"]] = e["finish_reason"]
    return texts, finish


@pytest.mark.slow  # seconds on 2 cores
@pytest.mark.parametrize(
    "req",
    [
        {"prompt": ["def add(a, b):", "import"], "temperature": 0, "logprobs": 2},
        {"prompt": ["x = 1", "class A:"], "n": 3, "top_k": 40, "stop": [" ", "e"]},
        {"prompt": "def add(a, b):", "n": 2, "echo": True, "logprobs": 0, "max_tokens": 0},
    ],
    ids=["greedy-logprobs", "n3-stops", "echo-max0"],
)
def test_a_streamed_request_gives_the_plain_answer(model, req):
    args = _args(model, **req)
    plain = complete(model, args)
    stream = _Stream()
    streamed = complete(model, {**args, "stream": True}, stream)
    assert [r["ids"] for r in streamed] == [r["ids"] for r in plain]
    texts, finish = _texts(stream.events, len(plain))
    for i, r in enumerate(plain):
        prompt = openai_api.prompt_of(args, i)
        echo = model.tokenizer.detokenize(prompt) if args["echo"] else ""
        assert texts[i] == echo + r["text"] and finish[i] == r["finish_reason"], i
    if args["logprobs"] is not None and args["max_tokens"]:
        for i, r in enumerate(plain):
            lps = [e["logprob"] for e in stream.events if e["row"] == i and "token" in e]
            start = len(openai_api.prompt_of(args, i)) - 1
            want = torch.tensor(r["logprobs"][start : start + len(lps)])
            torch.testing.assert_close(torch.tensor(lps), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_n_samples_differ_repeat_with_the_seed_and_best_of_keeps_the_likeliest(model):
    args = _args(model, prompt=["x = 1", "import"], n=3, max_tokens=6)
    first = [r["text"] for r in complete(model, args)]
    assert first == [r["text"] for r in complete(model, args)]  # the seed repeats them
    assert len(set(first[:3])) == 3 and len(set(first[3:])) == 3  # independent samples
    scored = complete(model, {**args, "logprobs": 0})
    best = complete(model, {**args, "n": 1, "best_of": 3})  # the same 3 samples, ranked
    for p in range(2):
        group = scored[3 * p : 3 * p + 3]
        means = [sum(r["logprobs"][-len(r["ids"]) :]) / len(r["ids"]) for r in group]
        assert best[p]["text"] == group[means.index(max(means))]["text"]
    assert len(best) == 2


def test_a_cancel_stops_every_row_at_once(model):
    args = _args(model, prompt=["x = 1", "import os"], max_tokens=40, temperature=0, stream=True)
    stream = _Stream(after=5)
    results = complete(model, args, stream)
    assert all(len(r["ids"]) <= 4 for r in results), [len(r["ids"]) for r in results]


def test_validation_of_n_best_of_and_stream(model):
    for req, field, words in [
        ({"n": 17}, "n", "[1, 16]"),
        ({"n": 0}, "n", "[1, 16]"),
        ({"n": 3, "best_of": 2}, "best_of", "at least 'n'"),
        ({"best_of": 17}, "best_of", "16"),
        ({"best_of": 2, "stream": True}, "best_of", "'stream'"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "'stream': true"),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options", "include_usage"),
        ({"prompt": ["a"] * 9, "n": 16}, "n", "128 sequences"),
    ]:
        with pytest.raises(openai_api.FieldError, match=words) as e:
            _args(model, **{"prompt": "x", **req})
        assert e.value.field == field, req
    args = _args(model, prompt="x", n=2, stream=True, stream_options={"include_usage": True})
    assert (args["n"], args["best_of"], args["stream"], args["include_usage"]) == (2, 2, True, True)


def test_chunks_and_their_framing(model):
    args = _args(model, prompt="x = 1", n=2, logprobs=1, stream=True)
    args["include_usage"] = True
    stream = _Stream()
    results = complete(model, args, stream)

    async def events():
        for e in [*stream.events, {"end": results}]:
            yield e

    async def collect():
        return [c async for c in openai_stream.completion_chunks(args, events(), model.tokenizer)]

    chunks = asyncio.run(collect())
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == openai_api.usage(args, results)
    body = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"] is None]
    assert len(body) == sum(len(r["ids"]) for r in results)  # one chunk per token (no stops)
    for i, r in enumerate(results):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == r["text"]
        assert [c["logprobs"]["tokens"][0] for c in mine] == [
            model.tokenizer.detokenize([t]) for t in r["ids"]
        ]
    assert all(c["usage"] is None for c in chunks[:-1])
    frame = openai_stream.sse(chunks[0])
    assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n") and frame.count(b"\n") == 2
    assert openai_stream.DONE == b"data: [DONE]\n\n"

    async def failing():
        yield {"error": "boom"}

    (err,) = asyncio.run(_all(openai_stream.completion_chunks(args, failing(), model.tokenizer)))
    assert err["error"]["type"] == "server_error" and "boom" in err["error"]["message"]


async def _all(agen):
    return [x async for x in agen]


def test_a_generated_end_of_document_is_a_token_not_text(eod_model):
    """As OpenAI and vLLM: the end-of-document token that ends a choice is in its logprobs
    (with its log-probability) and usage, streamed or not, but not in its text; so echo +
    logprobs hold the prompt and every generated token (what lm-eval's log-likelihoods
    count on: it drops the last token as the generated one)."""
    tok = eod_model.tokenizer
    prompts = ["The quick brown fox", "def add(a, b):", "import", "for i in range(10):"]
    args = _args(eod_model, prompt=prompts, temperature=0, echo=True, logprobs=1, max_tokens=8)
    results = complete(eod_model, args)
    body = openai_api.completion_response(args, results, tok)
    ended = 0
    for i, (r, c) in enumerate(zip(results, body["choices"], strict=True)):
        prompt = args["prompts"][i]
        assert len(c["logprobs"]["tokens"]) == len(prompt) + len(r["ids"])
        if r["ids"][-1] == tok.eod:
            ended += 1
            assert c["finish_reason"] == "stop" and c["logprobs"]["tokens"][-1] == "<|endoftext|>"
            assert c["text"] == tok.detokenize(prompt + r["ids"][:-1])  # not in the text
    assert ended >= 2, [r["ids"] for r in results]
    assert body["usage"]["completion_tokens"] == sum(len(r["ids"]) for r in results)
    stream = _Stream()
    complete(eod_model, {**args, "stream": True}, stream)
    texts, _ = _texts(stream.events, len(results))
    for i, r in enumerate(results):
        tokens = [e for e in stream.events if e["row"] == i and "token" in e]
        assert [e["token"] for e in tokens] == r["ids"]
        got = torch.tensor([e["logprob"] for e in tokens])
        want = torch.tensor(r["logprobs"][len(args["prompts"][i]) - 1 :])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert texts[i] == body["choices"][i]["text"]
