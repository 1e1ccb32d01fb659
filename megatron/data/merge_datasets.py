"""tools/merge_datasets.py: concatenate several datasets (PREFIX.bin/.idx) into one mmap dataset.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
An --input may also be a directory: every PREFIX.idx/.bin pair in it is merged, in name order.
Inputs may be mmap files or v1.x's older TNTIDX (lazy/cached) ones, mixed; the output is mmap.
"""

import argparse
import os
import sys

import numpy as np

from megatron.data.dataset_impl import infer_dataset_impl, make_indexed_dataset
from megatron.data.dataset_pair import commit_pair
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    dataset_exists,
    index_file_path,
)


def _prefixes(inputs):
    out = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, f[:-4])
                for f in os.listdir(item)
                if f.endswith(".idx") and dataset_exists(os.path.join(item, f[:-4]))
            )
            if not found:
                raise FileNotFoundError(f"--input {item}: no .bin/.idx pairs in this directory")
            out.extend(found)
        elif dataset_exists(item):
            out.append(item)
        else:
            raise FileNotFoundError(f"--input {item}: {item}.bin/.idx not found")
    return out


def _merge_legacy(builder: MMapIndexedDatasetBuilder, prefix: str) -> None:
    """Append a TNTIDX dataset's documents (its sequences and document boundaries as they are)."""
    ds = make_indexed_dataset(prefix, "lazy")
    if ds.dtype != builder.dtype:
        raise IndexedDatasetError(
            f"{index_file_path(prefix)}: dtype {ds.dtype} differs from {builder.dtype}; "
            "merge only datasets made with the same tokenizer"
        )
    ends = np.asarray(ds.doc_idx, dtype=np.int64)
    if len(ends) == 0 or ends[-1] != len(ds):  # sequences after the last closed document
        ends = np.append(ends if len(ends) else np.zeros(1, np.int64), len(ds))
    builder.add_batch(ds.read_range(0, len(ds)), ds.sizes, np.diff(ends))


def _shared_facts(prefixes) -> dict:
    """What every input's sidecar agrees on (tokenizer, largest id) carries to the output, so
    training still checks the merged data against its tokenizer."""
    records = [getattr(make_indexed_dataset(p), "pair", None) or {} for p in prefixes]
    facts = {}
    tokenizers = [r.get("tokenizer") for r in records]
    if tokenizers[0] and all(t == tokenizers[0] for t in tokenizers):
        facts["tokenizer"] = tokenizers[0]
    tops = [r.get("max_token_id") for r in records]
    if all(t is not None for t in tops):
        facts["max_token_id"] = max(tops)
    return facts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    try:
        prefixes = _prefixes(args.input)
        first = make_indexed_dataset(prefixes[0])
        tmp = f".tmp-{os.getpid()}"
        builder = MMapIndexedDatasetBuilder(f"{args.output_prefix}.bin{tmp}", first.dtype)
        try:
            for prefix in prefixes:
                if infer_dataset_impl(prefix) == "mmap":
                    builder.merge_file_(prefix)
                else:
                    _merge_legacy(builder, prefix)
            builder.finalize(f"{args.output_prefix}.idx{tmp}")
        except BaseException:
            builder.abort()
            for ext in (".bin", ".idx"):
                if os.path.exists(f"{args.output_prefix}{ext}{tmp}"):
                    os.remove(f"{args.output_prefix}{ext}{tmp}")
            raise
        out = args.output_prefix
        facts = {"dtype": builder.dtype.name, **_shared_facts(prefixes)}
        commit_pair(out, f"{out}.bin{tmp}", f"{out}.idx{tmp}", **facts)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    merged = MMapIndexedDataset(args.output_prefix)
    print(
        f"merged {len(prefixes)} datasets into {args.output_prefix}: "
        f"{merged.num_documents} documents, {len(merged)} sequences",
        file=sys.stderr,
    )
    return 0
