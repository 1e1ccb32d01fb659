"""A weighted mixture of datasets, drawn in a fixed interleaved order.

Sample i comes from the dataset whose weight most exceeds its share of the first i samples
(ties: the first such dataset), so every prefix of the blend is within one sample of the
weights. The order is cached like the GPT indices.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megatron.data.gpt_dataset import cached_indices


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, index of that sample within its dataset).

    Greedy on the deficit w_k (i + 1) - c_k; with few datasets a plain loop is quick enough
    (about a second per few million samples) and it is built once, then cached.
    """
    w = [float(x) for x in weights]
    k = len(w)
    counts = [0] * k
    which = np.empty(size, dtype=np.int16)
    ranges = range(k)
    for i in range(size):
        t = i + 1
        best, best_err = 0, w[0] * t - counts[0]
        for j in ranges:
            err = w[j] * t - counts[j]
            if err > best_err:
                best, best_err = j, err
        which[i] = best
        counts[best] += 1
    within = np.empty(size, dtype=np.int64)
    for j in range(k):
        mask = which == j
        within[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return which, within


class BlendableDataset(torch.utils.data.Dataset):
    def __init__(
        self,
        datasets: list,
        weights: list[float],
        size: int,
        *,
        name: str = "blend",
        cache_dir: str | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
        description: dict | None = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset is needed")
        self.datasets, self.size = datasets, size
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        if cache_dir is None:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(
                self.weights, size
            )
        else:
            desc = {
                "name": f"{name}-blend",
                "weights": self.weights,
                "size": size,
                "parts": description or {},
            }
            idx = cached_indices(
                desc,
                lambda: self._build(size),
                cache_dir,
                is_builder=is_builder,
                barrier=barrier,
                names=("dataset_index", "dataset_sample_index"),
            )
            self.dataset_index = idx["dataset_index"]
            self.dataset_sample_index = idx["dataset_sample_index"]
        for j, ds in enumerate(datasets):
            need = int((self.dataset_index == j).sum())
            if need > len(ds):
                raise ValueError(f"blend needs {need} samples from dataset {j}, it has {len(ds)}")

    def _build(self, size):
        which, within = build_blending_indices(self.weights, size)
        return {"dataset_index": which, "dataset_sample_index": within}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
