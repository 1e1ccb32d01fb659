"""Pipeline-parallel schedules: 1F1B and interleaved 1F1B, as static per-stage action lists.

With P stages, V model chunks per stage and M micro batches, stage s runs a list of actions
('F' or 'B', chunk, micro batch) fixed ahead of time (`megatron.pipeline_order`): some warm-up
forwards, then one-forward-one-backward, then the remaining backwards. Activations go to the
next virtual stage and gradients to the previous one with asynchronous sends; a stage blocks
only when it receives, and the time spent waiting there is the pipeline bubble it sees
(timer 'pipeline-wait'). Messages carry a tag naming (direction, receiving virtual stage,
micro batch); every pair of ranks also sends and receives them in the same order
(`megatron.pipeline_order.check_message_order`), which is what NCCL, which ignores tags, needs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron.pipeline_order import pipeline_actions
from megatron.training.timers import NULL_TIMER

FORWARD, BACKWARD = 0, 1


def _tag(kind: int, virtual_stage: int, mb: int) -> int:
    return (kind << 24) | (virtual_stage << 16) | mb


class _Comm:
    def __init__(self, state, shape, dtype, device, timers):
        self.state, self.shape, self.dtype, self.device = state, shape, dtype, device
        self.timers, self.pending = timers, []

    def send(self, tensor: torch.Tensor, dst_stage: int, tag: int) -> None:
        timer = self.timers("pipeline-send", 2) if self.timers else None
        if timer:
            timer.start()
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, self.state.pp_ranks[dst_stage], tag=tag), tensor))
        if timer:
            timer.stop()

    def recv(self, src_stage: int, tag: int) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        timer = self.timers("pipeline-wait", 1) if self.timers else None
        if timer:
            timer.start()
        dist.recv(out, self.state.pp_ranks[src_stage], tag=tag)
        if timer:
            timer.stop()
        return out

    def wait_all(self) -> None:
        for handle, _ in self.pending:
            handle.wait()
        self.pending.clear()


class _SharedBatches:
    """Micro batches read once per step and served to every chunk in micro-batch order."""

    def __init__(self, data_iterator):
        self.source, self.batches = data_iterator, []

    def chunk_iterator(self):
        mb = 0
        while True:
            while len(self.batches) <= mb:
                self.batches.append(next(self.source))
            yield self.batches[mb]
            mb += 1


def forward_backward_pipelining(
    forward_step,
    data_iterator,
    model,
    num_micro_batches,
    *,
    state,
    shape,
    dtype,
    scale_loss=lambda x: x,
    forward_only=False,
    timers=None,
) -> list[dict]:
    """Run one step of the (interleaved when V > 1) 1F1B schedule on this stage.

    `model` holds V chunks (`model[c]`); `shape` is the (micro batch, seq, hidden) activation
    shape. Returns the last stage's per-micro-batch stats (empty on other stages).
    """
    chunks = getattr(model, "module", model)  # DDP-wrapped ModelChunks, or the chunks
    P, s, V, M = state.pp_size, state.pp_rank, len(chunks), num_micro_batches
    if V > 1 and M % P:  # the user-facing rule is validate_training's (megatron/config/rules.py)
        raise ValueError(f"interleaved 1F1B: {M} micro batches are not a multiple of P = {P}")
    comm = _Comm(state, shape, dtype, next(model.parameters()).device, timers)
    run = _Runner(
        chunks, comm, _SharedBatches(data_iterator), forward_step, P, s, M, scale_loss, forward_only
    )
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    with no_sync():
        for kind, c, mb in pipeline_actions(P, s, M, V, forward_only):
            if kind == "F":
                run.forward(c, mb)
            else:
                run.backward(c, mb)
        comm.wait_all()
    return run.stats


class _Runner:
    """Executes one stage's actions; keeps the activations alive between F and B."""

    def __init__(
        self, chunks, comm, batches: _SharedBatches, forward_step, P, s, M, scale_loss, forward_only
    ):
        self.model, self.comm, self.forward_step = chunks, comm, forward_step
        self.iters = [batches.chunk_iterator() for _ in range(len(chunks))]
        self.P, self.s, self.V, self.M = P, s, len(chunks), M
        self.scale_loss, self.forward_only = scale_loss, forward_only
        self.inputs, self.outputs, self.stats = {}, {}, []

    def _virtual(self, c: int) -> int:
        return c * self.P + self.s

    def _timer(self, name: str):
        return self.comm.timers(name, 1) if self.comm.timers else NULL_TIMER

    def forward(self, c: int, mb: int) -> None:
        v, last = self._virtual(c), self.P * self.V - 1
        chunk = self.model[c]
        if v > 0:
            x = self.comm.recv((self.s - 1) % self.P, _tag(FORWARD, v, mb))
            x.requires_grad_(not self.forward_only)
            chunk.set_input_tensor(x)
            self.inputs[(c, mb)] = x
        self._timer("forward-compute").start()
        output, loss_func = self.forward_step(self.iters[c], chunk)
        if v == last:
            loss, micro_stats = loss_func(output)
            self.stats.append(micro_stats)
            output = loss
        self._timer("forward-compute").stop()
        if v != last:
            self.comm.send(output, (self.s + 1) % self.P, _tag(FORWARD, v + 1, mb))
        if not self.forward_only:
            self.outputs[(c, mb)] = output

    def backward(self, c: int, mb: int) -> None:
        v, last = self._virtual(c), self.P * self.V - 1
        output, x = self.outputs.pop((c, mb)), self.inputs.pop((c, mb), None)
        grad = None if v == last else self.comm.recv((self.s + 1) % self.P, _tag(BACKWARD, v, mb))
        self._timer("backward-compute").start()
        if v == last:
            self.scale_loss(output / self.M).backward()
        else:
            torch.autograd.backward(output, grad)
        self._timer("backward-compute").stop()
        if v > 0:
            self.comm.send(x.grad, (self.s - 1) % self.P, _tag(BACKWARD, v - 1, mb))
