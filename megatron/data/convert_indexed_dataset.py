"""tools/convert_indexed_dataset.py: v1.x TNTIDX (lazy/cached) PREFIX.bin/.idx -> mmap files.

The output is byte for byte what tools/preprocess_data.py writes for the same token ids: the
same index writer, and the same token dtype rule (uint16 when the vocab has fewer than 65500
entries, else int32). Give the tokenizer's `--vocab-size` to apply that rule exactly; without
it the largest id in the data stands in for the vocab (the same choice for any vocab under
65500). The input is checked first (header, offsets, ids >= 0 and < the vocab), and nothing is
left under the output names when anything fails.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from megatron.data.dataset_impl import infer_dataset_impl
from megatron.data.dataset_pair import commit_pair, sidecar_path
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    best_dtype,
    data_file_path,
    index_file_path,
    write_index,
)
from megatron.data.legacy_indexed_dataset import LegacyIndexedDataset

_BLOCK = 1 << 20  # sequences read per block: bounds memory for any corpus size


def _blocks(ds: LegacyIndexedDataset):
    for start in range(0, len(ds), _BLOCK):
        stop = min(start + _BLOCK, len(ds))
        yield start, ds.read_range(start, stop)


def _check_ids(ds: LegacyIndexedDataset, vocab_size: int | None) -> int:
    """The largest token id; raises naming the file and sequence for an id outside the vocab."""
    path = data_file_path(ds.prefix)
    if ds.dtype.kind not in "iu":
        raise IndexedDatasetError(f"{path}: dtype {ds.dtype} is not token ids (integers)")
    top = -1
    ends = np.cumsum(ds.sizes)
    for start, tokens in _blocks(ds):
        if not len(tokens):
            continue
        lo, hi = int(tokens.min()), int(tokens.max())
        bad = lo if lo < 0 else hi if vocab_size is not None and hi >= vocab_size else None
        if bad is not None:
            at = int(np.flatnonzero(tokens == bad)[0])
            base = int(ends[start - 1]) if start else 0
            seq = int(np.searchsorted(ends, base + at, side="right"))
            raise IndexedDatasetError(
                f"{path}: token id {bad} in sequence {seq} is outside the vocab [0, "
                f"{vocab_size if vocab_size is not None else 'inf'}); the file is damaged or "
                "--vocab-size is not the tokenizer's"
            )
        top = max(top, hi)
    return top


def convert(input_prefix: str, output_prefix: str, vocab_size: int | None = None) -> np.dtype:
    """Write OUTPUT.bin/.idx (mmap) holding the tokens of INPUT (TNTIDX); returns the dtype."""
    if os.path.abspath(input_prefix) == os.path.abspath(output_prefix):
        raise ValueError("--output-prefix must differ from --input (the input is read as written)")
    if infer_dataset_impl(input_prefix) == "mmap":
        raise IndexedDatasetError(
            f"{index_file_path(input_prefix)}: already the mmap format; read it with --data-impl "
            "mmap (or infer), nothing to convert"
        )
    ds = LegacyIndexedDataset(input_prefix)
    top = _check_ids(ds, vocab_size)
    dtype = np.dtype(best_dtype(vocab_size if vocab_size is not None else top + 1))
    if np.any(ds.sizes > np.iinfo(np.int32).max):
        raise IndexedDatasetError(f"{index_file_path(input_prefix)}: a sequence over 2^31 tokens")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    bin_tmp, idx_tmp = (
        f"{data_file_path(output_prefix)}{tag}",
        f"{index_file_path(output_prefix)}{tag}",
    )
    try:
        with open(bin_tmp, "wb") as f:
            for _, tokens in _blocks(ds):
                f.write(tokens.astype(dtype).tobytes(order="C"))
        write_index(idx_tmp, dtype, ds.sizes.astype(np.int32), ds.doc_idx)
        commit_pair(output_prefix, bin_tmp, idx_tmp, dtype=dtype.name, max_token_id=top)
    finally:
        for p in (bin_tmp, idx_tmp, f"{sidecar_path(output_prefix)}{tag}"):
            if os.path.exists(p):
                os.remove(p)
    return dtype


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="PREFIX of the TNTIDX .bin/.idx pair")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the tokenizer's vocab size: picks the token dtype as preprocess_data.py does and "
        "checks every id against it (default: from the largest id)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 1:
        print("error: --vocab-size must be positive", file=sys.stderr)
        return 2
    try:
        dtype = convert(args.input, args.output_prefix, args.vocab_size)
    except (ValueError, FileNotFoundError) as e:  # IndexedDatasetError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx ({dtype.name} tokens)",
        file=sys.stderr,
    )
    return 0
