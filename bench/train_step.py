"""Training step time: our single-process stack against a plain PyTorch GPT of the same shape.

    .venv/bin/python bench/train_step.py [--layers 4 --hidden 256 --heads 4 --seq 256
                                          --vocab 8192 --batch 8 --steps 10 --rounds 3]

Both sides train on the same random batches in the same process, alternating rounds so machine
noise hits both alike: ours = GPTModel + DistributedDataParallel (fp32 main_grad buffer) +
MegatronOptimizer (AdamW, global clip, inf check) + AnnealingLR, through train_step(); plain =
nn.Linear/nn.Embedding/SDPA blocks + torch AdamW + clip_grad_norm_. Prints median step times.
On a GPU (CUDA visible) it also runs GPT-2 small/medium in bf16 and reports tokens/s and MFU.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_optimizer import OptimizerConfig  # noqa: E402
from megatron.data_parallel.ddp import DistributedDataParallel  # noqa: E402
from megatron.initialize import Runtime  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.model.parallelize import parallelize  # noqa: E402
from megatron.models.gpt.model import build_model  # noqa: E402
from megatron.mpu.parallel_state import single_process_state  # noqa: E402
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker  # noqa: E402
from megatron.optim.plain import plain_optimizer  # noqa: E402
from megatron.training.learning_rates import AnnealingLR  # noqa: E402
from megatron.training.log import model_flops_per_sample, peak_tflops  # noqa: E402
from megatron.training.step import train_step  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1), device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_loss(per_token):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def build_ours(
    cfg: ModelConfig,
    device,
    dtype,
    ops=None,
    torch_compile: bool = False,
    builder=None,
    fwd=None,
    recompute=None,
    cuda_graph: bool = False,
):
    """One train_step of our stack; `builder`/`fwd`: another family's (bench/bert_step.py);
    `recompute`: a RecomputeConfig (bench/mfu.py's largest shape uses selective recompute);
    `cuda_graph` (with `torch_compile`): the compiled chunk replayed as CUDA graphs."""
    state = single_process_state()
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, 1)
    rt = Runtime(state=state, device=device, rng_tracker=tracker)
    ctx = BuildContext(state, seed=1, device=device, dtype=dtype, rng_tracker=tracker, ops=ops)
    model = parallelize(
        (builder or build_model)(cfg, ctx),
        state,
        recompute,
        torch_compile=torch_compile,
        cuda_graph=cuda_graph,
    )
    ddp = DistributedDataParallel(model, None)
    opt = plain_optimizer(
        model,
        OptimizerConfig(lr=1e-4, weight_decay=0.01),
        params_dtype=dtype,
        state=state,
        clip_grad=1.0,
    )
    sched = AnnealingLR(
        opt.optimizer,
        max_lr=1e-4,
        min_lr=1e-5,
        warmup_steps=10,
        decay_steps=1000,
        decay_style="cosine",
    )
    timers = Timers(0, device)

    def forward_step(batches, model_):
        tokens, labels = next(batches)
        return model_(tokens, labels=labels), _mean_loss

    def step(batches):
        train_step(fwd or forward_step, batches, ddp, opt, sched, 1, rt, timers)

    return step


def build_plain(args, device, dtype):
    model = PlainGPT(args.layers, args.hidden, args.heads, args.seq, args.vocab).to(device, dtype)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(batches):
        tokens, labels = next(batches)
        opt.zero_grad(set_to_none=True)
        model(tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def measure(args, device, dtype):
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        vocab_size=args.vocab,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device),
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device),
        )
        for _ in range(4)
    ]

    def batches():
        while True:
            yield from data

    steps = {"ours": build_ours(cfg, device, dtype), "plain": build_plain(args, device, dtype)}
    return cfg, median_step_times(steps, batches(), args.rounds, args.steps, device)


def median_step_times(steps: dict, it, rounds: int, per_round: int, device) -> dict[str, float]:
    """Seconds per step of each of `steps` (name -> step(batch iterator)), the median of
    `rounds` rounds of `per_round` steps each, taken in turn after 3 warm-up steps each
    (allocator, kernels)."""
    times = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(3):
            step(it)
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(per_round):
                _sync(device)
                t = time.perf_counter()
                step(it)
                _sync(device)
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--gpu-presets",
        action="store_true",
        help="on CUDA: GPT-2 small and medium in bf16 (tokens/s, MFU)",
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    runs = [
        ("fp32 " + f"L{args.layers} h{args.hidden} s{args.seq} b{args.batch}", args, torch.float32)
    ]
    if args.gpu_presets and device.type == "cuda":
        for name, (layers, hidden, heads) in {
            "gpt2-small": (12, 768, 12),
            "gpt2-medium": (24, 1024, 16),
        }.items():
            runs.append(
                (
                    f"bf16 {name}",
                    argparse.Namespace(
                        **{
                            **vars(args),
                            "layers": layers,
                            "hidden": hidden,
                            "heads": heads,
                            "seq": 1024,
                            "vocab": 50257,
                            "batch": 8,
                        }
                    ),
                    torch.bfloat16,
                )
            )
    print(f"device: {device}  torch {torch.__version__}")
    print(
        f"{'run':32s} | {'ours ms':>9s} | {'plain ms':>9s} | {'ours/plain':>10s} | "
        f"{'tokens/s':>10s} | {'TFLOP/s':>8s} | MFU"
    )
    for label, a, dtype in runs:
        cfg, t = measure(a, device, dtype)
        tokens = a.batch * a.seq / t["ours"]
        tflops = a.batch * model_flops_per_sample(cfg, a.seq) / t["ours"] / 1e12
        peak = peak_tflops(device, None)
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "-"
        print(
            f"{label:32s} | {1000 * t['ours']:9.1f} | {1000 * t['plain']:9.1f} | "
            f"{t['ours'] / t['plain']:10.3f} | {tokens:10.0f} | {tflops:8.2f} | {mfu}"
        )


if __name__ == "__main__":
    main()
