"""--torch-compile compiles each model chunk as one module (embedding, layers, head and loss):
no graph break in one process (torch._dynamo.explain), parameter names unchanged; the CUDA graph
and SDPA switches refuse what they cannot run, naming the flag."""

import pytest
import torch

from megatron import mpu
from megatron.config.schema_kernels import KernelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.fused_kernels import select_ops
from megatron.model.attention.sdpa import attention_report, sdpa_choice, sdpa_report
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel, build_model
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from tests.helpers.models import tiny_gpt

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=4,
    untie_embeddings_and_output_weights=True,
)
COMPILED = select_ops(KernelConfig(torch_compile=True), "cpu")


def _model(cfg, recompute=None):
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, 99)
    ctx = BuildContext(seed=3, ops=COMPILED, rng_tracker=tracker)
    return parallelize(GPTModel(cfg, ctx), mpu.single_process_state(), recompute)


@pytest.mark.parametrize(
    "name,extra,recompute,documents",
    [
        ("gpt2, full recompute", {}, "full", False),
        ("llama, selective recompute, documents", LLAMA, "selective", True),
    ],
)
def test_the_whole_chunk_compiles_without_graph_breaks(name, extra, recompute, documents):
    cfg = tiny_gpt(**extra)
    model = _model(cfg, RecomputeConfig(granularity=recompute))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    docs = torch.tensor([[0] * 8 + [1] * 8] * 2) if documents else None
    explained = torch._dynamo.explain(model)(tokens, labels=tokens, document_ids=docs)
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, (name, reasons)


def test_chunks_are_compiled_as_modules_keeping_their_names():
    cfg = tiny_gpt()
    state = mpu.single_process_state()
    plain = build_model(cfg, BuildContext(seed=3))
    model = parallelize(
        build_model(cfg, BuildContext(seed=3)), state, torch_compile=True, compile_backend="eager"
    )
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(chunk._compiled_call_impl is not None for chunk in model.chunks)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    torch.testing.assert_close(model(tokens, labels=tokens), plain(tokens, labels=tokens))
    with pytest.raises(ValueError, match="--enable-cuda-graph needs a CUDA device"):
        parallelize(
            build_model(cfg, BuildContext(seed=3)), state, torch_compile=True, cuda_graph=True
        )
    # the flags CUDA graphs cannot take: tests/training/test_compile.py (config rules)


def test_compiled_ops_leave_norms_and_activations_to_inductor_and_say_so():
    assert (COMPILED.add_norm, COMPILED.bias_gelu, COMPILED.swiglu, COMPILED.softmax) == (
        "torch",
    ) * 4
    assert COMPILED.describe().endswith("torch.compile fuses the torch ops")


def test_sdpa_backend_selects_the_kernel_around_our_calls_and_logs_it():
    q = torch.randn(1, 4, 16, 8)  # (b, heads, s, d)
    assert sdpa_choice("math", q, q, q, is_causal=True) == "math"
    assert sdpa_choice("flash", q, q, q, is_causal=True) == "flash"  # the CPU's flash kernel
    assert sdpa_choice("auto", q, q, q, is_causal=True) == "flash"
    assert sdpa_choice("cudnn", q, q, q, is_causal=True) is None
    line = sdpa_report("auto", 4, 16, 8, torch.float32, "cpu")
    assert line.startswith("SDPA backend: flash (auto: the first of cudnn, flash, efficient, math")
    cfg = tiny_gpt()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    state = mpu.single_process_state()
    losses = {}
    for backend in ("math", "flash", "efficient"):
        ops = select_ops(KernelConfig(sdpa_backend=backend), "cpu")
        model = GPTModel(cfg, BuildContext(seed=3, ops=ops))
        if backend == "efficient":  # no CPU kernel: refused at build, and in the forward
            with pytest.raises(ValueError, match="--sdpa-backend efficient cannot run"):
                attention_report(cfg, ops, state, torch.float32, "cpu")
            with pytest.raises(RuntimeError, match="No viable backend"):
                model(tokens, labels=tokens)
            continue
        assert f"SDPA backend: {backend}" in attention_report(cfg, ops, state, torch.float32, "cpu")
        losses[backend] = model(tokens, labels=tokens)
    torch.testing.assert_close(losses["flash"], losses["math"])
