"""Measure the activation memory a forward pass keeps for backward (for memory benchmarks).

    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels).mean()
    saved.bytes        # bytes autograd holds until backward, each storage counted once

Sequence parallelism (--sequence-parallel) is meant to divide the part of this that lives
outside the tensor-parallel regions (norm inputs, residuals, dropout masks) by the TP size; this
is how a benchmark sees it on any device, CPU included (no allocator statistics needed).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
