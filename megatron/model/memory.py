"""Measure the activation memory a forward pass keeps for backward (for memory benchmarks).

    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels).mean()
    saved.bytes        # bytes autograd holds until backward, each storage counted once

Sequence parallelism (--sequence-parallel) is meant to divide the part of this that lives
outside the tensor-parallel regions (norm inputs, residuals, dropout masks) by the TP size; this
is how a benchmark sees it on any device, CPU included (no allocator statistics needed).

`LiveActivations` follows the same bytes over time, through a whole pipeline step: the peak of
what is held for backward, the zero-bubble weight-gradient queue included (the quantity the
planner's per-schedule `activations` term models, megatron.planning.pipeline_memory).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron.mpu.weight_grad import SLOT as WEIGHT_GRAD_SPLIT


class SavedActivations:
    """Counts the tensors autograd saves for backward inside the block (saved_tensors_hooks).

    Each storage is counted once, at its full size (a view saves its whole storage). Tensors
    whose storage is in `exclude` (the parameters: a linear layer saves its weight) are not
    activations and are skipped. `by_shape` maps each saved shape to its bytes, for reports.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self.by_shape: dict[tuple[int, ...], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen and storage.nbytes() > 0:
            self._seen.add(key)
            self.bytes += storage.nbytes()
            shape = tuple(t.shape)
            self.by_shape[shape] = self.by_shape.get(shape, 0) + storage.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class LiveActivations:
    """The peak bytes held for backward while the block runs (a whole pipeline step): what
    autograd saves (saved_tensors_hooks) and what the weight-gradient queue holds between a
    zero-bubble B and its W (megatron.mpu.weight_grad: the linears' inputs and output gradients;
    `watch(model)` for each model, once its layers hold this step's split). A storage counts
    once, at its full size, from its first saved reference until the last one is dropped
    (autograd frees a node's saved tensors once it ran; a W drops its entry). Parameters
    (`exclude`, growing: a pipeline chunk's are added before it runs) are not activations. Not
    seen: the output buffers the pipeline exchanges, and what torch's checkpoint rebuilds in
    backward (it saves through its own hooks): under full recompute a group counts its input, as
    the planner's `activations` term does; its working set is the planner's separate
    `recompute_working`.

        with LiveActivations(model.parameters()) as live:
            step()  # where the pipeline has given model its split: live.watch(model)
        live.peak
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded: set[int] = set()
        self.exclude(exclude)
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.live = self.peak = 0
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_held)
        self._watched: list = []  # the splits storing their queued tensors through _pack

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self._excluded.update(t.untyped_storage().data_ptr() for t in tensors)

    def watch(self, model: torch.nn.Module) -> None:
        """Count what the weight-gradient queue holds too: the WeightGradSplit that `model`'s
        layers hold now (megatron.mpu.weight_grad, given by the pipeline for a zero-bubble
        step) stores the tensors it queues through this object's hooks until the block ends."""
        for module in model.modules():
            split = getattr(module, WEIGHT_GRAD_SPLIT, None)
            if split is not None and split not in self._watched:
                split.holding(self._pack, _unpack_held)
                self._watched.append(split)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return t
        if key not in self._refs:
            self._refs[key], self._size[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return _Held(t, key, self)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._size.pop(key)

    def __enter__(self) -> LiveActivations:
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for split in self._watched:
            split.hooks = None
        self._watched.clear()


def _unpack_held(held):
    return held.tensor if isinstance(held, _Held) else held


class _Held:
    """A saved reference: dropping it releases the storage's count."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: LiveActivations):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner._release(self.key)
