"""tools/preprocess_data.py's library call with the fixture GPT-2 BPE, and the documents the
preprocessing tests feed it."""

from __future__ import annotations

from megatron.data.preprocess import main
from tests.helpers.paths import MMAP

TOK = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(MMAP / "vocab.json"),
    "--merge-file",
    str(MMAP / "merges.txt"),
]
# Plain ASCII, code with newlines, CJK, an emoji.
DOCS = ["Hello world.", "def f(x):\n    return x\n", "分布式训练", "emoji 🚀 ok"]


def _run(tmp_path, inputs, *extra, prefix="out"):
    return main(
        [
            "--input",
            *map(str, inputs),
            "--output-prefix",
            str(tmp_path / prefix),
            *TOK,
            "--append-eod",
            *extra,
        ]
    )
