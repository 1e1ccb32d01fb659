"""Forward/backward schedules. One contract for all of them:

    forward_step(data_iterator, model) -> (loss, stats)

where `loss` is the scalar to minimise for one micro batch and `stats` a dict of detached
scalars to report. The schedule runs `num_micro_batches` of them, scales each loss by
1 / num_micro_batches (so gradients are those of the global-batch mean) and by the fp16 loss
scale, and returns the per-micro-batch stats. Gradients are all-reduced over DP only after the
last micro batch (the model's `no_sync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable


def forward_backward_no_pipelining(
    forward_step: Callable,
    data_iterator,
    model,
    num_micro_batches: int,
    *,
    scale_loss: Callable = lambda loss: loss,
    forward_only: bool = False,
    timers=None,
) -> list[dict]:
    """Gradient accumulation over micro batches on one pipeline stage."""
    stats = []
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for i in range(num_micro_batches):
        last = i == num_micro_batches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            if timers:
                timers("forward-compute", 1).start()
            loss, micro_stats = forward_step(data_iterator, model)
            if timers:
                timers("forward-compute", 1).stop()
            stats.append(micro_stats)
            if not forward_only:
                if timers:
                    timers("backward-compute", 1).start()
                scale_loss(loss / num_micro_batches).backward()
                if timers:
                    timers("backward-compute", 1).stop()
    return stats
