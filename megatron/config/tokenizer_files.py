"""The tokenizer's files: a training run needs a vocab, and GPT-2 BPE files that exist (checked
by megatron.config.rules.validate for training and evaluation; the search of
--tokenizer-model-type's files is TokenizerConfig.with_pretrained_files)."""

from __future__ import annotations

import os

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig


def validate_vocab(cfg: MegatronConfig) -> None:
    """A training run needs a vocab: a tokenizer, or --vocab-size for pre-tokenized ids."""
    if cfg.data.tokenizer.tokenizer_type is None and cfg.model.vocab_size is None:
        fail(
            "--vocab-file",
            "no tokenizer and no --vocab-size",
            "pass --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt (GPT-2 BPE, the "
            "v1.x default), or --vocab-size N for data that is already token ids",
        )


def check_tokenizer_files(cfg: MegatronConfig) -> None:
    """GPT-2 BPE files that exist (checked when training starts, before any other work)."""
    tok = cfg.data.tokenizer
    if tok.tokenizer_type != "GPT2BPETokenizer":
        return
    if not tok.vocab_file and not tok.merge_file:
        return  # GPT-2's own files, shipped in the package (megatron/data/gpt2_files.py)
    for flag, path in (("--vocab-file", tok.vocab_file), ("--merge-file", tok.merge_file)):
        if not path:
            fail(
                flag,
                "GPT2BPETokenizer needs both files or neither",
                f"pass {flag} too, or neither file for GPT-2's own (shipped in the package)",
            )
        if not os.path.isfile(path):
            fail(flag, f"{path}: no such file", f"pass the path of an existing file to {flag}")
