"""What every arm of bench/mfu.py shares: the shapes, the two FLOP counts, the batches and the
timing. bench/mcore_arm.py runs in a process without this repository on its path and repeats
the batch recipe (`batches`) on its own."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from megatron.config.schema import ModelConfig
from megatron.training.log import KNOWN_PEAK_TFLOPS, model_flops_per_sample

H100_PEAK = KNOWN_PEAK_TFLOPS["H100"]  # dense bf16 TFLOP/s of an H100 SXM
DATA_SEED = 0


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int  # micro-batch = global batch: one micro batch per step
    recompute: bool = False  # selective recompute (the attention core)
    vocab: int = 50257  # padded to a multiple of 128 for every system


SHAPES = {
    # GPT-2 small as llm.c and nanochat d12 measure it (llm.c: micro-batch 64 on one H100).
    "gpt2-small-b16": Shape(12, 768, 12, seq=1024, batch=16),
    "gpt2-small-b32": Shape(12, 768, 12, seq=1024, batch=32),
    "gpt2-small-b64": Shape(12, 768, 12, seq=1024, batch=64),
    "gpt2-medium": Shape(24, 1024, 16, seq=1024, batch=16),
    "gpt-1.3b": Shape(24, 2048, 16, seq=2048, batch=8),
    # The largest of these that fits one 80 GB H100 with fp32 Adam state (~18 bytes/param):
    # 2.7B params -> ~49 GB of weights, gradients and optimizer state, ~12 GB of activations.
    "gpt-2.7b": Shape(32, 2560, 32, seq=2048, batch=2, recompute=True),
    "tiny": Shape(2, 64, 4, seq=32, batch=2, vocab=1000),  # --smoke
}


def model_config(shape: Shape) -> ModelConfig:
    """The GPT every system trains: learned positions, LayerNorm, GeLU MLP 4h, tied embedding
    (ModelConfig's defaults), no dropout."""
    return ModelConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        seq_length=shape.seq,
        max_position_embeddings=shape.seq,
        vocab_size=shape.vocab,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def megatron_flops_per_sample(m: ModelConfig, seq: int) -> float:
    """Model FLOPs to train on one sample, as Megatron-LM counts them (`transformer_flops` in
    megatron/training/training.py, megatron-core 0.19) for a dense GPT without recompute.

    3 (forward, backward for inputs and for weights) x 2 (multiply-add) x, per token: per layer
    the projections h (q + 2 g d) + q h and the MLP h f (x 3/2 with SwiGLU, as 2 or 3 matmuls),
    plus the logits h V; and per sequence of s tokens s^2 q per layer for QK^T and PV, halved
    for the causal mask. The trainer's `model_flops_per_sample` (megatron.training.log) counts
    the whole s^2 term, as the 2021 Megatron paper, llm-foundry and nanochat publish theirs.
    """
    h, q = m.hidden_size, m.num_attention_heads * m.head_dim
    kv = 2 * m.query_groups * m.head_dim
    mlp = h * m.ffn_size * (3 if m.swiglu else 2)
    per_token = m.num_layers * (h * (q + kv) + q * h + mlp) + h * m.padded_vocab_size(1)
    per_sequence_core = m.num_layers * seq * seq * q / 2 * 2  # causal half of QK^T and PV
    return 3 * 2 * (seq * per_token + per_sequence_core)


def batches(shape: Shape, vocab: int, device) -> list[torch.Tensor]:
    """The four (b, s + 1) token batches every system trains on: tokens text[:, :-1] predict
    text[:, 1:] (bench/mcore_arm.py draws the same ones from the same generator)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return [
        torch.randint(0, vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
        for _ in range(4)
    ]


def batch_iterator(shape: Shape, device):
    """The trainer's micro batches ({"text": (b, s + 1)}) cycling over `batches` forever."""
    vocab = model_config(shape).padded_vocab_size(1)
    return ({"text": text} for text in itertools.cycle(batches(shape, vocab, device)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step(step, device, warmup: int, steps: int) -> float:
    """Median seconds of step(i) over `steps` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        step(i)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(device: torch.device, smoke: bool) -> float:
    """Measured TFLOP/s of a large bf16 matmul (the ceiling a training step can approach)."""
    n = 256 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_step(lambda i: a @ b, device, warmup=3, steps=5 if smoke else 20)
    return 2 * n**3 / seconds / 1e12


def free_memory(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs hold references to the modules they traced
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def figures(step_s: float, shape: Shape, peak: float) -> dict:
    """Tokens/s, TFLOP/s and MFU of one step of `shape`, by both counts: `tflops` / `mfu_*`
    with the causal half of the attention core (Megatron-LM's), `*_full` with all of it."""
    cfg = model_config(shape)
    out = {"tokens_per_s": shape.batch * shape.seq / step_s}
    for suffix, per_sample in (
        ("", megatron_flops_per_sample(cfg, shape.seq)),
        ("_full", model_flops_per_sample(cfg, shape.seq)),
    ):
        tflops = shape.batch * per_sample / step_s / 1e12
        out[f"tflops{suffix}"] = tflops
        out[f"mfu_989{suffix}"] = 100 * tflops / H100_PEAK
        out[f"mfu_measured_peak{suffix}"] = 100 * tflops / peak
    return out
