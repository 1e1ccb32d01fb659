"""Forward/backward schedules behind one contract, chosen by the parallel layout.

    forward_step(data_iterator, model) -> (output, loss_func)
    loss_func(output) -> (loss, stats)

`output` is what the model chunk returned (hidden states on all but the last pipeline stage);
`loss_func` is applied on the last stage only and gives the micro batch's scalar loss and a
dict of detached scalars to report. Every schedule runs `num_micro_batches` micro batches,
scales each loss by 1 / num_micro_batches (gradients of the global-batch mean) and by the fp16
loss scale, and returns the last stage's stats. Gradients are all-reduced over DP only once
complete: during the last micro batch's backward (the model's `no_sync` before it), and with
pipelining per bucket once every chunk holding its parameters ran its last backward or W.

- no pipelining: gradient accumulation (PP = 1; also the DeepSpeed engine's micro-batch loop)
- 1F1B: megatron.training.pipeline (PP > 1)
- interleaved 1F1B: megatron.training.pipeline with V model chunks
  (--num-layers-per-virtual-pipeline-stage)
- zero bubble (ZB-H1, ZBV, DualPipeV): megatron.training.pipeline, each backward split
  into the input gradient and a later weight gradient (megatron.mpu.weight_grad)
- any other schedule registered in megatron.schedules.registry: the same executor, its list
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from megatron.training.pipeline import forward_backward_pipelining


def forward_backward_no_pipelining(
    forward_step: Callable,
    data_iterator,
    model,
    num_micro_batches: int,
    *,
    scale_loss: Callable = lambda loss: loss,
    forward_only: bool = False,
    timers=None,
    engine: bool = False,
) -> list[dict]:
    """Gradient accumulation over micro batches on one pipeline stage.

    `model` is our DDP by default: forward_step gets its (only) model chunk, each loss is
    scaled by 1 / num_micro_batches and the fp16 loss scale before backward, and the DP
    all-reduce waits for the last micro batch (`no_sync`). `engine=True`: `model` is a DeepSpeed
    engine, which forward_step calls as it is, and whose backward(loss) + step() do the scaling,
    accumulation and all-reduce themselves (step() only updates at the accumulation boundary).
    """
    if engine:
        no_sync, chunk = contextlib.nullcontext, model

        def backward(loss):
            model.backward(loss)
            model.step()
    else:
        no_sync = getattr(model, "no_sync", contextlib.nullcontext)
        chunk = getattr(model, "module", model)
        chunk = chunk[0] if hasattr(chunk, "chunks") else chunk
        chunk = getattr(model, "forward_chunk", chunk)  # --DDP-impl torch: through torch DDP

        def backward(loss):
            scale_loss(loss / num_micro_batches).backward()

    stats = []
    for i in range(num_micro_batches):
        last = i == num_micro_batches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            if timers:
                timers("forward-compute", 1).start()
            output, loss_func = forward_step(data_iterator, chunk)
            loss, micro_stats = loss_func(output)
            if timers:
                timers("forward-compute", 1).stop()
            stats.append(micro_stats)
            if not forward_only:
                if timers:
                    timers("backward-compute", 1).start()
                backward(loss)
                if timers:
                    timers("backward-compute", 1).stop()
    return stats


def get_forward_backward_func(
    state,
    *,
    micro_batch_size: int,
    seq_length: int,
    hidden_size: int,
    dtype,
    schedule: str | None = None,
    overlap: bool = False,
) -> Callable:
    """The schedule for this layout, with the pipeline's activation shape bound: (b, s, h), or
    with sequence parallelism this TP rank's slice (b, s / tp, h), which is all a stage sends.
    `schedule`: --pipeline-schedule (None: 1F1B, or interleaved with model chunks); `overlap`:
    DualPipeV's forward / backward pairs overlapped (megatron.training.pipeline)."""
    if state.pp_size == 1:
        return forward_backward_no_pipelining
    if state.sequence_parallel:
        seq_length //= state.tp_size  # the rules checked that TP divides it
    return functools.partial(
        forward_backward_pipelining,
        state=state,
        shape=(micro_batch_size, seq_length, hidden_size),
        dtype=dtype,
        schedule=schedule,
        overlap=overlap,
    )
