"""The training step's speed switches on a GPU: `MEGATRON_TEST_DEVICE=cuda pytest
tests/gpu/test_cuda_step.py` (bench/gpu_check.sh). With the default (cpu) the same tests run on
the CPU where that means something, and the CUDA-only parts skip saying why. Covered: steps that
do not log never synchronize with the device (torch.cuda.set_sync_debug_mode("error")), an
inf/NaN step skipped on the device; the whole compiled chunk replayed as CUDA graphs
(--torch-compile --enable-cuda-graph) training like eager; every --sdpa-backend SDPA can run
giving the math backend's loss and gradients, and the one auto picks.
"""

import contextlib
import math

import pytest
import torch
import torch.utils.checkpoint

from megatron.config.schema_kernels import KernelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.fused_kernels import select_ops
from megatron.initialize import Runtime
from megatron.model.attention.sdpa import attention_report
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel, build_model
from megatron.mpu import overlap
from megatron.mpu.parallel_state import single_process_state
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron.optim.plain import plain_optimizer
from megatron.training.learning_rates import AnnealingLR
from megatron.training.step import train_step
from megatron.training.timers import Timers
from tests.helpers.models import tiny_gpt

GPT2 = tiny_gpt(num_attention_heads=4, seq_length=64, make_vocab_size_divisible_by=16)


def needs_cuda(device: torch.device, why: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"CUDA only: {why} (MEGATRON_TEST_DEVICE=cuda runs it)")


def _trainer(device, kernels: KernelConfig, dtype=torch.bfloat16):
    """step(poison: bool) -> (loss, updated?, grad norm), device values; and the model."""
    state = single_process_state()
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, 1)
    rt = Runtime(state=state, device=device, rng_tracker=tracker)
    ops = select_ops(kernels, device)
    ctx = BuildContext(state, seed=1, device=device, dtype=dtype, rng_tracker=tracker, ops=ops)
    model = parallelize(
        build_model(GPT2, ctx),
        state,
        torch_compile=kernels.torch_compile,
        compile_backend=kernels.torch_compile_backend,
        cuda_graph=kernels.enable_cuda_graph,
    )
    ddp = DistributedDataParallel(model, None)
    opt = plain_optimizer(
        model, OptimizerConfig(lr=1e-3), params_dtype=dtype, state=state, clip_grad=1.0
    )
    sched = AnnealingLR(opt.optimizer, max_lr=1e-3, warmup_steps=2, decay_steps=100)
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, GPT2.vocab_size, (16, 4, GPT2.seq_length + 1), generator=g)
    batches = [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in text]  # made up front
    timers, calls = Timers(0, device), {"n": 0}

    def step(poison: bool = False):
        def forward_step(_, chunk):
            tokens, labels = batches[calls["n"] % len(batches)]
            calls["n"] += 1

            def loss_func(per_token):
                loss = per_token.mean() * (math.nan if poison else 1.0)
                return loss, {"lm loss": loss.detach()}

            return chunk(tokens, labels=labels), loss_func

        result = train_step(forward_step, None, ddp, opt, sched, 2, rt, timers)
        return result["lm_loss"], result["updated"], result["grad_norm"]

    return step, model


def test_steps_that_do_not_log_never_wait_for_the_device(test_device):
    step, model = _trainer(test_device, KernelConfig())
    step(), step()  # warm-up: Triton's first launches, Adam's state
    on_cuda = test_device.type == "cuda"
    if on_cuda:
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        results = [step(), step(poison=True)]
        before = [p.detach().clone() for p in model.parameters()]
        results.append(step(poison=True))
        after = [p.detach().clone() for p in model.parameters()]
        results.append(step())
    finally:
        if on_cuda:
            torch.cuda.set_sync_debug_mode(0)
    updated = [bool(u) for _, u, _ in results]
    assert updated == [True, False, False, True]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "skip moved"
    assert math.isfinite(float(results[-1][0])) and math.isnan(float(results[1][2]))


@pytest.mark.slow  # Inductor compiles the forward and backward (about a minute)
def test_cuda_graphs_of_the_compiled_chunk_train_like_eager(test_device):
    needs_cuda(test_device, "CUDA graphs")
    losses = {}
    for name, kernels in {
        "eager": KernelConfig(),
        "compiled + CUDA graphs": KernelConfig(torch_compile=True, enable_cuda_graph=True),
    }.items():
        step, _ = _trainer(test_device, kernels)
        losses[name] = [float(step()[0]) for _ in range(6)]
    eager, graphs = losses["eager"], losses["compiled + CUDA graphs"]
    assert len(set(graphs)) > 1, f"the compiled run must train: {graphs}"
    torch.testing.assert_close(graphs, eager, rtol=2e-2, atol=0)  # bf16 rounding of the fusions


def test_each_sdpa_backend_that_runs_gives_the_math_backends_loss_and_gradients(test_device):
    dtype = torch.bfloat16 if test_device.type == "cuda" else torch.float32
    tokens = torch.randint(0, GPT2.vocab_size, (2, GPT2.seq_length), device=test_device)
    state, results, refused = single_process_state(), {}, {}
    for backend in ("math", "cudnn", "flash", "efficient", "auto"):
        ops = select_ops(KernelConfig(sdpa_backend=backend), test_device)
        try:
            report = attention_report(GPT2, ops, state, dtype, test_device)
        except ValueError as e:
            refused[backend] = str(e)
            continue
        model = GPTModel(GPT2, BuildContext(seed=3, device=test_device, dtype=dtype, ops=ops))
        loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        results[backend] = (report, loss.detach(), grads)
    assert "math" in results and "auto" in results, refused
    chosen = results["auto"][0].split()[2]  # "SDPA backend: <name> (auto: ..."
    assert chosen in results, f"auto picked {chosen}, which its own named run refused"
    if test_device.type == "cuda":
        assert chosen != "math", f"auto fell back to the math kernel on a GPU: {results['auto']}"
    _, loss0, grads0 = results["math"]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for backend, (report, loss, grads) in results.items():
        assert backend == "auto" or f"SDPA backend: {backend}" in report, report
        torch.testing.assert_close(loss, loss0, rtol=tol, atol=tol, msg=backend)
        for name, g in grads.items():
            scale = grads0[name].abs().max().clamp_min(1e-6)
            err = (g - grads0[name]).abs().max()
            assert err <= 5 * tol * scale, f"{backend} {name}: {err:.3g} vs {scale:.3g}"


_PAIRS = overlap.PairOverlap()  # what _HandOver hands over through


class _HandOver(torch.autograd.Function):
    """An identity passing the turn in its forward and backward, as the MoE all-to-all does."""

    @staticmethod
    def forward(ctx, x):
        _PAIRS.hand_over()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _PAIRS.hand_over()  # on CUDA: in autograd's device thread, the backward's side
        return grad


def _dropout_mlp(layers, x, out, recompute=False):
    def block(layer, h):
        return torch.nn.functional.dropout(_HandOver.apply(layer(h)), 0.3)

    def run():
        h = x
        for layer in layers:
            if recompute:  # its backward redraws the masks from the saved generator state
                h = torch.utils.checkpoint.checkpoint(block, layer, h, use_reentrant=False)
            else:
                h = block(layer, h)
        out.append(h)

    return run


def test_an_overlapped_pair_on_the_device_computes_what_the_sequential_order_does(test_device):
    """DualPipeV's pair (megatron.mpu.overlap): the forward of one micro batch and the backward
    of another, turns passed at every layer, with dropout on the device's generator and the
    backward recomputing its layers (their masks redrawn from the saved generator state while
    the forward draws new ones). Equal to forward then backward: the output, every gradient,
    the generator after. On CUDA also: the
    backward's thread works on the caller's stream (a side stream here)."""
    cuda = test_device.type == "cuda"
    results = []
    for paired in (False, True):
        stream = torch.cuda.Stream(test_device) if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            torch.manual_seed(0)
            layers = [torch.nn.Linear(32, 32).to(test_device) for _ in range(3)]
            x1, x2 = (torch.randn(8, 32, device=test_device) for _ in range(2))
            first, out, seen = [], [], {}
            _dropout_mlp(layers, x1, first, recompute=True)()
            loss = first[0].square().sum()

            def backward(loss=loss, seen=seen):
                seen["stream"] = torch.cuda.current_stream(test_device) if cuda else None
                loss.backward()

            if paired:
                _PAIRS.run(_dropout_mlp(layers, x2, out), backward, device=test_device)
            else:
                _dropout_mlp(layers, x2, out)()
                backward()
            generator = torch.cuda.get_rng_state(test_device) if cuda else torch.get_rng_state()
        if cuda:
            torch.cuda.synchronize(test_device)
            assert seen["stream"] == stream
        grads = [p.grad for layer in layers for p in layer.parameters()]
        results.append([out[0], *grads, generator])
    for sequential, paired in zip(*results, strict=True):
        assert torch.equal(sequential.cpu(), paired.cpu())
