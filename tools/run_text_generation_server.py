"""Serve a checkpoint over HTTP (Megatron's PUT /api), on any TP x PP layout.

    python tools/run_text_generation_server.py --load ckpt --port 5000
    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load ckpt_tp2
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
         -d '{"prompts": ["def main("], "tokens_to_generate": 32, "top_k": 40}'
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
