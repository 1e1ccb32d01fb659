"""/v1/chat/completions without a server: chat templates (built-in, file, a Hugging Face
tokenizer's own, checked against transformers' apply_chat_template), request validation, and
the reshaping of text_completion bodies and streaming chunks into chat ones."""

import json

import pytest

from megatron.data.tokenizers import build_tokenizer
from megatron.inference import chat, openai_api
from megatron.inference.chat_template import ChatTemplate, from_flag, resolve
from megatron.inference.openai_api import FieldError
from tests.helpers.paths import MMAP

pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install -e '.[serve]')")

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
# A Qwen-like template: bos_token, role alternation enforced with raise_exception, a loop control.
HF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.previtem is defined and loop.previtem['role'] == 'user' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% if loop.index > 50 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )


def _hf_tokenizer_dir(folder, config: dict, jinja: str | None = None):
    """A tiny word-level tokenizer.json with tokenizer_config.json (and chat_template.jinja)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "Hi", "Be", "brief"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_builtin_templates_render_as_documented(gpt2):
    plain = resolve(None, gpt2, log=lambda line: None)
    assert plain.render(MESSAGES) == (
        "Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: 2+2?\n\nAssistant:"
    )
    assert plain.stops == ("\nUser:",)
    said = []
    resolve(None, gpt2, log=said.append)
    assert len(said) == 1 and "no chat template" in said[0] and "'plain'" in said[0]
    chatml = resolve(from_flag("chatml"), gpt2, log=said.append)
    assert len(said) == 1  # a chosen template is not announced
    assert chatml.render(MESSAGES[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.stops == ("<|im_end|>",)


def test_a_tokenizer_template_renders_as_transformers_does(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = {"chat_template": HF_TEMPLATE, "eos_token": "<|endoftext|>"}
    folder = _hf_tokenizer_dir(tmp_path / "tok", config)
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    template = resolve(None, ours, log=pytest.fail)  # the tokenizer has one: nothing to say
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in (MESSAGES, MESSAGES[1:2], [{"role": "user", "content": " Hi  "}]):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == expected
    assert template.stops == ("<|im_end|>", "<|endoftext|>")  # the marker, then eos_token
    assert "tokenizer_config.json" in template.origin
    # The template's own refusal is the client's 400 on 'messages'.
    twice = json.dumps({"messages": [MESSAGES[1], MESSAGES[1]]}).encode()
    with pytest.raises(FieldError, match="roles must alternate") as e:
        chat.chat_args(twice, ours, 64, ours.vocab_size, template)
    assert e.value.field == "messages"
    # Special tokens in the rendered text are their ids, as transformers tokenizes them.
    args = chat.chat_args(json.dumps({"messages": MESSAGES[1:2]}).encode(), ours, 64, 99, template)
    assert args["prompts"][0][:3] == [1, 3, ours.tokenize("user")[0]]
    # --chat-template wins over the tokenizer's; chat_template.jinja wins over the config's.
    assert resolve(from_flag("plain"), ours).render(MESSAGES[1:2]) == "User: Hi\n\nAssistant:"
    named = {"chat_template": [{"name": "default", "template": "{{ 'named' }}"}]}
    jinja_dir = _hf_tokenizer_dir(tmp_path / "jinja", named, jinja="{{ 'from the jinja file' }}")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=jinja_dir)
    assert resolve(None, tok).render(MESSAGES) == "from the jinja file"
    (jinja_dir / "chat_template.jinja").unlink()
    assert resolve(None, tok).render(MESSAGES) == "named"


def test_template_files_and_bad_templates(tmp_path, gpt2):
    good = tmp_path / "turns.jinja"
    good.write_text(
        "{% for m in messages %}<|user|>{{ m.content }}<|end|>\n{% endfor %}<|assistant|>"
    )
    template = resolve(from_flag(str(good)), gpt2)
    assert template.render(MESSAGES[1:2]) == "<|user|>Hi<|end|>\n<|assistant|>"
    assert template.stops == ("<|end|>",)  # a known end-of-turn marker found in the file
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ValueError, match=rf"--chat-template {bad}: .*line 2") as e:
        from_flag(str(bad))
    assert "{{ m.content }" in str(e.value)  # the offending line is quoted
    with pytest.raises(ValueError, match="not a built-in template; .* plain, chatml"):
        from_flag(str(tmp_path / "missing.jinja"))
    # The template inline, as vLLM takes it; its syntax errors are named the same way.
    inline = resolve(from_flag(good.read_text()), gpt2)
    assert inline.render(MESSAGES[1:2]) == template.render(MESSAGES[1:2])
    assert inline.origin == "--chat-template (inline)" and inline.stops == ("<|end|>",)
    with pytest.raises(ValueError, match=r"--chat-template \(inline\): .*line 1"):
        from_flag("{{ m.content }")
    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="UTF-8"):
        from_flag(str(tmp_path / "latin1.jinja"))
    # The sandbox: a template cannot reach Python internals.
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", "escape")
    with pytest.raises(ValueError, match="escape refused the messages"):
        escape.render(MESSAGES)


def _args(gpt2, body, template=None):
    template = template or from_flag("plain")
    return chat.chat_args(json.dumps(body).encode(), gpt2, 64, gpt2.vocab_size, template)


def test_chat_args_are_the_completion_args_of_the_rendered_prompt(gpt2):
    body = {"messages": MESSAGES, "temperature": 0, "seed": 5, "stop": "!", "top_k": 3}
    body |= {"logprobs": True, "top_logprobs": 2, "max_completion_tokens": 4, "user": "u"}
    text = "Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: 2+2?\n\nAssistant:"
    completion = {"prompt": text, "temperature": 0, "seed": 5, "top_k": 3, "max_tokens": 4}
    completion |= {"stop": ["!", "\nUser:"], "logprobs": 2}
    expected = openai_api.completion_args(json.dumps(completion).encode(), gpt2, 64, 8192)
    assert _args(gpt2, body) == expected
    # Defaults: the reply may fill the context; no logprobs; content parts join with newlines.
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    args = _args(gpt2, {"messages": [{"role": "developer", "content": parts}]})
    assert args["prompts"] == [gpt2.tokenize("Hi\nthere\n\nAssistant:")]
    assert args["max_tokens"] == 64 - len(args["prompts"][0]) and args["logprobs"] is None
    assert _args(gpt2, {"messages": MESSAGES, "logprobs": True})["logprobs"] == 0


BAD = [
    (b"{not json", None, "not JSON"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "Hi"}, "messages", "non-empty list"),
    ({"messages": ["Hi"]}, "messages[0]", "'role' and 'content'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": "x", "mood": 1}]}, "messages[0].mood", "unknown"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
        "'image_url' part",
    ),
    ({"messages": [{"role": "user", "content": "x " * 100}]}, "messages", "context of 64"),
    ({"messages": MESSAGES, "stream": 1}, "stream", "true or false"),
    ({"messages": MESSAGES, "stream_options": {}}, "stream_options", "with 'stream': true"),
    ({"messages": MESSAGES, "logprobs": 2}, "logprobs", "true or false"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "[1, 64]"),
    ({"messages": MESSAGES, "max_completion_tokens": 60}, "max_completion_tokens", "context"),
    (
        {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 3},
        "max_completion_",
        "differ",
    ),
    ({"messages": MESSAGES, "temperature": -1}, "temperature", "'temperature'"),
    ({"messages": MESSAGES, "n": 17}, "n", "[1, 16]"),
    ({"messages": MESSAGES, "stop": ["a"] * 16}, "stop", "at most 15"),
    ({"messages": MESSAGES, "tools": []}, "tools", "unknown fields"),
]


@pytest.mark.parametrize("body, field, words", BAD, ids=[str(b[1]) for b in BAD])
def test_bad_chat_requests_name_the_field(gpt2, body, field, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(FieldError) as e:
        chat.chat_args(raw, gpt2, 64, gpt2.vocab_size, from_flag("plain"))
    assert e.value.field is None if field is None else e.value.field.startswith(field)
    assert words in str(e.value)


def test_a_completion_body_becomes_a_chat_completion():
    logprobs = {
        "tokens": [" 4", "."],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{" 4": -0.5, " 5": -2.0}, {".": -1.0, "é": -3.0}],
        "text_offset": [0, 2],
    }
    completion = {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "text": " 4.", "logprobs": logprobs, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    body = chat.from_completion(completion)
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    assert body["created"] == 7 and body["usage"] == completion["usage"]
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " 4."}
    assert choice["finish_reason"] == "stop"
    second = choice["logprobs"]["content"][1]
    assert second["token"] == "." and second["logprob"] == -1.0 and second["bytes"] == [46]
    assert second["top_logprobs"][1] == {"token": "é", "logprob": -3.0, "bytes": [195, 169]}


def _chunk(choices, **extra):
    return {"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "m",
            "choices": choices, **extra}  # fmt: skip


def test_streaming_chunks_map_to_chat_chunks():
    text = lambda i, t, reason=None: {"index": i, "text": t, "logprobs": None,
                                      "finish_reason": reason}  # fmt: skip
    stream = [
        _chunk([text(0, " Hel")]),
        _chunk([text(1, " Yo")]),  # n = 2: the second choice starts later
        _chunk([text(0, "lo")]),
        _chunk([text(0, "", "stop")]),
        _chunk([text(1, "!", "length")]),  # text and finish_reason in one chunk
        _chunk([], usage={"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}),
    ]
    out, started = [], frozenset()
    for c in stream:
        chunks, started = chat.chunk_from_completion(c, started)
        out += chunks
    assert started == {0, 1}
    assert {c["id"] for c in out} == {"chatcmpl-s"}
    assert {c["object"] for c in out} == {"chat.completion.chunk"}
    assert all(c["created"] == 1 and c["model"] == "m" for c in out)
    seen = [
        (c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
        for c in out[:-1]
    ]
    assert seen == [
        (0, {"role": "assistant", "content": ""}, None),
        (0, {"content": " Hel"}, None),
        (1, {"role": "assistant", "content": ""}, None),
        (1, {"content": " Yo"}, None),
        (0, {"content": "lo"}, None),
        (0, {}, "stop"),
        (1, {"content": "!"}, None),
        (1, {}, "length"),
    ]
    assert out[-1]["choices"] == [] and out[-1]["usage"]["total_tokens"] == 5
    # Pure: the same chunk and state give the same answer, and the state is not changed.
    state = frozenset({0})
    assert chat.chunk_from_completion(stream[2], state) == chat.chunk_from_completion(
        stream[2], state
    )
    assert state == {0}
    # Logprobs of a chunk's tokens go out with its text, in chat's shape.
    lp = {"tokens": ["lo"], "token_logprobs": [-0.25], "top_logprobs": [{"lo": -0.25}],
          "text_offset": [4]}  # fmt: skip
    (content,), _ = chat.chunk_from_completion(_chunk([{**text(0, "lo"), "logprobs": lp}]), state)
    assert content["choices"][0]["logprobs"]["content"][0]["token"] == "lo"
