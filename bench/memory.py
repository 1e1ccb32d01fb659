"""Per-rank memory of model states and activations, measured, next to the published formulas.

    .venv/bin/python bench/memory.py [--seq 512 --batch 1]

1. Model states: bytes per rank of parameters, gradients and optimizer state, summed over the
   tensors our trainer allocates (GPTModel + DistributedDataParallel + MegatronOptimizer or
   DistributedOptimizer, after one optimizer step so Adam's moments exist), built on the meta
   device: every shape and dtype as on a real run, no memory. TP ranks are real (gloo); the DP
   size is given to DDP as a stand-in group (the shards are laid out, no collective runs).
   Formula per parameter of the rank (ZeRO paper, Megatron's distributed optimizer):
       bf16 params, fp32 grads:  18 plain  vs  6 + 12 / DP distributed
       fp32:                     16 plain  vs  8 +  8 / DP distributed
   FSDP2 (--use-torch-fsdp2) at DP 2 and 4 (real gloo DP ranks, TP 1; fully_shard lays the
   meta tensors out over a real mesh): fp32 shards of the weights (the master weights), of the
   gradients and of Adam's moments, 16 / DP bytes per parameter in either dtype, plus, while a
   unit computes, its weights gathered whole (printed under the table). Beside it DeepSpeed's
   ZeRO-3 estimator (estimate_zero3_model_states_mem_needs, not a measurement).
2. Activations: bytes kept for backward by one transformer layer during a bf16 forward of one
   micro batch (autograd saved-tensor hooks; unique storages, parameters left out), per layer,
   against Korthikanti et al. 2022 with the s^2 term gone (SDPA/flash keeps no attention
   matrix; attention dropout 0): sbh (10 + 24 / t) without sequence parallelism, 34 sbh / t
   with it. The whole micro batch: L layers plus the embedding and the head/loss (measured on
   a one-layer GPT).
"""

import argparse
import contextlib
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron.data_parallel.ddp as ddp_module  # noqa: E402
from megatron import mpu  # noqa: E402
from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_optimizer import OptimizerConfig  # noqa: E402
from megatron.data_parallel.ddp import DistributedDataParallel  # noqa: E402
from megatron.data_parallel.fsdp2 import FullyShardedModel  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.model.stages import ModelChunks  # noqa: E402
from megatron.model.transformer import TransformerLayer  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu.parallel_state import initialize_model_parallel  # noqa: E402
from megatron.optim.distributed import distributed_optimizer  # noqa: E402
from megatron.optim.fsdp2 import fsdp2_optimizer  # noqa: E402
from megatron.optim.plain import plain_optimizer  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

MODELS = {
    "GPT L24 h1024 (345M)": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "GPT L24 h2048 (1.3B)": dict(num_layers=24, hidden_size=2048, num_attention_heads=16),
}
VOCAB = 50257


class _StandInDP:
    """A data-parallel 'group' of `size` ranks seen from rank 0, for laying out shards only."""

    def __init__(self, size: int):
        self.size = size


@contextlib.contextmanager
def _stand_in_dp():
    real_size, real_rank = ddp_module.group_size, ddp_module.group_rank
    ddp_module.group_size = lambda g: g.size if isinstance(g, _StandInDP) else real_size(g)
    ddp_module.group_rank = lambda g: 0 if isinstance(g, _StandInDP) else real_rank(g)
    try:
        yield
    finally:
        ddp_module.group_size, ddp_module.group_rank = real_size, real_rank


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(cfg: ModelConfig, state, dp: int, distributed: bool, dtype) -> dict:
    """{'params', 'grads', 'optimizer', 'n'}: bytes this rank allocates, and its parameters."""
    with torch.device("meta"):
        model = GPTModel(cfg, BuildContext(state, dtype=dtype))
    n = sum(p.numel() for p in model.parameters())
    with _stand_in_dp():
        ddp = DistributedDataParallel(
            model, _StandInDP(dp) if dp > 1 else None, use_distributed_optimizer=distributed
        )
    kw = {"params_dtype": dtype, "state": state, "clip_grad": 1.0}
    ocfg = OptimizerConfig(lr=1e-4)
    opt = (
        distributed_optimizer(ddp, ocfg, **kw)
        if distributed
        else plain_optimizer(model, ocfg, **kw)
    )
    opt.pieces.grads()  # each main's .grad: its fp32 gradient
    mains = [m for g in opt.optimizer.param_groups for m in g["params"]]
    for group in opt.optimizer.param_groups:  # torch's fused kernel does not run on meta
        group.update(fused=False, foreach=True)
    opt.optimizer.step()  # Adam allocates its moments at the first step
    params = {id(p) for p in model.parameters()}
    own_mains = [m for m in mains if id(m) not in params and m._base is None]  # fp32 copies
    moments = [t for s in opt.optimizer.state.values() for t in s.values() if t.ndim > 0]
    param_bytes = (
        _nbytes(ddp.param_buffer) if distributed else sum(map(_nbytes, model.parameters()))
    )
    return {
        "params": param_bytes,
        "grads": _nbytes(ddp.grad_buffer),
        "optimizer": sum(map(_nbytes, own_mains)) + sum(map(_nbytes, moments)),
        "n": n,
    }


def _saved_bytes(fn, weights: set[int], dropout: float) -> tuple[int, int]:
    """(bytes, bytes as on CUDA) of the unique storages autograd keeps for backward while
    `fn()` runs, weights left out. A dropout mask is recognised by its values (0 and 1/(1-p)
    only): torch's CPU dropout keeps it in the activation dtype, its CUDA kernel as 1-byte
    bools, which is what the formula counts."""
    seen: dict[int, tuple[int, int]] = {}
    keep = torch.tensor(1 / (1 - dropout)) if dropout else None

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in weights and ptr not in seen:
            mask = keep is not None and t.is_floating_point() and t.numel() > 1
            kept = t == keep.to(t.dtype)
            mask = mask and bool(kept.any()) and bool((kept | (t == 0)).all())
            seen[ptr] = (storage.nbytes(), t.numel() if mask else storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(b for b, _ in seen.values()), sum(c for _, c in seen.values())


def _layer_input(cfg: ModelConfig, seq: int, batch: int, tp: int, sp: bool) -> torch.Tensor:
    rows = seq // tp if sp else seq  # sequence parallel: each TP rank holds s / t positions
    return torch.randn(batch, rows, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)


def activation_bytes(cfg: ModelConfig, state, seq: int, batch: int, sp: bool = False) -> tuple:
    """((bytes, as on CUDA) one layer keeps, (bytes, as on CUDA) the embedding + head + loss
    keep) for one micro batch."""
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 1)
    if sp:  # the layer reads --sequence-parallel from the parallel state, as in training
        state = dataclasses.replace(state, sequence_parallel=True)
    layer = TransformerLayer(cfg, BuildContext(state, dtype=torch.bfloat16, rng_tracker=tracker))
    with torch.no_grad():  # real values, so that only dropout masks look like masks
        for p in layer.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.02)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = _layer_input(cfg, seq, batch, state.tp_size, sp)
    per_layer = _saved_bytes(lambda: layer(x), weights, cfg.hidden_dropout)
    if sp:
        return per_layer, (0, 0)
    one = GPTModel(
        dataclasses.replace(cfg, num_layers=1),
        BuildContext(state, dtype=torch.bfloat16, rng_tracker=tracker),
    )
    weights = {p.untyped_storage().data_ptr() for p in one.parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    whole = _saved_bytes(lambda: one(tokens, labels=tokens), weights, cfg.hidden_dropout)
    return per_layer, (whole[0] - per_layer[0], whole[1] - per_layer[1])


def _worker(rank, world, seq, batch):
    torch.manual_seed(0)
    state = initialize_model_parallel(world)
    rows = {"states": [], "acts": []}
    for name, shape in MODELS.items():
        cfg = ModelConfig(
            **shape, seq_length=seq, vocab_size=VOCAB, hidden_dropout=0.1, attention_dropout=0.0
        )
        for dtype in (torch.bfloat16, torch.float32):
            for dp in (1, 2, 4):
                for distributed in (False, True):
                    got = model_state_bytes(cfg, state, dp, distributed, dtype)
                    kind = "distributed" if distributed else "plain"
                    rows["states"].append((name, world, dp, kind, str(dtype)[6:], got))
        if seq:
            acts = activation_bytes(cfg, state, seq, batch)
            sp = activation_bytes(cfg, state, seq, batch, sp=True) if world > 1 else None
            rows["acts"].append((name, world, cfg, acts, sp))
    return rows if rank == 0 else None


def _fsdp2_worker(rank, world, seq):
    """FSDP2 at DP = world (TP 1): this rank's shards, laid out on the meta device over a real
    gloo mesh (fully_shard needs one; no collective runs on meta tensors)."""
    state = initialize_model_parallel(1)
    rows = []
    for name, shape in MODELS.items():
        cfg = ModelConfig(**shape, seq_length=seq, vocab_size=VOCAB)
        for dtype in (torch.bfloat16, torch.float32):
            got = fsdp2_state_bytes(cfg, state, dtype)
            rows.append((name, 1, world, "FSDP2", str(dtype)[6:], got))
            if dtype == torch.bfloat16:
                got = {**got, **zero3_estimate(got["n"], got["unit"], world)}
                rows.append((name, 1, world, "ZeRO-3 (DeepSpeed's estimator)", "bfloat16", got))
    return rows if rank == 0 else None  # rank 0 holds the largest shards (torch.chunk's split)


def fsdp2_state_bytes(cfg: ModelConfig, state, dtype) -> dict:
    """{'params', 'grads', 'optimizer', 'n', 'unit'}: the fp32 shards FSDP2 keeps of the weights
    (the master weights), of the gradients and Adam's moments; 'unit': the largest sharding
    unit's parameter count (gathered whole in the run's dtype while it computes)."""
    with torch.device("meta"):
        model = GPTModel(cfg, BuildContext(state, dtype=dtype))
    n = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in m.parameters()) for m in model.layer_list())
    fsdp = FullyShardedModel(ModelChunks([model]), state.dp_cp_group, params_dtype=dtype)
    kw = {"params_dtype": dtype, "state": state, "clip_grad": 1.0}
    opt = fsdp2_optimizer(fsdp, OptimizerConfig(lr=1e-4), **kw)
    grads = [torch.zeros_like(m) for m in opt.pieces.mains]  # the reduce-scattered fp32 shards
    for main, grad in zip(opt.pieces.mains, grads, strict=True):
        main.grad = grad
    for group in opt.optimizer.param_groups:
        group.update(fused=False, foreach=True)
    opt.optimizer.step()
    moments = [t for s in opt.optimizer.state.values() for t in s.values() if t.ndim > 0]
    return {
        "params": sum(map(_nbytes, opt.pieces.mains)),
        "grads": sum(map(_nbytes, grads)),
        "optimizer": sum(map(_nbytes, moments)),
        "n": n,
        "unit": unit,
    }


def zero3_estimate(n: int, largest_layer: int, dp: int) -> dict:
    """DeepSpeed's own ZeRO-3 estimate of the model states per device (its
    estimate_zero3_model_states_mem_needs, no offload: 18 bytes / DP per parameter plus 4 x the
    largest layer), shown as 2 + 2 bytes / DP of half weights and gradients, the rest as
    optimizer state. Not measured: DeepSpeed's ZeRO-3 needs real tensors."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        return {"params": 2 * n // dp, "grads": 2 * n // dp, "optimizer": 12 * n // dp}
    _, total, _ = estimate_zero3_model_states_mem_needs(
        n, largest_layer, num_gpus_per_node=dp, cpu_offload=False
    )
    return {"params": 2 * n // dp, "grads": 2 * n // dp, "optimizer": total - 4 * n // dp}


def _state_formula(dtype: str, dp: int, kind: str) -> float:
    if kind == "FSDP2":  # fp32 shards of weights (the masters) and grads, and the moments
        return 16 / dp
    if kind.startswith("ZeRO-3"):  # half weights and grads, fp32 masters and moments
        return 16 / dp
    if dtype == "bfloat16":
        return 6 + 12 / dp if kind == "distributed" else 18
    return 8 + 8 / dp if kind == "distributed" else 16


def print_states(rows) -> None:
    print(
        f"| model | TP | DP | dtype | optimizer | params/rank | param GiB | grad GiB | "
        f"optim GiB | bytes/param | formula | diff |\n|{'---|' * 12}"
    )
    for name, tp, dp, kind, dtype, got in rows:
        total = got["params"] + got["grads"] + got["optimizer"]
        per, formula = total / got["n"], _state_formula(dtype, dp, kind)
        print(
            f"| {name} | {tp} | {dp} | {dtype} | {kind} | "
            f"{got['n'] / 1e6:.1f} M | {got['params'] / 2**30:.3f} | {got['grads'] / 2**30:.3f} | "
            f"{got['optimizer'] / 2**30:.3f} | {per:.3f} | {formula:.3f} | "
            f"{100 * (per / formula - 1):+.2f}% |"
        )


def print_fsdp2_units(rows) -> None:
    """FSDP2 holds more than its shards while a unit computes: that unit's weights whole."""
    seen = set()
    for name, _, _, kind, dtype, got in rows:
        if kind == "FSDP2" and (name, dtype) not in seen:
            seen.add((name, dtype))
            size = 2 if dtype == "bfloat16" else 4
            print(
                f"FSDP2 {name} {dtype}: + {got['unit'] * size / 2**20:.0f} MiB while the largest "
                f"unit ({got['unit'] / 1e6:.1f} M parameters) is gathered (x2 with prefetch)"
            )


def print_activations(rows, seq: int, batch: int) -> None:
    note = "; SP needs TP > 1"
    print(
        f"\nActivations kept for backward, one micro batch, bf16, s={seq} b={batch} (/sbh: "
        f"bytes / (s b h); 'as on CUDA': dropout masks as 1-byte bools{note})\n"
        "| model | TP | layer MiB | /sbh CPU | /sbh as on CUDA | sbh(10+24/t) | diff | "
        "SP /sbh as on CUDA | 34/t | diff | micro batch MiB, as on CUDA (L layers + rest) |\n"
        f"|{'---|' * 11}"
    )
    for name, tp, cfg, ((layer, layer_cuda), (_, rest_cuda)), sp in rows:
        sbh = seq * batch * cfg.hidden_size
        per, formula = layer_cuda / sbh, 10 + 24 / tp
        sp_cells = "n/a | " + f"{34 / tp:.2f} | n/a"
        if sp is not None:
            sp_per = sp[0][1] / sbh
            sp_cells = f"{sp_per:.2f} | {34 / tp:.2f} | {100 * (sp_per * tp / 34 - 1):+.2f}%"
        total = (cfg.num_layers * layer_cuda + rest_cuda) / 2**20
        print(
            f"| {name} | {tp} | {layer / 2**20:.1f} | {layer / sbh:.2f} | {per:.2f} | "
            f"{formula:.2f} | {100 * (per / formula - 1):+.2f}% | {sp_cells} | {total:.0f} |"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512, help="sequence length (0: skip activations)")
    p.add_argument("--batch", type=int, default=1, help="micro batch size")
    args = p.parse_args()
    states, acts = [], []
    for tp in (1, 2, 4):
        rows = run_distributed(_worker, tp, args.seq, args.batch, timeout=600)[0]
        states += rows["states"]
        acts += rows["acts"]
    for dp in (2, 4):
        states += run_distributed(_fsdp2_worker, dp, args.seq, timeout=600)[0]
    states.sort(key=lambda r: (r[0], r[4], r[1], r[2], r[3]))
    print_states(states)
    print_fsdp2_units(states)
    print_activations(acts, args.seq, args.batch)


if __name__ == "__main__":
    main()
