"""A streamed POST /v1/completions: the events of one streamed ops.complete (streaming.py) as
OpenAI's text_completion chunks, and the server-sent-event framing the openai client and vLLM
use: each chunk one `data: {json}` event, then `data: [DONE]`.

    echo        the prompt (with its log-probabilities) first, one chunk per choice
    per token   its text (held back while it may still become a stop string), finish_reason
                null, and with logprobs that token's log-probability and top alternatives
    last        per choice: text "" (or the rest of a held-back tail) and its finish_reason
    usage       with stream_options.include_usage: choices [] and the usage, after all choices

A chat route streams the same request: it maps each of these chunks to a chat.completion.chunk
and frames it with `sse`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from megatron.inference.openai_api import (
    error_body,
    head,
    logprobs_body,
    prompt_of,
    top_dict,
    usage,
)

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def completion_chunks(
    args: dict, events: AsyncIterator[dict], tokenizer
) -> AsyncIterator[dict]:
    """The text_completion chunks (one id for all) of a streamed request's events, in order;
    an {"error"} event becomes OpenAI's error object and ends the stream."""
    top = head(args)
    tail = {"usage": None} if args["include_usage"] else {}  # as OpenAI, with include_usage
    offsets: dict[int, int] = {}  # choice -> text_offset of its next token

    def chunk(row: int, text: str, logprobs=None, finish=None) -> dict:
        choice = {"index": row, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**top, "choices": [choice], **tail}

    async for event in events:
        if "error" in event:
            yield error_body(f"completion failed: {event['error']}", None, "server_error")
            return
        if "end" in event:
            if args["include_usage"]:
                yield {**top, "choices": [], "usage": usage(args, event["end"])}
            return
        row = event["row"]
        prompt = prompt_of(args, row)
        if row not in offsets:
            offsets[row] = 0 if args["echo"] else len(tokenizer.detokenize(prompt))
        if "prompt" in event:
            logprobs = None
            if args["logprobs"] is not None:
                logprobs = logprobs_body(tokenizer, prompt, event, 0, 0)
                offsets[row] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            yield chunk(row, event["text"], logprobs)
        elif "token" in event:
            logprobs = None
            if args["logprobs"] is not None:
                piece = tokenizer.detokenize([event["token"]])
                logprobs = {
                    "tokens": [piece],
                    "token_logprobs": [event["logprob"]],
                    "top_logprobs": [top_dict(tokenizer, event["top"])],
                    "text_offset": [offsets[row]],
                }
                offsets[row] += len(piece)
            yield chunk(row, event["text"], logprobs)
        else:
            yield chunk(row, event["text"], None, event["finish_reason"])
