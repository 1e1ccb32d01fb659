"""tools/merge_datasets.py: concatenate several mmap datasets (PREFIX.bin/.idx) into one.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
An --input may also be a directory: every PREFIX.idx/.bin pair in it is merged, in name order.
"""

import argparse
import os
import sys

from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    dataset_exists,
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    try:
        prefixes = _prefixes(args.input)
        first = MMapIndexedDataset(prefixes[0])
        tmp = f".tmp-{os.getpid()}"
        builder = MMapIndexedDatasetBuilder(f"{args.output_prefix}.bin{tmp}", first.dtype)
        try:
            for prefix in prefixes:
                builder.merge_file_(prefix)
            builder.finalize(f"{args.output_prefix}.idx{tmp}")
        except BaseException:
            builder.abort()
            for ext in (".bin", ".idx"):
                if os.path.exists(f"{args.output_prefix}{ext}{tmp}"):
                    os.remove(f"{args.output_prefix}{ext}{tmp}")
            raise
        os.replace(f"{args.output_prefix}.bin{tmp}", f"{args.output_prefix}.bin")
        os.replace(f"{args.output_prefix}.idx{tmp}", f"{args.output_prefix}.idx")
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
