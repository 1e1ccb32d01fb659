"""Pipeline bubble against theory, and activation memory with and without recompute.

    .venv/bin/python bench/pipeline.py [--stages 4 --micro-batches 8 --ms 20]

1. Bubble: the real schedule executor (megatron.training.pipeline) on P gloo ranks, driving
   model chunks whose forward sleeps t ms and backward 2t ms (split over V chunks for the
   interleaved schedule). Sleeping uses no CPU, so even a 2-core machine measures the
   schedule itself. bubble = (step time - M x 3t) / (M x 3t), against (P - 1) / M for 1F1B
   and (P - 1) / (M V) for interleaved 1F1B. Also the time each stage spent waiting on
   pipeline transfers.
2. Memory: bytes of activations kept for backward during one forward of a GPT (counted with
   autograd's saved-tensor hooks, so it works on any device), for no / selective / full
   recompute.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import mpu  # noqa: E402
from megatron.config.schema import ModelConfig, RecomputeConfig  # noqa: E402
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu.parallel_state import initialize_model_parallel  # noqa: E402
from megatron.training.pipeline import forward_backward_pipelining  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

SHAPE = (1, 4, 8)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, grad.sum().reshape(1), None


class SleepChunk(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.w, self.seconds, self._input = nn.Parameter(torch.ones(1)), seconds, None

    def set_input_tensor(self, x):
        self._input = x

    def forward(self):
        x = self._input if self._input is not None else torch.ones(SHAPE)
        return _Sleep.apply(x, self.w, self.seconds)


def _loss(out):
    loss = out.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, chunk):
    next(data_iterator)
    return chunk(), _loss


def _bubble_worker(rank, world, micro_batches, ms, chunks):
    state = initialize_model_parallel(1, world, chunks if chunks > 1 else None)
    model = nn.ModuleList(SleepChunk(ms / 1000 / chunks) for _ in range(chunks))
    timers = Timers(1)
    data = iter(range(10**9))
    results = []
    for _ in range(3):  # step 0 is warm-up
        timers.pop_elapsed()
        torch.distributed.barrier()
        start = time.perf_counter()
        forward_backward_pipelining(
            _forward_step,
            data,
            model,
            micro_batches,
            state=state,
            shape=SHAPE,
            dtype=torch.float32,
            timers=timers,
        )
        torch.distributed.barrier()
        results.append(
            (time.perf_counter() - start, timers.pop_elapsed().get("pipeline-wait", 0.0))
        )
    return results[1:]


def bench_bubble(P: int, M: int, ms: float) -> list[tuple]:
    rows = []
    for V, name in ((1, "1F1B"), (2, "interleaved V=2")):
        per_rank = run_distributed(_bubble_worker, P, M, ms, V)
        step = min(r[0] for ranks in per_rank for r in ranks)
        wait = max(min(r[1] for r in ranks) for ranks in per_rank)
        ideal = M * 3 * ms / 1000
        rows.append(
            (
                f"{name}, P={P}, M={M}",
                (step - ideal) / ideal,
                (P - 1) / (M * V),
                1000 * step,
                1000 * wait,
            )
        )
    return rows


def _saved_bytes(cfg: ModelConfig, recompute: RecomputeConfig, batch: int) -> int:
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 1)
    model = parallelize(
        GPTModel(cfg, BuildContext(rng_tracker=tracker)), mpu.single_process_state(), recompute
    )
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return total[0]


def bench_memory() -> list[tuple]:
    base = ModelConfig(
        num_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=256,
        vocab_size=8192,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    rows = []
    for label, kw in (
        ("no recompute", {}),
        ("selective (attention core)", {"granularity": "selective"}),
        ("full, uniform, 1 layer", {"granularity": "full"}),
        ("full, uniform, 4 layers", {"granularity": "full", "num_layers": 4}),
    ):
        rows.append((label, _saved_bytes(base, RecomputeConfig(**kw), batch=4) / 2**20))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--ms", type=float, default=20.0, help="forward ms per micro batch and stage")
    args = p.parse_args()
    print(
        f"{'schedule':28s} | {'bubble':>7s} | {'theory':>7s} | {'step ms':>8s} | "
        f"{'max wait ms (a stage)':>21s}"
    )
    for name, bubble, theory, step, wait in bench_bubble(args.stages, args.micro_batches, args.ms):
        print(f"{name:28s} | {bubble:7.3f} | {theory:7.3f} | {step:8.1f} | {wait:21.1f}")
    print(f"\n{'activation memory (GPT L8 h256 s256 b4, fp32)':48s} | saved for backward")
    for label, mib in bench_memory():
        print(f"{label:48s} | {mib:8.1f} MiB")


if __name__ == "__main__":
    main()
