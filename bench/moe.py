"""Mixture of experts on one process: step time and expert load.

    .venv/bin/python bench/moe.py [--layers 2 --hidden 128 --heads 4 --seq 128 --vocab 512
                                   --experts 8 --topk 2 --expert-ffn 128 --batch 8
                                   --steps 8 --rounds 3 --balance-steps 60]
                                  [--device cuda --bf16] [--no-balance]

bench/gpu_check.sh's moe step runs part 1 on the GPU in bf16 (--no-balance), and at toy sizes on
the CPU for --smoke; its last line is a HEADLINE for the check's table.

1. Step time (train_step: forward, backward, DDP buffer, AdamW) of an MoE GPT (E experts of
   width f, top-k) against the dense GPT of equal active parameters (MLP width k f), each
   round alternating the variants so machine noise hits all alike; the MoE both with looped
   experts and with --moe-grouped-gemm (on the path moe.grouped_gemm_path names: the fused
   torch._grouped_mm or a padded bmm). Median ms per step, tokens/s and the ratio to dense.
2. Load balance over training: max / mean tokens per expert (mean over the MoE layers) every
   few steps of training on a learnable toy corpus (counting sequences), with and without the
   load-balancing loss (--moe-aux-loss-coeff 0.01 vs 0).
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_optimizer import OptimizerConfig  # noqa: E402
from megatron.data_parallel.ddp import DistributedDataParallel  # noqa: E402
from megatron.initialize import Runtime  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.model.moe import grouped_gemm_path  # noqa: E402
from megatron.models.gpt.model import build_model  # noqa: E402
from megatron.mpu.parallel_state import single_process_state  # noqa: E402
from megatron.optim.plain import plain_optimizer  # noqa: E402
from megatron.training.step import train_step  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402


class _NoSchedule:
    def step(self, *args):
        pass


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    per_token = model(tokens[:, :-1], labels=tokens[:, 1:])

    def loss(output):
        mean = output.mean()
        return mean, {"lm loss": mean.detach()}

    return per_token, loss


class Trainer:
    """One model with our DDP buffers and optimizer, stepped through train_step()."""

    def __init__(self, cfg: ModelConfig, grouped=False, seed=1, device="cpu", dtype=torch.float32):
        state = single_process_state()
        self.device = torch.device(device)
        ctx = BuildContext(state, seed, self.device, dtype, moe_grouped_gemm=grouped)
        self.model = build_model(cfg, ctx)
        self.ddp = DistributedDataParallel(self.model, None)
        self.opt = plain_optimizer(
            self.model,
            OptimizerConfig(lr=3e-3, weight_decay=0.0),
            params_dtype=dtype,
            state=state,
            clip_grad=1.0,
        )
        self.rt = Runtime(state=state, device=self.device, rng_tracker=None)
        self.timers = Timers(0, self.device)

    def step(self, batch: torch.Tensor) -> dict:
        batch = batch.to(self.device)
        return train_step(
            _forward_step, iter([batch]), self.ddp, self.opt, _NoSchedule(), 1, self.rt, self.timers
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(args, gen: torch.Generator) -> torch.Tensor:
    """Counting sequences with random starts and strides (learnable, as tests/test_training)."""
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    return (start + stride * torch.arange(args.seq + 1)) % args.vocab


def step_times(args, moe: ModelConfig, dense: ModelConfig) -> dict[str, float]:
    on = {"device": args.device, "dtype": args.dtype}
    variants = {
        "dense (equal active params)": Trainer(dense, **on),
        "MoE, looped experts": Trainer(moe, **on),
        "MoE, --moe-grouped-gemm": Trainer(moe, grouped=True, **on),
    }
    times = {name: [] for name in variants}
    gen = torch.Generator().manual_seed(0)
    for trainer in variants.values():  # warm-up
        trainer.step(_batch(args, gen))
    for _ in range(args.rounds):
        for name, trainer in variants.items():
            batches = [_batch(args, gen).to(trainer.device) for _ in range(args.steps)]
            _sync(trainer.device)
            start = time.perf_counter()
            for b in batches:
                trainer.step(b)
            _sync(trainer.device)
            times[name].append((time.perf_counter() - start) / args.steps)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def load_balance(args, moe: ModelConfig, coeff: float) -> list[tuple[int, float, float]]:
    """(step, max / mean expert load, lm loss) every few steps of training."""
    cfg = dataclasses.replace(moe, moe_aux_loss_coeff=coeff)
    trainer = Trainer(cfg, device=args.device, dtype=args.dtype)
    gen, rows = torch.Generator().manual_seed(1), []
    every = max(1, args.balance_steps // 6)
    for step in range(1, args.balance_steps + 1):
        result = trainer.step(_batch(args, gen))
        if step == 1 or step % every == 0:
            others = result["other_losses"]
            balance = float(others["expert load max/mean"])
            rows.append((step, balance, float(result["lm_loss"])))
    return rows


def dense_fields(args) -> dict:
    """The ModelConfig fields of the command line's model shape, dropout off."""
    return dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        vocab_size=args.vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 2), ("hidden", 128), ("heads", 4), ("seq", 128), ("vocab", 512),
        ("experts", 8), ("topk", 2), ("expert-ffn", 128), ("batch", 8), ("steps", 8),
        ("rounds", 3), ("balance-steps", 60),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights, fp32 optimizer state")
    p.add_argument("--no-balance", action="store_true", help="the step times only (part 1)")
    args = p.parse_args(argv)
    args.dtype = torch.bfloat16 if args.bf16 else torch.float32
    base = dense_fields(args)
    moe = ModelConfig(
        **base,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn,
    )
    dense = ModelConfig(**base, ffn_hidden_size=args.topk * args.expert_ffn)
    meta = BuildContext(device="meta")
    total = sum(p.numel() for p in build_model(moe, meta).parameters())
    active = sum(p.numel() for p in build_model(dense, meta).parameters())
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    path = grouped_gemm_path(device, args.dtype)
    print(
        f"torch {torch.__version__}, {where}, {torch.get_num_threads()} threads, "
        f"{str(args.dtype).removeprefix('torch.')}; L={args.layers} h={args.hidden} "
        f"s={args.seq} b={args.batch}; E={args.experts} top-{args.topk} f={args.expert_ffn}: "
        f"{total / 1e6:.2f}M parameters, dense twin {active / 1e6:.2f}M; grouped GEMM: {path}\n"
    )
    times = step_times(args, moe, dense)
    dense_ms = times["dense (equal active params)"]
    tokens = args.batch * args.seq
    print("| model | ms / step | tokens/s | vs dense |\n| --- | ---: | ---: | ---: |")
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {ms / dense_ms:.2f}x |")
    looped, grouped = times["MoE, looped experts"], times["MoE, --moe-grouped-gemm"]
    print(
        f"HEADLINE MoE step: looped {looped:.1f} ms, grouped ({path}) {grouped:.1f} ms "
        f"({tokens / grouped * 1e3:,.0f} tokens/s); dense twin {dense_ms:.1f} ms"
    )
    if args.no_balance:
        return
    print("\n| step | max/mean load, aux 0.01 | lm loss | max/mean load, no aux | lm loss |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    with_aux, without = load_balance(args, moe, 0.01), load_balance(args, moe, 0.0)
    for (step, b1, l1), (_, b0, l0) in zip(with_aux, without, strict=True):
        print(f"| {step} | {b1:.2f} | {l1:.3f} | {b0:.2f} | {l0:.3f} |")


if __name__ == "__main__":
    main()
