"""The tokenizer of a Hugging Face export, both ways: our tokenizer files copied beside the model
with a tokenizer_config.json that transformers' AutoTokenizer loads (GPT-2 BPE as
GPT2Tokenizer, a tokenizer.json as PreTrainedTokenizerFast, a SentencePiece model as is), and
the files of an HF directory as the tokenizer settings a checkpoint records.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from megatron.config.schema import ModelConfig
from megatron.data.gpt2_files import builtin_gpt2_files
from megatron.data.tokenizers import HF_EOD_TOKENS

GPT2_EOD = HF_EOD_TOKENS[0]  # "<|endoftext|>"


def write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def _tokenizer_kind(path: str) -> str:
    """'vocab', 'merges', 'tokenizer_json' or 'sentencepiece', from the name (and content)."""
    base = os.path.basename(path)
    if base.endswith(".model"):
        return "sentencepiece"
    if base.endswith(".txt"):
        return "merges"
    if base.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return "tokenizer_json" if isinstance(value.get("model"), dict) else "vocab"
    raise ValueError(
        f"--tokenizer-files {path}: expected vocab.json, merges.txt, tokenizer.json or a "
        "SentencePiece .model"
    )


def _recorded_tokenizer_files(tok_args: dict) -> list[str]:
    no_files = not any(tok_args.get(k) for k in ("vocab_file", "merge_file", "tokenizer_model"))
    if tok_args.get("tokenizer_type") == "GPT2BPETokenizer" and no_files:
        return list(builtin_gpt2_files())  # trained with GPT-2's own, shipped in the package
    files = []
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        path = tok_args.get(key)
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if path and os.path.isfile(path):
            files.append(path)
        elif path:
            print(f"warning: tokenizer file {path} is gone; not exported", file=sys.stderr)
    return files


def _eod_in(tokenizer_json: str) -> str | None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    return next((t for t in HF_EOD_TOKENS if tok.token_to_id(t) is not None), None)


def export_tokenizer(
    tok_args: dict, out_dir: str, files: list[str] | None, cfg: ModelConfig
) -> int | None:
    """Copy the tokenizer files into `out_dir` with a tokenizer_config.json; the eod id or None.

    vocab.json + merges.txt load as GPT2Tokenizer, a tokenizer.json as PreTrainedTokenizerFast;
    a SentencePiece model is copied as tokenizer.model without a tokenizer config.
    """
    kinds = {_tokenizer_kind(p): p for p in (files or _recorded_tokenizer_files(tok_args))}
    targets = {
        "vocab": "vocab.json",
        "merges": "merges.txt",
        "tokenizer_json": "tokenizer.json",
        "sentencepiece": "tokenizer.model",
    }
    for kind, path in kinds.items():
        shutil.copyfile(path, os.path.join(out_dir, targets[kind]))
    eod_token, tok_cfg = None, None
    if "vocab" in kinds and "merges" in kinds:
        with open(kinds["vocab"], encoding="utf-8") as f:
            vocab = json.load(f)
        eod_token = GPT2_EOD if GPT2_EOD in vocab else None
        tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
    elif "tokenizer_json" in kinds:
        eod_token = _eod_in(kinds["tokenizer_json"])
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    elif "sentencepiece" in kinds:
        print(
            "note: SentencePiece model copied as tokenizer.model, no tokenizer config",
            file=sys.stderr,
        )
    if tok_cfg is None:
        return None
    tok_cfg["model_max_length"] = cfg.max_positions
    eod = None
    if eod_token is not None:
        tok_cfg.update(bos_token=eod_token, eos_token=eod_token, unk_token=eod_token)
        if "tokenizer_json" in kinds:
            from tokenizers import Tokenizer

            eod = Tokenizer.from_file(kinds["tokenizer_json"]).token_to_id(eod_token)
        else:
            eod = vocab[eod_token]
    write_json(os.path.join(out_dir, "tokenizer_config.json"), tok_cfg)
    return eod if eod is not None and eod < cfg.vocab_size else None


def import_tokenizer(hf_dir: str) -> dict:
    """TokenizerConfig fields (as recorded in checkpoint args) for the files in `hf_dir`."""
    path = lambda name: os.path.abspath(os.path.join(hf_dir, name))  # noqa: E731
    exists = lambda name: os.path.isfile(os.path.join(hf_dir, name))  # noqa: E731
    tok = {"tokenizer_type": None, "vocab_file": None, "merge_file": None, "tokenizer_model": None}
    if exists("vocab.json") and exists("merges.txt"):
        with open(path("vocab.json"), encoding="utf-8") as f:
            if GPT2_EOD in json.load(f):
                tok.update(
                    tokenizer_type="GPT2BPETokenizer",
                    vocab_file=path("vocab.json"),
                    merge_file=path("merges.txt"),
                )
    if exists("tokenizer.json"):
        tok["tokenizer_model"] = path("tokenizer.json")  # GPT2BPETokenizer ignores it
        if tok["tokenizer_type"] is None and _eod_in(path("tokenizer.json")) is not None:
            tok["tokenizer_type"] = "HuggingFaceTokenizer"
    elif exists("tokenizer.model"):
        tok["tokenizer_model"] = path("tokenizer.model")
        tok["tokenizer_type"] = tok["tokenizer_type"] or "SentencePieceTokenizer"
    return tok
