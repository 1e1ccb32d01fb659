"""--fp8-format on a GPU with float8 tensor cores (compute capability 8.9+: L4/L40, H100, B200):
`MEGATRON_TEST_DEVICE=cuda pytest tests/gpu/test_fp8_cuda.py` (bench/gpu_check.sh). The real
float8 GEMMs (cuBLAS tensorwise, CUTLASS rowwise) against bf16 with the tolerances of the CPU
tests (tests/mpu/test_fp8.py, tests/model/test_fp8.py), and against torchao's emulation on the
same device (the same rounding: they differ by the GEMMs' accumulation only); a token count
that is not a multiple of 16; the GPT eager and under torch.compile; pretrain_gpt2.py with
--fp8-format on one rank. Elsewhere every test skips, saying why (the CPU suite covers the
numerics through the emulation).
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig, PrecisionConfig
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel
from megatron.mpu import fp8
from tests.helpers.paths import ROOT
from tests.helpers.training import flags

BF16 = torch.bfloat16
HYBRID = PrecisionConfig(bf16=True, fp8_format="hybrid")


@pytest.fixture
def fp8_device(test_device):
    if test_device.type != "cuda":
        pytest.skip("CUDA only: float8 GEMMs (MEGATRON_TEST_DEVICE=cuda runs it)")
    problem = fp8.device_problem(test_device)
    if problem is not None:
        pytest.skip(problem)
    pytest.importorskip("torchao", reason=f"pip install {fp8.TORCHAO_REQUIREMENT}")
    torch.cuda.set_device(test_device)
    return test_device


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _linear_run(matmul, x, w, b, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.linear(x, w, b) if matmul is None else matmul.linear(x, w, b)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
@pytest.mark.parametrize("tokens", [(4, 256), (3, 5)], ids=["aligned", "15-tokens"])
def test_float8_gemms_match_bf16_and_the_emulation(fp8_device, fmt, recipe, tokens):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*tokens, 1024, generator=g).to(fp8_device, BF16)
    w = (0.02 * torch.randn(2048, 1024, generator=g)).to(fp8_device, BF16)
    b = torch.zeros(2048, device=fp8_device, dtype=BF16)
    grad = torch.randn(*tokens, 2048, generator=g).to(fp8_device, BF16)
    ref = _linear_run(None, x, w, b, grad)
    real = _linear_run(fp8.Float8Matmul(fmt, recipe), x, w, b, grad)
    emulated = _linear_run(fp8.Float8Matmul(fmt, recipe, emulate=True), x, w, b, grad)
    grad_tol = 0.08 if fmt == "hybrid" else 0.05
    tols = {"Y": 0.05, "dX": grad_tol, "dW": grad_tol}
    for (name, tol), a, r, e in zip(tols.items(), real, ref, emulated, strict=True):
        assert torch.isfinite(a).all(), name
        assert 0.01 < _rel(a, r) < tol, f"{name}: {_rel(a, r):.4f} against bf16"
        assert _rel(a, e) < 0.01, f"{name}: {_rel(a, e):.4f} against the emulation"


def _gpt_step(model, device):
    g = torch.Generator().manual_seed(7)
    tokens, labels = (torch.randint(0, 100, (2, 128), generator=g).to(device) for _ in "tl")
    loss = model(tokens, labels=labels).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def _gpt(device, precision=None, compile_=False):
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=128,
        vocab_size=100,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(cfg, BuildContext(seed=3, device=device, dtype=BF16))
    state = mpu.single_process_state()
    return parallelize(model, state, torch_compile=compile_, precision=precision)


def test_a_gpt_in_float8_on_the_gpu_matches_bf16_eager_and_compiled(fp8_device):
    ref_loss, ref_grads = _gpt_step(_gpt(fp8_device), fp8_device)
    for compile_ in (False, True):
        loss, grads = _gpt_step(_gpt(fp8_device, HYBRID, compile_), fp8_device)
        assert abs(loss - ref_loss) < 1e-2 * ref_loss, (compile_, loss, ref_loss)
        errors = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
        assert max(errors.values()) < 0.2, (compile_, errors)


@pytest.mark.slow
def test_pretrain_gpt2_one_rank_in_float8(fp8_device, data_prefix):
    argv = flags(data_prefix, "--bf16", "--fp8-format", "hybrid", "--distributed-backend", "nccl")
    drop = ("TRITON_INTERPRET", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["CUDA_VISIBLE_DEVICES"] = str(fp8_device.index or 0)
    cmd = [sys.executable, "pretrain_gpt2.py", *argv]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr}"
    assert "> fp8 (hybrid): 8 linears in float8 tensorwise scaling" in done.stdout
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", done.stdout)]
    assert losses and losses[-1] < losses[0], done.stdout[-2000:]
