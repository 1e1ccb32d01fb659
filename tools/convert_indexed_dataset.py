"""Convert Megatron v1.x's older TNTIDX (--dataset-impl lazy/cached) datasets to mmap .bin/.idx.

Example:
    python tools/convert_indexed_dataset.py --input data/old_text_document \
        --output-prefix data/new_text_document --vocab-size 50257
writes data/new_text_document.bin/.idx, byte for byte what tools/preprocess_data.py writes for
the same token ids (read by --data-impl mmap or infer).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.convert_indexed_dataset import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
