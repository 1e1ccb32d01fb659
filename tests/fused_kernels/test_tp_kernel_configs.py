"""Under tensor parallelism every rank must run the same kernel configs (autotuning times each
rank on its own and may pick differently; the configs sum rows in different orders, and the
replicated norm weights would drift apart by last bits): the trainer turns autotuning off."""

from types import SimpleNamespace

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.fused_kernels import _triton
from megatron.training.step import build_context

ARGV = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--vocab-size", "100", "--train-iters", "1", "--lr", "1e-4",
]  # fmt: skip


@pytest.fixture
def autotune(monkeypatch):
    monkeypatch.setattr(_triton, "AUTOTUNE", True)  # restored after the test


@pytest.mark.parametrize("tp, expected", [(1, True), (2, False)])
def test_tensor_parallel_fixes_the_kernel_configs(autotune, tp, expected):
    cfg = parse_args(ARGV, world_size=1, purpose="train-gpt")
    rt = SimpleNamespace(state=SimpleNamespace(tp_size=tp), device=torch.device("cpu"))
    rt.rng_tracker = None
    build_context(cfg, rt)
    assert _triton.AUTOTUNE is expected


def test_fixed_configs_keep_one(autotune):
    configs = [_triton.config(w, ROWS=r) for r in (1, 2, 4) for w in (2, 4, 8)]
    assert len(_triton.bounded_configs(configs, lambda c: c.kwargs["ROWS"] * 1024)) > 1
    _triton.fix_configs()
    assert len(_triton.bounded_configs(configs, lambda c: c.kwargs["ROWS"] * 1024)) == 1
