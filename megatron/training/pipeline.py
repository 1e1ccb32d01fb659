"""Pipeline-parallel schedules as static per-stage action lists: 1F1B, interleaved 1F1B,
and the zero-bubble ones (ZB-H1, ZBV, DualPipeV).

With P stages, V model chunks per stage and M micro batches, stage s runs a list of actions
('F', 'B' or 'W', chunk, micro batch) fixed ahead of time by the schedule's object
(`megatron.schedules`, which also says which virtual stage each chunk is). Activations go to
the next virtual stage and gradients to the previous one with asynchronous sends (a hand-over
within the stage, at the bottom of a V, sends nothing); a stage blocks only when it receives,
and the time spent waiting there is the pipeline bubble it sees (timer 'pipeline-wait').
Messages carry a tag naming (direction, receiving virtual stage, micro batch), and a stage
posts its receives from a peer in the order that peer sends (`PipelineSchedule.messages`), so a
backend that ignores tags (NCCL) pairs them right too. NCCL also blocks a stream's later
operations behind a send until the peer receives it, and runs a stage pair's sends and receives
on one stream per group: two stages each sending to the other before receiving (1F1B's steady
state, a V's turns) would wait for each other for ever. So sends to a later stage use one group
(`pp_up_group`) and sends to an earlier stage another (`pp_down_group`): each carries one
direction between two stages, its receives posted in its sends' order.

Zero-bubble schedules: for their step the chunks' layers are given a WeightGradSplit
(megatron.mpu.weight_grad), with which they build ops whose weight gradients can wait; a 'B'
computes the input gradient and queues, per (chunk, micro batch), what the weight gradients
need; its 'W' computes them later. A 'B' with no 'W' in the list (1F1B, DualPipeV's full
backwards) runs its queue at once. The weight gradients reach `.grad` and the DDP hooks in the
order the W's run.

DualPipeV with `overlap` (expert-parallel all-to-alls to hide, megatron.training.step): each
steady-state pair, a forward and the full backward of the other chunk
(`PipelineSchedule.overlapped_pairs`), receives both its inputs, then runs the forward
here and the backward in a second thread, taking turns at the MoE all-to-alls (a PairOverlap,
megatron.mpu.overlap, whose hand-over the chunks' MoE layers are given for the step); the
forward's output is sent when it ends, the backward's input gradient when it ends but never
before the forward's (the peer receives in list order). The pair is timed as one
('forward-backward-overlap'), its two halves interleaving.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron.mpu.overlap import PairOverlap
from megatron.mpu.random import RNGStatesTracker
from megatron.mpu.weight_grad import WeightGradSplit, run_weight_grads
from megatron.schedules.base import PipelineSchedule
from megatron.schedules.registry import get_schedule, resolve_schedule
from megatron.training.timers import NULL_TIMER

FORWARD, BACKWARD = 0, 1


def _tag(kind: int, virtual_stage: int, mb: int) -> int:
    return (kind << 24) | (virtual_stage << 16) | mb


def _message_tag(message: tuple) -> int:
    kind, v, mb = message
    return _tag(FORWARD if kind == "F" else BACKWARD, v, mb)


class _Comm:
    """Sends asynchronously; receives from each peer in the order it sends (`expected`)."""

    def __init__(self, state, shape, dtype, device, timers, expected):
        self.state, self.shape, self.dtype, self.device = state, shape, dtype, device
        self.timers, self.pending, self.quiet = timers, [], False  # quiet: inside a pair
        self.expected = expected  # peer stage -> its messages to this stage, in send order
        self.posted = {}  # message -> (handle, buffer)
        self.local = {}  # message -> tensor handed over within this stage

    def send(self, tensor: torch.Tensor, dst_stage: int, message: tuple) -> None:
        tensor = tensor.detach()
        if dst_stage == self.state.pp_rank:
            self.local[message] = tensor
            return
        timer = self.timers("pipeline-send", 2) if self.timers and not self.quiet else None
        if timer:
            timer.start()
        tensor = tensor.contiguous()
        rank, group = self.state.pp_ranks[dst_stage], self._group(self.state.pp_rank, dst_stage)
        handle = dist.isend(tensor, rank, group=group, tag=_message_tag(message))
        # keep a sent tensor alive until its send completes, not to the end of the step
        self.pending = [(h, t) for h, t in self.pending if not h.is_completed()]
        self.pending.append((handle, tensor))
        if timer:
            timer.stop()

    def recv(self, src_stage: int, message: tuple) -> torch.Tensor:
        if src_stage == self.state.pp_rank:
            return self.local.pop(message).clone()
        queue = self.expected[src_stage]
        while message not in self.posted:  # post the peer's earlier messages first
            early = queue.pop(0)
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            rank, group = self.state.pp_ranks[src_stage], self._group(src_stage, self.state.pp_rank)
            self.posted[early] = (dist.irecv(out, rank, group=group, tag=_message_tag(early)), out)
        handle, out = self.posted.pop(message)
        timer = self.timers("pipeline-wait", 1) if self.timers else None
        if timer:
            timer.start()
        handle.wait()
        if timer:
            timer.stop()
        return out

    def _group(self, src_stage: int, dst_stage: int):
        """The group carrying src -> dst: one per direction (None: the default group, for a
        state built without them)."""
        if dst_stage > src_stage:
            return self.state.pp_up_group
        return self.state.pp_down_group

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
    schedule: str | PipelineSchedule | None = None,
    overlap: bool = False,
) -> list[dict]:
    """Run one step of `schedule` (a name or the object; default: 1F1B, interleaved when
    V > 1) on this stage.

    `model` holds V chunks (`model[c]`); `shape` is the (micro batch, seq, hidden) activation
    shape. `overlap`: run DualPipeV's forward / backward pairs overlapped. Returns the last
    virtual stage's per-micro-batch stats (empty on other stages).
    """
    chunks = getattr(model, "module", model)  # DDP-wrapped ModelChunks, or the chunks
    P, s, V, M = state.pp_size, state.pp_rank, len(chunks), num_micro_batches
    schedule = resolve_schedule(schedule, chunked=V > 1)
    if schedule.whole_rounds and M % P:  # the user-facing rule is in megatron/config
        raise ValueError(f"{schedule}: {M} micro batches are not a multiple of P = {P}")
    actions = schedule.actions(P, s, M, V, forward_only)
    sent = schedule.messages(P, M, V, forward_only)[0]
    expected = {src: list(sent.get((src, s), [])) for src in range(P)}
    comm = _Comm(state, shape, dtype, next(model.parameters()).device, timers, expected)
    run = _Runner(chunks, comm, _SharedBatches(data_iterator), forward_step, schedule, M)
    run.scale_loss, run.forward_only = scale_loss, forward_only
    run.deferred = {(c, mb) for kind, c, mb in actions if kind == "W"}
    split = schedule.split_backward and not forward_only
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    reduce = _GradSync(model, chunks, actions) if not forward_only else None
    pairs = (
        schedule.overlapped_pairs(actions, s == P - 1) if overlap and not forward_only else set()
    )
    with no_sync(), run.modes(split=split, overlap=bool(pairs)):
        _run_actions(run, actions, pairs, reduce)
        comm.wait_all()
    return run.stats


def _run_actions(run: _Runner, actions: list, pairs: set, reduce: _GradSync | None) -> None:
    i = 0
    while i < len(actions):
        kind, c, mb = actions[i]
        if i in pairs:  # this forward and the next action, a full backward, overlapped
            run.pair((c, mb), actions[i + 1][1:])
            done = (i, i + 1)
        else:
            getattr(run, {"F": "forward", "B": "backward", "W": "weight"}[kind])(c, mb)
            done = (i,)
        for j in done:
            if reduce is not None:
                reduce.after(j)
        i += len(done)


class _GradSync:
    """Starts the DP reduction of the buckets whose every parameter has its last gradient of
    the step: after the last B or W of each chunk (`start_grad_sync`, our DDP with
    --overlap-grad-reduce); a parameter two chunks share (the V's tied embedding) waits for
    both. The rest is launched by the step's finish_grad_sync."""

    def __init__(self, model, chunks, actions):
        self.start = getattr(model, "start_grad_sync", None)
        last = {}
        for i, (kind, c, _) in enumerate(actions):
            if kind in ("B", "W"):
                last[c] = i
        self.last = {i: c for c, i in last.items()}
        self.owners = {}
        for c in range(len(chunks)):
            for p in chunks[c].parameters():
                self.owners.setdefault(id(p), set()).add(c)
        self.finished, self.done = set(), set()

    def after(self, i: int) -> None:
        if self.start is None or i not in self.last:
            return
        self.finished.add(self.last[i])
        self.done = {p for p, owners in self.owners.items() if owners <= self.finished}
        self.start(self.done)


def _trackers(chunks) -> list[RNGStatesTracker]:
    """The chunks' named RNG streams (megatron.mpu.random), each once."""
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            tracker = getattr(module, "rng_tracker", None)
            if isinstance(tracker, RNGStatesTracker):
                found[id(tracker)] = tracker
    return list(found.values())


def _modes_of(chunks) -> tuple[WeightGradSplit, PairOverlap]:
    """The weight-gradient split and the pair overlap these chunks are given in their steps:
    made at the first step and kept with the first chunk, so that every step gives the layers
    the same objects (a compiled chunk's guards then see one object, not a new one a step)."""
    kept = vars(chunks[0]).get("_pipeline_modes")
    if kept is None:
        kept = vars(chunks[0])["_pipeline_modes"] = (WeightGradSplit(), PairOverlap())
    return kept


class _Runner:
    """Executes one stage's actions; keeps the activations alive between F and B, and the
    queued weight-gradient work between B and W."""

    def __init__(self, chunks, comm, batches: _SharedBatches, forward_step, schedule, M):
        self.model, self.comm, self.forward_step = chunks, comm, forward_step
        self.iters = [batches.chunk_iterator() for _ in range(len(chunks))]
        self.schedule, self.P, self.s = (
            get_schedule(schedule),
            comm.state.pp_size,
            comm.state.pp_rank,
        )
        self.V, self.M, self.last = len(chunks), M, comm.state.pp_size * len(chunks) - 1
        self.scale_loss, self.forward_only, self.deferred = (lambda x: x), False, set()
        self.inputs, self.outputs, self.stats, self.weights = {}, {}, [], {}
        self.in_pair = False  # the halves of an overlapped pair are not timed apart
        self.trackers = _trackers(chunks)  # swapped with the generators at each hand-over
        # a zero-bubble step's deferred W's and DualPipeV's overlapped pairs (modes())
        self.weight_grads, self.overlap = _modes_of(chunks)

    def modes(self, split: bool, overlap: bool) -> contextlib.ExitStack:
        """The step's modes, given to the chunks' layers that take them for as long as it runs:
        `split`, the weight-gradient split (linears, experts, embedding); `overlap`, the pairs'
        hand-over (the MoE layers' token all-to-alls)."""
        stack = contextlib.ExitStack()
        for chunk in self.model:
            if split:
                stack.enter_context(self.weight_grads.given_to(chunk))
            if overlap:
                stack.enter_context(self.overlap.given_to(chunk))
        return stack

    def _virtual(self, c: int) -> int:
        return self.schedule.virtual_stage(self.P, self.s, c)

    def _stage(self, v: int) -> int:
        return self.schedule.stage_of(self.P, v)[0]

    def _timer(self, name: str):
        return self.comm.timers(name, 1) if self.comm.timers and not self.in_pair else NULL_TIMER

    def forward(self, c: int, mb: int) -> None:
        self._forward(c, mb, self._input(c, mb))

    def backward(self, c: int, mb: int) -> None:
        self._backward(c, mb, self._output_grad(c, mb), self.comm.send)

    def _input(self, c: int, mb: int) -> torch.Tensor | None:
        """The previous virtual stage's activation (None on the first virtual stage)."""
        v = self._virtual(c)
        if v == 0:
            return None
        x = self.comm.recv(self._stage(v - 1), ("F", v, mb))
        return x.requires_grad_(not self.forward_only)

    def _output_grad(self, c: int, mb: int) -> torch.Tensor | None:
        """The next virtual stage's gradient (None on the last virtual stage: the loss)."""
        v = self._virtual(c)
        return None if v == self.last else self.comm.recv(self._stage(v + 1), ("B", v, mb))

    def _forward(self, c: int, mb: int, x: torch.Tensor | None) -> None:
        v = self._virtual(c)
        chunk = self.model[c]
        if x is not None:
            chunk.set_input_tensor(x)
            self.inputs[(c, mb)] = x
        self._timer("forward-compute").start()
        output, loss_func = self.forward_step(self.iters[c], chunk)
        if v == self.last:
            loss, micro_stats = loss_func(output)
            self.stats.append(micro_stats)
            output = loss
        self._timer("forward-compute").stop()
        if v != self.last:
            self.comm.send(output, self._stage(v + 1), ("F", v + 1, mb))
        if not self.forward_only:
            self.outputs[(c, mb)] = output

    def _backward(self, c: int, mb: int, grad, send) -> None:
        v = self._virtual(c)
        output, x = self.outputs.pop((c, mb)), self.inputs.pop((c, mb), None)
        self._timer("backward-compute").start()
        queue = []
        with self.weight_grads.deferring(queue):
            if v == self.last:
                self.scale_loss(output / self.M).backward()
            else:
                torch.autograd.backward(output, grad)
        self._timer("backward-compute").stop()
        if v > 0:
            send(x.grad, self._stage(v - 1), ("B", v - 1, mb))
        if (c, mb) in self.deferred:
            self.weights[(c, mb)] = queue
        else:  # a full backward: its weight gradients now
            self._run_weights(queue)

    def pair(self, f: tuple[int, int], b: tuple[int, int]) -> None:
        """F(f) and the full B(b) of the other chunk, overlapped (module docstring)."""
        x, grad = self._input(*f), self._output_grad(*b)
        held, forward_sent = [], []

        def send_after_forward(*message) -> None:  # the peers receive in list order: F, B
            if forward_sent:
                self.comm.send(*message)
            else:
                held.append(message)

        def forward() -> None:
            self._forward(*f, x)
            forward_sent.append(True)
            for message in held:
                self.comm.send(*message)

        timer = self._timer("forward-backward-overlap")
        timer.start()
        self.in_pair = self.comm.quiet = True
        try:
            self.overlap.run(
                forward,
                lambda: self._backward(*b, grad, send_after_forward),
                self.trackers,
                self.comm.device,
            )
        finally:
            self.in_pair = self.comm.quiet = False
        timer.stop()

    def weight(self, c: int, mb: int) -> None:
        self._run_weights(self.weights.pop((c, mb)))

    def _run_weights(self, queue: list) -> None:
        if not queue:
            return
        self._timer("backward-weight-compute").start()
        run_weight_grads(queue)
        self._timer("backward-weight-compute").stop()
