"""bench/profile_step.py runs (on the CPU, a tiny shape) and sorts kernels into categories."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location(
        "profile_step", os.path.join(ROOT, "bench", "profile_step.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_categories_of_gpu_kernel_names():
    cat = _module().category
    assert cat("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert cat("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    assert cat("flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert cat("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert cat("_norm_fwd_kernel") == "norm"
    assert cat("_sum_exp_target_kernel") == "cross-entropy"
    assert cat("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert cat("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"


def test_smoke_prints_a_headline(capsys):
    assert _module().main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "HEADLINE busy" in out and "longest kernels" in out


def test_flags_reach_the_trainer_config(capsys):
    assert _module().main(["--smoke", "--flags=--no-bias-gelu-fusion"]) == 0
    assert "flags: --no-bias-gelu-fusion" in capsys.readouterr().out
