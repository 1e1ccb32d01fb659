"""Multi-latent attention against one process: loss, grad norm, gradients and updated weights
of an MLA GPT (YaRN RoPE, value heads narrower than query/key heads) trained two steps at TP 2
with sequence parallelism, TP 2 without (plain query projection, selective recompute), CP 2
(ring attention with the values padded) and PP 2 (full recompute); the TP 2 and PP 2 models
then generate through the latent KV cache the one-process model's logits: all in ONE 2-rank
spawn.

Each rank also trains the single-process model on the same micro batches (the reference), so
the comparison needs no second spawn.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron import mpu
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.layouts import check_cached_generation, compare_layout, train_layout
from tests.helpers.models import tiny_mla

MODEL = tiny_mla()
MICRO, BATCH, STEPS = 2, 2, 2  # micro batches, samples per micro batch, steps

# (name, TP, PP, CP, sequence parallel, recompute, model changes)
LAYOUTS = [
    ("tp2-sp", 2, 1, 1, True, None, {}),
    ("tp2-selective", 2, 1, 1, False, "selective", {"q_lora_rank": None}),
    ("cp2", 1, 1, 2, False, None, {}),
    ("pp2-full", 1, 2, 1, False, "full", {}),
]


def _worker(rank, world):
    torch.manual_seed(0)
    report = {}
    for name, tp, pp, cp, sp, recompute, changes in LAYOUTS:
        cfg = dataclasses.replace(MODEL, **changes)
        ref = train_layout(cfg, mpu.single_process_state(), recompute, range(MICRO), BATCH, STEPS)
        state = initialize_model_parallel(tp, pp, sequence_parallel=sp, context_parallel_size=cp)
        try:
            mine = train_layout(cfg, state, recompute, range(MICRO), BATCH, STEPS)
            params = {n: p for c in mine[3].chunks for n, p in c.named_parameters()}
            compare_layout(name, ref, mine, params, state)
            if not sp and cp == 1:  # generation: the latent cache on every rank
                check_cached_generation(name, ref[3], mine[3], state)
            report[name] = mine[0]
        finally:
            destroy_model_parallel(state)
    return report


def _spawned(rank, world):
    return {"layouts": _worker(rank, world)}


@pytest.fixture(scope="module")
def spawn():
    return run_distributed(_spawned, 2, timeout=600)


def test_mla_layouts_match_one_process(spawn):
    layouts = spawn[0]["layouts"]
    assert set(layouts) == {name for name, *_ in LAYOUTS}
    for history in layouts.values():
        assert history[1][0] < history[0][0] + 1.0  # it trained, finitely
