"""A prompt longer than the model's context is refused before it is tokenized in full, on every
route that tokenizes text (/v1/completions, /v1/chat/completions, PUT /api): by the character
bound of byte-level BPE, else by counting pieces up to the limit; a prompt that fits gets the
ids of the whole text. And a request that names no model gets the served one."""

import json
import time

import pytest

from megatron.inference import chat, openai_api, prompt_tokens
from megatron.inference.chat_template import from_flag
from megatron.inference.megatron_api import BadRequest, check_length, parse_request
from megatron.inference.prompt_tokens import tokenize_within
from tests.helpers.serving import fixture_tokenizer

EIGHT_MB = 4 << 20  # "x " repeated: 8 MB of text, under the server's body limit with JSON


class Counting:
    """The fixture tokenizer, counting the characters it is asked to tokenize; `bound` False
    hides its character bound, so only the pieces stop the count."""

    def __init__(self, bound: bool = True):
        self.tok = fixture_tokenizer()
        self.piece_cut, self.eod = self.tok.piece_cut, self.tok.eod
        self.vocab_size = self.tok.vocab_size
        self.max_token_chars = self.tok.max_token_chars if bound else None
        self.chars = 0

    def tokenize(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.tok.tokenize(text)

    def detokenize(self, ids) -> str:
        return self.tok.detokenize(ids)


def _completion(tok, body: dict, served: str = "megatron") -> dict:
    return openai_api.completion_args(json.dumps(body).encode(), tok, 64, 8192, served)


@pytest.mark.parametrize(
    "bound, text",
    [(True, "x " * EIGHT_MB), (True, "y" * (2 * EIGHT_MB)), (False, "x " * EIGHT_MB)],
    ids=["char-bound", "char-bound-no-spaces", "pieces"],
)
def test_an_8_mb_prompt_is_refused_without_tokenizing_it(bound, text):
    tok = Counting(bound)
    start = time.perf_counter()
    with pytest.raises(openai_api.FieldError) as e:
        _completion(tok, {"prompt": text, "max_tokens": 4})
    assert e.value.field == "prompt" and "longer than 64 tokens" in str(e.value)
    assert "context of 64" in str(e.value)
    assert tok.chars <= (0 if bound else 2 * prompt_tokens.PIECE_CHARS), tok.chars
    assert time.perf_counter() - start < 2


def test_every_route_refuses_it_so():
    tok = Counting()
    huge = "x " * EIGHT_MB
    with pytest.raises(BadRequest, match="a prompt is longer than 64 tokens"):
        req = parse_request(json.dumps({"prompts": ["ok", huge], "tokens_to_generate": 4}).encode())
        check_length(req, tok, 64)
    body = {"messages": [{"role": "user", "content": huge}]}
    with pytest.raises(openai_api.FieldError, match="longer than 63 tokens") as e:
        chat.chat_args(json.dumps(body).encode(), tok, 64, 8192, from_flag("plain"))
    assert e.value.field == "messages"
    assert tok.chars == 2  # "ok": the huge ones were never tokenized


def test_a_prompt_that_fits_gets_the_ids_of_the_whole_text(monkeypatch):
    monkeypatch.setattr(prompt_tokens, "PIECE_CHARS", 8)  # many pieces
    text = "def add(a, b):\n    return a + b\n\n  x = [1,  2]   # café 🙂\n" * 2
    whole = fixture_tokenizer().tokenize(text)
    for bound in (True, False):
        tok = Counting(bound)
        assert tokenize_within(tok, text, len(whole)) == whole
        assert tokenize_within(tok, text, len(whole) - 1) is None
    # The character bound is the longest token's bytes: never below a text's ids.
    assert fixture_tokenizer().max_token_chars * len(whole) >= len(text.encode())


def test_a_request_that_names_no_model_gets_the_served_one():
    tok = fixture_tokenizer()
    for body in ({"prompt": "x"}, {"prompt": "x", "model": None}):  # lm-eval sends null
        assert _completion(tok, body, served="gpt-tiny")["model"] == "gpt-tiny"
    assert _completion(tok, {"prompt": "x", "model": "m"})["model"] == "m"
    with pytest.raises(openai_api.FieldError, match="'model' must be a string"):
        _completion(tok, {"prompt": "x", "model": 3})
    messages = {"messages": [{"role": "user", "content": "Hi"}], "model": None}
    args = chat.chat_args(json.dumps(messages).encode(), tok, 64, 8192, from_flag("plain"), "g")
    assert args["model"] == "g"
