"""pretrain(): initialize -> model, optimizer, scheduler, data -> train loop with evaluation,
logging, checkpoints and exit conditions (the loop itself: megatron.training.train_loop).
pretrain_gpt2.py is a thin wrapper around it."""

from __future__ import annotations

import dataclasses
import os
import sys

from megatron.checkpoint.storage import CheckpointError, write_text_atomic
from megatron.config.files import RUN_CONFIG_NAME, to_yaml
from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig
from megatron.config.tokenizer_files import check_tokenizer_files
from megatron.data.tokenizers import build_tokenizer
from megatron.heartbeat import explain_collective_failure
from megatron.initialize import Runtime, initialize_megatron
from megatron.model.families import DEFAULT_FAMILY, ModelSpec, get_spec
from megatron.resilience.preflight import (
    check_data,
    check_deepspeed_precision,
    check_load_dir,
    check_save_dir,
)
from megatron.training.backend import TrainerBackend
from megatron.training.data import DocumentMasking, build_data_iterators, validation_off
from megatron.training.log import start_lines
from megatron.training.state import TrainState
from megatron.training.step import NativeBackend
from megatron.training.train_loop import TrainingError, TrainLoop, TrainResult

__all__ = ["build_backend", "pretrain", "resolve_vocab"]


def resolve_vocab(cfg: MegatronConfig):
    """Set the model's vocab from the tokenizer (when one is configured); returns (cfg, tok).
    Its files are checked first (named errors); ModelConfig checks the size it gets."""
    tok_cfg = cfg.data.tokenizer
    check_tokenizer_files(cfg)
    if tok_cfg.tokenizer_type is None:
        return cfg, None
    tokenizer = build_tokenizer(
        tok_cfg.tokenizer_type, vocab_size=cfg.model.vocab_size, **tok_cfg.kwargs()
    )
    model = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    return cfg.replace(model=model), tokenizer


RUN_CONFIG_HEADER = "the resolved config of a training run; run it again with -c FILE"


def _record_run_config(text: str, save: str | None, is_rank0: bool, metrics) -> None:
    """The config beside the checkpoints (SAVE/run_config.yaml) and in TensorBoard / W&B, so
    every run can be reproduced, and compared, from what it left behind."""
    if save and is_rank0:
        write_text_atomic(os.path.join(save, RUN_CONFIG_NAME), text)
    metrics.run_config(text)


def pretrain(
    cfg: MegatronConfig,
    *,
    family: ModelSpec | None = None,
    forward_step_func=None,
    runtime: Runtime | None = None,
    out=sys.stdout,
) -> TrainResult:
    """Train as the config says; returns the per-iteration history (the last rank logs it).

    `family`: the model family's spec (megatron.model.families; None: the default family),
    which gives the model, the datasets, the forward step and the rules the config is validated
    by (megatron.config.rules.validate(cfg, family.purpose); a validated config passes
    unchanged); `forward_step_func` replaces the family's (tests wrap it)."""
    family = family or get_spec(DEFAULT_FAMILY)
    cfg = validate(cfg, family.purpose)
    check_load_dir(cfg.checkpoint.load, cfg.checkpoint.save)
    check_save_dir(cfg.checkpoint.save)
    check_deepspeed_precision(cfg)
    run_config = to_yaml(cfg, RUN_CONFIG_HEADER)  # as resolved, before the tokenizer sets vocab
    cfg, tokenizer = resolve_vocab(cfg)
    check_data(cfg, tokenizer)
    documents = DocumentMasking.from_config(cfg.data, tokenizer.eod if tokenizer else None)
    rt = runtime or initialize_megatron(cfg)
    forward_step_func = forward_step_func or family.forward_step(cfg)
    backend = build_backend(cfg, rt, forward_step_func, family)
    loop = None
    try:
        state = backend.load() if cfg.checkpoint.load else TrainState()
        iters = build_data_iterators(
            cfg,
            rt,
            state.consumed_train_samples,
            state.consumed_valid_samples,
            documents,
            family.datasets_provider,
        )
        no_validation = validation_off(cfg, iters[1])
        if rt.state.rank == 0:
            for line in start_lines(cfg, family):
                print(line, file=out, flush=True)
            if no_validation:
                print(f"warning: {no_validation}", file=out, flush=True)
        loop = TrainLoop(cfg, rt, backend, out)
        _record_run_config(run_config, cfg.checkpoint.save, rt.state.rank == 0, loop.metrics)
        result = loop.run(state, *iters)
        backend.wait_for_save()  # an --async-save in flight: committed before we return
        loop.announce_commits()
        if hasattr(backend.model, "finish_param_sync"):  # an --overlap-param-gather in flight
            backend.model.finish_param_sync()
        result.model = backend.model
        return result
    except (TrainingError, CheckpointError):  # our own errors already say what happened
        raise
    except RuntimeError as e:  # a collective failed (timed out, or a peer closed the connection)
        why = explain_collective_failure(rt.heartbeat, e, cfg.distributed.timeout_minutes)
        if why is None:
            raise
        raise TrainingError(why) from e
    finally:
        if getattr(backend, "replicas", None) is not None:
            backend.replicas.shutdown()  # torchft's manager threads and servers
        if loop is not None:
            loop.profiler.close()
            loop.metrics.close()
            if loop.stragglers is not None:
                loop.stragglers.close()
        if runtime is None and rt.heartbeat is not None:
            rt.heartbeat.stop()  # ours to stop: each pretrain() call would start another


def build_backend(
    cfg: MegatronConfig, rt: Runtime, forward_step_func, family: ModelSpec
) -> TrainerBackend:
    """--deepspeed picks DeepSpeed's engine (imported only then), else our own backend."""
    model_provider = family.model_provider(cfg)
    if cfg.deepspeed.enabled:
        from megatron.training.deepspeed.backend import DeepSpeedBackend

        return DeepSpeedBackend(
            cfg, rt, forward_step_func, model_provider, family.deepspeed_pipeline
        )
    return NativeBackend(cfg, rt, forward_step_func, model_provider)
