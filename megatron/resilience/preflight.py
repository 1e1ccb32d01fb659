"""Checks of the run's output paths, its data and its precision on this device, before any
work: a mistake found after model building and data indexing (or, worse, at the first save an
hour in) costs the user that time."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable

import torch

from megatron.checkpoint.storage import CheckpointError
from megatron.config.declare import ConfigError
from megatron.config.schema import MegatronConfig
from megatron.config.schema_data import parse_blend
from megatron.data.builder import check_tokenizer
from megatron.data.dataset_impl import make_indexed_dataset
from megatron.data.dataset_pair import tokenizer_fingerprint
from megatron.fileio import probe_writable


def check_save_dir(save: str | None) -> None:
    """--save must be a directory this process can create and write (a named error, not the
    traceback of the first write). Every rank checks it: on another node it may differ."""
    if not save:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(
            f"--save {save}: is an existing file, not a directory. Fix: pass a directory "
            "(it is created if missing)"
        )
    try:
        probe_writable(save)
    except OSError as e:
        raise CheckpointError(
            f"--save {save}: cannot write there ({e.strerror or e}"
            f"{': ' + e.filename if e.filename and e.filename != save else ''}). Fix: pass a "
            "writable directory, or fix its permissions / mount"
        ) from None


def starts_fresh_by_design(load: str | None, save: str | None) -> bool:
    """`--load X --save X`: Megatron's idiom for "resume if X holds a checkpoint, else start
    a new run there" (the same command restarts a job, first attempt included)."""
    return bool(load and save) and os.path.realpath(load) == os.path.realpath(save)


def check_load_dir(load: str | None, save: str | None) -> None:
    """--load must name an existing directory: a mistyped path would otherwise train from
    scratch and exit 0. Only `--load X --save X` may name one that does not exist yet."""
    if not load or starts_fresh_by_design(load, save):
        return
    if os.path.isdir(load):
        return
    if os.path.exists(load):
        raise CheckpointError(
            f"--load {load}: is a file, not a checkpoint directory. Fix: pass the directory "
            "that holds latest_checkpointed_iteration.txt (the --save of the earlier run)"
        )
    parent = os.path.dirname(os.path.abspath(load))
    siblings = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    close = difflib.get_close_matches(os.path.basename(os.path.normpath(load)), siblings, n=1)
    hint = f"did you mean {os.path.join(os.path.dirname(load), close[0])}? " if close else ""
    raise CheckpointError(
        f"--load {load}: no such directory, so there is nothing to resume from. Fix: {hint}"
        "check the path; to start a new run drop --load, or pass --load and --save the same "
        "directory (resumed when it holds a checkpoint, started from scratch when it does not)"
    )


_SPLITS = ("train", "valid", "test")


def check_data(cfg: MegatronConfig, tokenizer) -> None:
    """Open every prefix of --data-path (or of --train/valid/test-data-path), its .bin, .idx
    and PREFIX.idx.json, and check it against the run's `tokenizer` (None: ids against the
    vocab only), as the dataset builder will after start-up: a mistyped path, or data made with
    another tokenizer, is named now instead of after the model and the process groups are
    built. Loose JSON input (--train-data) is read at start-up, where it is prepared."""
    d = cfg.data
    splits = (d.train_data_path, d.valid_data_path, d.test_data_path)
    given = [("--data-path", d.data_path)] if d.data_path else []
    given = given or [(f"--{s}-data-path", p) for s, p in zip(_SPLITS, splits, strict=True)]
    prefixes = dict.fromkeys(p for flag, paths in given for _, p in parse_blend(paths, flag))
    fingerprint = None if tokenizer is None else tokenizer_fingerprint(tokenizer)
    for prefix in prefixes:
        indexed = make_indexed_dataset(prefix, d.data_impl)
        check_tokenizer(prefix, indexed, cfg.model.vocab_size, fingerprint)


def deepspeed_dtype_supported(name: str) -> bool:
    """Whether DeepSpeed's engine will accept `name` ("fp16" or "bf16") here: its accelerator's
    answer (on a CPU, fp16 needs oneDNN fp16 support), or without DeepSpeed, torch's."""
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        if name == "fp16":
            return torch.cuda.is_available()
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    accelerator = get_accelerator()
    return bool(getattr(accelerator, f"is_{name}_supported")())


def check_deepspeed_precision(
    cfg: MegatronConfig, supported: Callable[[str], bool] = deepspeed_dtype_supported
) -> None:
    """--deepspeed with --fp16 (--bf16) where DeepSpeed's accelerator lacks that type (fp16 on
    most CPUs): a ConfigError naming the fix now, instead of DeepSpeed's own "Type fp16 is not
    supported on your device" after start-up. Our own backend runs both types everywhere."""
    if not cfg.deepspeed.enabled:
        return
    p, d = cfg.precision, cfg.deepspeed
    for name, other, on in (("fp16", "bf16", p.fp16), ("bf16", "fp16", p.bf16)):
        if not on or supported(name):
            continue
        section = (d.config_json or {}).get(name)
        json_fix = ""
        if isinstance(section, dict) and section.get("enabled") is True:
            json_fix = (
                f' and, in --deepspeed_config {d.config}, "{name}": {{"enabled": false}} (or '
                f'remove its "{name}" section)'
            )
        device = "this GPU" if torch.cuda.is_available() else "this CPU"
        raise ConfigError(
            f"--{name} with --deepspeed: DeepSpeed's engine does not support {name} on "
            f"{device}. Fix: pass --{other} instead of --{name}{json_fix}, or drop --deepspeed "
            f"(our own backend runs --{name} here)"
        )
