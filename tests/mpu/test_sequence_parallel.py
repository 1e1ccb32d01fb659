"""Sequence parallelism (--sequence-parallel): the mappings against their math, the model and
the trainer against one process, the rules.

Ranks are gloo processes on the CPU; one spawn of 4 ranks checks the mappings and the model at
TP = 4 and TP = 2 (x DP 2), one of 8 ranks trains TP2 x PP2 x DP2 (interleaved) and resumes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.fused_kernels import FusedOps
from megatron.model.context import BuildContext
from megatron.model.memory import SavedActivations
from megatron.model.parallelize import parallelize
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.mpu.random import MODEL_PARALLEL_RNG, model_parallel_seed
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    _losses,
    _ref_worker,
    _resume_worker,
    _train,
    assert_same_run,
    flags,
    train_run,
)

# ---- the mappings: forward and backward against the math ----


def _per_rank(shape, seed: int, size: int) -> list[torch.Tensor]:
    """What every rank of a group of `size` feeds in (each rank can rebuild all of them)."""
    return [
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(size)
    ]


def _check_mappings(group) -> None:
    p, r = mpu.utils.group_size(group), mpu.utils.group_rank(group)
    b, s, h = 2, 4 * p, 3
    part = slice(r * s // p, (r + 1) * s // p)
    full = _per_rank((b, s, h), 1, 1)[0]  # equal on every rank
    grads_local = _per_rank((b, s // p, h), 100, p)  # rank-dependent upstream gradients
    grads_full = _per_rank((b, s, h), 200, p)

    # scatter: forward keeps my positions; backward all-gathers the gradient
    x = full.clone().requires_grad_()
    y = mpu.scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(y, full[:, part])
    y.backward(grads_local[r])
    assert torch.equal(x.grad, torch.cat(grads_local, dim=1))

    # gather (consumer TP-split): forward all-gathers; backward reduce-scatters
    x = full[:, part].clone().requires_grad_()
    y = mpu.gather_from_sequence_parallel_region(x, group)
    assert torch.equal(y, full)
    y.backward(grads_full[r])
    torch.testing.assert_close(x.grad, sum(grads_full)[:, part])

    # gather (consumer replicated): backward keeps my slice of the (equal) gradient
    x = full[:, part].clone().requires_grad_()
    mpu.gather_from_sequence_parallel_region(x, group, grad_is_partial=False).backward(full)
    assert torch.equal(x.grad, full[:, part])

    # reduce-scatter: forward sums over ranks and keeps my positions; backward all-gathers
    inputs = _per_rank((b, s, h), 300, p)
    x = inputs[r].clone().requires_grad_()
    y = mpu.reduce_scatter_to_sequence_parallel_region(x, group)
    torch.testing.assert_close(y, sum(inputs)[:, part])
    y.backward(grads_local[r])
    assert torch.equal(x.grad, torch.cat(grads_local, dim=1))

    ids = torch.arange(s).expand(b, s)
    assert torch.equal(mpu.sequence_slice(ids, group, dim=-1), ids[:, part])
    with pytest.raises(ValueError, match="not divisible"):
        mpu.reduce_scatter_to_sequence_parallel_region(torch.ones(1, s + 1, 1), group)


def _check_grad_sync(group) -> None:
    """Marked parameters' gradients are summed over TP (deferred, and in backward); others not."""
    p, r = mpu.utils.group_size(group), mpu.utils.group_rank(group)
    marked, plain = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    mpu.mark_sequence_parallel(marked)
    marked.main_grad = torch.full((3,), float(r + 1))
    plain.main_grad = torch.full((2,), float(r + 1))
    assert mpu.all_reduce_sequence_parallel_grads([marked, plain], group) == 1
    assert torch.equal(marked.main_grad, torch.full((3,), p * (p + 1) / 2))
    assert torch.equal(plain.main_grad, torch.full((2,), float(r + 1)))

    w = torch.nn.Parameter(torch.ones(3))
    mpu.mark_sequence_parallel(w)
    assert mpu.reduce_sequence_parallel_grads_in_backward([w], group) == 1
    for _ in range(2):  # two micro batches accumulate the summed gradients
        (w * (r + 1)).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2 * p * (p + 1) / 2))


# ---- the model: TP + SP against one process ----

_BASE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=8,
    seq_length=8,
    vocab_size=61,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# The kernels whose inputs change under SP (add + norm on the s / p slice) or sit at its
# boundaries (bias + GeLU after the gather, cross-entropy after the head's gather). The fused
# attention softmax sees the full sequence either way; it is skipped here for time (the Triton
# interpreter takes seconds per call on the CPU).
_FUSED = FusedOps(add_norm="triton", bias_gelu="triton", cross_entropy="triton")
_LLAMA = dataclasses.replace(
    _BASE,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=4,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
# (name, model config, recompute, fused ops, AdamW steps)
_VARIANTS = {
    "gpt2": (_BASE, None, None, 3),
    "llama-like (RoPE, RMSNorm, SwiGLU, GQA, untied), full recompute": (
        _LLAMA,
        RecomputeConfig(granularity="full", method="uniform", num_layers=1),
        None,
        3,
    ),
    "selective recompute": (_BASE, RecomputeConfig(granularity="selective"), None, 2),
    "fused kernels": (_BASE, None, _FUSED, 1),
}


def _tracker(seed: int, tp_rank: int) -> mpu.RNGStatesTracker:
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed, tp_rank))
    return tracker


def _batch(cfg: ModelConfig, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    text = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=g)
    return text[:, :-1], text[:, 1:]


def _train_steps(model, state, steps: int = 3):
    """Losses and the gradients of the first step, after `steps` AdamW steps on fixed batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses, first_grads = [], None
    for step in range(steps):
        tokens, labels = _batch(model.cfg, step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        if state.sequence_parallel:
            mpu.all_reduce_sequence_parallel_grads(model.parameters(), state.tp_group, attr="grad")
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, first_grads


def _check_model_equivalence(state, names) -> None:
    for name in names:
        cfg, recompute, ops, steps = _VARIANTS[name]
        ref = parallelize(
            GPTModel(cfg, BuildContext(seed=5, ops=ops)), mpu.single_process_state(), recompute
        )
        ref_losses, ref_grads = _train_steps(ref, ref.state, steps)
        model = parallelize(
            GPTModel(
                cfg, BuildContext(state, seed=5, rng_tracker=_tracker(5, state.tp_rank), ops=ops)
            ),
            state,
            recompute,
        )
        losses, grads = _train_steps(model, state, steps)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
        full = dict(ref.named_parameters())
        for pname, param in model.named_parameters():
            shard = _shard(ref_grads[pname], param, state)
            torch.testing.assert_close(
                grads[pname], shard, rtol=1e-4, atol=1e-6, msg=f"{name} {pname} grad"
            )
            weight = _shard(full[pname].detach(), param, state)
            torch.testing.assert_close(
                param.detach(), weight, rtol=1e-4, atol=1e-5, msg=f"{name} {pname}"
            )


def _shard(full: torch.Tensor, param, state) -> torch.Tensor:
    if not mpu.is_tensor_parallel(param):
        return full
    return mpu.shard(
        full, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride
    )


def _check_dropout_streams(state) -> None:
    """Residual dropout on the sequence slices: independent masks per TP rank, replayed exactly
    by full recompute, and replicated parameters stay equal over TP."""
    cfg = dataclasses.replace(_BASE, hidden_dropout=0.3)
    layer = TransformerLayer(cfg, BuildContext(state, rng_tracker=_tracker(9, state.tp_rank)))
    mask = layer._dropout(torch.ones(2, 16, 32)) == 0
    masks = [torch.empty_like(mask) for _ in range(state.tp_size)]
    dist.all_gather(masks, mask, group=state.tp_group)
    assert not torch.equal(masks[0], masks[1]), "TP ranks drew the same residual dropout mask"

    runs = []
    for recompute in (None, RecomputeConfig(granularity="full", num_layers=2)):
        torch.manual_seed(3)
        model = parallelize(
            GPTModel(cfg, BuildContext(state, seed=5, rng_tracker=_tracker(5, state.tp_rank))),
            state,
            recompute,
        )
        runs.append(_train_steps(model, state, steps=2) + (model,))
    (l0, g0, model), (l1, g1, _) = runs
    assert l0 == l1, "full recompute changed the losses under sequence-parallel dropout"
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    for n, p in model.named_parameters():
        if not mpu.is_tensor_parallel(p):  # replicated: must agree over TP after the steps
            copies = [torch.empty_like(p.detach()) for _ in range(state.tp_size)]
            dist.all_gather(copies, p.detach().contiguous(), group=state.tp_group)
            assert all(torch.equal(c, copies[0]) for c in copies), n


def _activation_bytes(state, cfg) -> int:
    model = GPTModel(cfg, BuildContext(state, seed=5, rng_tracker=_tracker(5, state.tp_rank)))
    tokens, labels = _batch(cfg, 0)
    with SavedActivations(exclude=model.parameters()) as saved:
        model(tokens, labels=labels).mean().backward()
    return saved.bytes


def _check_activation_memory(state) -> float:
    """What a forward keeps for backward: less with SP than with TP alone, same TP group."""
    cfg = dataclasses.replace(_BASE, seq_length=64, num_layers=4)
    sp = _activation_bytes(state, cfg)
    tp_only = _activation_bytes(dataclasses.replace(state, sequence_parallel=False), cfg)
    assert sp < tp_only, (sp, tp_only)
    return sp / tp_only


def _model_worker(rank, world):
    torch.manual_seed(0)
    everything, some, ratios = list(_VARIANTS), list(_VARIANTS)[:2], {}
    for tp, names in ((4, everything), (2, some)):  # TP 2 x DP 2: each TP pair checks itself
        state = initialize_model_parallel(tp, sequence_parallel=True)
        _check_mappings(state.tp_group)
        _check_grad_sync(state.tp_group)
        _check_model_equivalence(state, names)
        _check_dropout_streams(state)
        ratios[tp] = _check_activation_memory(state)
        destroy_model_parallel(state)
    return ratios


def test_sequence_parallel_mappings_and_model_match_one_process():
    """Mappings vs their math; GPT at TP4 and TP2 with SP vs one process: losses, first-step
    gradients, weights after 3 AdamW steps (learned/RoPE, LayerNorm/RMSNorm, GeLU/SwiGLU, tied
    and untied, full and selective recompute, Triton kernels); dropout streams."""
    env = {"TRITON_INTERPRET": "1"}
    ratios = run_distributed(_model_worker, 4, env_per_rank=lambda r: env)
    print(f"saved activations, SP / TP alone: {ratios[0]}")


# ---- the trainer: TP2 x PP2 x DP2 (interleaved) with SP vs one process; exact resume ----


def _sp_worker(rank, world, argv, ref_weights, resume_dir):
    result = train_run(rank, world, argv)
    model = result.model.module
    state = model.chunks[0].state
    assert state.sequence_parallel
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            expected = _shard(torch.from_numpy(ref_weights[name]), p, state)
            torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-5, msg=name)
    return result.history, _resume_worker(rank, world, argv, resume_dir)


_SP_LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def reference(data_prefix):
    """One process, 4 layers: (argv, history, final weights)."""
    argv = flags(data_prefix, "--num-layers", "4", "--adam-eps", "1e-4")
    ((history, weights),) = run_distributed(_ref_worker, 1, argv)
    return argv, history, weights


@pytest.mark.slow
def test_sequence_parallel_training_matches_one_process_and_resumes_exactly(reference, tmp_path):
    """TP2 x PP2 x DP2, interleaved (2 chunks per stage), SP: losses, grad norms and final
    weights of one process; straight vs save + resume, with dropout off and on, bit-exact."""
    argv, ref_history, ref_weights = reference
    layout = _SP_LAYOUT + [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ]
    results = run_distributed(_sp_worker, 8, argv + layout, ref_weights, str(tmp_path))
    for rank, (history, resume) in enumerate(results):
        assert_same_run(history, ref_history, f"rank {rank}")
        for kind, (straight, first, second, final_iter) in resume.items():
            assert final_iter == 6 and _losses(first) == _losses(straight)[:3], kind
            assert _losses(second) == _losses(straight)[3:], f"{kind}: resume not exact"


def _ds_worker(rank, world, argv):
    ds = argv + _SP_LAYOUT + ["--deepspeed", "--zero-stage"]
    return {
        "zero1": _train(rank, world, ds + ["1"])[0],
        "zero2": _train(rank, world, ds + ["2"])[0],
        "zero1 recompute": _train(rank, world, ds + ["1", "--checkpoint-activations"])[0],
        "pipe zero1": _train(rank, world, ds + ["1", "--pipeline-model-parallel-size", "2"])[0],
    }


@pytest.mark.slow
def test_sequence_parallel_with_deepspeed_matches_one_process(reference):
    """--deepspeed with SP: TP2 x DP2 with ZeRO-1, ZeRO-2 and ZeRO-1 + DeepSpeed's (reentrant)
    activation checkpointing, TP2 x PP2 in DeepSpeed's pipeline engine (ZeRO-1), against one
    process (the SP gradients summed over TP in backward)."""
    pytest.importorskip("deepspeed", reason="--deepspeed needs DeepSpeed")
    argv, ref_history, _ = reference
    for rank, runs in enumerate(run_distributed(_ds_worker, 4, argv)):
        for name, history in runs.items():
            assert_same_run(history, ref_history, f"{name} rank {rank}")


# ---- the rules ----


@pytest.mark.parametrize(
    "extra,world,message",
    [
        ([], 1, "needs --tensor-model-parallel-size > 1"),
        (["--tensor-model-parallel-size", "2", "--seq-length", "15"], 2, "not divisible"),
    ],
)
def test_bad_sequence_parallel_layouts_fail_before_any_work(extra, world, message):
    argv = ["--vocab-size", "64", "--seq-length", "16", "--sequence-parallel", *extra]
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(argv, world_size=world)
    assert str(err.value).startswith("--sequence-parallel:") and "Fix:" in str(err.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--zero-stage", "3"], "--sequence-parallel with ZeRO stage 3"),
        (["--checkpoint-activations", "--partition-activations"], "--partition-activations"),
    ],
)
def test_deepspeed_options_that_assume_equal_tp_activations_are_refused(extra, message):
    from megatron.config.deepspeed_json import build_ds_config

    base = ["--vocab-size", "64", "--tensor-model-parallel-size", "2", "--deepspeed"]
    cfg = parse_args(base + extra + ["--sequence-parallel"], world_size=2)
    with pytest.raises(ConfigError, match=message):
        build_ds_config(cfg)
    ds = build_ds_config(parse_args(base + ["--sequence-parallel"], world_size=2))
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
