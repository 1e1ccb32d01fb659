"""Every random stream of a rank (Python, NumPy, torch CPU, the device's) as values that
torch.load(weights_only=True) accepts, and back; saved in each checkpoint shard so a resumed run
draws what an uninterrupted one would.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron.checkpoint.storage import CheckpointError


def rng_state_dict(device: str | torch.device) -> dict:
    """Every RNG stream as values torch.load(weights_only=True) accepts.

    `cuda` is this rank's device generator (None off CUDA); `tracker` is for the caller's
    model-parallel `RNGStatesTracker.get_states()`.
    """
    device = torch.device(device)
    version, mt, gauss_next = random.getstate()  # mt: 624 words + position, as python ints
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "key": torch.from_numpy(key.astype(np.int64)),  # (624,) uint32 words, widened
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "tracker": None,
    }


def set_rng_state(state: dict, device: str | torch.device) -> None:
    """Restore what `rng_state_dict` captured; the tracker slot is the caller's to restore."""
    device = torch.device(device)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    key = npy["key"].cpu().numpy().astype(np.uint32)
    np.random.set_state((npy["name"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())  # a CPU ByteTensor, whatever map_location was
    if device.type == "cuda":
        if state.get("cuda") is None:
            raise CheckpointError(
                "checkpoint has no CUDA RNG state (it was saved on the CPU). Fix: resume with "
                "--no-load-rng (the random streams then start from --seed)"
            )
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
