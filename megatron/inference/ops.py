"""The work every TP x PP rank does together for one request, and the protocol that keeps them
in step.

Rank 0 (which talks to clients or to lm-eval) sends each operation to every rank as JSON
({"op": name, "args": {...}}, never pickle) and then runs it itself; the other ranks wait in
`follow()` and run the same operation on the same arguments, so every collective inside the
forward passes lines up. Arguments are validated on rank 0 before they are sent: an operation
that still fails does so on every rank alike, which each survives (rank 0 reports it to its
caller, the others log it and wait for the next one).

    score     ids -> log p(ids[t] | ids[:t]) for t >= 1, and the top n alternatives
    complete  ids -> sampled continuations (stop strings, end of document, max_tokens; n of
              best_of per prompt), and optionally the log-probabilities of prompt and
              continuation (OpenAI's logprobs); streamed: step by step (streaming.py), and
              rank 0 may stop every rank early (its client hung up)
    generate  Megatron's PUT /api request -> text and token ids
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.inference.engine import broadcast_json
from megatron.inference.generation import SamplingParams, generate
from megatron.inference.megatron_api import params_of
from megatron.inference.session import complete as complete_texts
from megatron.inference.streaming import RowsHook, TokenStream


@dataclass
class Model:
    """What an operation needs: the engine (this rank's part of the model) and the tokenizer."""

    engine: object
    tokenizer: object

    @property
    def max_positions(self) -> int:
        return self.engine.model.cfg.max_positions


def score(model: Model, sequences: list[list[int]], top_n: int = 0, batch_size: int = 8):
    """[{"logprobs": [len - 1 floats], "top": [len - 1 lists of [id, logprob]]}] per sequence.

    Sequences are sorted by length and right-padded within a batch (causal attention keeps the
    padding out of the real positions), so a batch costs its longest member.
    """
    engine = model.engine
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    out: list[dict | None] = [None] * len(sequences)
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        width = max(len(sequences[i]) for i in rows) - 1
        if width < 1:
            for i in rows:
                out[i] = {"logprobs": [], "top": []}
            continue
        batch = torch.zeros(len(rows), width + 1, dtype=torch.long)  # (b, s + 1)
        for r, i in enumerate(rows):
            batch[r, : len(sequences[i])] = torch.tensor(sequences[i])
        batch = batch.to(engine.device)
        lp, top_ids, top_lp = engine.token_logprobs(batch[:, :-1], batch[:, 1:], top_n)
        for r, i in enumerate(rows):
            n = len(sequences[i]) - 1
            top = [
                [[int(t), float(v)] for t, v in zip(ids, vals, strict=True)]
                for ids, vals in zip(top_ids[r, :n].tolist(), top_lp[r, :n].tolist(), strict=True)
            ]
            out[i] = {"logprobs": lp[r, :n].tolist(), "top": top}
    return out


def _cut(model: Model, new: list[int], stops: list[str]) -> tuple[list[int], str, str]:
    """(kept ids, text, finish reason) of one continuation, as OpenAI and vLLM do: a generated
    end-of-document token stays in the ids (a token with its log-probability, so echo +
    logprobs always hold the prompt and max_tokens generated tokens: lm-eval drops the last
    one as the generated one) and is left out of the text; anything from the first stop
    string on is removed from both."""
    eod = model.tokenizer.eod
    if new and new[-1] == eod:
        return new, model.tokenizer.detokenize(new[:-1]), "stop"
    text = model.tokenizer.detokenize(new)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return new, text, "length"
    text = text[: min(hits)]
    keep = len(new)
    while keep > 0 and len(model.tokenizer.detokenize(new[: keep - 1])) >= len(text):
        keep -= 1  # the ids up to the one that completed the kept text
    return new[:keep], text, "stop"


def _hook(model: Model, rows: list[list[int]], args: dict, stream: TokenStream | None):
    """The step hook of a request: stop strings, and for a streamed one the events (rank 0)
    and the cancel that every rank takes from rank 0 at every step."""
    streaming = args.get("stream", False)
    if not streaming and not args["stop"]:
        return None
    cancel = None
    if streaming:
        engine = model.engine

        def cancel() -> bool:
            return engine.flag_from_rank0(stream is not None and stream.cancelled)

    return RowsHook(
        model.tokenizer,
        rows,
        args["stop"],
        args["max_tokens"],
        cancel=cancel,
        stream=stream,
        top_n=args["logprobs"] if streaming else None,
    )


def _echo(model: Model, args: dict, best_of: int, stream: TokenStream | None) -> None:
    """A streamed request with echo: each row's prompt (and its log-probabilities) first."""
    top_n = args["logprobs"]
    scored = score(model, args["prompts"], top_n) if top_n is not None else None
    if stream is None:
        return
    for i, prompt in enumerate(args["prompts"]):
        event = {"prompt": prompt, "text": model.tokenizer.detokenize(prompt)}
        for row in range(i * best_of, (i + 1) * best_of):
            stream.put({"row": row, **event, **(scored[i] if scored else {})})


def _best(model: Model, rows, results: list[dict], top_n: int) -> None:
    """Score each continuation (its log-probabilities, with top_n alternatives) and rank it by
    the mean log-probability of its generated tokens, end of document included."""
    seqs = [p + r["ids"] for p, r in zip(rows, results, strict=True)]
    for p, r, s in zip(rows, results, score(model, seqs, top_n), strict=True):
        r.update(s)
        new = s["logprobs"][len(p) - 1 :]  # log p of each generated token
        r["rank"] = sum(new) / len(new) if new else float("-inf")


def complete(model: Model, args: dict, stream: TokenStream | None = None) -> list[dict]:
    """Continue every prompt (lists of ids) best_of times and keep the n of highest mean
    log-probability (n = best_of = 1 unless asked), prompt-major; see
    openai_api.completion_args for the keys. With args["stream"] every rank follows the
    request step by step: rank 0's `stream` gets the events and may cancel it."""
    n = args.get("n", 1)
    best_of = args.get("best_of") or n
    rows = [p for p in args["prompts"] for _ in range(best_of)]  # row = prompt_i * best_of + j
    streaming = args.get("stream", False)
    if streaming and args["echo"]:
        _echo(model, args, best_of, stream)
    if args["max_tokens"] > 0:
        params = SamplingParams(
            args["max_tokens"],
            args["greedy"],
            args["top_k"],
            args["top_p"],
            args["temperature"],
            args["seed"],
        )
        hook = _hook(model, rows, args, stream)
        full = generate(model.engine, rows, params, eod=model.tokenizer.eod, step_hook=hook)
    else:
        full = [list(p) for p in rows]
        for row in range(len(rows) if stream is not None else 0):
            stream.put({"row": row, "finish_reason": "length", "text": ""})
    results = []
    for prompt, seq in zip(rows, full, strict=True):
        ids, text, reason = _cut(model, seq[len(prompt) :], args["stop"])
        results.append({"ids": ids, "text": text, "finish_reason": reason})
    if not streaming and (args["logprobs"] is not None or best_of > n):
        _best(model, rows, results, args["logprobs"] or 0)
    if best_of > n:
        groups = [results[i : i + best_of] for i in range(0, len(results), best_of)]
        results = [r for g in groups for r in sorted(g, key=lambda r: -r["rank"])[:n]]
    return results


def megatron_generate(model: Model, req: dict) -> dict:
    """Megatron's PUT /api: {"text": [...], "tokens": [[...]]} (see megatron_api.parse_request)."""
    results = complete_texts(model.engine, model.tokenizer, req["prompts"], params_of(req))
    return {"text": [r["text"] for r in results], "tokens": [r["tokens"] for r in results]}


OPS = {  # (model, args, rank 0's TokenStream or None) -> result
    "score": lambda m, a, _: score(m, a["sequences"], a.get("top_n", 0), a.get("batch_size", 8)),
    "complete": complete,
    "generate": lambda m, a, _: megatron_generate(m, a),
}


class Leader:
    """Rank 0's side: send an operation to every rank, then run it here. Not thread-safe: one
    caller (the server's worker thread, or lm-eval) issues operations in order."""

    def __init__(self, model: Model, device):
        self.model, self.device = model, device

    def run(self, op: str, args: dict, stream: TokenStream | None = None):
        """The operation's result; a streamed "complete" also sends its steps to `stream`."""
        broadcast_json({"op": op, "args": args}, self.device)
        return OPS[op](self.model, args, stream)

    def stop(self) -> None:
        broadcast_json({"op": "stop"}, self.device)


def follow(model: Model, device, rank: int) -> None:
    """Ranks other than 0: run whatever rank 0 sends, until it says stop."""
    while True:
        cmd = broadcast_json(None, device)
        if cmd["op"] == "stop":
            return
        try:
            OPS[cmd["op"]](model, cmd["args"], None)
        except Exception as e:  # noqa: BLE001 - one request must not end the server
            print(f"[rank {rank}] {cmd['op']} failed: {e!r}", file=sys.stderr)


# --- stopping: a signal to any rank stops every rank, rank 0 first ---------------------------
# torchrun sends SIGTERM to every rank's process group at once. A follower killed by it in the
# middle of a broadcast made rank 0's stop broadcast fail ("Connection closed by peer") and
# rank 0 hung until torchrun's SIGKILL. So no rank dies of the signal: a follower writes it to
# the c10d store, rank 0 (which also stops on its own signal) sees the key, stops taking
# requests, finishes the running one and sends "stop"; every rank then exits 0.
_STOP_KEY = "megatron/serve/stop"
STOP_POLL_S = 0.2


def _store():
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


class StopSignals:
    """SIGTERM / SIGINT, caught from the start (a signal during loading waits its turn) and
    seen by a thread at once, even while the main thread is inside a collective: the signal's
    C handler writes to the wakeup fd this thread reads."""

    def __init__(self):
        self.received = threading.Event()
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)  # a Python handler: the wakeup fd is written
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._wake, args=(read_fd,), daemon=True).start()

    def _wake(self, read_fd: int) -> None:
        while True:
            signum = os.read(read_fd, 1)[0]
            if signum in (signal.SIGINT, signal.SIGTERM):
                self.received.set()

    def relay_to_rank0(self, rank: int) -> None:
        """A follower: once signalled, ask rank 0 (through the c10d store) to stop the server;
        this rank goes on following until rank 0 sends "stop"."""
        store = _store()

        def relay() -> None:
            self.received.wait()
            print(f"[rank {rank}] signalled: asking rank 0 to stop the server", file=sys.stderr)
            try:
                store.set(_STOP_KEY, str(rank))
            except Exception as e:  # noqa: BLE001 - rank 0 is gone; follow() fails on its own
                print(f"[rank {rank}] could not reach rank 0 ({e!r})", file=sys.stderr)

        if store is not None:
            threading.Thread(target=relay, name="stop-relay", daemon=True).start()

    def watch(self, on_stop) -> threading.Event:
        """Rank 0: on_stop(rank) once this process or a follower is signalled; set the returned
        event to end the watch."""
        done, store = threading.Event(), _store()

        def watch() -> None:
            while not done.wait(STOP_POLL_S):
                if self.received.is_set():
                    on_stop(0)
                    return
                try:
                    if store is not None and store.check([_STOP_KEY]):
                        on_stop(int(store.get(_STOP_KEY)))
                        return
                except Exception:  # noqa: BLE001 - the store is gone: the heartbeat reports it
                    return

        threading.Thread(target=watch, name="stop-watch", daemon=True).start()
        return done
