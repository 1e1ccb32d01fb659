"""Generate text from a checkpoint (greedy / top-k / top-p / temperature, KV cache).

    python tools/generate_text.py --load ckpt --prompt "def main(" --max-new-tokens 48 --greedy
    torchrun --nproc_per_node 2 tools/generate_text.py --load ckpt_tp2 --top-p 0.9
    python tools/generate_text.py --load ckpt --sample-input-file prompts.txt \
        --sample-output-file samples.jsonl --top-k 40
    python tools/generate_text.py --load ckpt --num-samples 8 --genfile samples.jsonl --top-p 0.9
With none of --prompt, --sample-input-file, --num-samples it asks for prompts interactively
(an empty line gives an unconditional sample; 'stop' or Ctrl-D quits).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.generate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
