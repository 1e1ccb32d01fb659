"""A generation followed token by token: the text each step adds to each row, where a row ends
(end of document, a stop string, max_tokens), and the hand-off of those steps from the
generation thread to the HTTP event loop.

Every rank runs the same `RowsHook` inside generation.generate (it decides which rows stop, so
it must answer alike everywhere); only rank 0's hook has a `TokenStream` to emit events to.
Tokens need no extra communication: every rank already samples the same token. Stopping a
streamed request early (its client hung up) does: rank 0 decides, and one byte broadcast per
step (only for streamed requests; rank 0 is not the logits' source under PP) tells the others,
so every rank leaves the loop after the same step.

Text is held back while it may still change: the text of ids that do not yet end a whole
character (detokenizer.py, which decodes only a window of the latest ids, so a step costs the
same at any length) and a tail that begins a stop string (dropped if the stop string
completes). So the concatenated deltas equal the text a non-streamed request returns.

Events (plain dicts, rank 0 -> the HTTP side):
    {"row", "prompt": ids, "text", ["logprobs", "top"]}          echo: the prompt, first
    {"row", "token": id, "text": delta, ["logprob", "top"]}      one per generated token, end
                                                                 of document included
    {"row", "finish_reason": "stop" | "length", "text": rest}    once per row, last
    {"end": results} or {"error": message}                       last (http_app.Scheduler)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import torch

from megatron.inference.detokenizer import IncrementalText


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start (not the whole) of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class RowText:
    """One continuation fed a token at a time: what may be sent so far, and how it ended
    (`finish`: None while running, then "stop" or "length", as ops.complete's results say).

    Its text is `IncrementalText`'s: settled text, then the pending text that may still change.
    Only a bounded tail of it is kept: the `keep` characters a stop string may reach back into
    (the rest was searched and sent), so a step costs the same at any length."""

    def __init__(self, tokenizer, stops: list[str], max_tokens: int):
        self.tokenizer, self.stops, self.max_tokens = tokenizer, stops, max_tokens
        self.text = IncrementalText(tokenizer)
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.tail = ""  # the settled text's last `keep` characters (fewer at the start)
        self.start = 0  # where `tail` starts in the whole text
        self.sent = 0  # characters of the text already handed out (>= start)
        self.finish: str | None = None

    def _send(self, window: str, end: int) -> str:
        """window[sent - start : end], with `window` the whole text from `start` on."""
        end = max(end, self.sent - self.start)
        delta = window[self.sent - self.start : end]
        self.sent = self.start + end
        return delta

    def add(self, token: int) -> str:
        """The text to send after `token` ("" while held back); sets `finish` at the end."""
        if token == self.tokenizer.eod:
            self.finish = "stop"
            window = self.tail + self.text.pending
            return self._send(window, len(window))
        settled = self.tail + self.text.add(token)
        window = settled + self.text.pending  # the text from `start` on
        # A stop string wholly inside the previous settled text was found before.
        hits = [window.find(s) for s in self.stops if s in window]
        if hits:
            self.finish = "stop"
            return self._send(window, min(hits))
        if len(self.text.ids) >= self.max_tokens:
            self.finish = "length"
            return self._send(window, len(window))
        delta = self._send(settled, len(settled) - _stop_prefix(settled, self.stops))
        cut = max(len(settled) - self.keep, 0)
        self.tail, self.start = settled[cut:], self.start + cut
        return delta


class TokenStream:
    """The events of one streamed request, from the generation thread (put) to the event loop
    that created it (the `events` queue); `cancel()` from the loop asks generation to stop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    def put(self, event: dict) -> None:
        """From any thread; in order."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class RowsHook:
    """generation.generate's step hook for one request, on every rank: rows stop at their end
    of document, stop string or max_tokens; with `cancel` (a callable giving rank 0's
    decision on every rank, called once per step) all rows stop once it says so. With `stream`
    (rank 0 only) each step's tokens go out as events, with their log-probability and top
    `top_n` alternatives from that step's logits when `top_n` is not None."""

    def __init__(
        self,
        tokenizer,
        prompts: list[list[int]],
        stops: list[str],
        max_tokens: int,
        *,
        cancel: Callable[[], bool] | None = None,
        stream: TokenStream | None = None,
        top_n: int | None = None,
    ):
        self.lengths = [len(p) for p in prompts]
        self.rows = [RowText(tokenizer, stops, max_tokens) for _ in prompts]
        self.cancel, self.stream, self.top_n = cancel, stream, top_n
        self.cancelled = False

    def __call__(self, pos: int, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.cancel is not None and not self.cancelled:
            self.cancelled = self.cancel()
        stop = torch.ones(len(self.rows), dtype=torch.bool)
        if self.cancelled:
            return stop
        for i, row in enumerate(self.rows):
            if row.finish is not None or pos < self.lengths[i]:
                stop[i] = row.finish is not None
                continue
            token = int(tokens[i, pos])
            delta = row.add(token)
            if self.stream is not None:
                self._emit(i, token, delta, logits[i], row.finish)
            stop[i] = row.finish is not None
        return stop

    def _emit(self, row: int, token: int, delta: str, logits: torch.Tensor, finish) -> None:
        # The end-of-document token too is a token (with its log-probability), as in the
        # plain answer; its text is only what was held back before it.
        event = {"row": row, "token": token, "text": delta}
        if self.top_n is not None:
            lp = logits.float().log_softmax(-1)  # (V,): the model's, before temperature
            event["logprob"] = float(lp[token])
            values, ids = lp.topk(self.top_n)  # (top_n,) each
            event["top"] = [[int(t), float(v)] for t, v in zip(ids, values, strict=True)]
        self.stream.put(event)
        if finish is not None:
            self.stream.put({"row": row, "finish_reason": finish, "text": ""})
