"""The CUDA varlen kernels of packed documents (model/attention/varlen_cuda.py) against the CPU
reference (SDPA once per document in float64): outputs and gradients, for every kernel this
machine has. `MEGATRON_TEST_DEVICE=cuda pytest tests/gpu/test_cuda_varlen.py`; on the CPU each
test skips saying why."""

import pytest
import torch

from megatron.fused_kernels import FusedOps
from megatron.model.attention import varlen_cuda
from megatron.model.attention.backends import choose_backend
from megatron.model.attention.core import CoreAttention
from megatron.model.attention.varlen import flatten_heads, unflatten_heads, varlen_mask
from megatron.model.attention.varlen_sdpa import SDPA_DOCUMENTS
from megatron.model.context import BuildContext
from tests.helpers.attention import PACKED, document_ids

AVAILABLE = {
    "varlen_attn": varlen_cuda._torch_varlen,
    "flash_attn": varlen_cuda._flash_attn,
    "flex attention": varlen_cuda._flex,
}
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 32, 64, generator=g, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize(
    "kernel,dtype",
    [
        ("varlen_attn", torch.bfloat16),
        ("flash_attn", torch.bfloat16),
        ("flex attention", torch.float32),
        ("flex attention", torch.bfloat16),
    ],
)
def test_cuda_varlen_kernel_equals_the_cpu_reference(kernel, dtype, test_device):
    if test_device.type != "cuda":
        pytest.skip("CUDA only: the varlen kernels (MEGATRON_TEST_DEVICE=cuda runs it)")
    if AVAILABLE[kernel]() is None:
        pytest.skip(f"{kernel} is not in this environment")
    core = CoreAttention(BuildContext(ops=FusedOps()), 0.0)
    q, k, v, dout = _inputs()
    ids = document_ids(PACKED)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = SDPA_DOCUMENTS.attend(core, *ref_in, varlen_mask(ids), 0.0)
    ref.backward(dout)
    got_in = [t.to(test_device, dtype).requires_grad_() for t in (q, k, v)]
    mask = varlen_mask(ids.to(test_device))
    flat = [flatten_heads(t) for t in got_in]
    out = unflatten_heads(varlen_cuda.KERNELS[kernel](core, *flat, mask.data, 0.0), 2)
    out.backward(dout.to(test_device, dtype))
    for name, a, b in [
        ("out", out, ref),
        *zip("qkv", (t.grad for t in got_in), (t.grad for t in ref_in), strict=True),
    ]:
        err = (a.detach().double().cpu() - b.detach()).abs().max()
        assert err <= TOL[dtype] * b.detach().abs().max(), f"{kernel} {name}: {err:.3g}"


def test_a_varlen_mask_on_cuda_runs_a_varlen_kernel(test_device):
    if test_device.type != "cuda":
        pytest.skip("CUDA only: the varlen kernels (MEGATRON_TEST_DEVICE=cuda runs it)")
    core = CoreAttention(BuildContext(ops=FusedOps()), 0.0)
    q = torch.randn(2, 4, 32, 64, device=test_device, dtype=torch.bfloat16)
    mask = varlen_mask(document_ids(PACKED).to(test_device))
    assert varlen_cuda.cuda_varlen_kernel(torch.bfloat16, 64, 0.0) is not None
    assert choose_backend(core, mask, q).name == "cuda varlen"
