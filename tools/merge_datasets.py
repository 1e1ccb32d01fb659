"""Concatenate several mmap datasets (PREFIX.bin/.idx) into one.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
An --input may also be a directory: every PREFIX.idx/.bin pair in it is merged, in name order.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
