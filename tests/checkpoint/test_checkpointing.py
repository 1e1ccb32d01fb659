"""Checkpoint storage: layout, crash safety (SIGKILL), pointer fallback, safe loading, keep-last-K,
exact RNG round trip, and a 2-rank gloo commit."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import megatron.checkpoint.storage as storage
from megatron.checkpoint.reading import (
    load_newest_intact,
    load_shard,
    read_tracker,
    resolve_load_iteration,
)
from megatron.checkpoint.rng_state import rng_state_dict, set_rng_state
from megatron.checkpoint.storage import (
    MARKER_NAME,
    SHARD_NAME,
    TRACKER_NAME,
    CheckpointError,
    ShardIntegrityError,
    checkpoint_dir,
    file_crc32,
    finalize_checkpoint,
    save_shard,
    shard_path,
    tracker_path,
)
from tests.helpers.checkpoints import _damage, _FullDisk, full_disk_on_rank1
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.training import _train, flags


def _noop() -> None:
    pass


def _state(iteration: int, tp: int = 0, pp: int = 0) -> dict:
    return {"iteration": iteration, "w": torch.full((3,), float(100 * iteration + 10 * tp + pp))}


def _save(root, iteration: int, tp_size: int = 1, pp_size: int = 1, retain_last=None) -> None:
    """A complete single-process save of every shard of `iteration`."""
    for tp in range(tp_size):
        for pp in range(pp_size):
            save_shard(
                root,
                iteration,
                _state(iteration, tp, pp),
                tp_rank=tp,
                pp_rank=pp,
                pp_size=pp_size,
                write=True,
            )
    finalize_checkpoint(
        root,
        iteration,
        barrier=_noop,
        is_rank0=True,
        num_shards_expected=tp_size * pp_size,
        retain_last=retain_last,
    )


def _crash(root, iteration: int) -> None:
    """What a crash after the shard write leaves: a shard, no marker, the pointer unmoved."""
    save_shard(root, iteration, _state(iteration), tp_rank=0, pp_rank=0, pp_size=1, write=True)


def _iterations(root) -> list[int]:
    return sorted(int(p.name[len("iter_") :]) for p in Path(root).glob("iter_*"))


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("pp_size", [1, 2])
def test_round_trip(tmp_path, pp_size):
    _save(tmp_path, 1000, tp_size=2, pp_size=pp_size)
    names = (
        {"mp_rank_00", "mp_rank_01"}
        if pp_size == 1
        else {"mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"}
    )
    it_dir = tmp_path / "iter_0001000"
    assert {p.name for p in it_dir.iterdir() if p.is_dir()} == names
    assert shard_path(tmp_path, 1000, 1, 1, pp_size) == str(
        it_dir / ("mp_rank_01" if pp_size == 1 else "mp_rank_01_001") / "model_optim_rng.pt"
    )
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1000"
    marker = json.loads((it_dir / MARKER_NAME).read_text())
    assert len(marker["shards"]) == len(names)
    assert not [p for p in tmp_path.rglob("*.tmp.*")], "temp files left behind"

    assert read_tracker(tmp_path) == 1000
    assert resolve_load_iteration(tmp_path) == 1000
    for tp in range(2):
        for pp in range(pp_size):
            got = load_shard(tmp_path, 1000, tp_rank=tp, pp_rank=pp, pp_size=pp_size)
            assert got["iteration"] == 1000
            assert torch.equal(got["w"], _state(1000, tp, pp)["w"])


def test_finalize_refuses_missing_shards(tmp_path):
    _save(tmp_path, 1)
    save_shard(tmp_path, 2, _state(2), tp_rank=0, pp_rank=0, pp_size=1, write=True)
    save_shard(tmp_path, 2, _state(2), tp_rank=1, pp_rank=0, pp_size=1, write=False)
    with pytest.raises(CheckpointError, match="expected 2 shard files, found 1"):
        finalize_checkpoint(tmp_path, 2, barrier=_noop, is_rank0=True, num_shards_expected=2)
    assert read_tracker(tmp_path) == 1
    assert not (tmp_path / "iter_0000002" / MARKER_NAME).exists()


def test_load_missing_shard_names_file_and_layout(tmp_path):
    _save(tmp_path, 3, tp_size=1)
    with pytest.raises(CheckpointError) as err:
        load_shard(tmp_path, 3, tp_rank=1, pp_rank=0, pp_size=1)  # loading with TP=2
    msg = str(err.value)
    assert "mp_rank_01" in msg and "mp_rank_00/model_optim_rng.pt" in msg and "TP/PP" in msg


def test_a_missing_optimizer_file_is_named_as_one_not_as_another_layout(tmp_path):
    _save(tmp_path, 3, tp_size=1)
    name = storage.DISTRIB_OPTIM_NAME.format(dp_rank=1)
    with pytest.raises(CheckpointError) as err:
        load_shard(tmp_path, 3, tp_rank=0, pp_rank=0, pp_size=1, name=name)
    msg = str(err.value)
    path = shard_path(tmp_path, 3, 0, 0, 1, name)
    assert msg.startswith(f"missing checkpoint optimizer state file {path}"), msg
    assert "--no-load-optim" in msg and "TP/PP" not in msg


# ---------------------------------------------------------------------------- SIGKILL mid-save

_CHILD = """
import os, signal, sys
import torch
import megatron.checkpoint.storage as ckpt

root, point = sys.argv[1], sys.argv[2]

def save(it, stop_after_shards=False):
    for tp in range(2):
        state = {"iteration": it, "w": torch.full((3,), float(100 * it + 10 * tp))}
        ckpt.save_shard(root, it, state, tp_rank=tp, pp_rank=0, pp_size=1, write=True)
    if stop_after_shards:
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.finalize_checkpoint(root, it, barrier=lambda: None, is_rank0=True, num_shards_expected=2)

save(1)
# Die right before the rename onto `target`: its temp file is fully written and fsynced.
target = {
    "temp_shard": ckpt.shard_path(root, 2, 0, 0, 1),
    "second_shard": ckpt.shard_path(root, 2, 1, 0, 1),
    "marker": os.path.join(ckpt.checkpoint_dir(root, 2), ckpt.MARKER_NAME),
    "pointer": ckpt.tracker_path(root),
}.get(point)
real_replace = os.replace
def replace(src, dst):
    if os.fspath(dst) == target:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = replace
save(2, stop_after_shards=point == "before_finalize")
"""

KILL_POINTS = ["temp_shard", "second_shard", "before_finalize", "marker", "pointer"]


@pytest.mark.slow
def test_sigkill_during_save_never_moves_pointer_to_partial_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    children = {
        point: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path / point), point],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for point in KILL_POINTS
    }
    for point, child in children.items():
        out = child.communicate(timeout=120)[0].decode()
        # A child that was not killed finished the save: the kill point was never reached,
        # e.g. because a file was written in place rather than renamed into place.
        assert child.returncode == -signal.SIGKILL, f"{point}: exit {child.returncode}\n{out}"
        root = tmp_path / point
        assert read_tracker(root) == 1, f"{point}: pointer moved past the complete checkpoint"
        assert resolve_load_iteration(root) == 1, point
        for tp in range(2):
            got = load_shard(root, 1, tp_rank=tp, pp_rank=0, pp_size=1)
            assert torch.equal(got["w"], torch.full((3,), float(100 + 10 * tp))), point
        # The next run overwrites the debris of the crashed save and commits normally.
        _save(root, 2, tp_size=2, retain_last=1)
        assert resolve_load_iteration(root) == 2 and _iterations(root) == [2], point
        # ... and removes the temp files the killed save left (shard, marker or pointer).
        assert not [p for p in root.rglob("*.tmp.*")], f"{point}: temp files of the dead save"
        assert load_shard(root, 2, tp_rank=1, pp_rank=0, pp_size=1)["iteration"] == 2


# ---------------------------------------------------------------------------- pointer fallback


def test_corrupt_pointer_falls_back_to_newest_complete(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    Path(tracker_path(tmp_path)).write_text("not-a-number\n")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_tracker(tmp_path)
    with pytest.warns(UserWarning, match="corrupt.*falling back .* iteration 2"):
        assert resolve_load_iteration(tmp_path) == 2
    Path(tracker_path(tmp_path)).write_bytes(b"\xff\xfe\x00")  # not even text
    with pytest.warns(UserWarning, match="unreadable.*falling back"):
        assert resolve_load_iteration(tmp_path) == 2


def test_pointer_to_missing_or_incomplete_dir_falls_back(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    Path(tracker_path(tmp_path)).write_text("7")
    with pytest.warns(UserWarning, match="iteration 7.*missing.*falling back .* iteration 2"):
        assert resolve_load_iteration(tmp_path) == 2
    _crash(tmp_path, 3)
    Path(tracker_path(tmp_path)).write_text("3")
    with pytest.warns(UserWarning, match="iteration 3.*incomplete.*iteration 2"):
        assert resolve_load_iteration(tmp_path) == 2
    os.remove(tracker_path(tmp_path))
    with pytest.warns(UserWarning, match="missing.*iteration 2"):
        assert resolve_load_iteration(tmp_path) == 2


def test_marker_with_wrong_shard_size_is_incomplete(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    shard = shard_path(tmp_path, 2, 0, 0, 1)
    size = os.path.getsize(shard)
    Path(shard).write_bytes(Path(shard).read_bytes()[:100])  # truncated after the commit
    # The marker is valid: the message names the truncated file and both sizes.
    why = re.escape(f"{shard} is 100 bytes, but its completion marker recorded {size}")
    with pytest.warns(UserWarning, match=f"iteration 2.*incomplete: {why}.*iteration 1"):
        assert resolve_load_iteration(tmp_path) == 1
    shutil.rmtree(checkpoint_dir(tmp_path, 1))
    with pytest.raises(CheckpointError, match=f"incomplete: {why}") as err:
        resolve_load_iteration(tmp_path)
    assert "no valid marker" not in str(err.value)


def test_no_complete_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    assert resolve_load_iteration(tmp_path) is None  # empty directory: a fresh run
    assert resolve_load_iteration(tmp_path / "does-not-exist") is None
    Path(tracker_path(tmp_path)).write_text("5")
    with pytest.raises(CheckpointError, match="no complete checkpoint.*refusing"):
        resolve_load_iteration(tmp_path)
    os.remove(tracker_path(tmp_path))
    _crash(tmp_path, 4)  # a crashed save, but a pointer exists: a commit happened once
    Path(tracker_path(tmp_path)).write_text("4")
    with pytest.raises(CheckpointError, match="iter_0000004"):
        resolve_load_iteration(tmp_path)
    # A committed checkpoint damaged later, the pointer lost: still no fresh start.
    os.remove(tracker_path(tmp_path))
    _save(tmp_path, 6)
    os.remove(tracker_path(tmp_path))
    shard = Path(shard_path(tmp_path, 6, 0, 0, 1))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="iter_0000004.*iter_0000006.*refusing"):
        resolve_load_iteration(tmp_path)


def test_only_never_committed_saves_start_from_scratch_with_a_warning(tmp_path):
    # A first save killed midway (twice): no pointer, no marker. Refusing would fail every
    # automatic restart the same way; there is nothing to resume, so start fresh, loudly.
    _crash(tmp_path, 4)
    _crash(tmp_path, 8)
    with pytest.warns(
        UserWarning, match=r"only incomplete checkpoints \['iter_0000004', 'iter_0000008'\]"
    ):
        assert resolve_load_iteration(tmp_path) is None
    with pytest.warns(UserWarning, match="starting from scratch"):
        assert load_newest_intact(tmp_path, lambda it: 1 / 0) == (None, None)
    _save(tmp_path, 4)  # the restarted run's first save commits over the debris
    assert resolve_load_iteration(tmp_path) == 4


def test_explicit_iteration_must_be_complete(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _crash(tmp_path, 3)
    assert resolve_load_iteration(tmp_path, iteration=1) == 1
    for it, why in [(3, "incomplete"), (9, "missing")]:
        with pytest.raises(CheckpointError, match=f"iteration {it}.*{why}"):
            resolve_load_iteration(tmp_path, iteration=it)


def test_release_pointer(tmp_path):
    # What a converter writes: `release/` without our marker, pointer text `release`.
    path = Path(shard_path(tmp_path, 0, 0, 0, 1))
    assert path.parent.parent.name == "release"
    path.parent.mkdir(parents=True)
    torch.save(_state(0), path)
    Path(tracker_path(tmp_path)).write_text("release\n")
    assert read_tracker(tmp_path) == 0
    assert resolve_load_iteration(tmp_path) == 0
    assert load_shard(tmp_path, 0, tp_rank=0, pp_rank=0, pp_size=1)["iteration"] == 0
    _save(tmp_path, 10, retain_last=1)  # a run started from it keeps the release
    assert resolve_load_iteration(tmp_path) == 10 and Path(checkpoint_dir(tmp_path, 0)).is_dir()


# ---------------------------------------------------------------------------- unsafe pickles


class _Trap:
    """Unpickling this runs a shell command that creates `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


def test_booby_trapped_pickle_is_refused_without_running(tmp_path):
    sentinel = tmp_path / "pwned"
    path = Path(shard_path(tmp_path / "ckpt", 1, 0, 0, 1))
    path.parent.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(2)}, "payload": _Trap(sentinel)}, path)
    finalize_checkpoint(tmp_path / "ckpt", 1, barrier=_noop, is_rank0=True)
    assert resolve_load_iteration(tmp_path / "ckpt") == 1
    with pytest.raises(CheckpointError, match="needs arbitrary unpickling, which we refuse"):
        load_shard(tmp_path / "ckpt", 1, tp_rank=0, pp_rank=0, pp_size=1)
    assert not sentinel.exists(), "the pickle ran code"
    torch.load(path, weights_only=False)  # the trap is live: an unsafe load would run it
    assert sentinel.exists()


def test_truncated_shard_is_a_checkpoint_error(tmp_path):
    _save(tmp_path, 1)
    shard = Path(shard_path(tmp_path, 1, 0, 0, 1))
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_shard(tmp_path, 1, tp_rank=0, pp_rank=0, pp_size=1)


# ---------------------------------------------------------------------------- checksums


def _big_state(iteration: int) -> dict:
    """A shard with 16 KiB of tensor data, so 1 KiB of damage lands inside one tensor."""
    gen = torch.Generator().manual_seed(iteration)
    return {"iteration": iteration, "w": torch.randn(4096, generator=gen), "args": {"it": "x"}}


def _save_big(root, iteration: int) -> None:
    save_shard(root, iteration, _big_state(iteration), tp_rank=0, pp_rank=0, pp_size=1, write=True)
    finalize_checkpoint(root, iteration, barrier=_noop, is_rank0=True, num_shards_expected=1)


def _load_newest(root):
    return load_newest_intact(
        root, lambda it: load_shard(root, it, tp_rank=0, pp_rank=0, pp_size=1)
    )


def test_marker_records_size_and_crc32_of_every_shard(tmp_path):
    _save(tmp_path, 1, tp_size=2)
    marker = json.loads((tmp_path / "iter_0000001" / MARKER_NAME).read_text())
    assert (
        set(marker["crc32"])
        == set(marker["shards"])
        == {f"mp_rank_0{tp}/model_optim_rng.pt" for tp in range(2)}
    )
    for rel, crc in marker["crc32"].items():
        data = (tmp_path / "iter_0000001" / rel).read_bytes()
        assert crc == zlib.crc32(data) and marker["shards"][rel] == len(data)
        assert file_crc32(tmp_path / "iter_0000001" / rel, chunk_size=7) == crc  # chunked


@pytest.mark.parametrize("where", ["tensor data", "pickle header"])
def test_damaged_newest_checkpoint_is_named_and_older_one_loads(tmp_path, where):
    _save_big(tmp_path, 1)
    _save_big(tmp_path, 2)
    path = shard_path(tmp_path, 2, 0, 0, 1)
    _damage(path, where)
    with pytest.raises(ShardIntegrityError, match=f"{path} is damaged: CRC-32"):
        load_shard(tmp_path, 2, tp_rank=0, pp_rank=0, pp_size=1)
    with pytest.warns(UserWarning) as record:
        iteration, state = _load_newest(tmp_path)
    assert iteration == 1 and torch.equal(state["w"], _big_state(1)["w"])
    messages = [str(w.message) for w in record]
    assert any(f"not loading iteration 2 from {tmp_path}: {path} is damaged" in m for m in messages)
    assert any("names iteration 2, but" in m and "falling back" in m for m in messages)
    # Nothing to fall back to: an error naming the file, never a fresh start.
    _damage(shard_path(tmp_path, 1, 0, 0, 1), where)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as err:
        _load_newest(tmp_path)
    msg = str(err.value)
    assert "no complete checkpoint that loads" in msg and "refusing to start from scratch" in msg
    assert path in msg and shard_path(tmp_path, 1, 0, 0, 1) in msg


def test_marker_without_checksums_still_loads_and_catches_unpicklable_shards(tmp_path):
    # Markers written before checksums (tests/fixtures/legacy_checkpoint) vouch for sizes only.
    _save_big(tmp_path, 1)
    _save_big(tmp_path, 2)
    for it in (1, 2):
        marker_file = Path(checkpoint_dir(tmp_path, it)) / MARKER_NAME
        marker = json.loads(marker_file.read_text())
        del marker["crc32"]
        marker_file.write_text(json.dumps(marker))
    assert torch.equal(_load_newest(tmp_path)[1]["w"], _big_state(2)["w"])
    path = shard_path(tmp_path, 2, 0, 0, 1)
    _damage(path, "pickle header")
    with pytest.raises(ShardIntegrityError, match=f"{path} is (damaged|unreadable)"):
        load_shard(tmp_path, 2, tp_rank=0, pp_rank=0, pp_size=1)
    with pytest.warns(UserWarning) as record:
        assert _load_newest(tmp_path)[0] == 1
    assert any(f"not loading iteration 2 from {tmp_path}: {path}" in str(w.message) for w in record)
    Path(path).write_bytes(Path(path).read_bytes()[:-10])  # the size check still holds
    with pytest.raises(ShardIntegrityError, match="bytes, but its checkpoint's marker recorded"):
        load_shard(tmp_path, 2, tp_rank=0, pp_rank=0, pp_size=1)


def test_ranks_fall_back_or_fail_together(tmp_path):
    """A shard damaged on another rank moves this rank back too; a layout error anywhere is
    an error everywhere (`agree` stands in for the all-gather over ranks)."""
    _save_big(tmp_path, 1)
    _save_big(tmp_path, 2)
    tried = []

    def load(it):
        tried.append(it)
        return load_shard(tmp_path, it, tp_rank=0, pp_rank=0, pp_size=1)

    def rank1_damaged_at_2(mine):
        return [mine, ("damaged", "rank 1: its shard of 2 is damaged") if tried[-1] == 2 else None]

    with pytest.warns(UserWarning, match="rank 1: its shard of 2 is damaged"):
        iteration, state = load_newest_intact(tmp_path, load, agree=rank1_damaged_at_2)
    assert tried == [2, 1] and iteration == 1 and state["iteration"] == 1
    with pytest.raises(CheckpointError, match="missing checkpoint shard on rank 1"):
        load_newest_intact(
            tmp_path,
            load,
            agree=lambda mine: [mine, ("error", "missing checkpoint shard on rank 1")],
        )
    assert tried == [2, 1, 2]


# ---------------------------------------------------------------------------- disk full


def _assert_previous_checkpoint_intact(root) -> None:
    assert read_tracker(root) == 1 and resolve_load_iteration(root) == 1
    assert load_shard(root, 1, tp_rank=0, pp_rank=0, pp_size=1)["iteration"] == 1
    assert not list(Path(root).rglob("*.tmp.*")), "the failed write's temp file must go"


@pytest.mark.parametrize("target", [SHARD_NAME, MARKER_NAME, TRACKER_NAME])
def test_disk_full_during_save_names_file_and_free_space(tmp_path, monkeypatch, target):
    _save(tmp_path, 1)
    real_open = open

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FullDisk(f) if os.path.basename(file).startswith(f".{target}.tmp.") else f

    monkeypatch.setattr(storage, "open", full_open, raising=False)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 2)
    monkeypatch.undo()
    written = {
        SHARD_NAME: shard_path(tmp_path, 2, 0, 0, 1),
        MARKER_NAME: os.path.join(checkpoint_dir(tmp_path, 2), MARKER_NAME),
        TRACKER_NAME: tracker_path(tmp_path),
    }[target]
    msg = str(err.value)
    assert "\n" not in msg, "one line"
    assert f"cannot write checkpoint file {written}: [Errno {errno.ENOSPC}] " in msg
    where = re.escape(os.path.dirname(written))
    assert re.search(rf"[0-9.]+ (B|KiB|MiB|GiB|TiB) free of [0-9.]+ \w+ on {where}\.", msg), msg
    assert f"the pointer in {tmp_path} still names iteration 1, a complete checkpoint; free " in msg
    _assert_previous_checkpoint_intact(tmp_path)


_FILE_TOO_LARGE = """
import resource, signal, sys
import torch
import megatron.checkpoint.storage as ckpt

root = sys.argv[1]
state = lambda it, n: {"iteration": it, "w": torch.ones(n)}
ckpt.save_shard(root, 1, state(1, 10), tp_rank=0, pp_rank=0, pp_size=1, write=True)
ckpt.finalize_checkpoint(root, 1, barrier=lambda: None, is_rank0=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
for where, it in ((root, 2), (root + "/first", 1)):  # after a checkpoint, and the first save
    try:
        ckpt.save_shard(where, it, state(it, 1 << 20), tp_rank=0, pp_rank=0, pp_size=1, write=True)
    except ckpt.CheckpointError as e:
        print(e)
"""


def test_real_write_error_inside_torch_save_is_one_named_line(tmp_path):
    # torch.save turns the OSError of a failed write into "enforce fail at inline_container.cc";
    # a real one (file size limit, EFBIG) must still come out as our one-line error.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FILE_TOO_LARGE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    shard = shard_path(tmp_path, 2, 0, 0, 1)
    after, first = out.stdout.splitlines()
    assert after.startswith(f"cannot write checkpoint file {shard}: [Errno {errno.EFBIG}]")
    # the limit, not the free space (plenty), and what a resume finds: each as it is
    limit = "this process's file-size limit (ulimit -f, RLIMIT_FSIZE 1.0 MiB)"
    assert limit in after and " free of " not in after, after
    assert f"the pointer in {tmp_path} still names iteration 1, a complete checkpoint" in after
    assert "raise the limit (ulimit -f unlimited)" in after
    assert f"{tmp_path}/first holds no complete checkpoint (this was its first save)" in first
    _assert_previous_checkpoint_intact(tmp_path)


# ---------------------------------------------------------------------------- keep-last-K


def test_keep_last_k_with_a_crash_in_between(tmp_path):
    k = 2
    _save(tmp_path, 1, retain_last=k)
    _save(tmp_path, 2, retain_last=k)
    assert _iterations(tmp_path) == [1, 2]
    _crash(tmp_path, 3)
    _save(tmp_path, 4, retain_last=k)
    # The crashed iter 3 neither counts toward K (else 2 would go) nor survives as garbage.
    assert _iterations(tmp_path) == [2, 4]
    _crash(tmp_path, 5)  # newer than every complete checkpoint: untouched until committed
    assert _iterations(tmp_path) == [2, 4, 5]
    _save(tmp_path, 6, retain_last=k)
    assert _iterations(tmp_path) == [4, 6]
    assert resolve_load_iteration(tmp_path) == 6
    for it in (4, 6):
        assert load_shard(tmp_path, it, tp_rank=0, pp_rank=0, pp_size=1)["iteration"] == it


def test_keep_last_one_keeps_the_checkpoint_just_committed(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 1)
    _save(tmp_path, 2, retain_last=1)  # a run resumed from 1; iter 5 belongs to another run
    assert _iterations(tmp_path) == [2, 5]
    assert read_tracker(tmp_path) == 2 and resolve_load_iteration(tmp_path) == 2
    with pytest.raises(ValueError, match="retain_last"):
        finalize_checkpoint(tmp_path, 2, barrier=_noop, is_rank0=True, retain_last=0)


# ---------------------------------------------------------------------------- RNG


def _draw() -> tuple:
    return (
        [random.random(), random.gauss(0, 1), random.getrandbits(64)],
        np.concatenate([np.random.rand(3), np.random.randn(3)]),
        torch.rand(4),
        torch.randn(3),
    )


def test_rng_round_trip_is_bit_exact(tmp_path):
    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # leave a cached gaussian in both generators
    np.random.randn(1)
    state = rng_state_dict("cpu")
    state["tracker"] = {"model-parallel-rng": torch.Generator().manual_seed(3).get_state()}
    torch.save({"rng_state": [state]}, tmp_path / "rng.pt")
    expected = _draw()

    _draw()  # move every generator on
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)["rng_state"][0]
    set_rng_state(loaded, "cpu")
    got = _draw()
    assert got[0] == expected[0]
    assert np.array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])
    assert torch.equal(
        loaded["tracker"]["model-parallel-rng"], state["tracker"]["model-parallel-rng"]
    )
    assert loaded["cuda"] is None


# ---------------------------------------------------------------------------- 2 gloo ranks


def _two_rank_commit(rank: int, world_size: int, root: str):
    import torch.distributed as dist

    pointer_writes = []
    real_replace = os.replace

    def spy(src, dst):
        if os.fspath(dst) == tracker_path(root):
            pointer_writes.append(rank)
        real_replace(src, dst)

    with mock.patch.object(os, "replace", spy):
        if rank == 1:
            time.sleep(0.5)  # a slow writer: rank 0 must wait for it before marking
        state = {"rank": rank, "w": torch.full((2,), float(rank))}
        save_shard(root, 7, state, tp_rank=rank, pp_rank=0, pp_size=1, write=True)
        finalize_checkpoint(
            root, 7, barrier=dist.barrier, is_rank0=rank == 0, num_shards_expected=world_size
        )
        # After finalize returns on any rank, the pointer has already moved.
        seen = read_tracker(root)
    return len(pointer_writes), seen


def _full_disk_on_rank1(rank: int, world_size: int, root: str, argv: list[str]):
    """A TP=2 run saving at iterations 2 and 4, whose rank 1 finds the disk full at 4: what
    each rank raised, and how long after the failed write."""
    # what the module's writer opens files with (shadows the builtin)
    storage.open = full_disk_on_rank1(rank)
    try:
        _train(rank, world_size, [*argv, "--save", root, "--save-interval", "2"])
    except CheckpointError as e:
        return str(e), time.monotonic()
    finally:
        del storage.open
    return None, time.monotonic()


@pytest.mark.slow
def test_two_ranks_commit_once_and_agree_on_a_failed_write(tmp_path, data_prefix):
    results = run_distributed(_two_rank_commit, 2, str(tmp_path))
    assert results == [(1, 7), (0, 7)]
    for tp in range(2):
        assert load_shard(tmp_path, 7, tp_rank=tp, pp_rank=0, pp_size=1)["rank"] == tp
    assert resolve_load_iteration(tmp_path) == 7

    # One rank's write fails: every rank stops at once with the error naming it (before, rank 0
    # waited in the commit barrier until the collective timeout), and 4 is never marked.
    root = str(tmp_path / "full")
    argv = flags(data_prefix, "--tensor-model-parallel-size", "2", iters=4)
    (msg0, t0), (msg1, t1) = run_distributed(_full_disk_on_rank1, 2, root, argv)
    lost = shard_path(root, 4, 1, 0, 1)
    assert msg1.startswith(f"cannot write checkpoint file {lost}: [Errno {errno.ENOSPC}]"), msg1
    assert msg0.startswith(f"iteration 4 was not saved: rank 1 failed (cannot write checkpoint "
                           f"file {lost}: [Errno {errno.ENOSPC}]"), msg0  # fmt: skip
    assert "previous checkpoint" in msg0 and "\n" not in msg0 + msg1
    assert abs(t0 - t1) < 10, "both ranks stop together"
    assert read_tracker(root) == 2 and resolve_load_iteration(root) == 2
    assert not os.path.exists(os.path.join(checkpoint_dir(root, 4), MARKER_NAME))
