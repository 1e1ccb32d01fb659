"""The planner's per-schedule activation peak (megatron/planning/pipeline_memory.py) against
what each stage holds for backward during a real training step (tests/helpers/pipeline_memory),
and the zero-bubble W queue's bytes against the planner's."""

from __future__ import annotations

import pytest

from megatron.config.schema import ModelConfig
from megatron.planning.memory import Device, Layout, Training
from megatron.planning.pipeline_memory import stage_activation_peak, weight_grad_bytes
from tests.helpers.distributed import run_distributed
from tests.helpers.pipeline_memory import SCHEDULES, case_flags, measure_peaks, planned_peak

_FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
_FULL += ["--recompute-num-layers", "1"]
_SELECTIVE = ["--recompute-granularity", "selective"]
_MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
_TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# PP 2 (x DP 2 or TP 2 on the same 4 ranks): full or selective recompute, an MoE model, TP 2
# with sequence parallelism (the W queue then holds the gathered inputs).
_PP2_EXTRA = {"1f1b": _SELECTIVE, "zb-h1": _MOE, "zbv": _TP2_SP, "dualpipev": _FULL}


@pytest.mark.slow
def test_each_stages_activation_peak_is_the_planners_within_5_percent(data_prefix):
    cases = [(s, 4, []) for s in SCHEDULES]
    cases += [(s, 2, _PP2_EXTRA.get(s, [])) for s in SCHEDULES]
    argvs = [case_flags(data_prefix, s, pp, *extra) for s, pp, extra in cases]
    per_rank = run_distributed(measure_peaks, 4, argvs)
    for i, (schedule, pp, extra) in enumerate(cases):
        for rank, results in enumerate(per_rank):
            stage, measured = results[i]
            planned = planned_peak(argvs[i], 4, stage)
            what = f"{schedule} PP{pp} {' '.join(extra)} stage {stage} (rank {rank})"
            assert abs(planned - measured) <= 0.05 * measured, (what, measured, planned)


def test_a_zero_bubble_w_keeps_the_linears_inputs_and_output_gradients():
    """Between a split B and its W a layer holds, per linear, its input and its output
    gradient: qkv (h, 3h), dense (h, h), fc1 (h, 4h), fc2 (4h, h) = 16 h per token. Without
    recompute that is about the chunk's activations (ZB-H1 near 1F1B's first-stage peak on
    every stage); under full recompute the B rebuilt them, so ZB-H1 holds far more than 1F1B."""
    m = ModelConfig(
        num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1024
    )
    t, dev = Training(dtype_bytes=2), Device()
    lay = Layout(1, 4, 1, 1, 8)
    assert weight_grad_bytes(m, lay, t, False, False) == 2 * 16 * 256 * 256 * 2  # 2 layers

    def peak(schedule, stage, recompute=None):
        lay = Layout(1, 4, 1, 1, 8, recompute=recompute, schedule=schedule)
        return stage_activation_peak(m, lay, t, dev, stage)["activations"]

    assert peak("1f1b", 0) < peak("zb-h1", 0) < 1.01 * peak("1f1b", 0)
    assert peak("zb-h1", 3, "full") > 10 * peak("1f1b", 3, "full")
