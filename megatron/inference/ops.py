"""The work every TP x PP rank does together for one request, and the protocol that keeps them
in step.

Rank 0 (which talks to clients or to lm-eval) sends each operation to every rank as JSON
({"op": name, "args": {...}}, never pickle) and then runs it itself; the other ranks wait in
`follow()` and run the same operation on the same arguments, so every collective inside the
forward passes lines up. Arguments are validated on rank 0 before they are sent: an operation
that still fails does so on every rank alike, which each survives (rank 0 reports it to its
caller, the others log it and wait for the next one).

    score     ids -> log p(ids[t] | ids[:t]) for t >= 1, and the top n alternatives
    complete  ids -> sampled continuation (stop strings, end of document, max_tokens), and
              optionally the log-probabilities of prompt and continuation (OpenAI's logprobs)
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


def _stop_hook(model: Model, prompts: list[list[int]], stops: list[str]):
    """A generation step hook that stops a row once its new text contains a stop string."""
    if not stops:
        return None
    lengths = [len(p) for p in prompts]

    def hook(pos: int, logits, tokens):
        stop = torch.zeros(len(prompts), dtype=torch.bool)
        for i, n in enumerate(lengths):
            if pos >= n:
                text = model.tokenizer.detokenize(tokens[i, n : pos + 1].tolist())
                stop[i] = any(s in text for s in stops)
        return stop

    return hook


def _cut(model: Model, new: list[int], stops: list[str]) -> tuple[list[int], str, str]:
    """(kept ids, text, finish reason) of one continuation: the end-of-document token and
    anything from the first stop string on are removed, as OpenAI does."""
    eod = model.tokenizer.eod
    if new and new[-1] == eod:
        new = new[:-1]
        return new, model.tokenizer.detokenize(new), "stop"
    text = model.tokenizer.detokenize(new)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return new, text, "length"
    text = text[: min(hits)]
    keep = len(new)
    while keep > 0 and len(model.tokenizer.detokenize(new[: keep - 1])) >= len(text):
        keep -= 1  # the ids up to the one that completed the kept text
    return new[:keep], text, "stop"


def complete(model: Model, args: dict) -> list[dict]:
    """Continue every prompt (lists of ids); see openai_api.completion_args for the keys."""
    prompts, stops = args["prompts"], args["stop"]
    if args["max_tokens"] > 0:
        params = SamplingParams(
            args["max_tokens"],
            args["greedy"],
            args["top_k"],
            args["top_p"],
            args["temperature"],
            args["seed"],
        )
        hook = _stop_hook(model, prompts, stops)
        full = generate(model.engine, prompts, params, eod=model.tokenizer.eod, step_hook=hook)
    else:
        full = [list(p) for p in prompts]
    results = []
    for prompt, seq in zip(prompts, full, strict=True):
        ids, text, reason = _cut(model, seq[len(prompt) :], stops)
        results.append({"ids": ids, "text": text, "finish_reason": reason})
    if args["logprobs"] is not None:
        seqs = [p + r["ids"] for p, r in zip(prompts, results, strict=True)]
        for r, s in zip(results, score(model, seqs, args["logprobs"]), strict=True):
            r.update(s)
    return results


def megatron_generate(model: Model, req: dict) -> dict:
    """Megatron's PUT /api: {"text": [...], "tokens": [[...]]} (see server.parse_request)."""
    results = complete_texts(model.engine, model.tokenizer, req["prompts"], params_of(req))
    return {"text": [r["text"] for r in results], "tokens": [r["tokens"] for r in results]}


OPS = {
    "score": lambda m, a: score(m, a["sequences"], a.get("top_n", 0), a.get("batch_size", 8)),
    "complete": complete,
    "generate": megatron_generate,
}


class Leader:
    """Rank 0's side: send an operation to every rank, then run it here. Not thread-safe: one
    caller (the server's worker thread, or lm-eval) issues operations in order."""

    def __init__(self, model: Model, device):
        self.model, self.device = model, device

    def run(self, op: str, args: dict):
        broadcast_json({"op": op, "args": args}, self.device)
        return OPS[op](self.model, args)

    def stop(self) -> None:
        broadcast_json({"op": "stop"}, self.device)


def follow(model: Model, device, rank: int) -> None:
    """Ranks other than 0: run whatever rank 0 sends, until it says stop."""
    while True:
        cmd = broadcast_json(None, device)
        if cmd["op"] == "stop":
            return
        try:
            OPS[cmd["op"]](model, cmd["args"])
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
