"""`--tokenizer-model-type NAME` (older Megatron's flag): a named pretrained vocabulary, found
in `--cache-dir` or given by `--vocab-file` / `--merge-file`. Nothing is ever downloaded.

Where a vocabulary is looked for in the cache directory, first match wins: the file names of the
original download URLs (`bert-large-uncased-vocab.txt`, `gpt2-vocab.json` + `gpt2-merges.txt`),
a folder named after the model (`gpt2/vocab.json`), and a Hugging Face hub cache
(`models--gpt2/snapshots/*/vocab.json`).
"""

from __future__ import annotations

import glob
import os

# name -> (tokenizer type, {kwarg: file name in the model's folder})
PRETRAINED = {
    "bert-large-uncased": ("BertWordPieceLowerCase", {"vocab_file": "vocab.txt"}),
    "bert-large-cased": ("BertWordPieceCase", {"vocab_file": "vocab.txt"}),
    "gpt2": ("GPT2BPETokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}),
}


def candidates(name: str, cache_dir: str, file: str) -> list[str]:
    """The paths looked at, in order, for one file of model `name` under `cache_dir`."""
    return [
        os.path.join(cache_dir, f"{name}-{file}"),
        os.path.join(cache_dir, name, file),
        os.path.join(cache_dir, f"models--{name}", "snapshots", "*", file),
    ]


def find_files(name: str, cache_dir: str | None) -> dict[str, str | None]:
    """{kwarg: path found in cache_dir, or None} for model `name`."""
    found: dict[str, str | None] = {}
    for kwarg, file in PRETRAINED[name][1].items():
        found[kwarg] = None
        for pattern in candidates(name, cache_dir, file) if cache_dir else []:
            hits = sorted(glob.glob(pattern)) if "*" in pattern else [pattern]
            hits = [h for h in hits if os.path.isfile(h)]
            if hits:
                found[kwarg] = hits[0]
                break
    return found


def problem(name: str, tokenizer_type: str | None, cache_dir: str | None, given: dict):
    """(flag, problem, fix) when --tokenizer-model-type `name` cannot be honoured, else None.
    `given`: the resolved {kwarg: path or None} (after the cache lookup)."""
    want, files = PRETRAINED[name]
    if tokenizer_type != want:
        return (
            "--tokenizer-model-type",
            f"{name} is a {want} vocab, but --tokenizer-type {tokenizer_type} was given",
            f"drop --tokenizer-type, or pass --tokenizer-type {want}",
        )
    flags = {"vocab_file": "--vocab-file", "merge_file": "--merge-file"}
    for kwarg, file in files.items():
        if given.get(kwarg) is None:
            where = (
                f"looked for {', '.join(candidates(name, cache_dir, file))}"
                if cache_dir
                else "no --cache-dir given"
            )
            return (
                "--tokenizer-model-type",
                f"{name}: its {file} was not found ({where}); nothing is downloaded",
                f"pass --cache-dir DIR holding {name}-{file} (or {name}/{file}), "
                f"or {flags[kwarg]} PATH",
            )
    return None
