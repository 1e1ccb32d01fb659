"""--wandb-project: the same scalars as TensorBoard plus the resolved config, checked in the
offline run file; wandb (and the other optional packages) are not imported unless used."""

import glob
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import rules_logging
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.training import counting_corpus, flags, train_quietly


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """200 documents counting by 1 (the corpus of test_profiling.py)."""
    return counting_corpus(tmp_path_factory.mktemp("data"), documents=200, strided=False)


def _wandb_records(path: str):
    """The protobuf records of an offline run file: a 7-byte header, then LevelDB-style log
    blocks of 32 KiB whose records are (crc32, length, type) + payload, split over blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _tensorboard_scalars(directory: str) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory)
    acc.Reload()
    return {
        (tag, e.step): e.value
        for tag in acc.Tags()["scalars"]
        if not tag.endswith(" vs samples")  # W&B logs consumed-samples as a metric instead
        for e in acc.Scalars(tag)
    }


@pytest.mark.slow
def test_offline_run_logs_the_tensorboard_scalars_and_the_config(
    data_prefix,
    tmp_path,
    monkeypatch,
):
    pytest.importorskip("wandb", reason="pip install wandb (the [wandb] extra)")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = flags(data_prefix, iters=4) + [
        "--eval-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
        "--wandb-project", "megatron-test", "--wandb-exp-name", "toy",
        "--wandb-save-dir", str(tmp_path / "wb"),
    ]  # fmt: skip
    run_distributed(train_quietly, 1, argv)
    (run_file,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged, config, name = {}, {}, None
    for r in _wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            step = r.history.step.num
            logged.update({(k, step): float(v) for k, v in items.items() if k[0] != "_"})
        elif kind == "config":
            config.update({i.key or "/".join(i.nested_key): i.value_json for i in r.config.update})
        elif kind == "run":
            name = r.run.display_name
    tensorboard = _tensorboard_scalars(str(tmp_path / "tb"))
    assert {k for k in tensorboard if k[0] == "lm-loss"} == {("lm-loss", s) for s in (1, 2, 3, 4)}
    assert ("validation lm-loss", 2) in tensorboard
    for key, value in tensorboard.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert logged[("consumed-samples", 4)] == 32
    assert name == "toy"
    assert '"micro_batch_size":2' in config["training"].replace(" ", "")
    assert '"hidden_size":32' in config["model"].replace(" ", "")


def test_wandb_project_without_the_package_fails_fast(monkeypatch):
    monkeypatch.setattr(rules_logging.importlib.util, "find_spec", lambda name: None)
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    argv += "--vocab-size 128 --train-iters 5 --lr 1e-3 --wandb-project p"
    with pytest.raises(ConfigError, match="--wandb-project.*pip install wandb"):
        validate(parse_args(argv.split(), world_size=1), "train-gpt")


_OPTIONAL = ("wandb", "pyarrow", "datasets", "lm_eval", "fastapi", "uvicorn", "matplotlib")


@pytest.mark.slow
def test_training_start_imports_no_optional_package():
    """`pretrain_gpt2.py --help` (and so a run's start) imports none of the optional extras."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['pretrain_gpt2.py', '--help']\n"
        "try:\n    runpy.run_path('pretrain_gpt2.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(sorted(m for m in {_OPTIONAL!r} if m in sys.modules), file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
