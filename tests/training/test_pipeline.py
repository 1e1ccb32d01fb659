"""Pipeline parallelism: the schedules themselves, and PP / interleaved / TP x PP x DP training
that equals one process; activation checkpointing that changes memory, never the numbers."""

import numpy as np
import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel
from megatron.schedules.one_f_one_b import pipeline_actions
from megatron.schedules.registry import check_message_order
from tests.helpers.distributed import run_distributed
from tests.helpers.pipeline import simulate
from tests.helpers.training import _losses, _pp_worker, _ref_worker, flags


@pytest.mark.parametrize(
    "P,V,Ms",
    [
        (2, 1, [1, 2, 3, 8]),
        (4, 1, [1, 3, 4, 9]),
        (2, 2, [2, 4, 6]),
        (4, 2, [4, 8]),
        (3, 3, [3, 6, 9]),
    ],
)
def test_schedules_are_complete_deadlock_free_and_ordered(P, V, Ms):
    for M in Ms:
        for s in range(P):
            actions = pipeline_actions(P, s, M, V)
            assert sorted(a for a in actions if a[0] == "F") == sorted(
                ("F", c, mb) for c in range(V) for mb in range(M)
            )
            assert len(actions) == 2 * M * V
        peak = simulate(P, M, V).peak
        if V == 1:  # 1F1B: stage s keeps at most P - s micro batches of activations
            assert all(peak[s] <= min(P - s, M) for s in range(P)), peak
        check_message_order(P, M, V)


CFG = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=64,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.2,
    attention_dropout=0.2,
)


@pytest.mark.parametrize(
    "granularity,method,n",
    [
        ("full", "uniform", 1),
        ("full", "uniform", 2),
        ("full", "block", 3),
        ("selective", "uniform", 1),
    ],
)
def test_activation_checkpointing_gives_identical_losses_and_grads(granularity, method, n):
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 5)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (None, RecomputeConfig(granularity, method, n)):
        model = parallelize(
            GPTModel(CFG, BuildContext(seed=3, dtype=torch.float64, rng_tracker=tracker)),
            mpu.single_process_state(),
            recompute,
        )
        torch.manual_seed(11)
        tracker.set_states({mpu.MODEL_PARALLEL_RNG: torch.Generator().manual_seed(5).get_state()})
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels=tokens).mean()
        loss.backward()
        results.append(
            (loss.detach(), {k: p.grad for k, p in model.named_parameters()}, sum(saved))
        )
    (l0, g0, saved0), (l1, g1, saved1) = results
    assert saved1 < saved0, "recompute must keep fewer activations alive during forward"
    with torch.no_grad():
        assert not torch.equal(model.eval()(tokens, labels=tokens).mean(), l1), "dropout is on"
    assert torch.equal(l0, l1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.slow
def test_pipeline_layouts_match_one_process_and_resume_exactly(data_prefix, tmp_path):
    argv = flags(data_prefix, "--num-layers", "4", "--adam-eps", "1e-4")
    ((ref_history, ref_weights),) = run_distributed(_ref_worker, 1, argv)
    layouts = [
        (2, ["--pipeline-model-parallel-size", "2"], False),
        (
            2,
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            False,
        ),
        (4, ["--pipeline-model-parallel-size", "4"], False),
        (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], True),
    ]
    for world, extra, resume in layouts:
        results = run_distributed(
            _pp_worker,
            world,
            argv + extra,
            ref_weights,
            str(tmp_path / f"w{world}") if resume else None,
        )
        for rank, out in enumerate(results):
            np.testing.assert_allclose(
                _losses(out["history"]),
                _losses(ref_history),
                rtol=2e-5,
                err_msg=f"{extra} rank {rank}",
            )
            if resume:
                for kind, (straight, _, second, final_iter) in out["resume"].items():
                    assert final_iter == 6, kind
                    assert _losses(second) == _losses(straight)[3:], f"{kind}: resume not exact"


@pytest.mark.parametrize(
    "batch_flags,batches",
    [
        (["--global-batch-size", "3"], "3"),
        (["--global-batch-size", "8", "--rampup-batch-size", "2", "1", "100"], "1"),
    ],
)
def test_interleaved_micro_batch_rule_is_checked_before_any_work(batch_flags, batches):
    """Every batch size of the run, the ramp's included, must be whole rounds of P micro
    batches; the schedule itself only keeps an internal check."""
    from megatron.config.cli import parse_args
    from megatron.config.declare import ConfigError
    from megatron.config.rules import validate

    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
    argv += ["--seq-length", "16", "--vocab-size", "100", "--lr", "1e-3"]
    argv += ["--train-samples", "800", "--pipeline-model-parallel-size", "2"]
    argv += ["--num-layers-per-virtual-pipeline-stage", "1", *batch_flags]
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage") as err:
        validate(parse_args(argv, world_size=2), "train-gpt")
    assert f"({batches} = batch" in str(err.value) and "Fix:" in str(err.value)
