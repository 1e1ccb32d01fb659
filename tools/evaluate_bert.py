"""Masked-LM loss / accuracy and NSP accuracy of a BERT checkpoint on held-out data.

    python tools/evaluate_bert.py <the training flags> --load CKPT [--eval-split test]

The held-out samples are the valid (or test) split of --data-path/--split, built exactly as
pretrain_bert.py builds them (same seed, same masking); --eval-iters micro batches per DP rank.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.storage import CheckpointError  # noqa: E402
from megatron.config.cli import parse_args  # noqa: E402
from megatron.initialize import shutdown_distributed  # noqa: E402
from megatron.models.bert.evaluate import evaluate_checkpoint  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = "valid"
    if "--eval-split" in argv:
        i = argv.index("--eval-split")
        split = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
        if split not in ("valid", "test"):
            print("error: --eval-split: choose valid or test", file=sys.stderr)
            return 1
    try:
        metrics = evaluate_checkpoint(parse_args(argv, purpose="eval-bert"), split)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed()
    print(" | ".join(f"{k}: {v:.6f}" for k, v in metrics.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
