"""--fault-tolerance: data-parallel replica groups that survive a lost replica (torchft).

Each replica group is a job of its own (one model copy, its own launcher and MASTER_PORT; one
rank today: TP, PP, CP and EP inside a group are refused, megatron.config.rules_ft). torchft's
lighthouse forms a quorum of the live groups at every step; the gradient is averaged over the
groups that take part (`Manager.allreduce` over a gloo/NCCL group rebuilt whenever the quorum
changes), so a dead group is dropped at the next step and nobody restarts. A group started later
(a replacement) joins a quorum, sees that it is behind, and fetches the weights, optimizer
state, LR schedule, RNG streams and data position from a live peer (torchft's HTTP transport,
not from disk) before its first step.

Every step the groups all-reduce one small vector before the gradients (`vote_box`): each
group's loss, a one-hot of its --ft-replica-id (so every group knows which took part), its
error count, the steps it has taken in this process and a fingerprint of the settings the
groups must agree on (`agreed_settings`). A Python exception in one group's forward/backward
(not a process death) zeroes its gradients and counts an error; every group then sees it, none
commits, and the step is redone on the same samples (torchft's max_retries bounds the retries
in a row). A group whose settings differ from the others', or the newer of two groups with one
--ft-replica-id, is refused by name (`judge`): every group drops that step before its
gradient all-reduce, the refused group ends, the others redo the step without it.

A dead peer costs the survivors seconds, not --ft-timeout-seconds: a group whose all-reduce
failed drops its process group at once (closing its connections), so a survivor still blocked
in that all-reduce on it fails too instead of waiting out the timeout while the first one
waits for it in the next quorum.

Data: group r always reads share r of each global batch (the sampler's DP rank is r, its DP
size --ft-group-size); a step without group r trains on a smaller batch, and r's share of it is
skipped, as in torchft.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from megatron.checkpoint.rng_state import rng_state_dict, set_rng_state
from megatron.config.declare import ConfigError, Tree
from megatron.config.schema import MegatronConfig
from megatron.mpu.parallel_state import ParallelState

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


# What the replica groups must agree on: the model's shape, the optimizer and its schedule, the
# data and its split, the tokenizer, precision, the seed and the batch. Not local paths of caches.
_AGREED_SECTIONS = ("model.", "optimizer.", "data.", "precision.")
_AGREED_KEYS = (
    "training.seed",
    "training.global_batch_size",
    "training.rampup_batch_size",
    "training.train_iters",
    "training.train_samples",
    "training.clip_grad",
    "parallel.ft_group_size",
)
_MAY_DIFFER = (
    "data.data_cache_path",
    "data.mmap_warmup",
    "data.tokenizer.cache_dir",
    "data.loose_json.cache_wait_minutes",
)
_ROWS = 64  # the box's per-group rows, at least --ft-group-size: one size for groups that differ


def agreed_settings(cfg: MegatronConfig) -> dict[str, str]:
    """{flag: repr(value)} of every setting the replica groups must agree on."""
    out = {}
    for path, s in Tree(type(cfg)).settings.items():
        if path in _MAY_DIFFER or not (path.startswith(_AGREED_SECTIONS) or path in _AGREED_KEYS):
            continue
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        out[s.flag] = repr(value)
    return out


def _hash(text: str) -> float:
    return float(zlib.crc32(text.encode()) & 0xFFFFFF)  # 24 bits: sums of 2^29 exact in float64


def _hashes(agreed: dict[str, str]) -> list[float]:
    return [_hash(f"{flag}={value}") for flag, value in agreed.items()]


def vote_box(loss, error, replica_id: int, rows: int, steps_here: int, agreed, device):
    """[loss, error, count (rows), steps in this process (rows), fingerprint (rows), the agreed
    settings' hashes]: summed over the groups, the count says which took part, twins sum to 2."""
    hashes = _hashes(agreed)
    box = torch.zeros(2 + 3 * rows + len(hashes), dtype=torch.float64, device=device)
    box[0] = loss.detach().double().reshape(())
    box[1] = float(error is not None)
    box[2 + replica_id] = 1.0
    box[2 + rows + replica_id] = float(steps_here)
    box[2 + 2 * rows + replica_id] = _hash(repr(sorted(agreed.items())))
    box[2 + 3 * rows :] = torch.tensor(hashes, dtype=torch.float64)
    return box


@dataclass
class Verdict:
    """What every group reads from the summed box (the same on all), and this group's own end."""

    took_part: list[int]
    refused: dict[int, str]  # replica id -> why every group drops this step
    mine: Exception | None = None  # this group is refused: end it with this error


def judge(box: list[float], rows: int, me: int, steps_here: int, agreed: dict) -> Verdict:
    """Who took part, and who is refused: the newer of twin ids (the old group, e.g. an orphan of
    a lost launcher, goes on; equal ages: both end), and the groups whose fingerprint differs
    from the most common one (a tie: the lowest id's). The healthy groups are never refused."""
    count, steps = box[2 : 2 + rows], box[2 + rows : 2 + 2 * rows]
    full, sums = box[2 + 2 * rows : 2 + 3 * rows], box[2 + 3 * rows :]
    verdict = Verdict([r for r in range(rows) if count[r] > 0.5], {})
    for r in verdict.took_part:
        n = round(count[r])
        if n > 1:
            verdict.refused[r] = f"{n} replica groups have --ft-replica-id {r}"
            if r == me and steps_here * n <= steps[r]:
                verdict.mine = RuntimeError(_twin_message(r, n))
    single = [r for r in verdict.took_part if r not in verdict.refused]
    if not single:
        return verdict
    tally = Counter(full[r] for r in single)
    ref = next(full[r] for r in single if tally[full[r]] == max(tally.values()))
    agree = [r for r in single if full[r] == ref]
    for r in single:
        if full[r] != ref:
            verdict.refused[r] = "its settings differ from the other groups'"
    if me in single and full[me] != ref:
        others = sum(count) - len(agree)  # groups assumed to hold this group's values
        verdict.mine = ConfigError(_differ_message(me, agree, agreed, sums, others))
    return verdict


def _twin_message(replica_id: int, n: int) -> str:
    return (
        f"--ft-replica-id {replica_id}: {n} replica groups of this id took part in one step (a "
        "replacement started while the group it replaces still runs?); they would read the same "
        "share of the batch, and this one is the newer: it stops, the others go on. Fix: start it "
        "again once the old group has stopped (a group whose launcher died stops within "
        "seconds), or give it a free --ft-replica-id"
    )


def _differ_message(me: int, agree: list[int], agreed: dict, sums: list[float], others) -> str:
    mine = _hashes(agreed)
    theirs = [(sums[i] - others * h) / len(agree) for i, h in enumerate(mine)]
    differ = [f for (f, _), h, t in zip(agreed.items(), mine, theirs, strict=True) if h != t]
    named = ", ".join(f"{f} (here {agreed[f]})" for f in differ[:6]) or "one of them"
    return (
        f"--ft-replica-id {me}: this replica group's settings differ from those of replica "
        f"groups {agree}: {named}; its gradients would be averaged with theirs. Fix: start "
        "every replica group with the same model shape, optimizer and schedule, data paths and "
        "split, seed and tokenizer (only --ft-replica-id and the launcher's port differ)"
    )


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
        self.agreed = agreed_settings(cfg)  # compared with the other groups' at every step
        self.rows = max(self.group_size, _ROWS)
        self.steps_here = 0  # steps this process took part in: the older of twins goes on
        self.broken = False  # the last all-reduce failed: drop the process group
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
        self.pg = pg_class(timeout=timeout)
        try:
            return torchft.Manager(
                pg=self.pg,
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
            "agreed": self.agreed,
        }

    def _load_state_dict(self, sd: dict) -> None:
        theirs = sd.get("agreed", {})
        differ = [f for f, v in self.agreed.items() if theirs.get(f) != v]
        if differ:  # before any tensor of another shape is loaded
            named = ", ".join(
                f"{f} {self.agreed[f]} (the live groups: {theirs.get(f)})" for f in differ[:6]
            )
            raise ConfigError(
                f"--ft-replica-id {self.replica_id}: this replica group's settings differ from "
                f"those of the live groups it would take the state of: {named}. Fix: start it "
                "with the same settings as the others"
            )
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
        if self.broken:  # a peer blocked on this group's old connections fails now, not at timeout
            self.broken = False
            failed = self.manager.errored()
            if failed is not None:  # the frames of its traceback hold the failed work's group
                traceback.clear_frames(failed.original_exception.__traceback__)
            self.pg.abort()  # drops torchft's reference; gloo closes the sockets once it is freed
            gc.collect()  # torchft's works and futures hold the group in cycles
        self.steps_here += 1
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
        loss, commit?). Every group takes the same decision: none commits when one raised or
        one is refused (its settings differ, or a twin id), and then no gradient is exchanged."""
        self.forward_done = True
        box = vote_box(
            loss,
            error,
            self.replica_id,
            self.rows,
            self.steps_here,
            self.agreed,
            grad_buffer.device,
        )
        self.manager.allreduce(box, reduce_op=ReduceOp.SUM).wait()
        broken = self.manager.errored()  # a peer died in the all-reduce: box is garbage
        verdict = None
        if broken is None:
            verdict = judge(box.tolist(), self.rows, self.replica_id, self.steps_here, self.agreed)
            if not verdict.refused:
                self.manager.allreduce(grad_buffer).wait()
                broken = self.manager.errored()
        if broken is None and (box[1] > 0 or verdict.refused):
            why = "; ".join(f"replica group {r} refused: {w}" for r, w in verdict.refused.items())
            error = error or RuntimeError(why or "a peer's step raised")
            self.manager.report_error(error)
        tic = time.perf_counter()
        committed = self.manager.should_commit()
        self.protocol_s[-1] += time.perf_counter() - tic
        took_part = verdict.took_part if verdict is not None else None
        if broken is not None:
            self.broken = True
            error, took_part = broken.original_exception, self.last_replicas
        if verdict is not None and verdict.mine is not None:
            raise verdict.mine  # after the vote: the others drop the step and go on
        self._announce(took_part, committed, error)
        self.took_part = took_part
        return (box[0] / max(len(took_part or ()), 1)).float(), committed

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

    def log_view(self, global_batch: int) -> tuple[int, int, bool]:
        """What the job's iteration line says of the last step: (the global batch it trained,
        this group's share times the groups that took part; how many groups took part; whether
        this group writes the line: the lowest replica id that took part, so a job of N groups
        logs one line, not N, and another takes over when that group is gone)."""
        took = self.took_part or []
        if not took:
            return global_batch, 1, True
        share = global_batch * len(took) // self.group_size
        return share, len(took), self.replica_id == min(took)

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
