"""The 2019 Megatron-LM's scripts/run_gpt2_eval.py on tools/evaluate.py's machinery:

    python scripts/run_gpt2_eval.py --model-parallel-size 1 --num-layers 24 --hidden-size 1024 \
        --num-attention-heads 16 --model-path ckpt --data-path wiki.test.tokens \
        --batch-size 16 --cache-dir cache
WikiText perplexity by default (--overlapping-eval, default 32); --cloze-eval (with
--strict-lambada) gives LAMBADA accuracy; --webtext-eval --eval-iters N the perplexity of a
loose-JSON file over its first N batches. --model-path is the checkpoint (--load), --data-path
the evaluation file; --cache-dir holds GPT-2's vocab.json and merges.txt when --vocab-file is
not given. The model flags must match the checkpoint.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.evaluate_cli import gpt2_eval_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(gpt2_eval_main())
