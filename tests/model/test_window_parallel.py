"""Sliding windows (the first layer windowed, the second global) with learnable attention sinks
against one process: loss, grad norm, gradients and updated weights after two steps at TP 2
with sequence parallelism (the sink logits split with the heads), TP 2, PP 2 (the windowed and
the global layer on different stages) and DP 2; then the TP 2 and PP 2 models generate through
the rolling cache of the windowed layer the one-process model's logits: all in ONE 2-rank
spawn."""

from __future__ import annotations

import pytest
import torch

from megatron import mpu
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.layouts import check_cached_generation, compare_layout, train_layout
from tests.helpers.models import small_gpt

MODEL = small_gpt(
    position_embedding_type="rope",
    window_size="3,0",
    window_attn_skip_freq="2",
    softmax_type="learnable",
)
MICRO, BATCH, STEPS = 2, 2, 2
LAYOUTS = [
    ("tp2-sp", 2, 1, True),
    ("tp2", 2, 1, False),
    ("pp2", 1, 2, False),
    ("dp2", 1, 1, False),
]


def _worker(rank, world):
    torch.manual_seed(0)
    ref = train_layout(MODEL, mpu.single_process_state(), None, range(MICRO), BATCH, STEPS)
    report = {}
    for name, tp, pp, sp in LAYOUTS:
        state = initialize_model_parallel(tp, pp, sequence_parallel=sp)
        try:
            per_rank = MICRO // state.dp_size  # DP 2: one micro batch each, the same two
            groups = range(state.dp_rank * per_rank, (state.dp_rank + 1) * per_rank)
            mine = train_layout(MODEL, state, None, groups, BATCH, STEPS)
            params = {n: p for c in mine[3].chunks for n, p in c.named_parameters()}
            sinks = [n for n in params if n.endswith("core.softmax_offset")]
            assert sinks and all(params[n].numel() == 4 // tp for n in sinks), sinks
            compare_layout(name, ref, mine, params, state)
            if not sp and state.dp_size == 1:  # generation: the rolling cache of layer 1
                check_cached_generation(name, ref[3], mine[3], state)
            report[name] = mine[0]
        finally:
            destroy_model_parallel(state)
    return report


@pytest.fixture(scope="module")
def spawn():
    return run_distributed(_worker, 2, timeout=600)


def test_windows_and_sinks_match_one_process_at_every_layout(spawn):
    assert set(spawn[0]) == {name for name, *_ in LAYOUTS}
    for history in spawn[0].values():
        assert history[1][0] < history[0][0] + 1.0  # it trained, finitely
