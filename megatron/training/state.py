"""What a training checkpoint holds and how the trainer saves and resumes it.

Every checkpoint, whatever the backend, holds the entries of `checkpoint_entries`: iteration,
consumed samples, RNG states (python, numpy, torch, device, the TP dropout stream) and the
arguments that fix the shapes, so tools can load it without repeating them. `resume` is the one
way back from them; `commit` makes a written checkpoint the one --load finds.

The native backend's TP x PP shards (written by DP rank 0) add the model shard with its
partition record (each tensor's TP split dimension and stride, or None: what
megatron.checkpoint.resharding merges and splits by), optimizer (with fp32 masters and the
loss scaler) and LR scheduler. With --use-distributed-optimizer every DP rank also writes its
optimizer shard (`distrib_optim_dp_XXX.pt` beside the model shard: per parameter, a flat range
and its state), and a resume at any DP size reassembles its own ranges from them. Storage,
atomic pointer and crash safety: megatron.checkpoint.storage.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron.checkpoint.async_save import AsyncSaver
from megatron.checkpoint.expert_bias import fit_expert_biases
from megatron.checkpoint.experts import (
    gather_experts,
    gather_optimizer_experts,
    local_experts,
    local_optimizer_experts,
)
from megatron.checkpoint.reading import load_newest_intact, load_shard, verify_checkpoint_files
from megatron.checkpoint.reshard_load import SavedLayout, read_layout
from megatron.checkpoint.resharding import partition_record
from megatron.checkpoint.rng_state import rng_state_dict, set_rng_state
from megatron.checkpoint.storage import (
    DISTRIB_OPTIM_NAME,
    CheckpointError,
    checkpoint_dir,
    finalize_checkpoint,
    remove_stale_optimizer_shards,
    save_shard,
)
from megatron.config.schema import MegatronConfig
from megatron.initialize import Runtime, barrier
from megatron.optim.shards import distributed_to_plain, plain_order, plain_parameter_names
from megatron.resilience.preflight import starts_fresh_by_design
from megatron.training import reshard
from megatron.training.checkpoint_args import (
    check_model_args,
    checkpoint_args,
    expert_bias_note,
)

T = TypeVar("T")
CHECKPOINT_VERSION = 3.0


@dataclass
class TrainState:
    """The counters a run continues from: saved in every checkpoint, restored by `resume`."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _gather(outcome):
    """Every rank's load outcome, so that all ranks fall back from a damaged shard together."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        return outcomes
    return [outcome]


def checkpoint_entries(cfg: MegatronConfig, rt: Runtime, state: TrainState) -> dict:
    """The entries every checkpoint holds whatever the backend (what `resume` reads back)."""
    entries = {
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "args": checkpoint_args(cfg),
    }
    if not cfg.checkpoint.no_save_rng:
        entries["rng_state"] = rng_state_dict(rt.device)
        entries["rng_state"]["tracker"] = rt.rng_tracker.get_states()
        st = rt.state
        if st.cp_size > 1:  # CP ranks draw other dropout masks: keep every CP rank's streams
            states = [None] * st.cp_size
            dist.all_gather_object(states, dict(entries["rng_state"]), group=st.cp_group)
            entries["rng_state"]["context_parallel"] = states
    return entries


def _own_rng_state(saved: dict, rt: Runtime) -> dict:
    """The RNG streams this rank saved: its CP rank's when saved at this CP size (else CP rank
    0's: resuming at another CP size cuts the sequence differently, so dropout cannot match)."""
    per_cp = saved.get("context_parallel")
    if per_cp is not None and len(per_cp) == rt.state.cp_size:
        return per_cp[rt.state.cp_rank]
    return saved


def commit(
    cfg: MegatronConfig, rt: Runtime, iteration: int, error: BaseException | None = None, **layout
) -> None:
    """After every rank wrote its files (or failed to: `error`): if all did, mark the checkpoint
    complete and move the pointer; if any did not, every rank raises the same CheckpointError
    naming it, at once (not one rank failing while the others wait in a barrier)."""
    finalize_checkpoint(
        cfg.checkpoint.save,
        iteration,
        barrier=barrier,
        is_rank0=rt.state.rank == 0,
        retain_last=cfg.checkpoint.save_retain_last,
        agree=_gather,
        error=error,
        **layout,
    )


def resume(
    cfg: MegatronConfig,
    rt: Runtime,
    read: Callable[[int], T],
    restore: Callable[[int, T], dict],
    agree=None,
) -> TrainState:
    """Continue from --load; a fresh (empty) directory starts at iteration 0 with a notice.

    The backend's part: `read(iteration)` checks (and may read) its files, raising
    ShardIntegrityError for a damaged one, so the newest intact checkpoint is chosen
    (load_newest_intact, all ranks deciding together through `agree`); `restore(iteration,
    read's value)` restores model (and optimizer, unless --no-load-optim or --finetune) and
    returns the checkpoint_entries it found. Here: the RNG states (unless --no-load-rng) and
    the counters (none with --finetune).
    """
    c = cfg.checkpoint
    kw = {} if agree is None else {"agree": agree}
    iteration, value = load_newest_intact(c.load, read, **kw)
    if iteration is None:
        if rt.state.rank == 0:  # loudly unless --load X --save X asked for a fresh start
            warn = "" if starts_fresh_by_design(c.load, c.save) else "warning: --load: "
            print(f"{warn}no checkpoint in {c.load}: starting from scratch", file=sys.stderr)
        return TrainState()
    saved = restore(iteration, value)
    if rt.state.rank == 0:
        print(f" loaded checkpoint from {c.load} at iteration {iteration}", file=sys.stderr)
    if c.finetune:
        return TrainState()
    _require(saved, c, iteration, keys=("rng_state",))  # the backend checked the rest
    if not c.no_load_rng:
        rng = _own_rng_state(saved["rng_state"], rt)
        set_rng_state(rng, rt.device)
        rt.rng_tracker.set_states(rng["tracker"])
    return TrainState(
        iteration=saved["iteration"],
        consumed_train_samples=saved["consumed_train_samples"],
        consumed_valid_samples=saved["consumed_valid_samples"],
    )


def current_layout(cfg: MegatronConfig, rt: Runtime, optimizer) -> SavedLayout:
    """The layout this run writes (and reads) its shards at."""
    st = rt.state
    kind = "distributed" if getattr(optimizer, "sharded", False) else "plain"
    return SavedLayout(
        tp=st.tp_size,
        pp=st.pp_size,
        vp=st.virtual_pp_size,
        dp=st.dp_size,
        cp=st.cp_size,
        optimizer=None if cfg.checkpoint.no_save_optim else kind,
        ep=st.ep_size,
        etp=st.etp_size if cfg.model.moe else None,
        v_shape=st.pipeline_v,
    )


def save_training_state(
    cfg: MegatronConfig,
    rt: Runtime,
    model,
    optimizer,
    scheduler,
    state: TrainState,
    saver: AsyncSaver | None = None,
) -> None:
    """The native backend's checkpoint: one shard per TP x PP rank, written by DP rank 0.

    With `saver` (--async-save) the state is staged to host memory here and written in the
    background; the commit follows at a later step (AsyncSaver.poll / wait)."""
    st = rt.state
    shard = {
        "checkpoint_version": CHECKPOINT_VERSION,
        **checkpoint_entries(cfg, rt, state),
        # MoE: every expert whole, all-gathered over EP and ETP (megatron.checkpoint.experts)
        "model": gather_experts(model.state_dict(), model, st),
        "partition": partition_record(model),  # how each tensor is split, for resharding
    }
    sharded = optimizer.shard_state_dict if optimizer.sharded else None
    if cfg.checkpoint.no_save_optim:
        sharded = None
    else:
        shard["optimizer"] = optimizer.state_dict()
        shard["opt_param_scheduler"] = scheduler.state_dict()
        if sharded is None:  # the plain one: moments of all experts, named by position
            order = plain_order(model.module)
            shard["optimizer"] = gather_optimizer_experts(shard["optimizer"], model, order, st)
            shard["optimizer"]["param_names"] = plain_parameter_names(model.module)
    optim_shard = sharded() if sharded is not None else None
    if saver is not None:  # the model shard is written by DP x CP rank 0 only: staged there
        if st.dp_cp_rank == 0:  # (FSDP2 hands the other ranks meta tensors)
            shard = saver.stage(shard, "model")
        optim_shard = saver.stage(optim_shard, "optim")
    where = {"tp_rank": st.tp_rank, "pp_rank": st.pp_rank, "pp_size": st.pp_size}
    root, it = cfg.checkpoint.save, state.iteration

    def write() -> None:
        # Weights are replicated over DP x CP (CP splits the sequence, not the weights), so
        # the shard is the same at every CP size; the distributed optimizer's are per DP x CP.
        if st.dp_cp_rank == 0:  # a re-save of this iteration at a smaller DP leaves no extras
            remove_stale_optimizer_shards(root, it, keep=st.dp_cp_size if sharded else 0, **where)
        save_shard(root, it, shard, write=st.dp_cp_rank == 0, **where)
        if optim_shard is not None:
            name = DISTRIB_OPTIM_NAME.format(dp_rank=st.dp_cp_rank)
            save_shard(root, it, optim_shard, write=True, name=name, **where)

    files_per_rank = 1 + (st.dp_cp_size if sharded is not None else 0)
    record = current_layout(cfg, rt, optimizer).record()

    def finish(error: BaseException | None) -> None:
        expected = st.tp_size * st.pp_size * files_per_rank
        commit(cfg, rt, it, error, num_shards_expected=expected, layout_record=record)

    if saver is not None:
        saver.start(it, write, finish)
        return
    error = None
    try:
        write()
    except (CheckpointError, OSError) as e:  # every rank hears of it in commit
        error = e
    finish(error)


def all_ranks_true(flag: bool, device) -> bool:
    """Whether `flag` holds on every rank (one scalar all-reduce; every rank must call it)."""
    t = torch.tensor([float(flag)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def load_training_state(
    cfg: MegatronConfig, rt: Runtime, model, optimizer, scheduler
) -> TrainState:
    """The native backend's resume: this rank's shard (the newest whose shards pass their
    checksums on every rank) into model, optimizer and scheduler. A checkpoint saved at
    another TP x PP (x virtual pipeline) layout is resharded on the way in (see
    megatron.training.reshard); one saved at another DP size only re-cuts the distributed
    optimizer's ranges."""
    c, st = cfg.checkpoint, rt.state
    with_optim = not (c.finetune or c.no_load_optim)
    here = current_layout(cfg, rt, optimizer)
    where = {"tp_rank": st.tp_rank, "pp_rank": st.pp_rank, "pp_size": st.pp_size}

    def read(iteration: int):
        saved_layout = read_layout(c.load, iteration)
        if not saved_layout.same_shards(here):
            # Each rank checks its share of the files; the ranks agree before any is read.
            verify_checkpoint_files(
                c.load, iteration, select=lambda i, _: i % st.world_size == st.rank
            )
            return saved_layout
        shard = load_shard(c.load, iteration, map_location=rt.device, **where)
        saved = shard.get("optimizer") or {}
        if saved.get("distributed") and with_optim:
            # Every saved DP rank's ranges of this TP x PP position (memory-mapped: only the
            # ranges this rank owns now are read), whatever DP size wrote them.
            shard["distrib_optim"] = [
                load_shard(
                    c.load, iteration, name=DISTRIB_OPTIM_NAME.format(dp_rank=k), mmap=True, **where
                )
                for k in range(saved["dp_size"])
            ]
        return shard

    def restore(iteration: int, value) -> dict:
        if isinstance(value, SavedLayout):
            return restore_resharded(iteration, value)
        shard = value
        check_model_args(shard, cfg, checkpoint_dir(c.load, iteration))
        own = model.state_dict()
        shard["model"] = fit_expert_biases(shard["model"], own)  # the bias turned on or off
        if list(shard["model"]) != list(own):  # other model chunks (no record)
            return restore_resharded(iteration, read_layout(c.load, iteration))
        _note_expert_bias(shard, cfg, rt)
        model.load_state_dict(local_experts(shard["model"], model, st))  # this EP/ETP rank's
        if not with_optim:
            optimizer.reload_model_params()
        _require(shard, c, iteration)
        if with_optim:
            load_optimizer(optimizer, model, shard)
            scheduler.load_state_dict(shard["opt_param_scheduler"])
        saved = read_layout(c.load, iteration)
        what = reshard.same_shard_changes(saved, here, with_optim)
        if what:
            reshard.announce(rt, iteration, saved, here, what)
        return shard

    def restore_resharded(iteration: int, saved: SavedLayout) -> dict:
        shards, entries = reshard.open_checkpoint(cfg, c.load, iteration, saved)
        # a named error before any tensor is cut
        check_model_args(entries, cfg, checkpoint_dir(c.load, iteration))
        _note_expert_bias(entries, cfg, rt)
        _require(entries, c, iteration)
        optim = with_optim and "optimizer" in entries
        state, optim_state = reshard.read_resharded(cfg, rt, model, shards, optim)
        model.load_state_dict(state)
        if optim:
            load_optimizer(optimizer, model, optim_state)
            scheduler.load_state_dict(entries["opt_param_scheduler"])
        else:
            optimizer.reload_model_params()
        what = ["weights"] + (["optimizer state"] if optim else [])
        if "rng_state" in entries and not c.no_load_rng:
            entries["rng_state"] = reshard.reseeded_rng_state(cfg, rt, iteration)
            what.append("RNG streams re-seeded from --seed and the iteration")
        reshard.announce(rt, iteration, saved, here, what)
        return entries

    return resume(cfg, rt, read, restore, agree=_gather)


def _note_expert_bias(saved: dict, cfg: MegatronConfig, rt: Runtime) -> None:
    note = expert_bias_note(saved, cfg)
    if note and rt.state.rank == 0:
        print(f" {note}", file=sys.stderr)


# checkpoint key -> (the flag that skips loading it, the flag that saved without it)
_OPTIONAL = {
    "optimizer": ("no_load_optim", "--no-load-optim", "--no-save-optim"),
    "rng_state": ("no_load_rng", "--no-load-rng", "--no-save-rng"),
}


def _require(shard: dict, c, iteration: int, keys=tuple(_OPTIONAL)) -> None:
    """A checkpoint saved without optimizer or RNG state (--no-save-optim/--no-save-rng, or
    converted, or weights only) resumes only with the flags that skip its gaps."""
    if c.finetune:
        return
    missing = [k for k in keys if not getattr(c, _OPTIONAL[k][0]) and k not in shard]
    if missing:
        raise CheckpointError(
            f"--load {c.load}: iteration {iteration} has no {' / '.join(missing)} state (saved "
            f"with {' / '.join(_OPTIONAL[k][2] for k in missing)}, or converted, or weights "
            f"only). Fix: resume with {' '.join(_OPTIONAL[k][1] for k in missing)}, or start "
            "from its weights with --finetune"
        )


def load_optimizer(optimizer, model, shard: dict) -> None:
    """Either optimizer from either kind of checkpoint: the distributed one's state (shared
    part + every saved DP rank's ranges) reassembles per parameter for any DP size, or for the
    plain optimizer; the plain one's (keyed by position) is cut into ranges."""
    saved = shard["optimizer"]
    distributed = optimizer.sharded
    st = optimizer.state
    if saved.get("distributed") and distributed:
        optimizer.load_state_dict(saved, shard["distrib_optim"])
    elif saved.get("distributed"):
        plain = distributed_to_plain(
            saved, shard["distrib_optim"], model.module, optimizer.masters, state=st
        )
        optimizer.load_state_dict(plain)
    elif distributed:
        optimizer.load_state_dict(saved)  # converts a plain state itself (experts whole)
    else:  # this EP rank's experts of the saved moments and masters
        order = plain_order(model.module)
        optimizer.load_state_dict(local_optimizer_experts(saved, model, order, st))
