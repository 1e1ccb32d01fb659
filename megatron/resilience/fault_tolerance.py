"""--fault-tolerance: data-parallel replica groups that survive a lost replica (torchft).

Each replica group is a job of its own (one model copy, its own launcher and MASTER_PORT; one
rank today: TP, PP, CP and EP inside a group are refused, megatron.config.rules_ft). torchft's
lighthouse forms a quorum of the live groups at every step; the gradient is averaged over the
groups that take part (`Manager.allreduce` over a gloo/NCCL group rebuilt whenever the quorum
changes), so a dead group is dropped at the next step and nobody restarts. A group started later
(a replacement) joins a quorum, sees that it is behind, and fetches the weights, optimizer
state, LR schedule, RNG streams and data position from a live peer (torchft's HTTP transport,
not from disk) before its first step.

Every step the groups all-reduce one small vector beside the gradients: each group's loss, a
one-hot of its --ft-replica-id (so every group knows which took part) and its error count. A
Python exception in one group's forward/backward (not a process death) zeroes its gradients
and counts an error; every group then sees it, none commits, and the step is redone on the same
samples (torchft's max_retries bounds the retries in a row).

Data: group r always reads share r of each global batch (the sampler's DP rank is r, its DP
size --ft-group-size); a step without group r trains on a smaller batch, and r's share of it is
skipped, as in torchft.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from megatron.checkpoint.rng_state import rng_state_dict, set_rng_state
from megatron.config.schema import ConfigError, MegatronConfig
from megatron.mpu import ParallelState

_QUORUM_TIMEOUT = timedelta(seconds=60)


def lighthouse_command(group_size: int) -> str:
    """How to start the lighthouse: a quorum needs a majority of the groups, so that groups
    that start early (or a partitioned half) never train apart from the others."""
    majority = group_size // 2 + 1
    return (
        f"torchft_lighthouse --min_replicas {majority} --quorum_tick_ms 100 --join_timeout_ms 10000"
    )


def batch_share(cfg: MegatronConfig, state: ParallelState) -> tuple[int, int]:
    """(rank, size) of this rank's share of the global batch: its DP rank and size, or with
    --fault-tolerance its replica group's id and the number of groups at full strength."""
    par = cfg.parallel
    if par.fault_tolerance:
        return par.ft_replica_id, par.ft_group_size
    return state.dp_rank, state.dp_size


def lighthouse_address(cfg: MegatronConfig, env=os.environ) -> str:
    address = cfg.parallel.ft_lighthouse or env.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ConfigError(
            "--fault-tolerance: no lighthouse address. Fix: start torchft's lighthouse once for "
            f"the job (`{lighthouse_command(cfg.parallel.ft_group_size)}`, it listens on port "
            "29510) and pass "
            "--ft-lighthouse http://HOST:29510 (or export TORCHFT_LIGHTHOUSE)"
        )
    return address


def _torchft():
    try:
        import torchft
    except ImportError:
        raise ConfigError(
            "--fault-tolerance needs torchft. Fix: pip install torchft (or the repository's "
            "extra: pip install '.[ft]')"
        ) from None
    return torchft


class ReplicaGroup:
    """This rank's torchft Manager, and the step protocol the native backend follows:
    start_step() before the forward, average_and_commit() after the backward (or
    discard_step() when the forward/backward raised)."""

    def __init__(self, cfg: MegatronConfig, rt, model, optimizer, scheduler, out=sys.stdout):
        self.cfg, self.rt, self.out = cfg, rt, out
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        par = cfg.parallel
        self.replica_id, self.group_size = par.ft_replica_id, par.ft_group_size
        self.state = None  # the loop's TrainState, set at each start_step
        self.healed_from_peer = False
        self.last_replicas: list[int] | None = None
        self.took_part: list[int] | None = None  # the groups of the last step (its log row)
        self.protocol_s: list[float] = []  # per step: the quorum and the commit vote
        self.forward_done = False  # raised before it: the step can be dropped and redone
        self.manager = self._manager(_torchft(), lighthouse_address(cfg))

    def _manager(self, torchft, lighthouse: str):
        par, st = self.cfg.parallel, self.rt.state
        if "MASTER_PORT" not in os.environ:
            raise ConfigError(
                "--fault-tolerance: MASTER_PORT is not set. Fix: launch each replica group with "
                "torchrun and a --master_port of its own (or export MASTER_ADDR/MASTER_PORT)"
            )
        timeout = timedelta(seconds=par.ft_timeout_seconds)
        cuda = self.rt.device.type == "cuda"
        pg_class = torchft.ProcessGroupNCCL if cuda else torchft.ProcessGroupGloo
        try:
            return torchft.Manager(
                pg=pg_class(timeout=timeout),
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=par.ft_min_replica_size,
                use_async_quorum=False,  # a replacement loads the peer's state before its forward
                timeout=timeout,
                # a quorum may wait for a group still building its model: torchft's default
                quorum_timeout=max(timeout, _QUORUM_TIMEOUT),
                connect_timeout=max(timeout, _QUORUM_TIMEOUT),
                rank=st.rank,
                world_size=st.world_size,
                store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                store_port=int(os.environ["MASTER_PORT"]),
                lighthouse_addr=lighthouse,
                replica_id=f"replica_{self.replica_id}",
                init_sync=False,  # every group builds the same weights from --seed
                max_retries=par.ft_max_retries,
            )
        except Exception as e:
            raise ConfigError(
                f"--fault-tolerance: replica group {self.replica_id} could not reach torchft's "
                f"lighthouse at {lighthouse} ({e}). Fix: start it "
                f"(`{lighthouse_command(self.group_size)}`) and check --ft-lighthouse"
            ) from e

    # What a replacement fetches from a live peer (torchft calls these on its own thread).
    def _state_dict(self) -> dict:
        s = self.state
        rng = rng_state_dict(self.rt.device)
        rng["tracker"] = self.rt.rng_tracker.get_states()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train": [s.iteration, s.consumed_train_samples, s.consumed_valid_samples],
            "rng": rng,
        }

    def _load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        s = self.state
        s.iteration, s.consumed_train_samples, s.consumed_valid_samples = sd["train"]
        set_rng_state(sd["rng"], self.rt.device)
        self.rt.rng_tracker.set_states(sd["rng"]["tracker"])
        self.healed_from_peer = True

    def start_step(self, state) -> bool:
        """Join this step's quorum; True when this group was behind and took a live peer's
        state (the loop then reads the data from the peer's position)."""
        self.state, self.healed_from_peer, self.forward_done = state, False, False
        tic = time.perf_counter()
        self.manager.start_quorum()
        self.protocol_s.append(time.perf_counter() - tic)
        if self.healed_from_peer:
            self._print(
                f" fault tolerance: replica group {self.replica_id} took the state of a live peer "
                f"at iteration {state.iteration} ({time.perf_counter() - tic:.2f} s)"
            )
        return self.healed_from_peer

    def average_and_commit(self, grad_buffer: torch.Tensor, loss: torch.Tensor, error=None):
        """Average the gradients over the groups of this step's quorum; returns (their mean
        loss, commit?). Every group takes the same decision: none commits when one raised."""
        self.forward_done = True
        grads = self.manager.allreduce(grad_buffer)
        box = torch.zeros(self.group_size + 2, device=grad_buffer.device)
        box[0] = loss.detach().float().reshape(())
        box[1 + self.replica_id] = 1.0
        box[-1] = float(error is not None)
        votes = self.manager.allreduce(box, reduce_op=ReduceOp.SUM)
        grads.wait()
        votes.wait()
        broken = self.manager.errored()  # a peer died in the all-reduce: box is garbage
        took_part = [r for r in range(self.group_size) if box[1 + r] > 0.5]
        if broken is None:
            refuse_twins(box[1:-1])
        if broken is None and box[-1] > 0:
            self.manager.report_error(error or RuntimeError("a peer's step raised"))
        tic = time.perf_counter()
        committed = self.manager.should_commit()
        self.protocol_s[-1] += time.perf_counter() - tic
        if broken is not None:
            error, took_part = broken.original_exception, self.last_replicas
        self._announce(took_part, committed, error)
        self.took_part = took_part
        return box[0] / max(len(took_part or ()), 1), committed

    def discard_step(self, error: Exception, grad_buffer: torch.Tensor):
        """The forward/backward raised: take part with zero gradients and an error vote, so
        that every group drops the step. Errors of the protocol itself are not survivable."""
        if self.forward_done:  # the commit itself, or the optimizer after it, failed
            raise error
        grad_buffer.zero_()
        self._print(f" fault tolerance: replica group {self.replica_id} step failed: {error!r}")
        return self.average_and_commit(grad_buffer, torch.zeros(()), error)

    def _announce(self, took_part: list[int], committed: bool, error) -> None:
        it = self.state.iteration + 1
        if not committed:
            why = "a replica group raised" if error is None else repr(error)
            self._print(f" fault tolerance: iteration {it} not committed ({why}); redoing it")
        if took_part != self.last_replicas:
            self._print(
                f" fault tolerance: iteration {it}: replica groups {took_part} take part "
                f"({len(took_part)} of {self.group_size})"
            )
            self.last_replicas = took_part

    def _print(self, line: str) -> None:
        if self.rt.state.rank == self.rt.state.world_size - 1:
            print(line, file=self.out, flush=True)

    def shutdown(self) -> None:
        if self.protocol_s:
            ms = sorted(1e3 * x for x in self.protocol_s)
            self._print(
                f" fault tolerance: quorum + commit vote per step: median {ms[len(ms) // 2]:.1f} "
                f"ms over {len(ms)} steps (the step's own all-reduces not included)"
            )
        self.manager.shutdown(wait=False)


def refuse_twins(counts: torch.Tensor) -> None:
    """Two live groups with one --ft-replica-id would both read that share of the batch."""
    twins = [r for r, n in enumerate(counts.tolist()) if n > 1.5]
    if twins:
        raise RuntimeError(
            f"--ft-replica-id {twins[0]}: {int(counts[twins[0]])} replica groups of this id took "
            "part in one step (a replacement started while the group it replaces still runs?); "
            "they would read the same share of the batch. Fix: stop the old group first, or "
            "give the new one a free --ft-replica-id"
        )
