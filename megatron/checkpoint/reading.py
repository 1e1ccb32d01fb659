"""Reading checkpoints back: which iteration to load (the pointer, else the newest complete one,
never a silent fresh start), per-shard integrity checks against the marker (size, CRC-32) before
any byte is unpickled, and the weights-only unpickling of a rank's shard. The layout and the
commit protocol that writes what is read here: megatron.checkpoint.storage.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from megatron.checkpoint.storage import (
    MARKER_NAME,
    RELEASE,
    SHARD_NAME,
    CheckpointError,
    ShardIntegrityError,
    checkpoint_dir,
    file_crc32,
    incomplete_reason,
    is_complete,
    iteration_dirs,
    read_marker,
    shard_files,
    shard_path,
    tracker_path,
)

T = TypeVar("T")


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


def resolve_load_iteration(
    root: str,
    *,
    iteration: int | None = None,
    damaged: Mapping[int, Sequence[str]] | None = None,
) -> int | None:
    """The iteration to load from `root`, or None for a fresh run (no pointer, no iter_* dirs).

    An explicit `iteration` must be complete. Otherwise the pointer wins if it names a complete
    checkpoint; if not, warn and fall back to the newest complete one. A pointer, or a directory
    that was once committed (has a marker), without any complete checkpoint raises
    CheckpointError rather than restarting from scratch. Only iter_* dirs that never got a
    marker, with no pointer (a first save killed midway), start from scratch with a warning.
    `damaged` ({iteration: problems}) lists checkpoints that failed to load (see
    `load_newest_intact`): they count as unusable, but never as a reason to start from scratch.
    """
    damaged = damaged or {}
    dirs = iteration_dirs(root)
    complete = sorted(it for it, d in dirs.items() if is_complete(d) and it not in damaged)

    def state(it: int) -> str:
        where = checkpoint_dir(root, it)
        if it in damaged:
            return f"{where} is damaged ({'; '.join(damaged[it])})"
        if it not in dirs:
            return f"{where} is missing"
        return f"{where} is incomplete: {incomplete_reason(dirs[it])}"

    if iteration is not None:
        if iteration in complete:
            return iteration
        raise CheckpointError(
            f"cannot load requested iteration {iteration}: {state(iteration)}; "
            f"complete checkpoints in {root}: {complete or 'none'}"
        )
    pointed = None
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
    never_committed = not any(os.path.lexists(os.path.join(d, MARKER_NAME)) for d in dirs.values())
    if never_committed and not damaged and not os.path.lexists(tracker_path(root)):
        # No pointer and no marker was ever written: every save here died before its commit
        # (a first save killed midway). There is nothing to resume, and refusing would make
        # every automatic restart fail the same way, so start from scratch, loudly.
        warnings.warn(
            f"{root} holds only incomplete checkpoints {names} (no pointer, no completion "
            "marker: saves that died before committing); starting from scratch. A later "
            "save of the same iteration overwrites them.",
            stacklevel=2,
        )
        return None
    bad = "".join(f"; {state(it)}" for it in sorted(damaged) if it != pointed)
    raise CheckpointError(
        f"{problem}, and {root} holds no complete checkpoint{' that loads' if damaged else ''} "
        f"(directories: {names or 'none'}){bad}; refusing to start from scratch. Remove the "
        "directory or point --load elsewhere."
    )


def load_newest_intact(
    root: str,
    load: Callable[[int], T],
    *,
    agree: Callable[[tuple[str, str] | None], Sequence[tuple[str, str] | None]] = lambda p: [p],
) -> tuple[int | None, T | None]:
    """(iteration, load(iteration)) for the newest complete checkpoint that loads intact, or
    (None, None) for a fresh run.

    `load` raises ShardIntegrityError for a damaged shard: warn naming it and try the next older
    complete checkpoint; when none is left, raise CheckpointError (never a fresh start). Other
    CheckpointErrors (layout mismatch) are raised as they are. With several ranks each loads its
    own shard, so they must decide together: `agree` gathers every rank's outcome (None, or
    (kind, message)) so that all ranks fall back, or fail, in step.
    """
    damaged: dict[int, list[str]] = {}
    while True:
        iteration = resolve_load_iteration(root, damaged=damaged)
        if iteration is None:
            return None, None
        value, outcome = None, None
        try:
            value = load(iteration)
        except ShardIntegrityError as e:
            outcome = ("damaged", str(e))
        except CheckpointError as e:
            outcome = ("error", str(e))
        outcomes = [o for o in agree(outcome) if o is not None]
        errors = [message for kind, message in outcomes if kind == "error"]
        if errors:
            raise CheckpointError(errors[0])
        if not outcomes:
            return iteration, value
        damaged[iteration] = sorted({message for _, message in outcomes})
        warnings.warn(
            f"not loading iteration {iteration} from {root}: {'; '.join(damaged[iteration])}",
            stacklevel=2,
        )


def _verify_shard(root: str, iteration: int, path: str) -> None:
    """Check `path` against the size and CRC-32 its checkpoint's marker recorded, before any
    byte of it is unpickled. Markers from before checksums (and converters' `release/`
    without a marker) vouch for the size only, or for nothing."""
    directory = checkpoint_dir(root, iteration)
    rel = os.path.relpath(path, directory)
    try:
        marker = read_marker(directory) or {}
        size, crc = marker.get("shards", {}).get(rel), marker.get("crc32", {}).get(rel)
        if not isinstance(size, int | None) or not isinstance(crc, int | None):
            raise ValueError(f"{rel}: size {size!r} / crc32 {crc!r} are not integers")
    except (OSError, ValueError, AttributeError) as e:
        raise ShardIntegrityError(
            f"{os.path.join(directory, MARKER_NAME)} is unreadable: {e}"
        ) from e
    try:
        actual_size = os.path.getsize(path)
    except FileNotFoundError as e:
        raise ShardIntegrityError(f"{path} is missing (its checkpoint's marker lists it)") from e
    if size is not None and actual_size != size:
        raise ShardIntegrityError(
            f"{path} is unreadable or truncated: {actual_size} bytes, but its checkpoint's "
            f"marker recorded {size}"
        )
    if crc is not None and (actual := file_crc32(path)) != crc:
        raise ShardIntegrityError(
            f"{path} is damaged: CRC-32 {actual:08x}, but its checkpoint's marker recorded "
            f"{crc:08x} (the bytes changed after the save)"
        )


def marker_files(root: str, iteration: int) -> list[str]:
    """The files (relative to the iteration's directory) its marker lists, sorted; [] for a
    checkpoint without a marker (a converter's `release/`)."""
    directory = checkpoint_dir(root, iteration)
    try:
        return sorted((read_marker(directory) or {}).get("shards", {}))
    except (OSError, ValueError, AttributeError) as e:
        raise ShardIntegrityError(
            f"{os.path.join(directory, MARKER_NAME)} is unreadable: {e}"
        ) from e


def marker_layout(root: str, iteration: int) -> dict | None:
    """The layout record the marker of `iteration` holds (None: a marker from before layout
    records, or none at all)."""
    try:
        record = (read_marker(checkpoint_dir(root, iteration)) or {}).get("layout")
    except (OSError, ValueError, AttributeError) as e:
        raise ShardIntegrityError(f"{checkpoint_dir(root, iteration)} marker: {e}") from e
    return record if isinstance(record, dict) else None


def verify_checkpoint_files(
    root: str, iteration: int, select: Callable[[int, str], bool] | None = None
) -> None:
    """Check every file the marker of `iteration` lists (or those `select(index, relative
    path)` picks: ranks share the work) against its size and CRC-32; for layouts whose files
    another library unpickles (DeepSpeed's), before it does."""
    directory = checkpoint_dir(root, iteration)
    for i, rel in enumerate(marker_files(root, iteration)):
        if select is None or select(i, rel):
            _verify_shard(root, iteration, os.path.join(directory, rel))


def _missing_file(root: str, iteration: int, path: str, rank, name: str) -> CheckpointError:
    """What a missing shard file means: with its rank directory there, a file lost (an
    optimizer file not copied, say); without it, another TP x PP layout than the saved one."""
    directory = checkpoint_dir(root, iteration)
    present = sorted(shard_files(directory))
    if os.path.isdir(os.path.dirname(path)):
        what = "shard" if name == SHARD_NAME else "optimizer state file"
        fix = "" if name == SHARD_NAME else ", or resume the weights alone with --no-load-optim"
        return CheckpointError(
            f"missing checkpoint {what} {path}: its rank directory is there but the file is not "
            f"({directory} holds {present or 'no shards'}); the checkpoint of iteration "
            f"{iteration} lost a file after it was saved. Fix: copy the file from where the "
            f"checkpoint was written{fix}"
        )
    tp_rank, pp_rank, pp_size = rank
    return CheckpointError(
        f"missing checkpoint shard {path} (TP rank {tp_rank}, PP rank {pp_rank} of "
        f"{pp_size}); {directory} holds {present or 'no shards'}. The "
        "TP/PP sizes probably differ from those the checkpoint was saved with."
    )


def load_shard(
    root: str,
    iteration: int,
    *,
    tp_rank: int,
    pp_rank: int,
    pp_size: int,
    map_location: str | torch.device = "cpu",
    name: str = SHARD_NAME,
    mmap: bool = False,
    verify: bool = True,
) -> dict:
    """This rank's shard (or its file `name`), verified against its marker's checksum, then
    unpickled with weights_only=True (tensors, containers, primitives); `mmap`: tensors stay
    in the page cache until read (only the slices used are ever read from disk); `verify=False`
    where another rank checked the file already (verify_checkpoint_files shared out)."""
    path = shard_path(root, iteration, tp_rank, pp_rank, pp_size, name)
    if not os.path.isfile(path):
        raise _missing_file(root, iteration, path, (tp_rank, pp_rank, pp_size), name)
    if verify:
        _verify_shard(root, iteration, path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        detail = [line for line in str(e).splitlines() if "GLOBAL" in line]
        if not detail:  # a corrupt opcode, not a refused class: the bytes are damaged
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["?"]
            why = next((line for line in lines if line.startswith("Unsupported")), lines[0])
            raise ShardIntegrityError(f"{path} is damaged: it cannot be unpickled ({why})") from e
        raise CheckpointError(
            f"{path} needs arbitrary unpickling, which we refuse (it could run code); "
            f"save only tensors, containers and primitive values. {' '.join(detail)}".strip()
        ) from e
    except Exception as e:  # noqa: BLE001 - damaged bytes surface as any error of the reader
        raise ShardIntegrityError(
            f"{path} is unreadable or truncated: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, expected a state dict")
    return state
