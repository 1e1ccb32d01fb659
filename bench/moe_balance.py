"""MoE load balance over training: the auxiliary-loss-free expert bias against the aux loss.

    .venv/bin/python bench/moe_balance.py [--layers 2 --hidden 32 --heads 4 --seq 32 --vocab 128
                                           --experts 8 --topk 2 --expert-ffn 32 --batch 8
                                           --steps 40 --rates 1e-3,1e-2 --coeff 1e-2] [--groups 2]

The same tiny MoE GPT, data and steps (bench/moe.py's Trainer: train_step with our DDP buffer
and AdamW; counting sequences), once per router variant:
  softmax + aux loss       Mixtral's router with --moe-aux-loss-coeff (bench/moe.py's part 2)
  sigmoid, no balancing    DeepSeek-V3's scores, nothing pulling the load even
  sigmoid + aux loss       the same with --moe-aux-loss-coeff
  sigmoid + expert bias    --moe-router-enable-expert-bias --moe-router-bias-update-rate r,
                           one row per rate (DeepSeek-V3's auxiliary-loss-free balancing; no
                           aux loss; Megatron-core's default rate 1e-3)
Each row: the expert-load spread max / mean tokens per expert (mean over the MoE layers; 1.00 is
perfect balance, E / k the worst) at a few steps, its mean over the last half of the run, and
the final LM loss. --groups G adds group-limited routing (G groups, top G / 2) to the sigmoid
rows.
"""

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe import Trainer, _batch, dense_fields  # noqa: E402  (bench/moe.py, beside this script)

from megatron.config.schema import ModelConfig  # noqa: E402


def variants(args) -> dict[str, dict]:
    sigmoid = {"moe_router_score_function": "sigmoid"}
    if args.groups:
        sigmoid |= {"moe_router_num_groups": args.groups, "moe_router_group_topk": args.groups // 2}
    out = {
        f"softmax + aux loss {args.coeff:g}": {"moe_aux_loss_coeff": args.coeff},
        "sigmoid, no balancing": sigmoid,
        f"sigmoid + aux loss {args.coeff:g}": {**sigmoid, "moe_aux_loss_coeff": args.coeff},
    }
    for rate in (float(r) for r in args.rates.split(",")):
        bias = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": rate}
        out[f"sigmoid + expert bias (rate {rate:g})"] = {**sigmoid, **bias}
    return out


def run(args, cfg: ModelConfig) -> tuple[list[float], float]:
    """max / mean expert load after every step, and the last LM loss."""
    trainer = Trainer(cfg)
    gen, spread, loss = torch.Generator().manual_seed(1), [], 0.0
    for _ in range(args.steps):
        result = trainer.step(_batch(args, gen))
        spread.append(float(result["other_losses"]["expert load max/mean"]))
        loss = float(result["lm_loss"])
    return spread, loss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 2), ("hidden", 32), ("heads", 4), ("seq", 32), ("vocab", 128),
        ("experts", 8), ("topk", 2), ("expert-ffn", 32), ("batch", 8), ("steps", 40),
        ("groups", 0),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rates", default="1e-3,1e-2", help="--moe-router-bias-update-rate values")
    p.add_argument("--coeff", type=float, default=1e-2, help="--moe-aux-loss-coeff")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    base = ModelConfig(
        **dense_fields(args),
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn,
    )
    marks = sorted({1, args.steps // 4, args.steps // 2, args.steps} - {0})
    print(
        f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; L={args.layers} "
        f"h={args.hidden} s={args.seq} b={args.batch}; E={args.experts} top-{args.topk}"
        f"{f', {args.groups} groups' if args.groups else ''}; {args.steps} steps, "
        f"expert load max/mean (1.00 = even, {args.experts / args.topk:.2f} = worst)\n"
    )
    head = " | ".join(f"step {s}" for s in marks)
    print(f"| router | {head} | mean, last half | lm loss |")
    print("| --- |" + " ---: |" * (len(marks) + 2))
    for name, changes in variants(args).items():
        spread, loss = run(args, dataclasses.replace(base, **changes))
        late = spread[len(spread) // 2 :]
        cells = " | ".join(f"{spread[s - 1]:.2f}" for s in marks)
        print(f"| {name} | {cells} | {sum(late) / len(late):.2f} | {loss:.3f} |", flush=True)


if __name__ == "__main__":
    main()
