"""GPT-2's own vocab.json / merges.txt, shipped in the package (megatron/data/assets/gpt2/,
OpenAI's MIT release), so `--tokenizer-type GPT2BPETokenizer` with no `--vocab-file` /
`--merge-file` works offline, as nanoGPT's and Hugging Face's `gpt2` do.

The files are checked against the sha256 that tiktoken checks for OpenAI's `gpt2` encoding, so a
damaged install fails loudly instead of tokenizing with a different vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

ASSETS = Path(__file__).with_name("assets") / "gpt2"
SHA256 = {
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


@functools.cache
def builtin_gpt2_files() -> tuple[str, str]:
    """(vocab.json, merges.txt) of GPT-2, after checking their sha256."""
    for name, want in SHA256.items():
        path = ASSETS / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: GPT-2's built-in {name} is missing from this install; reinstall the "
                "package (setup.py package_data ships it) or pass --vocab-file/--merge-file"
            )
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != want:
            raise ValueError(
                f"{path}: sha256 {got} is not GPT-2's {want}; the file is damaged, reinstall the "
                "package or pass --vocab-file/--merge-file"
            )
    return str(ASSETS / "vocab.json"), str(ASSETS / "merges.txt")
