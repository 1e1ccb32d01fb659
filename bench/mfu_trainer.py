"""The `trainer` row of bench/mfu.py: `pretrain_gpt2.py` itself, one rank, at a bench shape.

The trainer runs as a user would start it (a subprocess, its own data loader, logging and
loop), with the shape's flags and a variant's (bench/mfu_ours.py `shape_argv`), on a corpus of
random tokens written here as .bin/.idx (the trainer has no mock-data option; the GPU check's
demo corpus has another vocabulary). Its log lines give ms per iteration; the first window
(compilation, allocator warm-up, data-loader start) is left out and the others averaged.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from bench.mfu_common import Shape
from bench.mfu_ours import VariantError, parse_config, shape_argv, with_compile_backend
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MS_PER_ITER = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOGGED_MFU = re.compile(r"MFU: ([0-9.]+)%")


def write_random_corpus(prefix: str, vocab: int, seq: int, documents: int = 64) -> None:
    """`documents` documents of 2 x seq random tokens (the dataset cycles over them)."""
    rng = np.random.default_rng(0)
    dtype = np.uint16 if vocab < 2**16 else np.int32
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for _ in range(documents):
        builder.add_document([rng.integers(0, vocab, 2 * seq)])
    builder.finalize(f"{prefix}.idx")


def trainer_argv(shape: Shape, flags: list[str], data: str, iters: int, interval: int, smoke):
    """The whole command line after `pretrain_gpt2.py` (checked by our parser first)."""
    argv = shape_argv(shape, iters) + flags
    argv += ["--data-path", data, "--split", "100,0,0", "--eval-iters", "0"]
    argv += ["--log-interval", str(interval), "--num-workers", "0" if smoke else "2"]
    return argv


def window_ms(log: str) -> tuple[list[float], float | None]:
    """(ms per iteration of each logged window, the last line's MFU as the trainer logs it)."""
    lines = [x for x in log.splitlines() if " iteration " in x and "lm loss:" in x]
    ms = [float(m.group(1)) for x in lines if (m := MS_PER_ITER.search(x))]
    mfu = LOGGED_MFU.search(lines[-1]) if lines else None
    return ms, float(mfu.group(1)) if mfu else None


def run_trainer(shape: Shape, args, flags: list[str], log) -> dict:
    """Train `args.trainer_iters` iterations with pretrain_gpt2.py; the step time is the mean
    of the logged windows after the first. VariantError: flags it does not declare, or
    refuses (before it starts, or when it exits with its "error: ..." line)."""
    iters = args.trainer_iters
    interval = max(1, iters // 3)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "random_text_document")
        argv = trainer_argv(shape, flags, data, iters, interval, args.smoke)
        argv = with_compile_backend(argv, args.compile_backend)
        parse_config(argv)  # an unknown flag or a refusal: a row saying so, not a crash
        write_random_corpus(data, shape.vocab, shape.seq)
        env = dict(os.environ)
        if args.smoke:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is the CPU's, like the other arms
        command = [sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"), *argv]
        try:
            done = subprocess.run(
                command,
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.trainer_timeout,
            )
            out, err, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = _text(e.stdout), _text(e.stderr), f"killed after {e.timeout} s"
    log.write(f"--- trainer {' '.join(command)}\n{out}\n{err}\n")
    ms, logged_mfu = window_ms(out)
    named = [x for x in err.splitlines() if x.startswith("error: ")]
    if rc == 1 and named:  # pretrain_gpt2.py refusing the flags (its ValueErrors), by name
        raise VariantError("refused", named[-1].removeprefix("error: "))
    if rc != 0 or len(ms) < 2:
        tail = " / ".join((err or out).strip().splitlines()[-2:])
        raise RuntimeError(f"pretrain_gpt2.py exit {rc}, {len(ms)} log lines: {tail}")
    timed = ms[1:]
    base = len(trainer_argv(shape, flags, data, iters, interval, args.smoke))
    shown = " ".join(flags + argv[base:]) or "(bf16 defaults)"  # the variant's (+ backend)
    note = f"pretrain_gpt2.py {shown}, {iters} it: mean of the {len(timed)} log windows after 1st"
    if logged_mfu is not None:
        note += f"; its log: MFU {logged_mfu:.1f}% (full count)"
    return {"step_s": sum(timed) / len(timed) / 1000, "memory_gib": None, "note": note}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
