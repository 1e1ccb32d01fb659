"""What a training checkpoint holds and how the trainer saves and resumes it.

Each TP x PP shard (written by DP rank 0) holds the model shard, optimizer (with fp32 masters
and the loss scaler), LR scheduler, RNG states (python, numpy, torch, device, the TP dropout
stream), iteration, consumed samples, and the arguments that fix the shapes, so tools can load
it without repeating them. Storage, atomic pointer and crash safety: megatron.checkpoint.storage.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

from megatron.checkpoint.storage import (
    CheckpointError,
    finalize_checkpoint,
    load_newest_intact,
    load_shard,
    rng_state_dict,
    save_shard,
    set_rng_state,
)
from megatron.config.schema import MegatronConfig
from megatron.initialize import Runtime

CHECKPOINT_VERSION = 3.0
# Fields of ModelConfig that change parameter shapes: a resume must match them.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)


_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _gather(outcome):
    """Every rank's load outcome, so that all ranks fall back from a damaged shard together."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        return outcomes
    return [outcome]


def checkpoint_args(cfg: MegatronConfig) -> dict:
    p = cfg.parallel
    return {
        "model": dataclasses.asdict(cfg.model),
        # Absolute paths: tools load the tokenizer from wherever they are started.
        "tokenizer": {
            k: os.path.abspath(v) if k in _TOKENIZER_FILES and v else v
            for k, v in dataclasses.asdict(cfg.data.tokenizer).items()
        },
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "padded_vocab_size": cfg.model.padded_vocab_size(p.tensor_model_parallel_size),
        "params_dtype": str(cfg.precision.params_dtype),
    }


def save_training_state(
    cfg: MegatronConfig, rt: Runtime, model, optimizer, scheduler, state: TrainState
) -> None:
    st = rt.state
    rng = rng_state_dict(rt.device)
    rng["tracker"] = rt.rng_tracker.get_states()
    shard = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng,
        "args": checkpoint_args(cfg),
    }
    root = cfg.checkpoint.save
    save_shard(
        root,
        state.iteration,
        shard,
        tp_rank=st.tp_rank,
        pp_rank=st.pp_rank,
        pp_size=st.pp_size,
        write=st.dp_rank == 0,
    )
    finalize_checkpoint(
        root,
        state.iteration,
        barrier=_barrier,
        is_rank0=st.rank == 0,
        num_shards_expected=st.tp_size * st.pp_size,
        retain_last=cfg.checkpoint.save_retain_last,
    )


def _check_shapes(saved: dict, cfg: MegatronConfig, path: str) -> None:
    saved_model = saved.get("args", {}).get("model", {})
    current = dataclasses.asdict(cfg.model)
    for name in SHAPE_FIELDS:
        if name in saved_model and saved_model[name] != current[name]:
            raise CheckpointError(
                f"{path}: the checkpoint was saved with {name}={saved_model[name]!r} but this run "
                f"has {current[name]!r}; pass the same model flags (or convert the checkpoint)"
            )


def load_training_state(
    cfg: MegatronConfig, rt: Runtime, model, optimizer, scheduler
) -> TrainState:
    """Restore from --load; a fresh (empty) directory starts at iteration 0 with a notice.

    The newest checkpoint whose shards (on every rank) pass their checksums is loaded: a
    damaged one is named in a warning and skipped, so the run never trains on damaged state.
    """
    c, st = cfg.checkpoint, rt.state
    iteration, shard = load_newest_intact(
        c.load,
        lambda it: load_shard(
            c.load,
            it,
            tp_rank=st.tp_rank,
            pp_rank=st.pp_rank,
            pp_size=st.pp_size,
            map_location=rt.device,
        ),
        agree=_gather,
    )
    if iteration is None:
        if st.rank == 0:
            print(f" no checkpoint in --load {c.load}; starting from iteration 0", file=sys.stderr)
        return TrainState()
    _check_shapes(shard, cfg, c.load)
    model.load_state_dict(shard["model"])
    if c.finetune:
        optimizer.reload_model_params()
        return TrainState()
    missing = [
        key
        for key, skip in (("optimizer", c.no_load_optim), ("rng_state", c.no_load_rng))
        if not skip and key not in shard
    ]
    if missing:
        raise CheckpointError(
            f"--load {c.load}: iteration {iteration} has no {' / '.join(missing)} state (a "
            "converted or weights-only checkpoint). Fix: resume with --no-load-optim "
            "--no-load-rng, or start from its weights with --finetune"
        )
    if not c.no_load_optim:
        optimizer.load_state_dict(shard["optimizer"])
        scheduler.load_state_dict(shard["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if not c.no_load_rng:
        set_rng_state(shard["rng_state"], rt.device)
        rt.rng_tracker.set_states(shard["rng_state"]["tracker"])
    if st.rank == 0:
        print(f" loaded checkpoint from {c.load} at iteration {iteration}", file=sys.stderr)
    return TrainState(
        iteration=shard["iteration"],
        consumed_train_samples=shard["consumed_train_samples"],
        consumed_valid_samples=shard["consumed_valid_samples"],
    )
