"""A model trained a few steps at a parallel layout with our DDP and optimizer, without the
trainer's loop: what the layouts-against-one-process tests of the model pieces share."""

from __future__ import annotations

import functools

import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.inference.engine import InferenceModel
from megatron.initialize import Runtime
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import build_model
from megatron.models.gpt.train import lm_loss
from megatron.mpu.context_parallel import context_parallel_slice
from megatron.optim.plain import plain_optimizer
from megatron.training.schedules import get_forward_backward_func
from megatron.training.step import train_step
from megatron.training.timers import Timers


def random_micro_batches(step: int, groups, state, batch: int) -> list[dict]:
    """Micro batches `groups` of `step` (`batch` samples of 8 tokens from a vocab of 64, seeded by
    step and micro batch): this rank's, as its CP rank's chunks of the sequences."""
    out = []
    for g in groups:
        gen = torch.Generator().manual_seed(1000 * step + g)
        tokens = torch.randint(0, 64, (batch, 9), generator=gen)
        micro = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
        if state.cp_size > 1:
            micro = {
                k: context_parallel_slice(v, state.cp_rank, state.cp_size) for k, v in micro.items()
            }
        out.append(micro)
    return out


def lm_forward_step(state, data_iterator, model):
    """The GPT loss of the next micro batch, every token counted, CP-aware."""
    batch = next(data_iterator)
    per_token = model(batch["tokens"], labels=batch["labels"])
    mask = torch.ones(batch["labels"].shape)
    return per_token, functools.partial(
        lm_loss, mask, context_parallel=state if state.cp_size > 1 else None
    )


class _Scheduler:
    def step(self, *args):
        pass


def train_steps(
    cfg: ModelConfig, state, forward_step, steps: list[list], micro_batch_size: int, recompute=None
):
    """One train_step per entry of `steps` (that step's micro batches, in order) of the GPT
    `cfg` at `state`: AdamW lr 1e-2, eps 1e-4, no weight decay, no clipping, fp32, our DDP
    over DP x CP (the shared embedding in its own bucket). Returns (the steps' results, model
    chunks)."""
    policy = RecomputeConfig(granularity=recompute) if recompute else None
    model = parallelize(build_model(cfg, BuildContext(state=state)), state, policy)
    shared = model.word_embeddings_weight() if state.pp_size > 1 else None
    ddp = DistributedDataParallel(
        model, state.dp_cp_group, own_bucket=(shared,) if shared is not None else ()
    )
    opt_cfg = OptimizerConfig(lr=1e-2, adam_eps=1e-4, weight_decay=0.0)
    opt = plain_optimizer(model, opt_cfg, params_dtype=torch.float32, state=state, clip_grad=0.0)
    schedule = get_forward_backward_func(
        state,
        micro_batch_size=micro_batch_size,
        seq_length=cfg.seq_length // state.cp_size,
        hidden_size=cfg.hidden_size,
        dtype=torch.float32,
    )
    rt = Runtime(state=state, device=torch.device("cpu"), rng_tracker=None)
    results = [
        train_step(
            forward_step, iter(batches), ddp, opt, _Scheduler(), len(batches), rt, Timers(),
            schedule,
        )
        for batches in steps
    ]  # fmt: skip
    return results, model


def train_layout(cfg: ModelConfig, state, recompute, groups, batch: int, steps: int):
    """`steps` steps of this rank's micro batches `groups` (random_micro_batches) of `batch`
    samples; (losses and grad norms, weights, grads, model)."""
    batches = [random_micro_batches(step, groups, state, batch) for step in range(steps)]
    step = functools.partial(lm_forward_step, state)
    results, model = train_steps(cfg, state, step, batches, batch, recompute)
    history = [(float(r["lm_loss"]), float(r["grad_norm"])) for r in results]
    grads = {n: p.main_grad.clone() for c in model.chunks for n, p in c.named_parameters()}
    weights = {n: p.detach().clone() for c in model.chunks for n, p in c.named_parameters()}
    return history, weights, grads, model


def _local_view(full: torch.Tensor, param, state) -> torch.Tensor:
    if mpu.is_tensor_parallel(param) and state.tp_size > 1:
        return mpu.shard(
            full, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride
        )
    return full


def compare_layout(name, ref, mine, params, state):
    """`train_layout`'s results at a layout (`params` its named parameters) against one
    process's: losses and grad norms, then each weight and grad as this rank's shard."""
    torch.testing.assert_close(
        torch.tensor(mine[0]),
        torch.tensor(ref[0]),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"{name}: loss / grad norm: {m}",
    )
    for pname, value in mine[1].items():
        for what, got, full in (("weight", value, ref[1]), ("grad", mine[2][pname], ref[2])):
            torch.testing.assert_close(
                got,
                _local_view(full[pname], params[pname], state),
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, p=pname, w=what: f"{name} {w} {p}: {m}",
            )


def check_cached_generation(name, ref_model, model, state):
    """Step-by-step logits through the KV caches (the latent one under MLA, the rolling one of
    windowed layers) on this layout == the one-process model's uncached forward (the engine
    broadcasts them to every rank). The small GPT's shapes: 8 tokens, vocab 64, hidden 32."""
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    ref_chunk = ref_model.chunks[0]
    ref_chunk.eval()
    with torch.no_grad():
        want = ref_chunk(tokens)[..., :64].float()  # (b, s, V)
    engine = InferenceModel(model.chunks, state, 64, 32)
    caches = engine.new_caches(2, 8)
    positions = torch.arange(8).expand(2, -1)
    for pos in range(3, 8):
        window = slice(0, pos + 1) if pos == 3 else slice(pos, pos + 1)
        got = engine.next_token_logits(tokens[:, window], positions[:, window], caches)
        torch.testing.assert_close(
            got, want[:, pos], rtol=1e-4, atol=1e-5, msg=lambda m, p=pos: f"{name} {p}: {m}"
        )
