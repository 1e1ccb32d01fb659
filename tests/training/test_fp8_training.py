"""pretrain() with --fp8-format on gloo ranks, through torchao's emulation (MEGATRON_FP8_EMULATE=1:
float8 rounding, fp32 GEMMs): it learns like bf16; TP x SP x DP with the distributed optimizer
and TP x PP give TP = 1's losses within float8 rounding; its checkpoint (weights unchanged, so
no fp8 in it) resumes without --fp8-format.

Tolerances: the toy run's losses (4.87 falling to 4.75 in 6 steps) within 0.2% of bf16's and
of TP = 1 fp8's at every iteration (measured: float8 and the layouts move them by <= 1e-4).
"""

import numpy as np
import pytest

from megatron.mpu import fp8
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _losses, _train, flags

pytest.importorskip("torchao", reason=f"pip install {fp8.TORCHAO_REQUIREMENT} (the fp8 extra)")

FP8 = ["--bf16", "--fp8-format", "hybrid"]
TP2_SP_DP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
TP2_SP_DP2 += ["--use-distributed-optimizer"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _one_rank_worker(rank, world, argv):
    return {name: _train(rank, world, argv + extra)[0] for name, extra in (
        ("bf16", ["--bf16"]),
        ("fp8", FP8),
        ("fp8 rowwise e4m3", ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]),
    )}  # fmt: skip


def _four_rank_worker(rank, world, argv, save):
    out = {
        "tp2 sp dp2 distopt": _train(rank, world, argv + FP8 + TP2_SP_DP2 + ["--save", save]),
        "tp2 pp2": _train(rank, world, argv + FP8 + TP2_PP2),
    }
    resumed = [a if a != "6" else "8" for a in argv]  # --train-iters 8
    out["resumed in bf16"] = _train(rank, world, resumed + ["--bf16", "--load", save])
    return {name: (history, iteration) for name, (history, _, iteration) in out.items()}


@pytest.mark.slow
def test_fp8_training_learns_like_bf16_in_every_layout_and_resumes_without_fp8(
    data_prefix, tmp_path, monkeypatch
):
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    argv = flags(data_prefix, "--adam-eps", "1e-4")
    ((ref),) = run_distributed(_one_rank_worker, 1, argv)
    bf16 = _losses(ref["bf16"])
    assert bf16[-1] < bf16[0], "the toy run must learn"
    for name in ("fp8", "fp8 rowwise e4m3"):
        np.testing.assert_allclose(_losses(ref[name]), bf16, rtol=2e-3, err_msg=name)
        assert _losses(ref[name]) != bf16, f"{name}: no float8 rounding reached the loss"
    results = run_distributed(_four_rank_worker, 4, argv, str(tmp_path / "ckpt"))
    last = results[-1]  # the last rank logs the losses (last pipeline stage)
    for name in ("tp2 sp dp2 distopt", "tp2 pp2"):
        history, iteration = last[name]
        assert iteration == 6, name
        np.testing.assert_allclose(_losses(history), _losses(ref["fp8"]), rtol=2e-3, err_msg=name)
    history, iteration = last["resumed in bf16"]
    assert iteration == 8 and [h["iteration"] for h in history] == [7, 8]
    assert max(_losses(history)) < bf16[0], "the resumed run lost the fp8 run's training"
