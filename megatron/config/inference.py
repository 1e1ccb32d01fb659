"""The training command line in the inference tools.

Megatron users start generation and evaluation with the flags of the training run (shapes,
layout, precision, tokenizer, ...). The tools take those flags from the trainer's own
declarations (megatron.config.schema), after their own flags, and honour each one:

- shape (--num-layers, --hidden-size, ...): must equal what the checkpoint records; the model
  is always built from the checkpoint, so a different value is an error naming the flag.
- layout (--tensor-model-parallel-size = --model-parallel-size, --pipeline-model-parallel-size):
  TP x PP must equal the process count (inference runs one replica) and the checkpoint's layout.
- run time (--distributed-backend, --distributed-timeout-minutes, --local-rank, --fp16/--bf16,
  the tokenizer flags, --log-interval): used.
- training only (_NO_EFFECT): true of every inference run already, so accepted as satisfied.
Any other training flag (--lr, --train-iters, ...) is refused, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

from megatron.config.cli import unrecognized
from megatron.config.declare import ConfigError, Tree
from megatron.config.schema import MegatronConfig, ModelConfig, PrecisionConfig
from megatron.config.schema_data import TokenizerConfig
from megatron.config.schema_distributed import DistributedConfig
from megatron.config.schema_parallel import ParallelConfig

_LAYOUT = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size")
_RUNTIME = (
    "distributed.backend",
    "distributed.timeout_minutes",
    "distributed.local_rank",
    "precision.fp16",
    "precision.bf16",
    "logging.log_interval",
    *(f"data.tokenizer.{f.name}" for f in dataclasses.fields(TokenizerConfig)),
)
_NO_EFFECT = {
    "recompute.granularity": "inference runs no backward pass, so nothing is recomputed",
    "recompute.method": "inference runs no backward pass, so nothing is recomputed",
    "recompute.num_layers": "inference runs no backward pass, so nothing is recomputed",
    "checkpoint.no_load_optim": "inference never loads optimizer state",
    "checkpoint.no_load_rng": "inference never loads RNG state",
    "model.hidden_dropout": "inference runs in eval mode, without dropout",
    "model.attention_dropout": "inference runs in eval mode, without dropout",
    "model.init_method_std": "the weights come from the checkpoint",
    "training.seed": "evaluation draws no random numbers",
}
# ModelConfig fields read through a property: the checkpoint's effective value is compared.
_EFFECTIVE = {
    "max_position_embeddings": "max_positions",
    "ffn_hidden_size": "ffn_size",
    "num_query_groups": "query_groups",
    "kv_channels": "head_dim",
}


EPILOG = (
    "Also accepted: the training run's flags. Shape flags (--num-layers, --hidden-size, ...) "
    "must match the checkpoint; --tensor-model-parallel-size x --pipeline-model-parallel-size "
    "must equal the process count; --fp16/--bf16, the tokenizer flags, --distributed-backend "
    "and --log-interval are used; --checkpoint-activations, --no-load-optim, --no-load-rng "
    "have nothing to do at inference. Other training flags are refused."
)


@functools.cache
def _tree() -> Tree:
    return Tree(MegatronConfig)


def _training_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, prog="training flags")
    _tree().add_arguments(p, given_only=True)
    return p


def parse_with_training_flags(parser: argparse.ArgumentParser, argv=None):
    """(tool args, {config path: value} of the training flags given). The tool's own flags win
    (e.g. its --seq-length); the rest must be training flags an inference run can honour."""
    args, rest = parser.parse_known_args(argv)
    training = _training_parser()
    ns, unknown = training.parse_known_args(rest)
    if unknown:
        parser.error(unrecognized(unknown, parser, training))
    given = _tree().given(ns)
    shape = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)} - {"model.seq_length"}
    for path in given:
        if path not in (*_LAYOUT, *_RUNTIME, *_NO_EFFECT, *shape):
            flag = _tree().settings[path].flag
            raise ConfigError(
                f"{flag}: a training setting that inference does not use. Fix: drop {flag} "
                f"(see {parser.prog} --help for this tool's flags)"
            )
    return args, given


def inference_config(given: dict, world_size: int, pp_default: int = 1) -> MegatronConfig:
    """The run config of an inference tool from the training flags given: the layout (TP
    defaults to the processes / PP: one model replica), the process-group and precision
    settings; the model comes from the checkpoint. Check it with validate(cfg, "inference")."""
    pp = given.get("parallel.pipeline_model_parallel_size", pp_default)
    tp = given.get("parallel.tensor_model_parallel_size", max(world_size // max(pp, 1), 1))
    sections = {"distributed": DistributedConfig, "precision": PrecisionConfig}
    kwargs = {
        name: cls(**{p.rpartition(".")[2]: v for p, v in given.items() if p.startswith(name + ".")})
        for name, cls in sections.items()
    }
    par = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world_size
    )
    return MegatronConfig(parallel=par, **kwargs)


def check_against_checkpoint(given: dict, saved: ModelConfig, load: str) -> None:
    """Every shape flag given equals the checkpoint's value, or a ConfigError naming it."""
    for path, value in given.items():
        section, _, name = path.rpartition(".")
        if section != "model" or path in _NO_EFFECT or name == "seq_length":
            continue
        recorded = getattr(saved, _EFFECTIVE.get(name, name))
        if value != recorded and value is not None:
            flag = _tree().settings[path].flag
            if isinstance(value, bool):
                raise ConfigError(
                    f"{flag}: the checkpoint {load} was trained with {name} = {recorded}. "
                    f"Fix: drop {flag} (the architecture comes from the checkpoint)"
                )
            raise ConfigError(
                f"{flag} {value}: the checkpoint {load} was trained with {recorded}. Fix: pass "
                f"{flag} {recorded} or drop the flag (the shapes come from the checkpoint)"
            )


def tokenizer_overrides(given: dict) -> dict:
    """{field: value} of the tokenizer flags given; they replace the checkpoint's record."""
    prefix = "data.tokenizer."
    return {p[len(prefix) :]: v for p, v in given.items() if p.startswith(prefix)}


def precision_dtype(given: dict):
    """torch dtype asked for by --fp16/--bf16 (None: keep the checkpoint's)."""
    import torch

    if given.get("precision.fp16"):
        return torch.float16
    if given.get("precision.bf16"):
        return torch.bfloat16
    return None
