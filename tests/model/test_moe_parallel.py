"""Expert parallelism against one process: loss, gradients, updated weights and the logged
router statistics of an MoE GPT trained two steps at EP = 2 (and 4), EP x TP with sequence
parallelism, EP x PP, the allgather dispatcher, capacity-limited routing and the distributed
optimizer, and under context parallelism (EP within and across the CP ranks, with TP + SP, PP,
the sequence-level aux loss), and DeepSeek-V3's router (sigmoid, group-limited, scaled, with
the auxiliary-loss-free expert bias, whose buffers must equal one process's) at TP 2 x SP x
EP 2 and at PP 2 x EP 2 (DP 2, distributed optimizer) with a dense first layer; then an EP = 2
checkpoint resumed at EP = 1 and 2 and loaded by the inference tools, and a CP 2 x EP 2 run
(equal to DP 4) resumed at CP 1 x EP 4: all in ONE 4-rank spawn.

Each rank also trains the single-process model on every micro batch of the global batch (the
reference), so the comparison needs no second spawn. Data-parallel rank d runs micro batches
[d M, (d + 1) M) of the G = DP x M (its CP ranks each their chunks of the sequences); the one
process runs all G as gradient accumulation; with the aux loss on, each micro batch's load
statistics are its own in both.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.initialize import Runtime
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import build_model
from megatron.mpu.expert_shards import cut_whole
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.optim.distributed import distributed_optimizer
from megatron.optim.plain import plain_optimizer
from megatron.training.schedules import get_forward_backward_func
from megatron.training.step import train_step
from megatron.training.timers import Timers
from tests.helpers.distributed import run_distributed
from tests.helpers.layouts import lm_forward_step, random_micro_batches
from tests.helpers.models import tiny_moe

MODEL = tiny_moe(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
MICRO, BATCH, STEPS = 2, 2, 2  # micro batches per DP rank, samples per micro batch, steps

# (name, TP, PP, EP, sequence parallel, dispatcher, distributed optimizer, model changes)
LAYOUTS = [
    ("ep2", 1, 1, 2, False, "alltoall", False, {}),
    ("ep4", 1, 1, 4, False, "alltoall", False, {}),
    ("ep2-allgather", 1, 1, 2, False, "allgather", False, {"moe_router_topk": 1}),
    (
        "ep2-capacity",
        1,
        1,
        2,
        False,
        "alltoall",
        False,
        {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"},
    ),
    ("ep2-tp2-sp", 2, 1, 2, True, "alltoall", False, {"moe_shared_expert_intermediate_size": 16}),
    ("ep2-pp2-recompute", 1, 2, 2, False, "alltoall", False, {"swiglu": True, "recompute": True}),
    # interleaved 1F1B, MoE on layers 0 and 2 only: stage 1 has no MoE layer at all
    (
        "ep2-pp2-interleaved",
        1,
        2,
        2,
        False,
        "alltoall",
        False,
        {"num_layers": 4, "moe_layer_freq": 2, "vp": 2},
    ),
    ("ep2-distopt", 1, 1, 2, False, "alltoall", True, {"moe_grouped_gemm": True}),
    # context parallelism ("cp"): EP carved from DP x CP (CP ranks first), as in Megatron-core
    ("cp2-ep2", 1, 1, 2, False, "alltoall", False, {"cp": 2}),  # EP over each CP pair
    ("cp2-ep4-seqaux", 1, 1, 4, False, "alltoall", False, {"cp": 2, "seq_aux": True}),
    ("cp4-ep2-allgather", 1, 1, 2, False, "allgather", False, {"cp": 4, "seq_aux": True}),
    ("cp2-tp2-ep1", 2, 1, 1, False, "alltoall", False, {"cp": 2}),
    (
        "cp2-tp2-sp-ep2",
        2,
        1,
        2,
        True,
        "alltoall",
        False,
        {"cp": 2, "seq_aux": True, "moe_shared_expert_intermediate_size": 16},
    ),
    ("cp2-pp2-ep2", 1, 2, 2, False, "alltoall", False, {"cp": 2, "swiglu": True}),
    ("cp2-ep2-distopt", 1, 1, 2, False, "alltoall", True, {"cp": 2, "moe_grouped_gemm": True}),
    # expert tensor parallelism ("etp": 2 = TP): each expert's FFN split over the TP pair
    (
        "tp2-etp2-ep2",
        2,
        1,
        2,
        False,
        "alltoall",
        False,
        {"etp": 2, "swiglu": True, "add_bias_linear": True},
    ),
    (
        "tp2-sp-etp2-ep2-allgather",
        2,
        1,
        2,
        True,
        "allgather",
        False,
        {"etp": 2, "add_bias_linear": True, "moe_shared_expert_intermediate_size": 16},
    ),
    (
        "tp2-sp-etp2-distopt",
        2,
        1,
        2,
        True,
        "alltoall",
        True,
        {"etp": 2, "swiglu": True, "moe_grouped_gemm": True},
    ),
]


# DeepSeek-V3's router (sigmoid scores normalized over the chosen, scaled; group-limited;
# the auxiliary-loss-free expert bias, fast enough to change step 2's routing)
V3_ROUTER = {
    "num_experts": 8,
    "moe_router_topk": 2,
    "moe_router_score_function": "sigmoid",
    "moe_router_topk_scaling_factor": 2.5,
    "moe_router_num_groups": 2,  # groups of 4 scored by their top 2 (k / g), as DeepSeek-V3's
    "moe_router_group_topk": 1,
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 0.01,
}
LAYOUTS += [
    ("tp2-sp-ep2-bias", 2, 1, 2, True, "alltoall", False, {**V3_ROUTER, "swiglu": True}),
    (
        "pp2-ep2-bias-dense-first",
        1,
        2,
        2,
        False,
        "alltoall",
        True,
        {**V3_ROUTER, "num_layers": 4, "moe_layer_freq": "([0]*1+[1]*3)", "ffn_hidden_size": 48},
    ),
]


_STATS = ("load balancing loss", "z loss", "expert load max/mean")


class _Scheduler:
    def step(self, *args):
        pass


def _train(cfg: ModelConfig, state, dispatcher, run, distributed, micro_groups):
    """STEPS steps of the MoE GPT on this rank's micro batches; losses, norms, model, grads."""
    grouped = run.get("moe_grouped_gemm", False)
    ctx = BuildContext(state=state, moe_dispatcher=dispatcher, moe_grouped_gemm=grouped)
    recompute = RecomputeConfig(granularity="full") if run.get("recompute") else None
    model = parallelize(build_model(cfg, ctx), state, recompute)
    tied = model.word_embeddings_weight() if state.pp_size > 1 else None
    ddp = DistributedDataParallel(
        model,
        state.dp_cp_group,
        use_distributed_optimizer=distributed,
        own_bucket=(tied,) if tied is not None else (),
        expert_group=state.expert_data_group,
    )
    opt_cfg = OptimizerConfig(lr=1e-2, adam_eps=1e-4, weight_decay=0.0)
    kw = {"params_dtype": torch.float32, "state": state, "clip_grad": 0.0}
    opt = (
        distributed_optimizer(ddp, opt_cfg, **kw)
        if distributed
        else plain_optimizer(model, opt_cfg, **kw)
    )
    schedule = get_forward_backward_func(
        state,
        micro_batch_size=BATCH,
        seq_length=8 // state.cp_size,
        hidden_size=32,
        dtype=torch.float32,
    )
    rt = Runtime(state=state, device=torch.device("cpu"), rng_tracker=None)
    history = []
    for step in range(STEPS):
        batches = iter(random_micro_batches(step, micro_groups, state, BATCH))
        result = train_step(
            functools.partial(lm_forward_step, state),
            batches,
            ddp,
            opt,
            _Scheduler(),
            len(micro_groups),
            rt,
            Timers(),
            schedule,
        )
        moe = result["other_losses"]  # the logged router statistics
        logged = tuple(float(moe[k]) for k in _STATS)
        history.append((float(result["lm_loss"]), float(result["grad_norm"])) + logged)
        grads = {n: p.main_grad.clone() for c in model.chunks for n, p in c.named_parameters()}
    weights = {n: p.detach().clone() for c in model.chunks for n, p in c.named_parameters()}
    biases = [(n, b) for c in model.chunks for n, b in c.named_buffers() if "expert_bias" in n]
    weights.update({n: b.clone() for n, b in biases})  # --moe-router-enable-expert-bias
    return history, weights, grads


def _local_view(full: torch.Tensor, param, state) -> torch.Tensor:
    """The part of a one-process tensor this rank holds: its experts (and their ETP shard),
    its TP shard."""
    if getattr(param, "expert_parallel", False):
        return cut_whole(full, param, state)
    if mpu.is_tensor_parallel(param) and state.tp_size > 1:
        full = mpu.shard(
            full, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride
        )
    return full


def _worker(rank, world):
    torch.manual_seed(0)
    report = {}
    for name, tp, pp, ep, sp, dispatcher, distributed, layout_changes in LAYOUTS:
        changes = dict(layout_changes)
        options = ("moe_grouped_gemm", "recompute", "vp", "cp", "seq_aux", "etp")
        run = {k: changes.pop(k) for k in options if k in changes}
        if run.get("seq_aux"):
            changes["moe_router_load_balancing_type"] = "seq_aux_loss"
        cfg = dataclasses.replace(MODEL, **changes)
        cp = run.get("cp", 1)
        dp = world // (tp * pp * cp)
        ref = _train(cfg, mpu.single_process_state(), dispatcher, {}, False, range(dp * MICRO))
        state = initialize_model_parallel(
            tp,
            pp,
            run.get("vp"),
            sequence_parallel=sp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=run.get("etp", 1),
        )
        try:
            mine = range(state.dp_rank * MICRO, (state.dp_rank + 1) * MICRO)
            history, weights, grads = _train(cfg, state, dispatcher, run, distributed, mine)
            model = build_model(cfg, BuildContext(state=state))  # for the parameter marks
            params = {n: p for c in model.chunks for n, p in c.named_parameters()}
            if sp:
                parallelize(model, state)
            torch.testing.assert_close(
                torch.tensor(history),
                torch.tensor(ref[0]),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name: f"{n}: loss / grad norm / aux, z, load: {m}",
            )
            biases = [n for n in weights if n.endswith("expert_bias")]
            assert bool(biases) == ("moe_router_enable_expert_bias" in changes), name
            for pname in biases:  # the same on every rank, moved off zero, as one process's
                assert weights[pname].abs().sum() > 0, f"{name} {pname} never moved"
                torch.testing.assert_close(weights.pop(pname), ref[1][pname], rtol=0, atol=1e-7)
            for pname, value in weights.items():
                want = _local_view(ref[1][pname], params[pname], state)
                torch.testing.assert_close(
                    value,
                    want,
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name, p=pname: f"{n} {p}: {m}",
                )
                if not distributed:  # the plain optimizer's buffers hold every reduced grad
                    want = _local_view(ref[2][pname], params[pname], state)
                    torch.testing.assert_close(
                        grads[pname],
                        want,
                        rtol=1e-4,
                        atol=1e-7,
                        msg=lambda m, n=name, p=pname: f"{n} grad {p}: {m}",
                    )
            report[name] = history
        finally:
            destroy_model_parallel(state)
    return report


def _spawned(rank, world, argv, save_dir):
    """Everything multi-rank of this file in one 4-rank spawn (a spawn costs seconds)."""
    return {"layouts": _worker(rank, world), "resume": _resume_worker(rank, world, argv, save_dir)}


@pytest.fixture(scope="module")
def spawn(data_prefix, tmp_path_factory):  # noqa: F811
    from tests.helpers.training import flags

    moe = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
    argv = flags(data_prefix, *moe, iters=4)
    save_dir = str(tmp_path_factory.mktemp("moe_checkpoints"))
    return run_distributed(_spawned, 4, argv, save_dir, timeout=900)


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process(spawn):
    results = [out["layouts"] for out in spawn]
    for report in results:
        assert set(report) == {layout[0] for layout in LAYOUTS}
    # the capacity layout really dropped assignments: its losses differ from dropless EP = 2
    assert results[0]["ep2-capacity"] != results[0]["ep2"]


def _resume_worker(rank, world, argv, save_dir):
    """For the plain and the distributed optimizer: 4 steps at DP 4 with EP = 2 saving at step
    2, then steps 3-4 resumed at EP = 1 and at EP = 2 from that checkpoint (and, with the
    distributed optimizer, from it converted to PP 2 by tools/convert_checkpoint.py)."""
    import torch.distributed as dist

    from tests.helpers.checkpoints import _checkpoint_at, _cli
    from tests.helpers.training import _train

    out = {}
    for optim in ([], ["--use-distributed-optimizer"]):
        d = f"{save_dir}/{'distributed' if optim else 'plain'}"
        ep2 = ["--expert-model-parallel-size", "2"]
        save = ["--save", d, "--save-interval", "2"]
        straight, _, _ = _train(rank, world, argv + optim + ep2 + save)
        pp2 = ["--target-pipeline-model-parallel-size", "2"]
        if rank == 0:
            _checkpoint_at(d, 2, f"{d}_at2")
            out[f"generated {bool(optim)}"] = _generate_from(f"{d}_at2")
            if optim:  # tools/convert_checkpoint.py to PP 2 keeps the distributed state
                assert _cli()(["--load", f"{d}_at2", "--save", f"{d}_pp2", *pp2]) == 0
        dist.barrier()
        resumed = {}
        for ep in (1, 2):
            load = ["--load", f"{d}_at2"] + (ep2 if ep == 2 else [])
            resumed[ep] = _train(rank, world, argv + optim + load)[0]
        if optim:  # the converted checkpoint, at PP 2 x DP 2 (EP 1)
            pp = ["--load", f"{d}_pp2", "--no-load-rng", "--pipeline-model-parallel-size", "2"]
            resumed["converted to PP 2"] = _train(rank, world, argv + optim + pp)[0]
        out[bool(optim)] = (straight, resumed)
    out["cp"] = _cp_resume(rank, world, argv, save_dir, straight)
    out["etp"] = _etp_resume(rank, world, argv, save_dir)
    return out


def _etp_resume(rank, world, argv, save_dir):
    """The trainer at TP 2 x EP 2 (DP 2) with the default ETP (= TP 2, SwiGLU experts split
    over the TP pair), both optimizers, saving at step 2; resumed at TP 2 x ETP 1 (the same
    shards, experts re-cut) and at TP 1 x EP 2 (DP 4, resharded on load)."""
    import torch.distributed as dist

    from tests.helpers.checkpoints import _checkpoint_at
    from tests.helpers.training import _train

    out = {}
    tp2 = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--swiglu"]
    for optim in ([], ["--use-distributed-optimizer"]):
        d = f"{save_dir}/etp{'distributed' if optim else 'plain'}"
        save = ["--save", d, "--save-interval", "2"]
        straight, _, _ = _train(rank, world, argv + optim + tp2 + save)
        if rank == 0:
            _checkpoint_at(d, 2, f"{d}_at2")
        dist.barrier()
        load = ["--load", f"{d}_at2", "--no-load-rng"]
        etp1 = _train(
            rank, world, argv + optim + tp2 + load + ["--expert-tensor-parallel-size", "1"]
        )
        tp1 = ["--expert-model-parallel-size", "2", "--swiglu"]
        out[bool(optim)] = (
            straight,
            {"ETP 1": etp1[0], "TP 1": _train(rank, world, argv + optim + tp1 + load)[0]},
        )
    return out


def _cp_resume(rank, world, argv, save_dir, dp4):
    """The trainer at CP 2 x EP 2 (DP 2; each EP group is a CP pair) with the distributed
    optimizer: the losses of DP 4 x EP 2 (`dp4`, the same data); its step-2 checkpoint resumed
    at CP 1 x EP 4 (DP 4) to the uninterrupted losses."""
    import torch.distributed as dist

    from tests.helpers.checkpoints import _checkpoint_at
    from tests.helpers.training import _train

    d = f"{save_dir}/cp"
    cp2 = ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]
    optim = ["--use-distributed-optimizer"]
    save = ["--save", d, "--save-interval", "2"]
    straight, _, _ = _train(rank, world, argv + optim + cp2 + save)
    if rank == 0:
        _checkpoint_at(d, 2, f"{d}_at2")
    dist.barrier()
    ep4 = ["--expert-model-parallel-size", "4", "--load", f"{d}_at2"]
    resumed, _, _ = _train(rank, world, argv + optim + ep4)
    return straight, resumed, dp4


def _generate_from(load: str) -> list[list[int]]:
    """The inference tools' loading (one process, EP = 1) of an EP = 2 checkpoint: greedy
    continuations, with the KV cache and without."""
    from megatron.inference.engine import InferenceModel
    from megatron.inference.generation import SamplingParams, generate
    from megatron.inference.loading import load_model_for_inference

    rt = Runtime(state=mpu.single_process_state(), device=torch.device("cpu"), rng_tracker=None)
    chunks, _, cfg, iteration = load_model_for_inference(load, rt)
    assert iteration == 2 and cfg.num_experts == 4
    engine = InferenceModel(chunks, rt.state, cfg.vocab_size, cfg.hidden_size)
    prompts, params = [[1, 2, 3], [7, 8]], SamplingParams(6, greedy=True)
    cached = generate(engine, prompts, params, use_cache=True)
    assert cached == generate(engine, prompts, params, use_cache=False)
    return cached


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_at_ep1_and_ep2(spawn):
    from tests.helpers.training import _losses

    for rank_out in [dict(out["resume"]) for out in spawn]:
        rank_out.pop("cp")  # test_cp_x_ep_trains_as_dp_and_resumes_at_another_cp_and_ep
        rank_out.pop("etp")  # test_expert_tensor_parallel_checkpoint_resumes_at_etp1_and_tp1
        for key in [k for k in rank_out if isinstance(k, str)]:
            assert all(len(row) > 3 for row in rank_out.pop(key))  # generated from EP = 2
        for distributed, (straight, resumed) in rank_out.items():
            for ep, history in resumed.items():
                assert [h["iteration"] for h in history] == [3, 4]
                torch.testing.assert_close(
                    torch.tensor(_losses(history)),
                    torch.tensor(_losses(straight)[2:]),
                    rtol=1e-5,
                    atol=0,
                    msg=lambda m, e=ep, d=distributed: f"EP {e} distributed {d}: {m}",
                )


@pytest.mark.slow
def test_cp_x_ep_trains_as_dp_and_resumes_at_another_cp_and_ep(spawn):
    """pretrain() at CP 2 x EP 2 equals DP 4 x EP 2 (the same global batches); its checkpoint
    (experts whole, distributed optimizer ranges over DP x CP / EP) resumes at CP 1 x EP 4."""
    from tests.helpers.training import _losses

    for rank_out in [out["resume"] for out in spawn]:
        straight, resumed, dp4 = rank_out["cp"]
        torch.testing.assert_close(
            torch.tensor(_losses(straight)), torch.tensor(_losses(dp4)), rtol=2e-5, atol=0
        )
        torch.testing.assert_close(
            torch.tensor([h["grad_norm"] for h in straight]),
            torch.tensor([h["grad_norm"] for h in dp4]),
            rtol=1e-4,
            atol=0,
        )
        assert [h["iteration"] for h in resumed] == [3, 4]
        torch.testing.assert_close(
            torch.tensor(_losses(resumed)), torch.tensor(_losses(straight)[2:]), rtol=2e-5, atol=0
        )


@pytest.mark.slow
def test_expert_tensor_parallel_checkpoint_resumes_at_etp1_and_tp1(spawn):
    """A TP 2 x EP 2 run with its experts split over TP (ETP 2, the default) saves them whole:
    resumed at ETP 1 and at TP 1 it continues with the uninterrupted losses, either optimizer
    (the distributed one's expert ranges saved element-indexed in the whole tensors)."""
    from tests.helpers.training import _losses

    for rank_out in [out["resume"]["etp"] for out in spawn]:
        for distributed, (straight, resumed) in rank_out.items():
            for where, history in resumed.items():
                assert [h["iteration"] for h in history] == [3, 4]
                torch.testing.assert_close(
                    torch.tensor(_losses(history)),
                    torch.tensor(_losses(straight)[2:]),
                    rtol=2e-5,
                    atol=0,
                    msg=lambda m, w=where, d=distributed: f"{w} distributed {d}: {m}",
                )
