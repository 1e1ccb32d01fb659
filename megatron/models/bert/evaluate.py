"""Masked-LM evaluation of a trained BERT on held-out data: loss and accuracy over the
predicted tokens, and NSP accuracy (tools/evaluate_bert.py).

MLM accuracy = (predicted tokens whose argmax logit is the original id) / (predicted tokens),
over every DP rank's samples. The argmax of vocab-parallel logits needs no gather: the global
max M (all-reduce MAX of the local maxima), then the smallest id holding it (all-reduce MIN).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig
from megatron.initialize import initialize_megatron
from megatron.models.bert import train as bert
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.utils import group_rank
from megatron.training.data import build_data_iterators
from megatron.training.loop import resolve_vocab
from megatron.training.step import NativeBackend


def _reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def vocab_parallel_argmax(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """logits (*, V/p), this rank's vocab slice -> the global argmax ids (*,)."""
    local_max, local_idx = logits.max(dim=-1)
    start = group_rank(tp_group) * logits.size(-1)
    global_max = _reduce(local_max.clone(), dist.ReduceOp.MAX, tp_group)
    big = torch.iinfo(torch.long).max
    candidate = torch.where(local_max == global_max, local_idx + start, big)
    return _reduce(candidate, dist.ReduceOp.MIN, tp_group)


@torch.no_grad()
def mlm_metrics(model, data_iterator, iters: int, rt) -> dict[str, float]:
    """MLM loss / accuracy and NSP accuracy of `iters` micro batches per DP rank (PP = 1)."""
    tp_group = rt.state.tp_group
    # loss, correct, predicted, nsp right, samples; on the device: NCCL reduces no CPU tensor.
    sums = torch.zeros(5, dtype=torch.float64, device=rt.device)
    model.eval()
    for _ in range(iters):
        data = {k: v.to(rt.device) for k, v in next(data_iterator).items()}
        tokens, types, pad, labels = (data[k] for k in ("text", "types", "padding_mask", "labels"))
        logits, nsp = model(tokens, pad, types)  # (b, s, V/p), (b, 2)
        chosen = data["loss_mask"] > 0
        loss = vocab_parallel_cross_entropy(logits.float(), labels, tp_group)
        pred = vocab_parallel_argmax(logits, tp_group)
        sums[0] += loss[chosen].sum().item()
        sums[1] += (pred == labels)[chosen].sum().item()
        sums[2] += chosen.sum().item()
        if nsp is not None:
            sums[3] += (nsp.argmax(-1) == data["is_random"]).sum().item()
            sums[4] += len(nsp)
    _reduce(sums, dist.ReduceOp.SUM, rt.state.dp_group)
    out = {"mlm loss": sums[0] / sums[2], "mlm accuracy": sums[1] / sums[2]}
    if sums[4]:
        out["nsp accuracy"] = sums[3] / sums[4]
    return {k: float(v) for k, v in out.items()}


def evaluate_checkpoint(cfg: MegatronConfig, split: str = "valid") -> dict[str, float]:
    """Load --load and measure --eval-iters micro batches of the `split` split."""
    if not cfg.checkpoint.load:
        raise ValueError("--load: pass the checkpoint directory to evaluate")
    if cfg.parallel.pipeline_model_parallel_size != 1:
        raise ValueError(
            "--pipeline-model-parallel-size: evaluation runs PP = 1 (any TP). Fix: reshard "
            "with tools/convert_checkpoint.py --target-pipeline-model-parallel-size 1"
        )
    cfg, _ = resolve_vocab(validate(cfg, "eval-bert"))
    rt = initialize_megatron(cfg)
    backend = NativeBackend(cfg, rt, bert.make_forward_step(cfg), bert.model_provider(cfg))
    backend.load()
    iters = build_data_iterators(cfg, rt, 0, 0, None, bert.datasets_provider)
    data = iters[{"valid": 1, "test": 2}[split]]
    if data is None:
        raise ValueError(f"--split {cfg.data.split}: the {split} split is empty")
    return mlm_metrics(backend.model.module[0], data, cfg.training.eval_iters, rt)
