"""What stands in front of the generation server's routes: an API key, read deadlines and a cap on
open connections (rank 0, under http_app).

uvicorn closes a connection idle *between* requests (`timeout_keep_alive`), but has no deadline
*while* it reads one: a client that sends a header byte every few seconds holds its connection
forever (a probe kept 300 open), and `limit_concurrency` answers 503 only once the headers are
complete. So the HTTP protocol here is uvicorn's h11 one with two additions:

    header deadline  armed when a connection opens and again when a response is complete;
                     disarmed when a request's headers are complete. When it fires, the
                     connection is closed (this also cuts a client still dripping the body of a
                     request already answered, e.g. a 401).
    connection cap   a connection beyond `max_connections` gets a 503 and is closed at once.

The body deadline belongs to the route that reads the body (http_app._read_body: a 408). When
it passes, the route asks the protocol, through the request's scope["state"][WAITING_ON_CLIENT],
whether the server is waiting on the client: only then did the body not arrive. Bytes the
server has read but the route not yet taken (the event loop was busy), a read paused because
the route is behind, or a body read in full mean it did arrive. The API
key (vLLM's `--api-key` / VLLM_API_KEY convention; here `--api-key` / MEGATRON_API_KEY) is an
ASGI middleware: `Authorization: Bearer KEY` on every route except GET /health.
"""

from __future__ import annotations

import functools
import hmac
import os
import select
from dataclasses import dataclass

API_KEY_ENV = "MEGATRON_API_KEY"
WAITING_ON_CLIENT = "megatron.waiting_on_client"  # scope["state"] key: () -> bool
OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"retry-after: 2\r\nconnection: close\r\ncontent-length: 33\r\n\r\n"
    b"too many open connections; retry\n"
)


@dataclass(frozen=True)
class Limits:
    """How long a request may take to arrive and how many connections may be open at once."""

    header_timeout: float = 10.0  # seconds from connect (or the last response) to full headers
    body_timeout: float = 30.0  # seconds to read a request's body, once its headers are in
    max_connections: int = 512  # open TCP connections; more are refused with a 503


def api_key_from(flag: str | None) -> str | None:
    """The key to require: `--api-key` if given, else $MEGATRON_API_KEY, else none (open)."""
    if flag is not None:
        if not flag.strip():
            raise ValueError(
                f"--api-key is empty: give a key, or leave it out (or set {API_KEY_ENV})"
            )
        return flag
    return os.environ.get(API_KEY_ENV) or None


class ApiKey:
    """ASGI middleware: a request to any path but OPEN_PATHS needs `Authorization: Bearer KEY`,
    else a 401 naming the header (OpenAI's error shape on /v1, Megatron's on /api)."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = given.strip().partition(b" ")
        # compare_digest: the time taken does not tell how many leading bytes were right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._authorized(scope["headers"]):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        from megatron.inference import openai_api

        message = (
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
            f"key the server was started with (--api-key or {API_KEY_ENV})"
        )
        if scope["path"].startswith("/v1"):
            body = openai_api.error_body(message, None)
            body["error"]["code"] = "invalid_api_key"
        else:
            body = {"error": message}
        response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _waiting_on_client(cycle, flow, transport) -> bool:
    """The body is not complete, and no byte of it waits on the server's side: none read by
    uvicorn that the route has not taken, no read paused for the route, none in the socket."""
    if not cycle.more_body or cycle.body or flow.read_paused or cycle.disconnected:
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return True
    waiting = select.poll()  # poll, not select: descriptors past 1024 under many connections
    waiting.register(sock.fileno(), select.POLLIN)
    return not waiting.poll(0)


def guarded_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with the header deadline and the connection cap of `limits`; pass
    it as uvicorn.Config(http=...). (Pinning h11 also means the same parser whether or not
    httptools happens to be installed.)"""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            if len(self.connections) > limits.max_connections:
                transport.write(_FULL)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _in_request(self) -> bool:
            """A request's headers are in and its response is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

        def _expired(self) -> None:
            self._deadline = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self.cycle is not None:  # a request's headers are in
                waiting = (_waiting_on_client, self.cycle, self.flow, self.transport)
                self.scope["state"][WAITING_ON_CLIENT] = functools.partial(*waiting)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                self._arm()  # the next request's headers (or the rest of this one's body)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11
