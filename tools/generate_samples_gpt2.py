"""Megatron-LM v1.x's sampling entry point, on tools/generate_text.py's machinery.

    python tools/generate_samples_gpt2.py --load ckpt --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --num-layers 24 \
        --hidden-size 1024 --num-attention-heads 16 --max-position-embeddings 1024 --fp16 \
        --batch-size 2 --seq-length 1024 --out-seq-length 1024 --temperature 1.0 \
        --genfile unconditional_samples.json --num-samples 2 --top_p 0.9 --recompute
Without --num-samples: --sample-input-file (results to --sample-output-file, by default the
input file + '.out', as Megatron's "Context:/Megatron-LM:" blocks) or an interactive prompt
(an empty line gives an unconditional sample; 'stop' or Ctrl-D quits). The model flags must
match the checkpoint; the shapes come from it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.generate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(v1=True))
