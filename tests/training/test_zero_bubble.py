"""Zero-bubble pipeline schedules: the orders proven complete and deadlock-free by the
simulator, their bubbles against 1F1B's, the B/W split against the plain backward, the flag's
rules, and ZB-H1, ZBV and DualPipeV training (PP 4 and PP 2; with TP 2 and sequence
parallelism, the distributed optimizer, an MoE model) equal to one process in losses,
gradient norms and final weights."""

import contextlib
import dataclasses

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from megatron.mpu import overlap
from megatron.mpu.weight_grad import WeightGradSplit, run_weight_grads
from megatron.schedules.registry import (
    SCHEDULES,
    check_message_order,
    messages,
    overlapped_pairs,
    schedule_actions,
)
from megatron.schedules.sim import Costs, Deadlock, simulate, textbook_bubble
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    BASE,
    _losses,
    _pp_worker,
    _ref_worker,
    _train,
    assert_same_run,
    flags,
    train_run,
    with_dropout,
)


def _chunks(schedule):
    return 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1


def test_every_schedule_runs_every_action_once_without_deadlock():
    """The simulator runs each stage's list with its sends and receives to the end for every
    (P, M) here; a receive order the peer does not send in is posted early, never waited on
    out of turn, so the same lists run on backends that ignore tags."""
    for schedule in SCHEDULES:
        for P in range(2, 7):
            for M in range(1, 3 * P + 2):
                if schedule == "interleaved" and M % P:
                    continue
                run = simulate(schedule, P, M, _chunks(schedule))
                assert len(run.timeline[0]) >= 2 * M * _chunks(schedule)
                sent, received = messages(schedule, P, M, _chunks(schedule))
                for pair in sent:  # the same messages, whatever their order
                    assert sorted(sent[pair]) == sorted(received[pair]), (schedule, P, M, pair)
    check_message_order(4, 8, 1, "zb-h1")  # ZB-H1 keeps 1F1B's per-pair order


def test_dualpipev_with_overlapped_pairs_cannot_deadlock():
    """Each overlapped pair receives both its inputs before it computes and sends as each half
    ends: the simulator runs such lists to the end for P = 2..6, M = 2P..3P+1 (even), and the
    pairs are the steady state (every micro batch's forward of one chunk but the warm-up's)."""
    for P in range(2, 7):
        for M in range(2 * P, 3 * P + 2, 2):
            paired = simulate("dualpipev", P, M, overlap=True)
            alone = simulate("dualpipev", P, M)
            assert paired.peak == alone.peak and paired.busy == alone.busy
            for s in range(P):
                actions = schedule_actions("dualpipev", P, s, M, 2)
                pairs = overlapped_pairs("dualpipev", actions, s == P - 1)
                assert len(pairs) >= M - 2 * P + s + 1, (P, M, s)
                for i in pairs:  # a pair is one step: both halves start and end together
                    assert paired.timeline[s][i][:2] == paired.timeline[s][i + 1][:2]
    assert not overlapped_pairs("zbv", schedule_actions("zbv", 4, 0, 8, 2))


def test_a_deadlocking_order_is_caught(monkeypatch):
    import megatron.schedules.sim as sim

    def reversed_stage0(schedule, P, s, M, V=1, forward_only=False):
        actions = schedule_actions(schedule, P, s, M, V)
        return actions if s else [a for a in actions if a[0] != "F"] + [("F", 0, 0)]

    monkeypatch.setattr(sim, "schedule_actions", reversed_stage0)
    with pytest.raises(ValueError, match="out of order"):
        sim.simulate("1f1b", 2, 2)
    monkeypatch.setattr(
        sim, "schedule_actions", lambda *a, **k: [("F", 0, 0), ("B", 0, 0)] if a[2] else []
    )
    with pytest.raises((Deadlock, ValueError)):
        sim.simulate("1f1b", 2, 1)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_zb_h1_cuts_the_bubble_to_a_third_and_zbv_nearly_removes_it(P):
    for M in (P, 2 * P, 4 * P):
        one_f_one_b = simulate("1f1b", P, M)
        zb = simulate("zb-h1", P, M)
        work = M * 3.0  # F = B = W = 1 per micro batch and stage
        assert one_f_one_b.step_time - work == pytest.approx(3 * (P - 1))
        assert zb.step_time - work == pytest.approx(P - 1)  # a third of 1F1B's idle time
        assert zb.bubble[0] == pytest.approx(textbook_bubble("zb-h1", P, M))
        assert max(zb.peak) <= P  # 1F1B's first-stage activations, on every stage
        if M >= 2 * P - 1:
            zbv = simulate("zbv", P, M)
            # Only the first forward's trip down the V's first leg (F / 2 a stage) is idle:
            # half of ZB-H1's, a sixth of 1F1B's, whatever M.
            assert zbv.step_time - work == pytest.approx((P - 1) * 0.5)
            assert max(simulate("dualpipev", P, M).bubble) <= max(zb.bubble)
    # Unequal costs: the W's still fill the cool-down (the paper's (P - 1)(F + B - W)).
    costs = Costs(f=1.0, b=1.2, w=0.8)
    zb = simulate("zb-h1", P, 4 * P, costs=costs)
    assert zb.step_time - 4 * P * 3.0 <= (P - 1) * (1.0 + 1.2 - 0.8) + 1e-9


def test_split_weight_gradients_equal_the_plain_backward():
    """The deferred W's of a dense and an MoE GPT give the plain backward's gradients."""
    from megatron.config.schema import ModelConfig

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for experts in (None, 4):
        cfg = ModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            vocab_size=64,
            make_vocab_size_divisible_by=8,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            num_experts=experts,
        )
        grads = []
        for split in (False, True):
            model = GPTModel(cfg, BuildContext(seed=3, dtype=torch.float64))
            queue, weight_grads = [], WeightGradSplit()
            with weight_grads.given_to(model) if split else contextlib.nullcontext():
                loss = model(tokens, labels=tokens).mean()
                with weight_grads.deferring(queue):
                    loss.backward()
                if split:  # B left the big weights' gradients for W
                    assert len(queue) >= 8
                    assert model.layers["0"].self_attention.dense.weight.grad is None
                run_weight_grads(queue)
            grads.append({k: p.grad for k, p in model.named_parameters()})
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, msg=name)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "4"], "8 chunks"),
        (
            ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "2"]
            + ["--num-layers-per-virtual-pipeline-stage", "2"],
            "exactly two chunks",
        ),
        (["--pipeline-schedule", "zb-h1"], "needs pipeline stages"),
        (["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2"], "chunks"),
        (
            ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2"]
            + ["--num-layers-per-virtual-pipeline-stage", "1"],
            "one model chunk",
        ),
        (
            ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2", "--deepspeed"],
            "DeepSpeed's pipeline engine",
        ),
    ],
)
def test_schedules_that_cannot_run_are_refused_with_the_fix(extra, match):
    argv = [*BASE, "--lr", "1e-3", "--train-iters", "10", "--global-batch-size", "8", *extra]
    with pytest.raises(ConfigError, match=match) as err:
        validate(parse_args(argv, world_size=4), "train-gpt")
    assert "--pipeline-schedule" in str(err.value) and "Fix:" in str(err.value)


def test_the_default_schedule_is_what_the_other_flags_imply():
    argv = [*BASE, "--pipeline-model-parallel-size", "2"]
    assert parse_args(argv, world_size=2).parallel.resolved_pipeline_schedule == "1f1b"
    argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
    assert parse_args(argv, world_size=2).parallel.resolved_pipeline_schedule == "interleaved"


_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
_PP2, _PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
_EP2 = [*_PP2, "--expert-model-parallel-size", "2", "--moe-grouped-gemm"]
_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
# (schedule, layout, dense 0 / MoE 1): every schedule at PP 4 and PP 2; TP 2 with sequence
# parallelism, the distributed optimizer and an MoE model more than once among them.
_LAYOUTS = [
    ("zb-h1", _PP4, 0),
    ("zbv", _PP4, 0),
    ("dualpipev", _PP4, 0),
    ("zb-h1", [*_PP2, "--use-distributed-optimizer"], 0),
    ("zbv", [*_PP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 0),
    ("dualpipev", [*_PP2, "--use-distributed-optimizer"], 1),
    # EP 2 (the all-to-all in B; dualpipev's pairs overlapped) and grouped GEMMs: losses and
    # gradient norms (expert shards)
    ("dualpipev", _EP2, 1),
    ("zb-h1", _PP2, 1),
]


def _refs(rank, world, dense, moe):
    return _ref_worker(rank, world, dense), _ref_worker(rank, world, moe)


def _zb_layouts(rank, world, models, refs, save_dir):
    """Every layout on the same 4 ranks, each held to its one-process reference (the final
    weights here, the losses and gradient norms by the test); then the V placement's
    checkpoint: 2 steps saved, resumed for the third."""
    out = []
    for schedule, extra, model in _LAYOUTS:
        argv = [*models[model], "--pipeline-schedule", schedule, *extra]
        if "--expert-model-parallel-size" in extra:
            out.append(_train(rank, world, argv)[0])
        else:
            out.append(_pp_worker(rank, world, argv, refs[model][1])["history"])  # + weights
    schedule, extra, model = _LAYOUTS[4]
    argv = [*models[model], "--pipeline-schedule", schedule, *extra]
    two = [a if a != "3" else "2" for a in argv]  # --train-iters 2
    _train(rank, world, [*two, "--save", save_dir])
    resumed, _, iteration = _train(rank, world, [*argv, "--load", save_dir])
    return out, (resumed, iteration), _overlap_with_dropout(rank, world, models[1])


def _overlap_with_dropout(rank, world, moe):
    """dualpipev at PP 2 x EP 2 with dropout and full recompute (the MoE all-to-alls replayed
    in B), its pairs overlapped, then run one after the other: both histories, whether the
    final weights are equal bit for bit, and the hand-overs the overlapped run made."""
    argv = [*with_dropout(moe), "--pipeline-schedule", "dualpipev", *_EP2, *_RECOMPUTE]
    argv += ["--micro-batch-size", "1"]  # 4 micro batches per DP rank: pairs in the steady state
    before = overlap.counts()["hand_overs"]
    paired = train_run(rank, world, argv)
    hand_overs = overlap.counts()["hand_overs"] - before
    alone = train_run(rank, world, [*argv, "--no-overlap-moe-expert-parallel-comm"])
    weights = [dict(run.model.named_parameters()) for run in (paired, alone)]
    same = all(torch.equal(p, weights[1][name]) for name, p in weights[0].items())
    return paired.history, alone.history, same, hand_overs


@pytest.mark.slow
def test_zero_bubble_schedules_train_like_one_process(data_prefix, tmp_path):
    dense = flags(data_prefix, "--num-layers", "8", "--adam-eps", "1e-4", iters=3)
    moe = flags(data_prefix, "--num-layers", "4", "--adam-eps", "1e-4", *_MOE, iters=3)
    ((dense_ref, moe_ref),) = run_distributed(_refs, 1, dense, moe)
    refs = (dense_ref, moe_ref)
    results = run_distributed(_zb_layouts, 4, (dense, moe), refs, str(tmp_path / "zbv"))
    for rank, (runs, (resumed, iteration), overlapped) in enumerate(results):
        for (schedule, extra, model), history in zip(_LAYOUTS, runs, strict=True):
            assert_same_run(history, refs[model][0], f"{schedule} {extra} rank {rank}")
        assert iteration == 3 and _losses(resumed) == _losses(runs[4])[2:], "zbv resume"
        paired, alone, same_weights, hand_overs = overlapped  # bit for bit, dropout on
        assert hand_overs > 0 and same_weights, f"dualpipev overlap rank {rank}"
        assert [(h["lm_loss"], h["grad_norm"]) for h in paired] == [
            (h["lm_loss"], h["grad_norm"]) for h in alone
        ], f"dualpipev overlap rank {rank}"


def test_the_planner_walks_the_new_schedules():
    """Its bubble is the simulator's (ZB-H1: a third of 1F1B's), its V puts the head on stage
    0, and --auto-parallel keeps a given --pipeline-schedule."""
    from megatron.config.schema import ModelConfig
    from megatron.planning.auto import search_for
    from megatron.planning.memory import Layout, Training, stage_params
    from megatron.planning.pipeline_memory import estimate_memory
    from megatron.planning.timing import Hardware, step_time

    m = ModelConfig(
        num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=256, vocab_size=8192
    )
    quiet = Hardware(latency_s=0.0, layer_overhead_s=0.0)
    bubble = {}
    for schedule in ("1f1b", "zb-h1", "zbv", "dualpipev"):
        lay = Layout(1, 4, 1, 1, 8, 2 if schedule in ("zbv", "dualpipev") else None)
        lay = dataclasses.replace(lay, schedule=schedule)
        bubble[schedule] = step_time(m, lay, Training(), quiet)["bubble"]
        assert estimate_memory(m, lay, Training()).terms["activations"] > 0
    assert bubble["zb-h1"] == pytest.approx(bubble["1f1b"] / 3)
    assert bubble["zbv"] < bubble["zb-h1"] and bubble["dualpipev"] < bubble["zb-h1"]
    loop, v = stage_params(m, 1, 4, 0), stage_params(m, 1, 4, 0, v_shape=True)
    assert v > loop and stage_params(m, 1, 4, 3, v_shape=True) < stage_params(m, 1, 4, 3)
    argv = [*BASE, "--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2"]
    argv += ["--auto-parallel", "--auto-parallel-gpu-memory-gb", "80"]
    search = search_for(parse_args(argv, world_size=4))
    assert search.schedules == ("zb-h1",) and search.only_schedules


def test_a_chunks_buckets_are_reduced_once_its_last_gradient_ran():
    """The DP reduction starts per chunk, after its last B or W of the step; the V's shared
    embedding waits for both chunks."""
    from torch import nn

    from megatron.schedules.zero_bubble import zbv_actions
    from megatron.training.pipeline import _GradSync

    chunks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    chunks[1].weight = chunks[0].weight  # one parameter in both chunks
    calls = []

    class Model:
        def start_grad_sync(self, done):
            calls.append(set(done))

    actions = zbv_actions(2, 0, 4)
    sync = _GradSync(Model(), chunks, actions)
    for i in range(len(actions)):
        sync.after(i)
    ids = {name: id(p) for name, p in [("w", chunks[0].weight), ("b0", chunks[0].bias)]}
    assert len(calls) == 2 and max(sync.last) == len(actions) - 1  # one call per chunk
    assert ids["w"] not in calls[0] and ids["w"] in calls[1]
    assert calls[1] == {id(p) for c in chunks for p in c.parameters()}
