"""Helpers for the inference, server and lm-eval tests: a tiny checkpoint with the fixture
tokenizer (also the `checkpoint` fixture of tests/conftest.py), a wikitext passage, and a server
started on 127.0.0.1 as real processes (gloo ranks)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron.checkpoint.storage import finalize_checkpoint, save_shard
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.distributed import free_port
from tests.helpers.paths import MMAP, ROOT, load_tool

# A wikitext-103 passage (its tokenization: spaces around punctuation, " @-@ ").
WIKI = (
    " = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre "
    "actor . He had a guest @-@ starring role on the television series The Bill in 2000 . "
    "This was followed by a starring role in the play Herons written by Simon Stephens , "
    "which was performed in 2001 at the Royal Court Theatre . \n"
)
CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=8192,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def fixture_tokenizer():
    """The GPT-2 BPE tokenizer of the fixture files (what make_checkpoint records)."""
    from megatron.data.tokenizers import build_tokenizer

    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_size=CFG.vocab_size,
        vocab_file=str(MMAP / "vocab.json"),
        merge_file=str(MMAP / "merges.txt"),
    )


def lean_to_eod(state: dict, strength: float = 5.0) -> None:
    """Shift (in place) a GPT's final-norm bias toward the end-of-document embedding, which the
    tied output layer scores: with CFG, seed 5 and 5.0, end-of-document is the greedy next
    token at about half the positions (after 13 of the 21 texts of test_lm_eval's
    QUESTIONS). A model that predicts end-of-document, from random weights."""
    e = state["embedding.word_embeddings.weight"][fixture_tokenizer().eod]
    state["head.final_layernorm.bias"] += strength * e / e.norm()


def make_checkpoint(
    root: Path, cfg: ModelConfig = CFG, seed: int = 5, edit: Callable | None = None
) -> str:
    """A GPT saved the way the trainer saves it (iteration 7), with the fixture GPT-2 BPE;
    `edit(state_dict)` may change its weights in place first (e.g. lean_to_eod)."""
    model = GPTModel(cfg, BuildContext(seed=seed))
    if edit is not None:
        edit(model.state_dict())
    args = {
        "model": cfg.__dict__,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "padded_vocab_size": cfg.padded_vocab_size(1),
        "tokenizer": {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str(MMAP / "vocab.json"),
            "merge_file": str(MMAP / "merges.txt"),
            "tokenizer_model": None,
        },
    }
    state = {"model": model.state_dict(), "args": args, "iteration": 7}
    save_shard(str(root), 7, state, tp_rank=0, pp_rank=0, pp_size=1, write=True)
    finalize_checkpoint(str(root), 7, barrier=lambda: None, is_rank0=True)
    return str(root)


def convert(args: list[str]) -> None:
    """tools/convert_checkpoint.py's main with these arguments (reshard or export to HF), in
    this process: the tool is one process without torch.distributed, and a subprocess costs
    a Python + torch start-up per call (its command line is tested in
    tests/checkpoint/test_convert_checkpoint.py)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = load_tool("convert_checkpoint").main([str(a) for a in args])
    if code:
        raise AssertionError(f"convert_checkpoint.py {' '.join(map(str, args))}: {err.getvalue()}")


def rank_env(rank: int, world: int, master_port: int) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if world > 1:
        env.update(
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
        )
    return env


class Server:
    """tools/run_text_generation_server.py as `world` processes; rank 0 on 127.0.0.1:port."""

    def __init__(self, load: str, world: int = 1, extra: tuple = ()):
        self.port, master = free_port(), free_port()
        tool = str(ROOT / "tools" / "run_text_generation_server.py")
        cmd = [sys.executable, tool, "--load", load, "--port", str(self.port), *extra]
        self.procs = [
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=rank_env(r, world, master),
            )
            for r in range(world)
        ]
        first = self.procs[0].stdout.readline()
        if "serving checkpoint iteration" not in first:
            self.stop()
            raise AssertionError(f"server did not start: {first!r} {self.procs[0].stderr.read()}")
        self.url = f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self, timeout: float = 30) -> list[int]:
        """SIGTERM rank 0 (it stops the others); the exit codes."""
        self.procs[0].terminate()
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes
