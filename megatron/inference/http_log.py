"""One line per request on rank 0's stderr, when its response is complete (a stream: at its end):

    [server] POST /v1/completions 200 12+16 tokens 153 ms
    [server] POST /v1/completions 400 - 2 ms: 'prompt[0]' holds a lone UTF-16 surrogate ...

The tokens are the request's prompt + generated tokens ("?" where a route does not know its
prompt's), "-" for a request that generated nothing; an error's message follows the time. A
route reports its counts with `note_tokens` and its error with `note_error`; the status comes
from the response itself, so a 401 of the API key, a 404 and a 500 are logged too.
"""

from __future__ import annotations

import sys
import time

_TOKENS = "megatron.tokens"  # keys of the request's ASGI scope["state"]
_ERROR = "megatron.error"


def note_tokens(request, prompt: int | None, generated: int) -> None:
    """The request's token counts, for its log line (prompt None: not known to the route)."""
    request.scope.setdefault("state", {})[_TOKENS] = (prompt, generated)


def note_error(request, message: str) -> None:
    request.scope.setdefault("state", {})[_ERROR] = message


def log_line(method: str, path: str, status: int, state: dict, ms: float) -> str:
    tokens = state.get(_TOKENS)
    counts = "-" if tokens is None else f"{'?' if tokens[0] is None else tokens[0]}+{tokens[1]}"
    line = f"[server] {method} {path} {status} {counts}{' tokens' * (tokens is not None)}"
    line += f" {ms:.0f} ms"
    error = state.get(_ERROR)
    return line + (f": {error[:200]}" if error and status >= 400 else "")


class RequestLog:
    """ASGI middleware: log_line for every HTTP request, to `write` (stderr by default)."""

    def __init__(self, app, write=None):
        self.app = app
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        state = scope.setdefault("state", {})
        seen = {"status": 500, "done": False}  # what the client was sent

        async def watch(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                seen["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException:
            seen.update(status=500, done=True)  # what uvicorn answers for it
            raise
        finally:
            status = seen["status"] if seen["done"] else 499  # the client left before the end
            ms = 1000 * (time.monotonic() - start)
            self.write(log_line(scope["method"], scope["path"], status, state, ms))
