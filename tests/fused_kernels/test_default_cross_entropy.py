"""--cross-entropy-loss-fusion is on by default where the Triton kernel runs (a CUDA device, or
Triton's interpreter on the CPU) and torch elsewhere, logged; under --torch-compile the kernel
runs between the compiled graphs and gives the eager torch loss and gradients."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.schema_kernels import KernelConfig  # noqa: E402
from megatron.fused_kernels import select_ops  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from tests.helpers.models import tiny_gpt  # noqa: E402
from tests.helpers.training import BASE  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)


def test_the_triton_cross_entropy_is_the_default_where_it_runs(monkeypatch):
    assert parse_args(BASE, world_size=1).kernels.cross_entropy_loss_fusion
    for argv in (["--cross-entropy-loss-fusion"], []):
        assert parse_args(BASE + argv, world_size=1).kernels.cross_entropy_loss_fusion
    off = parse_args(BASE + ["--no-cross-entropy-loss-fusion"], world_size=1).kernels
    assert select_ops(off, "cpu").cross_entropy == "torch"
    ops = select_ops(KernelConfig(), "cpu")  # the interpreter counts as a place it runs
    assert ops.cross_entropy == "triton" and "cross-entropy = triton" in ops.describe()
    v1 = KernelConfig(fp16_lm_cross_entropy=True)  # the loss in the logits' dtype: torch's
    assert select_ops(v1, "cpu").cross_entropy == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")  # a CPU run: torch
    assert select_ops(KernelConfig(), "cpu").cross_entropy == "torch"


def test_under_torch_compile_the_kernel_runs_between_graphs_with_eager_results():
    cfg = tiny_gpt(hidden_size=32, num_attention_heads=4, seq_length=12)
    ops = select_ops(KernelConfig(torch_compile=True), "cpu")
    assert (ops.cross_entropy, ops.add_norm) == ("triton", "torch")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    eager = GPTModel(cfg, BuildContext(seed=3))
    compiled = GPTModel(cfg, BuildContext(seed=3, ops=ops))
    explained = torch._dynamo.explain(compiled)(tokens, labels=tokens)
    assert explained.graph_count == 1 and len(explained.break_reasons) == 1  # at the loss
    compiled.compile(backend="aot_eager")
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
