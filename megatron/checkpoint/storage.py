"""Checkpoint storage: Megatron's layout and crash-safe commits (reading them back:
megatron.checkpoint.reading; the RNG streams in each shard: megatron.checkpoint.rng_state).

Layout (Megatron's, so users' tooling carries over):
    SAVE/latest_checkpointed_iteration.txt             newest COMPLETE iteration (or `release`)
    SAVE/iter_0001000/mp_rank_00/model_optim_rng.pt    TP rank 00 (PP = 1)
    SAVE/iter_0001000/mp_rank_00_001/model_optim_rng.pt  TP rank 00, PP rank 001
    SAVE/iter_0001000/mp_rank_00/distrib_optim_dp_002.pt  --use-distributed-optimizer: the
                                                       optimizer shard of DP rank 2 (each DP rank)
    SAVE/iter_0001000/complete                         our marker: shard files, sizes, CRC-32s

A save commits in three steps, each atomic (temp file, fsync, os.replace, fsync the directory):
  1. every writing rank replaces its shard file;
  2. after a barrier, rank 0 writes the `complete` marker;
  3. rank 0 replaces the pointer.
A SIGKILL between any two steps leaves the pointer on the previous complete checkpoint, and a
directory without a valid marker is never loaded; the temp files of a killed save are removed
when the next save of that iteration starts. Iteration 0 is Megatron's `release`
checkpoint: directory `release/`, pointer text `release`. Converters write it without our
marker, so `release/` counts as complete when it holds shard files.

Integrity: the marker records every shard's size and CRC-32. A checkpoint counts as complete
when its files have the recorded sizes (cheap, checked for every candidate); `load_shard`
(reading.py) verifies the CRC-32 of its file before unpickling it, so bytes damaged after the
save (a bad disk, a partial copy) raise `ShardIntegrityError` naming the file instead of
loading silently as garbage, and `load_newest_intact` falls back to the newest checkpoint that
does load.
Markers written before checksums were recorded are checked by size only.

Nothing here touches torch.distributed or the model classes: the trainer passes plain state
dicts and a `barrier` callable.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import BinaryIO

import torch

from megatron.fileio import fsync_path

TRACKER_NAME = "latest_checkpointed_iteration.txt"
SHARD_NAME = "model_optim_rng.pt"
DISTRIB_OPTIM_NAME = "distrib_optim_dp_{dp_rank:03d}.pt"
_DISTRIB_OPTIM = re.compile(r"distrib_optim_dp_[0-9]{3,}\.pt")
MARKER_NAME = "complete"
RELEASE = "release"
_ITER_DIR = re.compile(r"iter_([0-9]{7,})")


_CHUNK = 16 << 20  # CRC-32 read size: large reads keep the checksum near disk/memory speed


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be committed or loaded safely; the message names the file."""


class ShardIntegrityError(CheckpointError):
    """A shard whose bytes are not those that were saved (checksum or size mismatch) or that
    cannot be unpickled: the checkpoint is damaged, and a loader may fall back to an older one.
    Layout or configuration mismatches stay plain CheckpointErrors: an older checkpoint would
    not fix them."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """`root/iter_{iteration:07d}`, or `root/release` for iteration 0."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return os.path.join(root, RELEASE if iteration == 0 else f"iter_{iteration:07d}")


def shard_path(
    root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int, name: str = SHARD_NAME
) -> str:
    """The file `name` (default the model/optimizer shard) of one TP x PP rank directory."""
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(checkpoint_dir(root, iteration), rank_dir, name)


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


def _marker_path(root: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir(root, iteration), MARKER_NAME)


def _temp_prefix(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp.")


def _remove_dead_temps(path: str) -> None:
    """Remove the temp files of `path` that saves killed before their rename left behind.

    They carry the dead process's pid, so no later save would overwrite or remove them. Only
    the one process that writes `path` calls this, before it writes, so no live temp is hit.
    """
    prefix = _temp_prefix(path)
    directory, start = os.path.dirname(prefix), os.path.basename(prefix)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(start):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`, if any: torch.save reports a failed write as a RuntimeError
    ('enforce fail at inline_container.cc') whose context is the OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _space(path: str) -> str:
    directory = os.path.dirname(path)
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)  # a directory we could not create
    try:
        usage = shutil.disk_usage(directory)
        return f"{_bytes(usage.free)} free of {_bytes(usage.total)} on {directory}"
    except OSError as e:
        return f"free space on {directory} unknown ({e.strerror or e})"


def _file_too_large() -> tuple[str, str]:
    """(what stopped a write with EFBIG, the fix): this process's file-size limit, if it has
    one (ulimit -f: the kernel refuses to grow any file past it), else the file system's."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (
            f"this process's file-size limit (ulimit -f, RLIMIT_FSIZE {_bytes(limit)}) is "
            "smaller than the file",
            "raise the limit (ulimit -f unlimited) or make the shards smaller (more "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size)",
        )
    return "the file system's largest file is smaller", "pass --save on another file system"


def _newest_complete(path: str) -> str:
    """What a resume from the root of `path` finds, now that this save failed (as
    megatron.checkpoint.reading.resolve_load_iteration would: the pointer's checkpoint, else
    the newest complete one)."""
    root = os.path.dirname(path)  # the pointer's (or run_config.yaml's) directory
    for directory in (root, os.path.dirname(root)):  # a marker's, a shard's iteration
        if (
            _ITER_DIR.fullmatch(os.path.basename(directory))
            or os.path.basename(directory) == RELEASE
        ):
            root = os.path.dirname(directory)
            break
    complete = [it for it, d in iteration_dirs(root).items() if is_complete(d)]
    try:
        with open(tracker_path(root), encoding="utf-8") as f:
            text = f.read().strip()
        pointer = 0 if text == RELEASE else int(text)
    except (OSError, ValueError):
        pointer = None
    if pointer in complete:
        return f"the pointer in {root} still names iteration {pointer}, a complete checkpoint"
    if complete:
        return (
            f"a resume from {root} falls back to iteration {max(complete)}, its newest complete one"
        )
    return f"{root} holds no complete checkpoint (this was its first save)"


def _write_failed(path: str, error: OSError) -> CheckpointError:
    """One line for an I/O error while saving: the file, the error, what caused it (the free
    space there, or a file-size limit) and what a resume would find."""
    reason = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
    if error.errno == errno.EFBIG:
        cause, fix = _file_too_large()
    else:
        cause, fix = _space(path), "free space or pass --save elsewhere"
    return CheckpointError(
        f"cannot write checkpoint file {path}: {reason}; {cause}. {_newest_complete(path)}; "
        f"{fix}, then resume with --load."
    )


def _atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Fill a temp file beside `path` with `write(f)`, fsync it, rename it over `path`.

    An I/O error (disk full, quota, EIO) leaves `path` as it was, removes the temp file and
    raises a one-line CheckpointError naming `path` and the free space, not a traceback.
    """
    directory = os.path.dirname(path)
    tmp = f"{_temp_prefix(path)}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(directory)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if (error := _os_error(e)) is not None:
            raise _write_failed(path, error) from e
        raise


def write_text_atomic(path: str, text: str) -> None:
    """`text` to `path` (e.g. run_config.yaml beside the checkpoints): a crash leaves the old
    file or none, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def save_shard(
    root: str,
    iteration: int,
    state: dict,
    *,
    tp_rank: int,
    pp_rank: int,
    pp_size: int,
    write: bool,
    name: str = SHARD_NAME,
) -> None:
    """Write this rank's shard atomically; ranks with write=False (DP rank > 0) do nothing."""
    if not write:
        return
    path = shard_path(root, iteration, tp_rank, pp_rank, pp_size, name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise _write_failed(path, e) from e
    # Re-saving an iteration (a resumed run overtaking an older save): its old marker must not
    # vouch for a mix of old and new shards if we crash half-way.
    with contextlib.suppress(FileNotFoundError):
        os.remove(_marker_path(root, iteration))
        fsync_path(checkpoint_dir(root, iteration))
    _remove_dead_temps(path)  # this rank is the only writer of `path`
    _atomic_write(path, lambda f: torch.save(state, f))


def remove_stale_optimizer_shards(
    root: str, iteration: int, *, tp_rank: int, pp_rank: int, pp_size: int, keep: int
) -> None:
    """Delete the distrib_optim_dp_K.pt files with K >= keep of one rank directory: left by an
    earlier save of this iteration at a larger DP size, they would not belong to this one."""
    directory = os.path.dirname(shard_path(root, iteration, tp_rank, pp_rank, pp_size))
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if _DISTRIB_OPTIM.fullmatch(name) and int(name[len("distrib_optim_dp_") : -3]) >= keep:
            os.remove(os.path.join(directory, name))


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


def file_crc32(path: str, chunk_size: int = _CHUNK) -> int:
    """CRC-32 of a file, streamed in large chunks into one reused buffer (no whole-file copy)."""
    crc = 0
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def shard_files(directory: str) -> dict[str, int]:
    """{'mp_rank_../model_optim_rng.pt': size in bytes} for the shards present in `directory`
    (and the distributed optimizer's `mp_rank_../distrib_optim_dp_*.pt` beside them)."""
    if not os.path.isdir(directory):
        return {}
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name, SHARD_NAME)
        if name.startswith("mp_rank_") and os.path.isfile(path):
            found[f"{name}/{SHARD_NAME}"] = os.path.getsize(path)
            for extra in sorted(os.listdir(os.path.join(directory, name))):
                if _DISTRIB_OPTIM.fullmatch(extra):
                    found[f"{name}/{extra}"] = os.path.getsize(os.path.join(directory, name, extra))
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
    agree: Callable[[str | None], Sequence[str | None]] | None = None,
    error: BaseException | None = None,
    layout_record: dict | None = None,
) -> None:
    """Commit `iteration` on every rank: barrier, marker, pointer, keep-last-K, barrier.

    `layout_record` (the parallel layout the shards were written at, with its format version:
    megatron.checkpoint.reshard_load) is stored in the marker, where a loader at another
    layout reads it before any shard.

    `agree(message or None)` gathers every rank's outcome (an all-gather, so also a barrier):
    with it, both barriers become agreements. A rank whose own write failed (`error`, e.g. a
    full disk) or a rank 0 that cannot write the marker or the pointer stops every rank at
    once with the same CheckpointError naming that rank and its file, and nothing marks the
    iteration complete: the pointer still names the previous checkpoint. Without `agree`
    (one process), the error is raised here and the others would wait in the barrier.
    """
    if retain_last is not None and retain_last < 1:
        raise ValueError(f"retain_last must be >= 1 (keeps the newest), got {retain_last}")

    def settle(err: BaseException | None) -> None:
        if agree is None:
            if err is not None:
                raise err
            barrier()
            return
        failed = [(r, m) for r, m in enumerate(agree(None if err is None else str(err))) if m]
        if err is not None:
            raise err
        if failed:
            rank, message = failed[0]
            raise CheckpointError(
                f"iteration {iteration} was not saved: rank {rank} failed ({message}); the "
                f"previous checkpoint in {root} stays the newest"
            )

    settle(error)  # every writing rank has replaced its shard file (or said why it could not)
    err = None
    try:
        if is_rank0:
            _mark_complete(root, iteration, num_shards_expected, retain_last, layout, layout_record)
    except (CheckpointError, OSError) as e:
        err = e
    settle(err)  # no rank moves on (or loads) before the pointer has moved


def _mark_complete(
    root: str,
    iteration: int,
    num_shards_expected: int | None,
    retain_last: int | None,
    layout,
    layout_record: dict | None = None,
) -> None:
    """Rank 0's part of finalize_checkpoint: check the shards, write the marker and pointer."""
    directory = checkpoint_dir(root, iteration)
    # megatron: mp_rank_*/model_optim_rng.pt shards; deepspeed: every file the engine wrote.
    shards = shard_files(directory) if layout == "megatron" else _all_files(directory)
    if layout != "megatron":
        num_shards_expected = None
    if not shards or (num_shards_expected is not None and len(shards) != num_shards_expected):
        raise CheckpointError(
            f"{directory}: expected {num_shards_expected or 'some'} shard files, found "
            f"{len(shards)} {sorted(shards)}; not marking iteration {iteration} complete"
        )
    # Checksums of what is on disk now, after every rank's fsync: later damage shows up.
    crcs = {rel: file_crc32(os.path.join(directory, rel)) for rel in shards}
    entries = {"iteration": iteration, "shards": shards, "crc32": crcs}
    if layout_record is not None:
        entries["layout"] = layout_record
    marker = json.dumps(entries, indent=1)
    # Rank 0 alone writes the marker and the pointer: dead saves' temps of them can go.
    _remove_dead_temps(_marker_path(root, iteration))
    _atomic_write(_marker_path(root, iteration), lambda f: f.write(marker.encode()))
    pointer = RELEASE if iteration == 0 else str(iteration)
    _remove_dead_temps(tracker_path(root))
    _atomic_write(tracker_path(root), lambda f: f.write(f"{pointer}\n".encode()))
    if retain_last is not None:
        _apply_retention(root, iteration, retain_last)


def iteration_dirs(root: str) -> dict[int, str]:
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


def read_marker(directory: str) -> dict | None:
    """The parsed marker of `directory`; None if it has none. Raises OSError/ValueError if it
    is unreadable or not JSON."""
    try:
        with open(os.path.join(directory, MARKER_NAME)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def is_complete(directory: str) -> bool:
    """The marker parses and every shard it lists is present with the recorded size."""
    return incomplete_reason(directory) is None


def incomplete_reason(directory: str) -> str | None:
    """Why `directory` is not a complete checkpoint, naming the file at fault; None if it is."""
    where = os.path.join(directory, MARKER_NAME)
    try:
        marker = read_marker(directory)
    except (OSError, ValueError) as e:
        return f"its completion marker {where} is unreadable ({e})"
    if marker is None:
        # Converters write `release/` without our marker; trust it when it holds shards.
        if os.path.basename(directory) == RELEASE and shard_files(directory):
            return None
        return f"it has no completion marker {where} (its save never committed)"
    shards = marker.get("shards") if isinstance(marker, dict) else None
    if not isinstance(shards, dict) or not shards:
        return f"its completion marker {where} lists no shard files"
    for rel, size in shards.items():
        path = os.path.join(directory, rel)
        try:
            actual = os.path.getsize(path)
        except OSError:
            return f"{path} is missing (its completion marker lists it)"
        if actual != size:
            return (
                f"{path} is {actual} bytes, but its completion marker recorded {size} "
                "(truncated or overwritten after the save)"
            )
    return None


def _apply_retention(root: str, iteration: int, keep: int) -> None:
    """Keep `iteration` and the newest keep-1 complete checkpoints before it.

    Older complete ones and every incomplete directory before `iteration` (crash garbage) go.
    Directories after `iteration` (a run that this one rewound past) and `release/` stay.
    """
    older = {it: d for it, d in iteration_dirs(root).items() if 0 < it < iteration}
    complete = sorted((it for it, d in older.items() if is_complete(d)), reverse=True)
    kept = set(complete[: keep - 1])
    for it in sorted(set(older) - kept):
        try:
            # Marker first: a deletion cut short must not leave a "complete" half-checkpoint.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(older[it], MARKER_NAME))
            shutil.rmtree(older[it])
        except OSError as e:
            warnings.warn(f"keep-last-{keep}: could not delete {older[it]}: {e}", stacklevel=3)
