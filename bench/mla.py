"""Multi-latent attention against grouped-query attention of about equal parameters, one process.

    .venv/bin/python bench/mla.py [--layers 2 --hidden 128 --heads 4 --seq 64 --batch 2
                                   --vocab 512 --q-lora-rank 48 --kv-lora-rank 32
                                   --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32
                                   --steps 3 --rounds 2] [--device cuda --bf16]

The GQA twin has the same hidden size and heads (head size h / heads) and the query-group count
whose attention parameters come nearest the MLA's. For each: attention parameters per layer,
median ms per training step (forward, backward, AdamW; rounds alternate the variants so machine
noise hits both alike), the activation bytes a forward keeps for backward
(model/memory.py SavedActivations) and the KV-cache bytes per token and layer, measured from
the engine's caches beside the formula: MLA (kv-lora-rank + qk-pos-emb-head-dim) x bytes,
GQA 2 x groups x head size x bytes.
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
from megatron.inference.engine import InferenceModel  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.model.memory import SavedActivations  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu.parallel_state import single_process_state  # noqa: E402


def _configs(a) -> tuple[ModelConfig, ModelConfig]:
    base = ModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        seq_length=a.seq,
        vocab_size=a.vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
    )
    mla = dataclasses.replace(
        base,
        multi_latent_attention=True,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_head_dim=a.qk_head_dim,
        qk_pos_emb_head_dim=a.qk_pos_emb_head_dim,
        v_head_dim=a.v_head_dim,
        rope_type="rope",
    )
    target = _attention_params(mla, a.device)
    groups = [g for g in range(1, a.heads + 1) if a.heads % g == 0]
    best = min(
        groups,
        key=lambda g: abs(
            _attention_params(dataclasses.replace(base, num_query_groups=g), a.device) - target
        ),
    )
    return mla, dataclasses.replace(base, num_query_groups=best)


def _attention_params(cfg: ModelConfig, device: str) -> int:
    with torch.device("meta"):
        layer = GPTModel(dataclasses.replace(cfg, num_layers=1), BuildContext(seed=1))
    attn = layer.layers["0"].self_attention
    return sum(p.numel() for p in attn.parameters())


def _step_ms(model, optimizer, tokens) -> float:
    start = time.perf_counter()
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if tokens.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _kv_bytes_per_token(model, cfg: ModelConfig) -> int:
    engine = InferenceModel([model], single_process_state(), cfg.vocab_size, cfg.hidden_size)
    caches = engine.new_caches(1, cfg.seq_length)
    total = sum(c.k.nbytes + c.v.nbytes for c in caches.values())
    return total // (len(caches) * cfg.seq_length)


def _formula(cfg: ModelConfig, element: int) -> int:
    if cfg.multi_latent_attention:
        return (cfg.kv_rank + cfg.qk_rope_dim) * element
    return 2 * cfg.query_groups * cfg.head_dim * element


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (
        ("--layers", 2), ("--hidden", 128), ("--heads", 4), ("--seq", 64), ("--batch", 2),
        ("--vocab", 512), ("--q-lora-rank", 48), ("--kv-lora-rank", 32), ("--qk-head-dim", 32),
        ("--qk-pos-emb-head-dim", 16), ("--v-head-dim", 32), ("--steps", 3), ("--rounds", 2),
    ):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    variants = dict(zip(("MLA", "GQA"), _configs(a), strict=True))
    models, optims, times, rows = {}, {}, {k: [] for k in variants}, {}
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=a.device)
    for name, cfg in variants.items():
        models[name] = GPTModel(
            cfg, BuildContext(seed=1, device=torch.device(a.device), dtype=dtype)
        )
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
        _step_ms(models[name], optims[name], tokens)  # warm-up
    for _ in range(a.rounds):
        for name in variants:
            times[name] += [_step_ms(models[name], optims[name], tokens) for _ in range(a.steps)]
    element = torch.tensor([], dtype=dtype).element_size()
    for name, cfg in variants.items():
        model = models[name]
        with SavedActivations(exclude=model.parameters()) as saved:
            model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        shape = (
            f"q {cfg.q_lora_rank}, kv {cfg.kv_rank}, d {cfg.qk_nope_dim}+{cfg.qk_rope_dim}/"
            f"{cfg.v_dim}"
            if cfg.multi_latent_attention
            else f"{cfg.query_groups} groups x {cfg.head_dim}"
        )
        rows[name] = (
            shape,
            _attention_params(cfg, a.device),
            statistics.median(times[name]),
            saved.bytes / 2**20,
            _kv_bytes_per_token(model, cfg),
            _formula(cfg, element),
        )
    print(
        f"# {a.layers} layers, h {a.hidden}, {a.heads} heads, seq {a.seq}, batch {a.batch}, "
        f"{dtype}, {a.device}; median of {a.rounds} x {a.steps} steps"
    )
    head = ("variant", "attention", "attn params/layer", "ms/step", "saved act MiB")
    head += ("KV B/token/layer", "formula")
    print(" | ".join(head))
    for name, (shape, params, ms, mib, kv, formula) in rows.items():
        print(f"{name} | {shape} | {params} | {ms:.1f} | {mib:.1f} | {kv} | {formula}")
    ratio = rows["GQA"][4] / rows["MLA"][4]
    print(f"KV cache: MLA holds {ratio:.1f}x fewer bytes per token than the GQA twin")


if __name__ == "__main__":
    main()
