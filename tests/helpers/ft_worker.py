"""One --fault-tolerance replica group for the kill-and-rejoin test (one process, TP = PP = 1),
or the deterministic replay of a recorded run in one process.

    python ft_worker.py OUT [--kill-at N] [--raise-at N] [--wait-for FILE] -- <pretrain flags>
    python ft_worker.py OUT --replay SETS_JSON -- <pretrain flags>

Each forward sleeps FT_STEP_SLEEP seconds (so that a replacement can join a run this small).
--kill-at N: SIGKILL itself in the forward of iteration N (as the OOM killer would);
--raise-at N: raise once in the forward of iteration N (a rank error that is not a death);
--wait-for FILE: import everything, then wait for FILE before training (a replacement);
--booted FILE: touch FILE when about to ask for the first quorum; --hold-at N --hold-for FILE:
wait for FILE in the forward of iteration N (so that a slow replacement joins before the end).
OUT gets {"history": [[iteration, loss, replica groups], ...], "weights": {name: tensor}}.
"""

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

import torch  # noqa: E402

from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.rules import validate  # noqa: E402
from megatron.initialize import initialize_megatron, shutdown_distributed  # noqa: E402
from megatron.models.gpt.train import datasets_provider, forward_step, model_provider  # noqa: E402
from megatron.resilience import fault_tolerance  # noqa: E402
from megatron.training.data import build_data_iterators  # noqa: E402
from megatron.training.loop import pretrain  # noqa: E402
from megatron.training.schedules import forward_backward_no_pipelining  # noqa: E402
from megatron.training.step import setup_model_and_optimizer, train_step  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402


def _options():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--raise-at", type=int)
    p.add_argument("--wait-for")
    p.add_argument("--replay")
    p.add_argument("--booted", help="touch this file before the first quorum")
    p.add_argument("--hold-at", type=int, help="in this iteration's forward, wait for...")
    p.add_argument("--hold-for", help="...this file")
    argv = sys.argv[1:]
    cut = argv.index("--")
    opts = p.parse_args(argv[:cut])
    opts.flags = argv[cut + 1 :]
    return opts


def _hook(opts):
    """The forward step, with the sleep and the injected failures. The iteration is the run's
    (a group that took a peer's state counts on from the peer's)."""
    sleep = float(os.environ.get("FT_STEP_SLEEP", "0"))
    calls = {"iteration": 0, "raised": False}
    start_step = fault_tolerance.ReplicaGroup.start_step

    def counting_start_step(self, state):
        if opts.booted:  # about to ask for its first quorum
            Path(opts.booted).touch()
            opts.booted = None
        healed = start_step(self, state)
        calls["iteration"] = state.iteration + 1
        return healed

    fault_tolerance.ReplicaGroup.start_step = counting_start_step

    def step(data_iterator, model):
        iteration = calls["iteration"]
        time.sleep(sleep)
        if (
            opts.hold_at is not None and iteration >= opts.hold_at
        ):  # until the replacement asks to join
            while not os.path.exists(opts.hold_for):
                time.sleep(0.02)
        if opts.kill_at is not None and iteration >= opts.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if opts.raise_at is not None and iteration >= opts.raise_at and not calls["raised"]:
            calls["raised"] = True
            raise RuntimeError(f"injected error in iteration {iteration}")
        return forward_step(data_iterator, model)

    return step


def train(opts, cfg) -> dict:
    result = pretrain(cfg, forward_step_func=_hook(opts))
    rows = [[h["iteration"], float(h["lm_loss"]), h.get("replicas")] for h in result.history]
    return {"history": rows, "weights": result.model.state_dict()}


class _Replay:
    """The replica groups of a recorded step in one process: after the first group's
    forward/backward, the others' run on their shares into the same gradient buffer, which
    then holds their sum; divided by their number it is what torchft's all-reduce gives."""

    def __init__(self, iterators, groups, num_micro, model, optimizer):
        self.iterators, self.groups, self.num_micro = iterators, groups, num_micro
        self.model, self.optimizer, self.took_part = model, optimizer, groups

    def average_and_commit(self, grad_buffer, loss):
        total = loss.clone()
        for r in self.groups[1:]:
            stats = forward_backward_no_pipelining(
                forward_step,
                self.iterators[r],
                self.model,
                self.num_micro,
                scale_loss=self.optimizer.scale_loss,
            )
            total += torch.stack([s["lm loss"].detach().float() for s in stats]).mean()
        grad_buffer.div_(len(self.groups))
        return total / len(self.groups), True


def replay(opts, cfg) -> dict:
    """Train with the recorded replica groups of each iteration (one process, no torchft)."""
    sets = {int(k): v for k, v in json.loads(Path(opts.replay).read_text()).items()}
    os.environ.pop("MASTER_PORT", None)
    rt = initialize_megatron(cfg)
    model, optimizer, scheduler = setup_model_and_optimizer(cfg, rt, model_provider(cfg))
    par, t = cfg.parallel, cfg.training
    gbs, num_micro = (
        t.global_batch_size,
        t.global_batch_size // (t.micro_batch_size * par.ft_group_size),
    )
    iterators = []
    for r in range(par.ft_group_size):
        share = cfg.replace(parallel=dataclasses.replace(par, ft_replica_id=r))
        iterators.append(build_data_iterators(share, rt, 0, 0, None, datasets_provider)[0])
    rows = []
    for iteration in range(1, t.train_iters + 1):
        groups = sets[iteration]
        for r in groups:
            iterators[r].seek((iteration - 1) * gbs)
        replicas = _Replay(iterators, groups, num_micro, model, optimizer)
        step = train_step(
            forward_step,
            iterators[groups[0]],
            model,
            optimizer,
            scheduler,
            num_micro,
            rt,
            Timers(0, rt.device),
            replicas=replicas,
        )
        rows.append([iteration, float(step["lm_loss"]), groups])
    return {"history": rows, "weights": model.state_dict()}


def main() -> None:
    opts = _options()
    cfg = validate(parse_args(opts.flags), "train-gpt")
    if opts.wait_for:  # everything is imported: wait for the go
        print("waiting", flush=True)
        while not os.path.exists(opts.wait_for):
            time.sleep(0.02)
    try:
        out = replay(opts, cfg) if opts.replay else train(opts, cfg)
    finally:
        shutdown_distributed()
    torch.save(out, opts.out)


if __name__ == "__main__":
    main()
