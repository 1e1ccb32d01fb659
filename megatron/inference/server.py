"""tools/run_text_generation_server.py: serve a checkpoint over HTTP, on any TP x PP layout.

    PUT /api              Megatron's request (megatron_api) -> {"text": [...], "tokens": [[...]]}
    POST /v1/completions  OpenAI's completions (openai_api), as lm-eval and the openai client use;
                          "stream": true answers with server-sent events (openai_stream)
    POST /v1/chat/completions  OpenAI's chat (chat), the prompt from --chat-template or the
                          tokenizer's template, else the built-in `plain` (chat_template)
    GET /health           200 {"status": "ok", "queued": n}

Rank 0 binds 127.0.0.1 (unless --host says otherwise) and runs the FastAPI app of http_app on
uvicorn; it validates each request (400 naming the field; 413 over the body limit; 503 with
Retry-After when the queue is full) and hands valid ones, one at a time, to every rank
(ops.Leader); the other ranks run them in step (ops.follow). SIGTERM / SIGINT to any
rank (torchrun sends it to all at once): the server stops taking requests, finishes the running
one and stops the other ranks; all exit 0 (ops.relay_stop_signals).
--api-key (or $MEGATRON_API_KEY) guards every route but /health; --header-timeout,
--body-timeout and --max-connections bound slow and piled-up clients (http_guard).
FastAPI and uvicorn are imported only when serving starts.
"""

from __future__ import annotations

import argparse
import socket
import sys

from megatron.inference.chat_template import BUILTIN, from_flag, resolve
from megatron.inference.http_guard import API_KEY_ENV, Limits, api_key_from
from megatron.inference.ops import Leader, Model, StopSignals, follow
from megatron.inference.session import add_checkpoint_args, run_tool, setup

LISTEN_BACKLOG = 1024  # pending TCP connections: a burst of clients is queued, never reset


def _listen(host: str, port: int) -> socket.socket:
    """Bound and listening before the first line is printed, so a client that reads that line
    can connect at once; the backlog holds a burst of clients (the default of 5 reset 9 of 150
    concurrent connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


def serve(
    model: Model,
    leader: Leader,
    sock: socket.socket,
    stops: StopSignals,
    banner: str,
    args: argparse.Namespace,
) -> None:
    """Rank 0: print `banner`, answer HTTP on `sock` until a SIGINT / SIGTERM to any rank, then
    stop the other ranks. `args`: the model name, API key, limits and resolved chat template
    of the command line."""
    import uvicorn

    from megatron.inference.http_app import Scheduler, build_app
    from megatron.inference.http_guard import guarded_protocol

    scheduler = Scheduler(leader)
    app = build_app(
        scheduler, model, args.model_name, args.limits, args.api_key, args.chat_template
    )
    config = uvicorn.Config(
        app,
        http=guarded_protocol(args.limits),
        log_level="warning",
        timeout_graceful_shutdown=5,
        backlog=LISTEN_BACKLOG,
    )
    server = uvicorn.Server(config)

    def stop(rank: int) -> None:
        if rank:
            print(f"rank {rank} got a signal: stopping the server", file=sys.stderr, flush=True)
        server.should_exit = True  # uvicorn's loop checks it on every tick

    # uvicorn shuts down gracefully on SIGINT / SIGTERM and then raises the signal again for
    # the handler found before it: StopSignals' no-op one, so the other ranks are stopped below.
    watch = stops.watch(stop)
    print(banner, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        watch.set()
        scheduler.close()


def add_guard_args(p: argparse.ArgumentParser) -> None:
    """Who may call the server, and how long and how many connections it holds open."""
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: "
        f"${API_KEY_ENV} if set, else no key; the variable keeps the key out of `ps`)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=Limits.header_timeout,
        help="seconds a connection may take to send a request's headers, from connect or the "
        f"previous response; then it is closed ({Limits.header_timeout:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=Limits.body_timeout,
        help=f"seconds to receive a request's body; then 408 ({Limits.body_timeout:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=Limits.max_connections,
        help=f"open connections at most; more get 503 and are closed ({Limits.max_connections})",
    )


def limits_from(args: argparse.Namespace) -> Limits:
    """The limits of the command line, each checked (a ValueError names the flag)."""
    for flag, value in (
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not value > 0:  # NaN included
            raise ValueError(f"{flag} must be a positive number of seconds, not {value}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, not {args.max_connections}")
    return Limits(args.header_timeout, args.body_timeout, args.max_connections)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=5000, help="port (5000)")
    p.add_argument(
        "--model-name", default="megatron", help="the model id /v1/models reports (megatron)"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="the chat template of /v1/chat/completions: a Jinja file, the Jinja template "
        f"inline, or a built-in name ({', '.join(BUILTIN)}) (default: the tokenizer's own "
        "template, else 'plain')",
    )
    add_guard_args(p)
    args = p.parse_args(argv)

    def body() -> None:
        import importlib.util

        args.api_key = api_key_from(args.api_key)
        args.limits = limits_from(args)
        if not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "jinja2")):
            raise ValueError("serving needs fastapi, uvicorn and jinja2: pip install -e '.[serve]'")
        if args.chat_template is not None:  # a bad file fails here, before the model loads
            args.chat_template = from_flag(args.chat_template)
        stops = StopSignals()
        rt, engine, tokenizer, iteration = setup(args.load, args.pipeline_model_parallel_size)
        model = Model(engine, tokenizer)
        if rt.state.rank != 0:
            stops.relay_to_rank0(rt.state.rank)
            follow(model, rt.device, rt.state.rank)
            return
        leader = Leader(model, rt.device)
        try:
            args.chat_template = resolve(args.chat_template, tokenizer)
            sock = _listen(args.host, args.port)
        except (OSError, ValueError):
            leader.stop()
            raise
        banner = (
            f"serving checkpoint iteration {iteration} on http://{args.host}:"
            f"{sock.getsockname()[1]} (PUT /api, POST /v1/completions, POST /v1/chat/completions, "
            "GET /health)" + ("; API key required" if args.api_key else "")
        )
        serve(model, leader, sock, stops, banner, args)

    return run_tool(body)
