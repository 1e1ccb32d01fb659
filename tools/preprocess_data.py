"""Turn JSON/JSONL/text corpora into Megatron mmap datasets (.bin/.idx).

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2
writes data/my_text_document.bin and data/my_text_document.idx.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
