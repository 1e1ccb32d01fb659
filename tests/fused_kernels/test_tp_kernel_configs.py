"""Under tensor parallelism every rank must run the same kernel configs (autotuning times each
rank on its own and may pick differently; the configs sum rows in different orders, and the
replicated norm weights would drift apart by last bits): the trainer turns autotuning off."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.config.cli import parse_args  # noqa: E402
from megatron.fused_kernels import _triton  # noqa: E402
from megatron.training.step import build_context  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

ARGV = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--vocab-size", "100", "--train-iters", "1", "--lr", "1e-4",
]  # fmt: skip


@pytest.fixture
def autotune(monkeypatch):
    monkeypatch.setattr(_triton, "AUTOTUNE", True)  # restored after the test


def test_tensor_parallel_fixes_the_kernel_configs_for_its_run_only(autotune):
    cfg = parse_args(ARGV, world_size=1, purpose="train-gpt")
    for tp, expected in ((1, True), (2, False), (1, True)):  # the last: autotuning is back
        rt = SimpleNamespace(state=SimpleNamespace(tp_size=tp), device=torch.device("cpu"))
        rt.rng_tracker = None
        build_context(cfg, rt)
        assert _triton.AUTOTUNE is expected, tp


def test_fixed_configs_keep_one(autotune):
    configs = [_triton.config(w, ROWS=r) for r in (1, 2, 4) for w in (2, 4, 8)]
    assert len(_triton.bounded_configs(configs, lambda c: c.kwargs["ROWS"] * 1024)) > 1
    _triton.fix_configs()
    assert len(_triton.bounded_configs(configs, lambda c: c.kwargs["ROWS"] * 1024)) == 1
