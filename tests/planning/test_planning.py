"""The parallel planner (megatron/planning): enumeration through the config rules, the memory
model against hand-computed values and the built model, bad input, --auto-parallel."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import MegatronConfig, ModelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_training import TrainingConfig
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from megatron.planning.auto import auto_parallel
from megatron.planning.enumerate import PlanError, Search, best_plan, layouts, plans
from megatron.planning.memory import (
    Device,
    GiB,
    Layout,
    Training,
    gib_above,
    model_state_bytes,
    stage_params,
)
from megatron.planning.pipeline_memory import estimate_memory, stage_activation_peak
from megatron.planning.timing import Hardware, step_time
from megatron.schedules.registry import overlapped_pairs, schedule_actions
from tests.helpers.pipeline import simulate
from tests.helpers.planning import saved_and_predicted_activations

GPT_1_3B = ModelConfig(
    num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024, vocab_size=50304
)


def _cfg(model=GPT_1_3B, gbs=512, **precision) -> MegatronConfig:
    cfg = MegatronConfig(
        model=model,
        training=TrainingConfig(global_batch_size=gbs),
        optimizer=OptimizerConfig(lr=1e-4),
    )
    return cfg.replace(precision=dataclasses.replace(cfg.precision, **precision))


# ---- enumeration ----


def test_enumeration_keeps_exactly_the_layouts_the_rules_accept():
    cfg = _cfg(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100))
    search = Search(8, 80, micro_batches=(1,), recompute=(None,), context_parallel=(1,))
    found, refused = layouts(cfg, search)
    got = {(x.tp, x.pp, x.vp, x.sequence_parallel) for x in found}
    # TP 8 cannot split 4 heads; V = 2 needs 2 layers per stage (PP <= 2); SP only with TP > 1
    assert (8, 1, None, False) not in got and refused["--num-attention-heads"] > 0
    assert (2, 2, 2, True) in got and (1, 4, 2, False) not in got
    assert all(x.tp > 1 for x in found if x.sequence_parallel)
    assert all(x.tp * x.pp * x.dp == 8 and x.num_micro_batches * x.dp == 512 for x in found)
    # (TP, PP) in (1,1) (1,2) (1,4) (2,1) (2,2) (2,4) (4,1) (4,2); SP with the 5 of TP > 1;
    # V = 2 with (1,2), (2,2), (4,2), and with SP for the last two
    assert len(got) == len(found) == 8 + 5 + 5


def test_the_memory_model_matches_the_schedule_and_the_built_model():
    for kw in ({}, {"swiglu": True, "normalization": "RMSNorm", "num_query_groups": 2}):
        m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=250, **kw)
        model = GPTModel(m, BuildContext(seed=1))
        assert stage_params(m, 1, 1, 0) == sum(p.numel() for p in model.parameters())
    m = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256
    )
    measured, predicted = saved_and_predicted_activations(m)
    assert abs(predicted - measured) / measured < 0.01


def test_memory_model_against_hand_computed_values():
    # GPT-2 345M-like layer, TP 2: 12 h^2 / 2 matmul weights + 4.5 h biases... computed by hand
    m = ModelConfig(
        num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257
    )
    h = 1024
    layer = (
        12 * h * h // 2 + (3 * h + 4 * h) // 2 + 2 * h + 4 * h
    )  # weights, split + replicated biases, norms
    words = 50432 * h // 2  # vocab padded to a multiple of 128 x 2
    assert stage_params(m, 2, 2, 0) == 12 * layer + words + 1024 * h
    assert stage_params(m, 2, 2, 1) == 12 * layer + words + 2 * h  # tied copy + final norm
    # bf16 + Adam: 2 + 4 + 12 bytes per parameter; distributed optimizer: 2 + 4 + 12 / DP
    assert model_state_bytes(1000, 4, Training(dtype_bytes=2)) == {
        "parameters": 2000,
        "gradients": 4000,
        "optimizer": 12000,
    }
    assert sum(model_state_bytes(1000, 4, Training(2, sharding="distributed")).values()) == 9000
    assert sum(model_state_bytes(1000, 4, Training(4, sharding="distributed")).values()) == 10000
    # --use-torch-fsdp2: 16 bytes / DP in either dtype (fp32 shards are the master weights)
    for dtype_bytes in (2, 4):
        fsdp2 = model_state_bytes(1000, 4, Training(dtype_bytes, sharding="fsdp2"))
        assert fsdp2 == {"parameters": 1000, "gradients": 1000, "optimizer": 2000}
    # activations per layer: Megatron's s b h (34 + 5 a s / h) in fp16 with 1-byte masks
    lay = Layout(1, 1, 1, micro_batch=2, num_micro_batches=1)  # (b = 1 keeps the qkv storage)
    no_flash = Device(mask_bytes=1, flash_attention=False)
    t = Training(dtype_bytes=2)
    from megatron.planning.memory import layer_activation_bytes

    s, a = 1024, 16
    expected = s * 2 * h * (34 + 5 * a * s / h) + 16 * s * 2  # + the norms' fp32 statistics
    assert layer_activation_bytes(m, lay, t, no_flash) == expected
    sp = Layout(4, 1, 1, 2, 1, sequence_parallel=True)  # SP divides everything by t
    assert layer_activation_bytes(m, sp, t, no_flash) == expected / 4
    # 1F1B: stage 0 of 4 holds 4 micro batches, the last stage 1
    pp = Layout(1, 4, 1, 1, 8)
    first = stage_activation_peak(m, pp, t, no_flash, 0)["activations"]
    one = stage_activation_peak(m, Layout(1, 4, 1, 1, 1), t, no_flash, 0)["activations"]
    assert first == 4 * one


def test_context_parallelism_in_the_planner():
    """CP is enumerated; it divides the activations by CP (the ring keeping no score matrix),
    shards the distributed optimizer over DP x CP, and rings K/V behind the attention."""
    cfg = _cfg(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100))
    found, _ = layouts(cfg, Search(8, 80, micro_batches=(1,), recompute=(None,)))
    assert {x.cp for x in found} == {1, 2, 4, 8}
    assert all(x.tp * x.cp * x.pp * x.dp == 8 for x in found)
    long = dataclasses.replace(GPT_1_3B, seq_length=16384)
    t, flash = Training(), Device(flash_attention=True)
    one = stage_activation_peak(long, Layout(1, 1, 1, 1, 1), t, flash, 0)["activations"]
    four = estimate_memory(long, Layout(1, 1, 1, 1, 1, cp=4), t, flash)
    # s / 4 tokens each; the ring's query copy D a s d per layer on top of flash SDPA's
    # log-sum-exp (its blocks through the fused kernels keep no fp32 output)
    ring = 24 * 2 * 16 * 4096 * 128
    assert four.terms["activations"] == pytest.approx(one / 4 + ring, rel=0.01)
    # the explicit block math (--attention-backend unfused) keeps the fp32 output as well
    math_blocks = dataclasses.replace(t, attention_backend="unfused")
    math_four = estimate_memory(long, Layout(1, 1, 1, 1, 1, cp=4), math_blocks, flash)
    fp32_out = 24 * 4 * 16 * 4096 * 128
    assert math_four.terms["activations"] - four.terms["activations"] == fp32_out
    sharded = estimate_memory(long, Layout(1, 1, 2, 1, 1, cp=4), Training(sharding="distributed"))
    assert sharded.terms["optimizer"] == stage_params(long, 1, 1, 0) * 12 // 8
    terms = step_time(long, Layout(1, 1, 1, 1, 1, cp=4), t, Hardware())
    assert 0 <= terms["cp_comm"] and "CP4" in Layout(1, 1, 1, 1, 1, cp=4).describe()
    slow_net = step_time(long, Layout(1, 1, 1, 1, 1, cp=4), t, Hardware(intra_node_gbps=0.01))
    assert slow_net["cp_comm"] > terms["cp_comm"]


def test_a_layout_that_does_not_fit_is_rejected_and_timing_terms_are_printed():
    cfg = _cfg(bf16=True)
    fits = Search(8, 32, Hardware(peak_tflops=125))
    ranked = plans(cfg, fits)
    ddp = next(
        p
        for p in ranked
        if p.layout.tp == 1
        and p.layout.pp == 1
        and p.layout.cp == 1
        and p.layout.micro_batch == 16
        and p.layout.recompute is None
    )
    assert not ddp.fits and ddp.memory.total > 32 * GiB
    best, _ = best_plan(cfg, fits)
    assert best.fits and best.memory.total <= 32 * GiB
    assert set(best.time) >= {"compute", "tp_comm", "bubble", "pp_p2p", "dp_comm", "recompute"}


@pytest.mark.parametrize(
    "P,M,V", [(2, 4, 1), (3, 5, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (2, 6, 3)]
)
def test_the_bubble_is_the_idle_time_of_the_schedule_run_as_a_timeline(P, M, V):
    """The planner's bubble against the schedule itself (megatron.schedules) run with a
    backward twice the forward: the time a stage waits = the step's span - its own work."""
    lay = Layout(1, P, 1, 1, M, vp=V if V > 1 else None)
    quiet = Hardware(latency_s=0.0, layer_overhead_s=0.0)  # compute is all a stage does
    t = step_time(GPT_1_3B, lay, Training(), quiet)
    run = simulate(P, M, V)
    assert t["bubble"] == pytest.approx(t["compute"] * (run.makespan - run.busy) / run.busy)
    # With TP the all-reduces and launches run inside each forward and backward: they wait too.
    lay = dataclasses.replace(lay, tp=2)
    t = step_time(GPT_1_3B, lay, Training(), Hardware())
    busy = t["compute"] + t["launch"] + t["tp_comm"]
    assert t["launch"] > 0 and t["tp_comm"] > 0
    assert t["bubble"] == pytest.approx(busy * (run.makespan - run.busy) / run.busy)


def test_bad_input_names_the_smallest_fix():
    cfg = _cfg(gbs=512)
    with pytest.raises(PlanError, match="launch 8 ranks instead of 7|--global-batch-size 518"):
        best_plan(cfg, Search(7, 80))
    with pytest.raises(PlanError, match=r"needs [\d.]+ GiB per GPU.*Smallest fix: GPUs with"):
        best_plan(_cfg(bf16=True), Search(8, 2))
    assert estimate_memory(GPT_1_3B, Layout(8, 1, 1, 1, 512), Training()).total < 8 * GiB
    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    shape += ["--seq-length", "1024", "--vocab-size", "50304", "--global-batch-size", "512"]
    auto = ["--bf16", "--auto-parallel", "--auto-parallel-gpu-memory-gb", "2"]
    with pytest.raises(PlanError, match=r"\(--auto-parallel-gpu-memory-gb [\d.]+\)"):
        auto_parallel(parse_args([*shape, *auto], world_size=8), log=lambda line: None)


def test_a_need_just_over_the_limit_reads_over_it():
    assert gib_above(int(1.5 * GiB), 1) == ("1.5", "1.5")
    assert gib_above(GiB + 1, 1) == ("1.000000001", "1.000000001")  # one byte over
    assert gib_above(int(1.05011 * GiB), 1.05) == ("1.0501", "1.0502")  # the limit's decimals
    for limit in (1, 0.5, 1.05, 79.3):
        for over in (1, 999, 2**20, int(0.049 * GiB), int(0.051 * GiB)):
            need, enough = gib_above(int(limit * GiB) + over, limit)
            assert float(need) > limit and float(enough) * GiB >= int(limit * GiB) + over
            assert len(need) == len(enough) and float(enough) - float(need) < 2 * 10 ** -(
                len(need.partition(".")[2])
            )


def test_the_no_fit_message_at_the_boundary_shows_the_need_above_the_limit():
    """The leanest layout needs one byte more than 1 GiB: the message reads over 1 GiB, and the
    memory it suggests makes that layout fit."""
    cfg = _cfg(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 seq_length=128, vocab_size=1000), gbs=8)  # fmt: skip
    lean = min(p.memory.total for p in plans(cfg, Search(1, 1000)))
    device = Device(overhead_bytes=GiB + 1 - lean)
    with pytest.raises(PlanError) as e:
        best_plan(cfg, Search(1, 1, device=device))
    assert "fits in 1 GiB" in str(e.value) and "needs 1.000000001 GiB per GPU" in str(e.value)
    assert "Smallest fix: GPUs with at least 1.000000001 GiB (--gpu-memory 1.000000001)" in str(
        e.value
    )
    best, _ = best_plan(cfg, Search(1, 1.000000001, device=device))
    assert best.memory.total == GiB + 1
    with pytest.raises(PlanError, match=r"needs 1.0 GiB .*\(--gpu-memory 1.1\)"):  # far over
        best_plan(cfg, Search(1, 0.9, device=device))


@pytest.mark.slow  # over a second on 2 cores
def test_auto_parallel_picks_a_layout_and_writes_it_into_the_config(capsys):
    argv = [
        "--num-layers",
        "24",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--seq-length",
        "1024",
        "--vocab-size",
        "50304",
        "--global-batch-size",
        "512",
        "--bf16",
        "--auto-parallel",
        "--auto-parallel-gpu-memory-gb",
        "32",
    ]
    lines = []
    cfg = parse_args(argv, world_size=8, plan=lambda c: auto_parallel(c, log=lines.append))
    best, _ = best_plan(_cfg(bf16=True), Search(8, 32, device=Device(overhead_bytes=GiB)))
    par = cfg.parallel
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (
        best.layout.tp,
        best.layout.pp,
    )
    assert cfg.training.micro_batch_size == best.layout.micro_batch
    assert not par.auto_parallel and "chose" in lines[0]
    from megatron.config.files import to_yaml

    assert f"tensor_model_parallel_size: {best.layout.tp}" in to_yaml(cfg, "x")
    with pytest.raises(ConfigError, match="--auto-parallel-gpu-memory-gb"):
        parse_args(argv[:-2] + ["--auto-parallel-gpu-memory-gb", "-1"], world_size=8)
    # a given TP stays fixed
    cfg = parse_args(
        argv + ["--tensor-model-parallel-size", "4"],
        world_size=8,
        plan=lambda c: auto_parallel(c, log=lines.append),
    )
    assert cfg.parallel.tensor_model_parallel_size == 4


@pytest.mark.slow  # over a second on 2 cores
def test_pretrain_auto_parallel_resolves_the_layout_and_the_tool_reports_bad_input(
    monkeypatch, capsys
):
    import pretrain_gpt2
    from tools import plan_parallel

    model = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "1024", "--vocab-size", "50304", "--global-batch-size", "512",
             "--bf16"]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "8")
    argv = model + ["--auto-parallel", "--auto-parallel-gpu-memory-gb", "32", "--print-config"]
    with pytest.raises(SystemExit) as done:
        pretrain_gpt2.main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "auto-parallel: " in out and "chose TP" in out
    assert "auto_parallel: false" in out and "micro_batch_size: " in out
    assert plan_parallel.main(model + ["--world-size", "7", "--gpu-memory", "80"]) == 1
    assert "Smallest fix: launch 8 ranks instead of 7" in capsys.readouterr().err
    assert plan_parallel.main(model + ["--world-size", "8", "--gpu-memory", "2"]) == 1
    assert "GPUs with at least" in capsys.readouterr().err
    assert plan_parallel.main(model + ["--world-size", "8", "--gpu-memory", "40"]) == 0
    assert "best: " in capsys.readouterr().out


def test_plan_parallel_with_no_arguments_plans_its_example(capsys):
    from tools import plan_parallel

    assert plan_parallel.main([]) == 0  # not argparse's exit 2 for missing --world-size
    out = capsys.readouterr().out
    assert "No model given: planning the example" in out and "--help lists" in out
    assert "best: " in out


def test_dualpipev_pairs_hide_all_to_alls_up_to_the_other_micro_batchs_compute():
    """The planner's ep_comm under dualpipev (EP > 1): each overlapped pair hides its forward's
    all-to-alls behind the backward's compute and the backward's behind the forward's; zbv
    (same V, no pairs) exposes them all."""
    moe = ModelConfig(
        num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000, num_experts=8
    )
    P, M = 2, 8
    pairs = min(
        len(overlapped_pairs("dualpipev", schedule_actions("dualpipev", P, s, M, 2)))
        for s in range(P)
    )
    assert pairs > 0
    fast, slow = Hardware(intra_node_gbps=1e6, latency_s=0.0), Hardware(intra_node_gbps=1e-4)
    for hw, bound in ((fast, "network"), (slow, "compute")):
        zbv, dualpipev = (
            step_time(moe, Layout(1, P, 4, 1, M, ep=2, schedule=s), Training(), hw)
            for s in ("zbv", "dualpipev")
        )
        assert dualpipev["compute"] == zbv["compute"]
        hidden = zbv["ep_comm"] - dualpipev["ep_comm"]
        if bound == "network":  # fast links: every pair hides one micro batch's all-to-alls
            assert hidden == pytest.approx(pairs * zbv["ep_comm"] / M)
        else:  # slow links: it hides as much as one micro batch computes
            assert hidden == pytest.approx(pairs * zbv["compute"] / M)
    one_rank_experts = step_time(moe, Layout(1, P, 4, 1, M, schedule="dualpipev"), Training(), slow)
    assert one_rank_experts["ep_comm"] == 0  # EP 1: nothing to overlap


@pytest.mark.slow  # two full plans: over a second on 2 cores
def test_plan_parallel_tries_the_zero_bubble_schedules_it_is_given(capsys):
    from tools import plan_parallel

    def layouts(*extra) -> str:
        assert plan_parallel.main([*plan_parallel.EXAMPLE, "--top", "0", *extra]) == 0
        return capsys.readouterr().out.split("\nbest: ")[0]

    plain, zero_bubble = layouts(), layouts("--pipeline-schedules", "zb-h1", "zbv")
    assert " PP2" in plain and "zb-h1" not in plain and "zbv" not in plain
    assert "zb-h1" in zero_bubble and "zbv" in zero_bubble and "dualpipev" not in zero_bubble
