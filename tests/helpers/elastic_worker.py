"""pretrain_gpt2.py for the elastic-restart test: on the first attempt only, rank 1 kills itself
(SIGKILL, as the OOM killer or a node failure would) in the middle of iteration KILL_AT_ITERATION.

    torchrun --max-restarts 1 ... tests/helpers/elastic_worker.py KILL_AT_ITERATION <pretrain flags>
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.rules import validate  # noqa: E402
from megatron.initialize import shutdown_distributed  # noqa: E402
from megatron.models.gpt.train import forward_step  # noqa: E402
from megatron.training.loop import pretrain  # noqa: E402


def main() -> None:
    kill_at, argv = int(sys.argv[1]), sys.argv[2:]
    cfg = parse_args(argv)
    validate(cfg, "train-gpt")
    dp = cfg.parallel.data_parallel_size
    per_step = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
    doomed = os.environ.get("RANK") == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        # forward_step runs per_step times per iteration; iterations resume where the
        # checkpoint left them, but this attempt starts from 0 so counting calls is enough.
        if doomed and calls["n"] == per_step * (kill_at - 1) + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(data_iterator, model)

    try:
        pretrain(cfg, forward_step_func=step)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
