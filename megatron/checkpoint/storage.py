"""Checkpoint storage: Megatron's layout, crash-safe commits, safe loading, exact RNG state.

Layout (Megatron's, so users' tooling carries over):
    SAVE/latest_checkpointed_iteration.txt             newest COMPLETE iteration (or `release`)
    SAVE/iter_0001000/mp_rank_00/model_optim_rng.pt    TP rank 00 (PP = 1)
    SAVE/iter_0001000/mp_rank_00_001/model_optim_rng.pt  TP rank 00, PP rank 001
    SAVE/iter_0001000/complete                         our marker: shard files and their sizes

A save commits in three steps, each atomic (temp file, fsync, os.replace, fsync the directory):
  1. every writing rank replaces its shard file;
  2. after a barrier, rank 0 writes the `complete` marker;
  3. rank 0 replaces the pointer.
A SIGKILL between any two steps leaves the pointer on the previous complete checkpoint, and a
directory without a valid marker is never loaded. Iteration 0 is Megatron's `release`
checkpoint: directory `release/`, pointer text `release`. Converters write it without our
marker, so `release/` counts as complete when it holds shard files.

Nothing here touches torch.distributed or the model classes: the trainer passes plain state
dicts and a `barrier` callable.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import torch

TRACKER_NAME = "latest_checkpointed_iteration.txt"
SHARD_NAME = "model_optim_rng.pt"
MARKER_NAME = "complete"
RELEASE = "release"
_ITER_DIR = re.compile(r"iter_([0-9]{7,})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be committed or loaded safely; the message names the file."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """`root/iter_{iteration:07d}`, or `root/release` for iteration 0."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return os.path.join(root, RELEASE if iteration == 0 else f"iter_{iteration:07d}")


def shard_path(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(checkpoint_dir(root, iteration), rank_dir, SHARD_NAME)


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


def _marker_path(root: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir(root, iteration), MARKER_NAME)


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the directory holding it is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Fill a temp file beside `path` with `write(f)`, fsync it, rename it over `path`."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def write_text_atomic(path: str, text: str) -> None:
    """`text` to `path` (e.g. run_config.yaml beside the checkpoints): a crash leaves the old
    file or none, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def save_shard(
    root: str, iteration: int, state: dict, *, tp_rank: int, pp_rank: int, pp_size: int, write: bool
) -> None:
    """Write this rank's shard atomically; ranks with write=False (DP rank > 0) do nothing."""
    if not write:
        return
    path = shard_path(root, iteration, tp_rank, pp_rank, pp_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Re-saving an iteration (a resumed run overtaking an older save): its old marker must not
    # vouch for a mix of old and new shards if we crash half-way.
    with contextlib.suppress(FileNotFoundError):
        os.remove(_marker_path(root, iteration))
        _fsync_dir(checkpoint_dir(root, iteration))
    _atomic_write(path, lambda f: torch.save(state, f))


def _all_files(directory: str) -> dict[str, int]:
    """{relative path: size} of every file under `directory` but the marker (DeepSpeed's layout:
    mp_rank_XX_model_states.pt, zero_pp_rank_*_optim_states.pt, ...)."""
    found = {}
    for dirpath, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, directory)
            if rel != MARKER_NAME and ".tmp" not in name:
                found[rel] = os.path.getsize(path)
    return found


def _shard_files(directory: str) -> dict[str, int]:
    """{'mp_rank_../model_optim_rng.pt': size in bytes} for the shards present in `directory`."""
    if not os.path.isdir(directory):
        return {}
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name, SHARD_NAME)
        if name.startswith("mp_rank_") and os.path.isfile(path):
            found[f"{name}/{SHARD_NAME}"] = os.path.getsize(path)
    return found


def finalize_checkpoint(
    root: str,
    iteration: int,
    *,
    barrier: Callable[[], None],
    is_rank0: bool,
    num_shards_expected: int | None = None,
    retain_last: int | None = None,
    layout: str = "megatron",
) -> None:
    """Commit `iteration` on every rank: barrier, marker, pointer, keep-last-K, barrier.

    If rank 0 raises (missing shards), the other ranks wait in the second barrier until the
    collective timeout; the pointer still names the previous checkpoint.
    """
    if retain_last is not None and retain_last < 1:
        raise ValueError(f"retain_last must be >= 1 (keeps the newest), got {retain_last}")
    barrier()  # every writing rank has replaced its shard file
    if is_rank0:
        directory = checkpoint_dir(root, iteration)
        # megatron: mp_rank_*/model_optim_rng.pt shards; deepspeed: every file the engine wrote.
        shards = _shard_files(directory) if layout == "megatron" else _all_files(directory)
        if layout != "megatron":
            num_shards_expected = None
        if not shards or (num_shards_expected is not None and len(shards) != num_shards_expected):
            raise CheckpointError(
                f"{directory}: expected {num_shards_expected or 'some'} shard files, found "
                f"{len(shards)} {sorted(shards)}; not marking iteration {iteration} complete"
            )
        marker = json.dumps({"iteration": iteration, "shards": shards}, indent=1)
        _atomic_write(_marker_path(root, iteration), lambda f: f.write(marker.encode()))
        pointer = RELEASE if iteration == 0 else str(iteration)
        _atomic_write(tracker_path(root), lambda f: f.write(f"{pointer}\n".encode()))
        if retain_last is not None:
            _apply_retention(root, iteration, retain_last)
    barrier()  # no rank moves on (or loads) before the pointer has moved


def _iteration_dirs(root: str) -> dict[int, str]:
    """{iteration: directory} for every iter_* (and release) directory, complete or not."""
    found: dict[int, str] = {}
    if not os.path.isdir(root):
        return found
    for name in os.listdir(root):
        match = _ITER_DIR.fullmatch(name)
        it = 0 if name == RELEASE else int(match.group(1)) if match else None
        path = os.path.join(root, name)
        # Only names our path functions produce (not iter_0000000 nor iter_00000001).
        if it is not None and checkpoint_dir(root, it) == path and os.path.isdir(path):
            found[it] = path
    return found


def _is_complete(directory: str) -> bool:
    """The marker parses and every shard it lists is present with the recorded size."""
    try:
        with open(os.path.join(directory, MARKER_NAME)) as f:
            shards = json.load(f)["shards"]
    except FileNotFoundError:
        # Converters write `release/` without our marker; trust it when it holds shards.
        return os.path.basename(directory) == RELEASE and bool(_shard_files(directory))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        return bool(shards) and all(
            os.path.getsize(os.path.join(directory, rel)) == size for rel, size in shards.items()
        )
    except (OSError, TypeError, AttributeError):
        return False


def _apply_retention(root: str, iteration: int, keep: int) -> None:
    """Keep `iteration` and the newest keep-1 complete checkpoints before it.

    Older complete ones and every incomplete directory before `iteration` (crash garbage) go.
    Directories after `iteration` (a run that this one rewound past) and `release/` stay.
    """
    older = {it: d for it, d in _iteration_dirs(root).items() if 0 < it < iteration}
    complete = sorted((it for it, d in older.items() if _is_complete(d)), reverse=True)
    kept = set(complete[: keep - 1])
    for it in sorted(set(older) - kept):
        try:
            # Marker first: a deletion cut short must not leave a "complete" half-checkpoint.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(older[it], MARKER_NAME))
            shutil.rmtree(older[it])
        except OSError as e:
            warnings.warn(f"keep-last-{keep}: could not delete {older[it]}: {e}", stacklevel=3)


def read_tracker(root: str) -> int | None:
    """The pointer's iteration (`release` -> 0); None if it is missing.

    Raises CheckpointError if it exists but is unreadable or not an iteration number;
    `resolve_load_iteration` turns that into a fallback.
    """
    path = tracker_path(root)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint pointer {path} is unreadable: {e}") from e
    if text == RELEASE:
        return 0
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointError(
            f"checkpoint pointer {path} is corrupt: expected an iteration number or "
            f"'{RELEASE}', found {text[:40]!r}"
        )
    return int(text)


def resolve_load_iteration(root: str, *, iteration: int | None = None) -> int | None:
    """The iteration to load from `root`, or None for a fresh run (no pointer, no iter_* dirs).

    An explicit `iteration` must be complete. Otherwise the pointer wins if it names a complete
    checkpoint; if not, warn and fall back to the newest complete one. A pointer or iter_* dirs
    without any complete checkpoint raise CheckpointError rather than restarting from scratch.
    """
    dirs = _iteration_dirs(root)
    complete = sorted(it for it, d in dirs.items() if _is_complete(d))

    def state(it: int) -> str:
        where = checkpoint_dir(root, it)
        return f"{where} is {'incomplete (no valid marker)' if it in dirs else 'missing'}"

    if iteration is not None:
        if iteration in complete:
            return iteration
        raise CheckpointError(
            f"cannot load requested iteration {iteration}: {state(iteration)}; "
            f"complete checkpoints in {root}: {complete or 'none'}"
        )
    try:
        pointed = read_tracker(root)
    except CheckpointError as e:
        problem = str(e)
    else:
        if pointed is not None and pointed in complete:
            return pointed
        problem = (
            f"checkpoint pointer {tracker_path(root)} is missing"
            if pointed is None
            else f"{tracker_path(root)} names iteration {pointed}, but {state(pointed)}"
        )
    if complete:
        warnings.warn(
            f"{problem}; falling back to the newest complete checkpoint, iteration {complete[-1]}",
            stacklevel=2,
        )
        return complete[-1]
    if not dirs and not os.path.lexists(tracker_path(root)):
        return None
    names = sorted(os.path.basename(d) for d in dirs.values())
    raise CheckpointError(
        f"{problem}, and {root} holds no complete checkpoint (directories: {names or 'none'}); "
        "refusing to start from scratch. Remove the directory or point --load elsewhere."
    )


def load_shard(
    root: str,
    iteration: int,
    *,
    tp_rank: int,
    pp_rank: int,
    pp_size: int,
    map_location: str | torch.device = "cpu",
) -> dict:
    """This rank's shard, unpickled with weights_only=True (tensors, containers, primitives)."""
    path = shard_path(root, iteration, tp_rank, pp_rank, pp_size)
    if not os.path.isfile(path):
        directory = checkpoint_dir(root, iteration)
        present = sorted(_shard_files(directory))
        raise CheckpointError(
            f"missing checkpoint shard {path} (TP rank {tp_rank}, PP rank {pp_rank} of "
            f"{pp_size}); {directory} holds {present or 'no shards'}. The "
            "TP/PP sizes probably differ from those the checkpoint was saved with."
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = [line for line in str(e).splitlines() if "GLOBAL" in line]
        raise CheckpointError(
            f"{path} needs arbitrary unpickling, which we refuse (it could run code); "
            f"save only tensors, containers and primitive values. {' '.join(detail)}".strip()
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} is unreadable or truncated: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, expected a state dict")
    return state


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
            raise CheckpointError("checkpoint has no CUDA RNG state (saved on another device)")
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
