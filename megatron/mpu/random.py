"""Named RNG streams on any device, and an activation checkpoint that replays them exactly.

Dropout on tensors that are split over TP (attention probabilities of local heads) must differ
between TP ranks, while dropout on replicated tensors must agree. The default generator serves
the replicated case (same seed on every TP rank); `RNGStatesTracker.fork(name)` swaps in a
separate stream, seeded per TP rank, for the split case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from megatron.mpu.utils import group_rank, group_size

MODEL_PARALLEL_RNG = "model-parallel-rng"


def default_generator(device: torch.device | str) -> torch.Generator:
    """The generator that dropout on `device` draws from."""
    device = torch.device(device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no RNG tracker support for device type {device.type!r}")


class RNGStatesTracker:
    """Named generator states for one device; `fork(name)` runs a block on that stream."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        # Generator states are CPU byte tensors, even when a checkpoint was loaded onto a GPU.
        self._states = {name: state.detach().to("cpu", copy=True) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        gen = default_generator(self.device)
        saved = gen.get_state()
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()
        gen.set_state(saved)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (initialize the seeds first)")
        gen = default_generator(self.device)
        saved = gen.get_state()
        gen.set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = gen.get_state()
            gen.set_state(saved)


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """Seed of the TP-split stream: distinct per TP rank, never equal to the default seed."""
    return seed + 2718 + tp_rank


def checkpoint(function: Callable, tracker: RNGStatesTracker | None, *args, impl=None, **kwargs):
    """Run `function(*args, **kwargs)` without keeping its activations; recompute in backward.

    The recompute sees the same default-generator state (the checkpoint implementation restores
    it) and the same tracker streams (restored here), so dropout masks replay exactly and
    checkpointing changes memory, never the numbers. The tracker's streams are left where the
    first pass left them. `impl(fn, *args)`: another checkpoint implementation (DeepSpeed's,
    with activation partitioning / CPU offload); default torch's non-reentrant one.
    """
    if tracker is None and impl is None:  # nothing to replay: torch's, as torch.compile traces
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )
    entry_states = tracker.get_states() if tracker is not None else None
    calls = 0

    def run(*a, **kw):
        nonlocal calls
        calls += 1
        if tracker is None or calls == 1:
            return function(*a, **kw)
        current = tracker.get_states()
        tracker.set_states(entry_states)
        try:
            return function(*a, **kw)
        finally:
            tracker.set_states(current)

    if impl is not None:
        # Tensors only: DeepSpeed's checkpoint, partitioning activations, mishandles other
        # arguments (a None position_ids); they are bound here instead.
        where = [i for i, a in enumerate(args) if torch.is_tensor(a)]

        def tensors_only(*tensors):
            full = list(args)
            for i, t in zip(where, tensors, strict=True):
                full[i] = t
            return run(*full, **kwargs)

        return impl(tensors_only, *(args[i] for i in where))
    return torch_checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )


def _local_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/size of x flattened (zero-padded to a multiple of the group size)."""
    size, rank = group_size(group), group_rank(group)
    flat = x.detach().reshape(-1)
    per = -(-flat.numel() // size)
    flat = torch.nn.functional.pad(flat, (0, per * size - flat.numel()))
    return flat[rank * per : (rank + 1) * per].clone()  # clone: frees the full tensor


def _gather_full(piece: torch.Tensor, shape: torch.Size, group) -> torch.Tensor:
    """Inverse of _local_slice over the group: all-gather the pieces, drop padding, reshape."""
    if group_size(group) == 1:
        return piece.reshape(shape)
    pieces = [torch.empty_like(piece) for _ in range(group_size(group))]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces)[: shape.numel()].reshape(shape)


class _DistributedCheckpoint(torch.autograd.Function):
    """Forward without keeping activations; keep 1/TP of the input x on each TP rank.

    backward: all-gather x over the TP group, replay the forward with the saved
    default-generator state (same dropout masks), backpropagate through it."""

    @staticmethod
    def forward(ctx, function, group, x, *rest):
        ctx.function, ctx.group, ctx.rest = function, group, rest
        ctx.shape, ctx.needs_x_grad = x.shape, x.requires_grad
        ctx.generator = default_generator(x.device)
        ctx.rng_state = ctx.generator.get_state()
        with torch.no_grad():
            out = function(x, *rest)
        ctx.save_for_backward(_local_slice(x, group))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (piece,) = ctx.saved_tensors
        x = _gather_full(piece, ctx.shape, ctx.group).detach().requires_grad_(ctx.needs_x_grad)
        current = ctx.generator.get_state()
        ctx.generator.set_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                out = ctx.function(x, *ctx.rest)
        finally:
            ctx.generator.set_state(current)
        torch.autograd.backward(out, grad_out)
        return (None, None, x.grad if ctx.needs_x_grad else None, *([None] * len(ctx.rest)))


def distributed_checkpoint(function: Callable, x: torch.Tensor, *rest, group=None):
    """A checkpoint `impl` (see `checkpoint`) for --distribute-checkpointed-activations: the
    saved layer input takes x.numel() / TP elements per TP rank instead of x.numel(); the
    recompute all-gathers it first (one all-gather per checkpointed layer in backward).
    Gradients and dropout masks are those of the plain checkpoint."""
    return _DistributedCheckpoint.apply(function, group, x, *rest)
