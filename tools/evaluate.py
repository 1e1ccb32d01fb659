"""Zero-shot evaluation of a checkpoint (Megatron's tasks/zeroshot_gpt).

    python tools/evaluate.py --task wikitext --valid-data wiki.test.tokens --load ckpt \
        --overlapping-eval 32
    python tools/evaluate.py --task lambada --valid-data lambada_test.jsonl --load ckpt \
        --strict-lambada
    torchrun --nproc_per_node 4 tools/evaluate.py --task loose-json --valid-data held_out.jsonl \
        --load ckpt_tp2_pp2 --pipeline-model-parallel-size 2
The training run's flags are accepted too (--tensor-model-parallel-size, --fp16, the shape flags,
which must match the checkpoint, ...). Megatron-LM v1.x's tasks/main.py and the 2019
scripts/run_gpt2_eval.py run the same evaluation with their own command lines.
The last line printed is the result as JSON:
    {"task": "wikitext", "ppl": ..., "adjusted_ppl": ..., "num_tokens": ...}
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.evaluate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
