"""The whole model through the Triton kernels (on the CPU, in Triton's interpreter) gives the
same loss and gradients as the torch path; the fused cross-entropy composes with TP."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron import mpu  # noqa: E402
from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_kernels import KernelConfig  # noqa: E402
from megatron.fused_kernels import TORCH_OPS, FusedOps, select_ops  # noqa: E402
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.models import LLAMA

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

BASE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=12,
    vocab_size=60,
    make_vocab_size_divisible_by=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
VARIANTS = {
    "gpt2": BASE,
    "llama": dataclasses.replace(
        BASE,
        **LLAMA,
        num_query_groups=2,
    ),
}


KERNELS = KernelConfig()
FUSED = KernelConfig(attention_backend="fused", cross_entropy_loss_fusion=True)


def test_dispatch_picks_triton_under_the_interpreter_and_torch_without_it(monkeypatch):
    ops = select_ops(FUSED, torch.device("cpu"))
    assert (ops.softmax, ops.add_norm, ops.bias_gelu, ops.swiglu, ops.cross_entropy) == (
        "triton",
    ) * 5
    assert "add+norm = triton" in ops.describe()
    off = dataclasses.replace(KERNELS, layer_norm_fusion=False, bias_gelu_fusion=False)
    assert select_ops(off, torch.device("cpu")).add_norm == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert select_ops(KERNELS, torch.device("cpu")) == TORCH_OPS
    with pytest.raises(ValueError, match="--attention-backend fused"):
        select_ops(FUSED, torch.device("cpu"))


def _failing_checks(monkeypatch):
    """Triton 'runs' here, the add+norm check raises, the bias+gelu one disagrees."""
    from megatron import fused_kernels
    from megatron.fused_kernels import checks

    def compile_error(device):
        raise OSError("ptxas: not found")

    monkeypatch.setattr(fused_kernels, "triton_available", lambda device: True)
    fake = {op: (lambda device: True) for op in checks.CHECKS["triton"]}
    fake.update(add_norm=compile_error, bias_gelu=lambda device: False)
    monkeypatch.setattr(checks, "CHECKS", {**checks.CHECKS, "triton": fake})


def test_a_kernel_failing_its_check_warns_and_falls_back_by_default(monkeypatch):
    _failing_checks(monkeypatch)
    monkeypatch.delenv("MEGATRON_KERNELS_STRICT", raising=False)
    with pytest.warns(UserWarning) as warned:
        ops = select_ops(KERNELS, "cpu")
    assert [str(w.message) for w in warned] == [
        "Triton add_norm kernel unavailable on cpu (OSError: ptxas: not found); using the torch "
        "implementation",
        "Triton bias_gelu kernel disagrees with torch on cpu; using the torch implementation",
    ]
    assert (ops.add_norm, ops.bias_gelu, ops.swiglu) == ("torch", "torch", "triton")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_mode_raises_with_the_original_error_instead(monkeypatch, how):
    _failing_checks(monkeypatch)
    strict = {"strict": True} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("MEGATRON_KERNELS_STRICT", "1")
    with pytest.raises(RuntimeError, match="add_norm kernel unavailable.*strict mode") as e:
        select_ops(KERNELS, "cpu", **strict)
    assert isinstance(e.value.__cause__, OSError)
    off = dataclasses.replace(KERNELS, layer_norm_fusion=False)
    with pytest.raises(RuntimeError, match="bias_gelu kernel disagrees with torch.*strict mode"):
        select_ops(off, "cpu", **strict)
    monkeypatch.setenv("MEGATRON_KERNELS_STRICT", "yes")
    with pytest.raises(ValueError, match="MEGATRON_KERNELS_STRICT='yes': use 1"):
        select_ops(KERNELS, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_model_through_triton_kernels_equals_the_torch_path(name):
    cfg = VARIANTS[name]
    tokens = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    variants = [None, select_ops(FUSED, "cpu"), FusedOps(attention_backend="unfused")]
    if importlib.util.find_spec("liger_kernel") is not None:  # Liger's SwiGLU (its norms: ours)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Liger's norms cannot run in the interpreter
            variants.append(select_ops(dataclasses.replace(FUSED, kernel_library="liger"), "cpu"))
    for ops in variants:
        model = GPTModel(cfg, BuildContext(seed=5, ops=ops))
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (ref_loss, ref_grads), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def _ce_worker(rank, world):
    from megatron.fused_kernels.triton_cross_entropy import vocab_parallel_cross_entropy_fused

    state = initialize_model_parallel(world, 1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 32, generator=g)
    logits[:, -3:] = float("-inf")  # padded vocab rows, as the model masks them
    target = torch.randint(0, 29, (5,), generator=g)
    local = mpu.shard(logits, -1, state.tp_rank, world).requires_grad_()
    ref_local = local.detach().clone().requires_grad_()
    fused = vocab_parallel_cross_entropy_fused(local, target, state.tp_group)
    ref = mpu.vocab_parallel_cross_entropy(ref_local, target, state.tp_group)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
    fused.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(local.grad, ref_local.grad, rtol=1e-5, atol=1e-6)
    destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_fused_cross_entropy_composes_with_tensor_parallelism():
    assert run_distributed(_ce_worker, 2) == [True, True]
