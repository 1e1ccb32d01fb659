"""Multi-token prediction (--mtp-num-layers): the losses against a hand computation on a tiny
GPT, their gradient, what evaluation and generation skip, the flag rules, resharding; and the
same model at TP 2 (with and without sequence parallelism, with an MoE layer), CP 2 and PP 2
(tied and untied head) against one process (losses, logged MTP losses, gradients, updated
weights) in ONE 2-rank spawn."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.model.context import BuildContext
from megatron.model.mtp import mtp_step_stats, set_mtp_loss_scale
from megatron.models.gpt.model import GPTModel, build_model
from megatron.models.gpt.train import lm_loss
from megatron.mpu.context_parallel import context_parallel_slice
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.layouts import train_steps
from tests.helpers.models import LLAMA, small_gpt
from tests.helpers.training import BASE

MODEL = small_gpt(vocab_size=60, **LLAMA, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
DT = torch.float64


def _batch(cfg, batch=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=g)
    mask = (torch.rand(batch, cfg.seq_length, generator=g) > 0.2).to(DT)
    return seq[:, :-1], seq[:, 1:], mask


def _hand_losses(model: GPTModel, tokens, labels, mask):
    """Main loss and L_1 .. L_D written out with plain torch ops on the model's weights."""
    emb = model.embedding.word_embeddings.weight[: model.cfg.vocab_size]
    x = F.embedding(tokens, emb)
    for layer in model.run_order():
        x = layer(x)
    h = model.head.final_layernorm(x)

    def masked_mean(hidden, targets, keep):
        logits = hidden @ emb.t()  # tied head, the real vocab only
        ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return (ce * keep).sum() / keep.sum()

    main = masked_mean(h, labels, mask)
    depths, s = [], tokens.size(1)
    for k, module in enumerate(model.mtp.layers, start=1):
        ahead = torch.zeros_like(tokens)  # t_{i+k}, zero (and masked) past the end
        ahead[:, : s - k] = tokens[:, k:]
        targets = torch.zeros_like(labels)  # t_{i+k+1}
        targets[:, : s - k] = labels[:, k:]
        keep = torch.zeros_like(mask)
        keep[:, : s - k] = mask[:, k:]
        both = torch.cat([module.enorm(F.embedding(ahead, emb)), module.hnorm(h)], -1)
        h = module.final_layernorm(module.transformer_layer(both @ module.eh_proj.weight.t()))
        depths.append(masked_mean(h, targets, keep))
    return main, torch.stack(depths)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_losses_and_gradient_equal_a_hand_computation(depth):
    cfg = dataclasses.replace(MODEL, mtp_num_layers=depth)
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    tokens, labels, mask = _batch(cfg)
    set_mtp_loss_scale(model, 1.0)
    per_token = model(tokens, labels=labels, loss_mask=mask)
    loss, _ = lm_loss(mask, per_token)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged = mtp_step_stats(model, mpu.single_process_state(), cfg)
    assert list(logged) == [f"mtp_{k} loss" for k in range(1, depth + 1)]

    model.zero_grad()
    main, depths = _hand_losses(model, tokens, labels, mask)
    torch.testing.assert_close(loss, main, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.stack(list(logged.values())), depths.float())
    (main + cfg.mtp_loss_scaling_factor / depth * depths.sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert got["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_evaluation_and_generation_skip_mtp():
    model = GPTModel(MODEL, BuildContext(seed=3, dtype=DT))
    plain = GPTModel(
        dataclasses.replace(MODEL, mtp_num_layers=None), BuildContext(seed=3, dtype=DT)
    )
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "mtp." not in k})
    tokens, labels, mask = _batch(MODEL)
    torch.testing.assert_close(model(tokens), plain(tokens))  # logits: the main model's
    model.eval()
    torch.testing.assert_close(
        model(tokens, labels=labels, loss_mask=mask), plain(tokens, labels=labels)
    )
    assert model.mtp.sums is None  # nothing recorded for the log


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--mtp-loss-scaling-factor", "0.2"], "--mtp-loss-scaling-factor"),
        (["--mtp-num-layers", "32"], "--mtp-num-layers"),
        (
            ["--mtp-num-layers", "1", "--deepspeed", "--pipeline-model-parallel-size", "2"],
            "--mtp-num-layers",
        ),
        (["--mtp-num-layers", "1", "--deepspeed", "--zero-stage", "3"], "--mtp-num-layers"),
    ],
)
def test_impossible_mtp_settings_are_refused(extra, flag):
    with pytest.raises(ConfigError, match=flag):  # before any work (the training rules too)
        argv = [*BASE, "--train-iters", "10", "--lr", "1e-3", *extra]
        validate(parse_args(argv, world_size=2), "train-gpt")


DEEPSEEK = {
    "multi_latent_attention": True,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_head_dim": 8,
    "qk_pos_emb_head_dim": 4,
    "v_head_dim": 8,
    "rope_type": "rope",
    "num_experts": 4,
    "moe_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "moe_router_topk": 2,
    "moe_router_score_function": "sigmoid",
    "moe_layer_freq": "([0]*1+[1]*1)",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 0.05,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
}
# (name, TP, PP, sequence parallel, model changes): 2 ranks each, DP 1 (CP 2 with "cp")
LAYOUTS = [
    ("tp2", 2, 1, False, {}),
    ("cp2", 1, 1, False, {"cp": 2}),
    (
        "tp2-sp-moe",
        2,
        1,
        True,
        {"num_experts": 2, "moe_router_topk": 1, "moe_aux_loss_coeff": 0.01},
    ),
    ("pp2", 1, 2, False, {}),
    # interleaved 1F1B (2 chunks per stage): the last chunk holds the MTP depth; recomputed
    ("pp2-vp2-recompute", 1, 2, False, {"num_layers": 4, "vp": 2, "re": "full"}),
    # DeepSeek-V3's pieces: MLA, a dense first layer, the sigmoid router with the expert bias
    # and group-limited routing; the MTP depth's layer is an MoE layer with a bias of its own
    ("pp2-mla-bias-router", 1, 2, False, DEEPSEEK),
    (
        "pp2-untied-learned",
        1,
        2,
        False,
        {"untie_embeddings_and_output_weights": True, "position_embedding_type": "learned"},
    ),
]
MICRO, BATCH, STEPS = 2, 2, 2


def _forward_step(state, data_iterator, model):
    tokens, labels, mask = (
        context_parallel_slice(x, state.cp_rank, state.cp_size) for x in next(data_iterator)
    )
    cp = state if state.cp_size > 1 else None
    per_token = model(tokens, labels=labels, loss_mask=mask)
    return per_token, functools.partial(lm_loss, mask, context_parallel=cp)


def _train(cfg, state, recompute=None):
    """STEPS steps on MICRO micro batches: (lm loss, MTP losses, grad norm) per step, weights
    and buffers, gradients, parameters."""
    steps = [
        [_batch(cfg, BATCH, seed=100 * step + m) for m in range(MICRO)] for step in range(STEPS)
    ]
    steps = [[(t, lab, m.float()) for t, lab, m in batches] for batches in steps]
    step = functools.partial(_forward_step, state)
    results, model = train_steps(cfg, state, step, steps, BATCH, recompute)
    history = []
    for result in results:
        mtp = [float(v) for k, v in result["other_losses"].items() if k.startswith("mtp_")]
        assert len(mtp) == cfg.mtp_num_layers
        history.append([float(result["lm_loss"]), *mtp, float(result["grad_norm"])])
    params = {n: p for c in model.chunks for n, p in c.named_parameters()}
    grads = {n: p.main_grad.clone() for n, p in params.items()}
    weights = {n: p.detach().clone() for n, p in params.items()}
    weights.update({n: b.clone() for c in model.chunks for n, b in c.named_buffers()})
    return history, weights, grads, params


def _local(full, param, state):
    if param is not None and mpu.is_tensor_parallel(param) and state.tp_size > 1:
        return mpu.shard(
            full, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride
        )
    return full


def _worker(rank, world):
    report = {}
    for name, tp, pp, sp, changes in LAYOUTS:
        changes = dict(changes)
        cp, vp, recompute = changes.pop("cp", 1), changes.pop("vp", None), changes.pop("re", None)
        cfg = dataclasses.replace(MODEL, **changes)
        ref_history, ref_weights, ref_grads, _ = _train(cfg, mpu.single_process_state())
        state = initialize_model_parallel(
            tp,
            pp,
            vp,
            sequence_parallel=sp,
            context_parallel_size=cp,
            expert_tensor_parallel_size=1,
        )
        try:
            history, weights, grads, params = _train(cfg, state, recompute)
            torch.testing.assert_close(
                torch.tensor(history),
                torch.tensor(ref_history),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name: f"{n}: lm loss / mtp losses / grad norm: {m}",
            )
            for pname, value in weights.items():
                pairs = [(value, ref_weights, "weight")]
                if pname in grads:  # a parameter, not a buffer (the expert bias)
                    pairs.append((grads[pname], ref_grads, "grad"))
                for got, ref, what in pairs:
                    torch.testing.assert_close(
                        got,
                        _local(ref[pname], params.get(pname), state),
                        rtol=1e-4,
                        atol=1e-6,
                        msg=lambda m, n=name, p=pname, w=what: f"{n} {w} {p}: {m}",
                    )
            report[name] = (history, sorted(weights))
        finally:
            destroy_model_parallel(state)
    return report


def _resume_worker(rank, world, argv, save_dir):
    """The trainer with one MTP depth at PP 2: 4 steps saving at 2; then from step 2 at TP 2
    (resharded on load). Returns both runs' losses and grad norms (the MTP losses are in the
    gradients)."""
    import torch.distributed as dist

    from tests.helpers.checkpoints import _checkpoint_at
    from tests.helpers.training import _train

    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    pp2 = ["--pipeline-model-parallel-size", "2", "--save", save_dir, "--save-interval", "2"]
    straight, _, _ = _train(rank, world, argv + mtp + pp2)
    if rank == 0:
        _checkpoint_at(save_dir, 2, f"{save_dir}_at2")
    dist.barrier()
    tp2 = ["--tensor-model-parallel-size", "2", "--load", f"{save_dir}_at2"]
    resumed, _, _ = _train(rank, world, argv + mtp + tp2)
    return [[s["lm_loss"], s["grad_norm"]] for s in straight], [
        [s["lm_loss"], s["grad_norm"]] for s in resumed
    ]


def _spawned(rank, world, argv, save_dir):
    """Everything multi-rank of this file in one 2-rank spawn."""
    return {"layouts": _worker(rank, world), "resume": _resume_worker(rank, world, argv, save_dir)}


@pytest.mark.slow
def test_mtp_at_tp2_and_pp2_matches_one_process(data_prefix, tmp_path):
    from tests.helpers.training import flags

    argv = flags(data_prefix, iters=4)
    out = run_distributed(_spawned, 2, argv, str(tmp_path / "ckpt"), timeout=600)
    straight, resumed = out[0]["resume"]  # a PP 2 run resumed at TP 2 from its step 2
    assert len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[2:]), rtol=2e-5, atol=0)
    results = [o["layouts"] for o in out]
    for report in results:
        assert set(report) == {layout[0] for layout in LAYOUTS}
    names = results[1]["pp2"][1]  # the last stage holds the MTP modules and the embedding copy
    assert "mtp.layers.1.eh_proj.weight" in names and "embedding.word_embeddings.weight" in names
    assert not any(n.startswith("mtp.") for n in results[0]["pp2"][1])
    assert "embedding.word_embeddings.weight" in results[1]["pp2-untied-learned"][1]
    # the MTP depth's MoE layer has its expert bias (moved, compared with one process's)
    assert (
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias"
        in results[1]["pp2-mla-bias-router"][1]
    )


@pytest.mark.parametrize("untied", [False, True])
def test_mtp_checkpoint_reshards_to_tp2_pp2_and_back(tmp_path, untied):
    """The MTP weights split over TP as their layers say (eh_proj by rows), live on the last
    stage with a copy of the word embedding (also with an untied head), and merge back equal."""
    from megatron.checkpoint.reading import load_shard
    from megatron.checkpoint.resharding import load_full_state, save_resharded
    from tests.helpers.checkpoints import _args, _unpadded

    cfg = dataclasses.replace(MODEL, untie_embeddings_and_output_weights=untied)
    model = GPTModel(cfg, BuildContext(seed=3))
    full = _unpadded(model, cfg)
    save_resharded(full, _args(cfg, 1, 1), str(tmp_path), 2, 2, 5, quiet=True)
    last = load_shard(str(tmp_path), 5, tp_rank=1, pp_rank=1, pp_size=2)
    assert last["model"]["mtp.layers.0.eh_proj.weight"].shape == (16, 64)
    assert "embedding.word_embeddings.weight" in last["model"]
    first = load_shard(str(tmp_path), 5, tp_rank=0, pp_rank=0, pp_size=2)
    assert not any(n.startswith("mtp.") for n in first["model"])
    merged, _ = load_full_state(str(tmp_path))
    assert list(merged) == list(full) and all(torch.equal(merged[n], full[n]) for n in full)
    stage = dataclasses.replace(mpu.single_process_state(), pp_size=2, pp_rank=1)
    tp1 = str(tmp_path / "pp2")
    save_resharded(merged, _args(cfg, 1, 1), tp1, 1, 2, 5, quiet=True)
    chunk = build_model(cfg, BuildContext(stage, seed=9))
    chunk.load_state_dict(load_shard(tp1, 5, tp_rank=0, pp_rank=1, pp_size=2)["model"])


@pytest.mark.parametrize("changes", [{}, {"untie_embeddings_and_output_weights": True}, DEEPSEEK])
def test_planner_counts_the_mtp_parameters_of_the_built_stages(changes):
    from megatron.planning.memory import stage_params

    cfg = dataclasses.replace(MODEL, **changes)
    for pp in (1, 2):
        for rank in range(pp):
            stage = dataclasses.replace(mpu.single_process_state(), pp_size=pp, pp_rank=rank)
            with torch.device("meta"):
                chunk = build_model(cfg, BuildContext(stage))
            built = sum(p.numel() for p in chunk.parameters())
            assert stage_params(cfg, 1, pp, rank) == built, (pp, rank)
