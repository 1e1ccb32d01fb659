"""Megatron-LM v1.x's tasks/main.py: zero-shot LAMBADA and WikiText-103 on tools/evaluate.py's
machinery (megatron.inference.evaluate_cli), e.g. examples/evaluate_zeroshot_gpt2.sh:

    python -m torch.distributed.launch --nproc_per_node 1 ./tasks/main.py --task LAMBADA \
        --valid-data lambada_test.jsonl --strict-lambada --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --load ckpt \
        --model-parallel-size 1 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --batch-size 8 --checkpoint-activations --seq-length 1024 \
        --max-position-embeddings 1024 --log-interval 10 --fp16 --no-load-optim --no-load-rng
--task WIKITEXT103 --valid-data wiki.test.tokens (--overlapping-eval N, default 32) gives the
perplexity. The model flags must match the checkpoint; TP x PP must equal the process count.
Prints Megatron's result block, then the result as one JSON line.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.evaluate_cli import tasks_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(tasks_main())
