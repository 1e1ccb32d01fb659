"""The `ours` arm of bench/mfu.py: a variant is a list of the trainer's own command-line flags.

The flags of a shape (`shape_argv`) plus a variant's flags go through the trainer's parser and
rules (megatron.config.cli.parse_args, purpose "train-gpt"), and the model, DDP, optimizer and
LR schedule are built by the trainer's own `build_backend` (megatron/training/loop.py, as
pretrain_gpt2.py builds them); each timed step is the backend's `train_step` with the GPT
family's forward step. The benchmark and the trainer therefore cannot drift apart: a technique
is measured here exactly as `pretrain_gpt2.py <flags>` would run it.

A variant whose flags this checkout's parser does not know yields a row "unknown flag ..."
(never a silent default run); one the trainer's rules refuse (on this device, say) a row with
the trainer's reason.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys

import torch

from bench.mfu_common import Shape, batch_iterator, median_step, memory_gib
from megatron.config.cli import build_parser, parse_args
from megatron.config.schema import MegatronConfig
from megatron.initialize import Runtime, set_random_seeds
from megatron.model.families import get_spec
from megatron.mpu.parallel_state import single_process_state
from megatron.training.loop import build_backend
from megatron.training.timers import Timers

# name -> the trainer's flags that switch the technique on (over the bf16 defaults).
VARIANTS = {
    "default": [],
    "compile": ["--torch-compile"],
    "cudagraphs": ["--torch-compile", "--enable-cuda-graph"],  # graphs of the compiled chunks
    "fused-linear-ce": ["--cross-entropy-fusion-impl", "linear"],
    # torchao's float8 casts and scales are separate kernels in eager mode (three times slower
    # than bf16 at GPT-2 small on an H100, 2026-11-26): it is meant to run compiled, as
    # torchtitan runs it, so the fp8 variants compile too.
    "fp8": ["--torch-compile", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "fp8-rowwise": ["--torch-compile", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    "fp8-eager": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "liger": ["--kernel-library", "liger"],
}
# --best-flags's default: on one H100 (2026-11-26, GPT-2 small b16) --torch-compile took the
# step from 54.6 to 38.2 ms; the fused linear + cross-entropy alone was 1.4 ms slower (it saves
# memory, not time, at this vocabulary).
BEST_FLAGS = "--torch-compile"


class VariantError(Exception):
    """A variant that cannot run here. kind: "unknown-flag" (this checkout's parser lacks a
    flag), "refused" (the trainer's parser or rules reject the combination, with its reason)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def variant_table(best_flags: str, extra: list[str]) -> dict[str, list[str]]:
    """VARIANTS, `best` = --best-flags, and each --variant-flags NAME=FLAGS (which may also
    replace a built-in one)."""
    table = {**VARIANTS, "best": shlex.split(best_flags)}
    for item in extra:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--variant-flags {item!r}: write NAME=FLAGS, e.g. 'ce=--foo bar'")
        table[name.strip()] = shlex.split(flags)
    return table


def shape_argv(shape: Shape, iters: int) -> list[str]:
    """The trainer's flags for `shape` in bf16 (fp32 master weights), one micro batch per step,
    the optimizer and schedule of every arm (AdamW 1e-4, weight decay 0.01, clip 1.0)."""
    argv = [
        "--num-layers", str(shape.layers),
        "--hidden-size", str(shape.hidden),
        "--num-attention-heads", str(shape.heads),
        "--seq-length", str(shape.seq),
        "--max-position-embeddings", str(shape.seq),
        "--vocab-size", str(shape.vocab),
        "--make-vocab-size-divisible-by", "128",
        "--hidden-dropout", "0",
        "--attention-dropout", "0",
        "--micro-batch-size", str(shape.batch),
        "--global-batch-size", str(shape.batch),
        "--bf16",
        "--lr", "1e-4",
        "--min-lr", "1e-5",
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "10",
        "--lr-decay-iters", "1000",
        "--weight-decay", "0.01",
        "--clip-grad", "1.0",
        "--train-iters", str(iters),
    ]  # fmt: skip
    if shape.recompute:
        argv += ["--recompute-granularity", "selective"]
    return argv


def unknown_flags(argv: list[str]) -> list[str]:
    """The options in `argv` that the trainer's parser does not declare."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            _, extra = build_parser().parse_known_args(argv)
        except SystemExit:  # a known flag with a bad value: parse_config reports it
            return []
    return [a for a in extra if a.startswith("-")]


def parse_config(argv: list[str]) -> MegatronConfig:
    """The trainer's validated config for one process; VariantError when it cannot be."""
    unknown = unknown_flags(argv)
    if unknown:
        raise VariantError(
            "unknown-flag",
            f"unknown flag {' '.join(unknown)}: this checkout's trainer does not declare it",
        )
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(argv, world_size=1, purpose=get_spec("gpt").purpose)
    except SystemExit:  # argparse: a bad value, a missing argument
        lines = err.getvalue().strip().splitlines()
        raise VariantError("refused", lines[-1] if lines else "the parser exited") from None
    except ValueError as e:  # ConfigError: the trainer's rules, naming the flag and the fix
        raise VariantError("refused", str(e)) from None


def with_compile_backend(argv: list[str], backend: str) -> list[str]:
    """`argv` + `--torch-compile-backend BACKEND` where it compiles without naming a backend,
    the trainer declares the flag and BACKEND is not its default (the CPU smoke: eager, as
    Inductor's C++ build takes minutes there)."""
    flag = "--torch-compile-backend"
    if backend == "inductor" or flag in argv or unknown_flags([flag, backend]):
        return argv
    try:
        compiles = parse_config(argv).kernels.torch_compile
    except VariantError:  # reported when the caller parses it
        return argv
    return argv + [flag, backend] if compiles else argv


@contextlib.contextmanager
def compile_backend(name: str):
    """torch.compile's backend where the caller names none (a trainer without
    --torch-compile-backend names none)."""
    if name == "inductor":
        yield
        return
    original = torch.compile

    def compile_with(*args, **kwargs):
        kwargs.setdefault("backend", name)
        return original(*args, **kwargs)

    torch.compile = compile_with
    try:
        yield
    finally:
        torch.compile = original


def build_step(cfg: MegatronConfig, device: torch.device):
    """(step(iterator), parameter count, what the trainer logged about its kernels): the
    trainer's backend on one process, with the trainer's seeds."""
    state = single_process_state()
    rt = Runtime(state, device, set_random_seeds(cfg.training.seed, state, device))
    family = get_spec("gpt")
    printed = io.StringIO()  # rank 0's notes: the kernels, attention and compilation it chose
    try:
        with contextlib.redirect_stderr(printed):
            backend = build_backend(cfg, rt, family.forward_step(cfg), family)
    finally:
        notes = [x.strip() for x in printed.getvalue().splitlines() if x.startswith(" ")]
        others = [x for x in printed.getvalue().splitlines() if not x.startswith(" ")]
        sys.stderr.write("".join(f"{x}\n" for x in others))  # warnings, tracebacks
    timers = Timers(cfg.logging.timing_log_level, device)

    def step(iterator) -> None:
        backend.train_step(iterator, 1, timers)

    params = sum(p.numel() for p in backend.model.parameters())
    note = "; ".join(x.removeprefix("fused kernels: ") for x in notes)
    return step, params, note


def run_ours(shape: Shape, device, args, flags: list[str]) -> dict:
    """Time the trainer's step at `shape` with `flags`; raises VariantError (not runnable)."""
    base = shape_argv(shape, args.warmup + args.steps)
    argv = with_compile_backend(base + flags, args.compile_backend)
    cfg, flags = parse_config(argv), argv[len(base) :]

    it = batch_iterator(shape, device)
    try:
        with compile_backend(args.compile_backend):
            step, params, note = build_step(cfg, device)
            seconds = median_step(lambda i: step(it), device, args.warmup, args.steps)
    except ValueError as e:  # the trainer refusing (as pretrain_gpt2.py reports ValueErrors)
        raise VariantError("refused", str(e)) from None
    return {
        "step_s": seconds,
        "memory_gib": memory_gib(device),
        "params": params,
        "note": f"{' '.join(flags) or '(bf16 defaults)'}; {note}",
    }
