"""Run lm-evaluation-harness on a checkpoint, on any TP x PP layout (the model "megatron").

    python tools/lm_eval.py --model megatron --model_args load=ckpt --tasks lambada_openai
    torchrun --nproc_per_node 4 tools/lm_eval.py --model megatron \\
        --model_args load=ckpt_tp2_pp2,pipeline_model_parallel_size=2 \\
        --tasks my_task --include_path my_tasks/ --batch_size 8

Every argument is lm-eval's (`lm_eval --help`); --model_args of "megatron": load,
pipeline_model_parallel_size, batch_size, max_length, max_gen_toks, rolling (lm-eval or
megatron), overlapping_eval, seed. Rank 0 runs lm-eval; the other ranks follow it.
"""

import os
import sys

# This file's folder must not shadow the lm_eval package: the repository root replaces it.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron.inference.lm_eval_tool import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
