"""Model families by name: what the generic trainer, checkpoint and inference code need from one.

Each family is a folder `megatron/models/<name>/` whose `spec.py` defines `SPEC`, a ModelSpec.
Code outside the folders asks for a family by its name (the entry point's choice, or the one a
checkpoint records), never by importing it: `get_spec(name)` imports the family's folder on first
use. This module imports no family, so every layer may import it (the families themselves sit on
top: they use the trainer's data loading and backends).

Adding a family: a folder with its model (built from ModelConfig + BuildContext), datasets
provider, forward step and, if it has a Hugging Face twin, the mapping; a `spec.py`; its name in
FAMILIES; an entry point that calls `pretrain(cfg, family=get_spec(name))`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

FAMILIES = ("gpt", "bert")
# The family of a checkpoint that records none (every Megatron-LM GPT checkpoint), and of
# pretrain() when it is not told one.
DEFAULT_FAMILY = "gpt"


@dataclass(frozen=True)
class ModelSpec:
    """One model family, as the generic code sees it.

    model_provider(cfg) -> build(ModelConfig, BuildContext) -> ModelChunks (this rank's chunks);
        cfg None: as the recorded architecture alone says (inference)
    datasets_provider(cfg, rt, counts) -> [train, valid, test] datasets
    forward_step(cfg) -> forward_step(data_iterator, model) -> (output, loss_fn); the function's
        `other_losses` attribute names stats logged beside "lm loss"
    reference_model(model_cfg, family) -> the whole TP = 1 model of a recorded checkpoint
        family (built on the meta device by resharding to learn names, shapes and splits)
    checkpoint_families: the names checkpoints of this family record in args["model_family"]
    family_of_names(names) -> which of them a state dict's names are, or None: not this family
    vocab_sized: state-dict names with one row per (padded) vocab entry
    deepspeed_pipeline(cfg, rt, checkpoint_fn) -> a deepspeed PipelineModule, or None
    hf_export(state, args, out_dir, **kw) -> architecture name; hf_import(hf_dir, hf_config)
        -> (state, args); hf_model_types: the Hugging Face `model_type`s it imports
    causal_lm: generation and LM evaluation (megatron.inference) can run it
    purpose: what megatron.config.rules.validate(cfg, purpose) checks a training run of this
        family against (the family's own rules live there, beside the others)
    """

    name: str
    model_provider: Callable
    datasets_provider: Callable
    forward_step: Callable
    reference_model: Callable
    checkpoint_families: tuple[str, ...]
    family_of_names: Callable
    vocab_sized: tuple[str, ...] = ()
    deepspeed_pipeline: Callable | None = None
    hf_export: Callable | None = None
    hf_import: Callable | None = None
    hf_model_types: tuple[str, ...] = ()
    causal_lm: bool = False
    purpose: str = "train-gpt"


def get_spec(name: str) -> ModelSpec:
    """The spec of family `name` (imported on first use)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; the families are {', '.join(FAMILIES)}")
    return importlib.import_module(f"megatron.models.{name}.spec").SPEC


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in FAMILIES]


def spec_of_checkpoint_family(family: str | None) -> ModelSpec:
    """The spec owning a recorded args["model_family"] (None: the default family)."""
    family = family or DEFAULT_FAMILY
    for spec in all_specs():
        if family in spec.checkpoint_families:
            return spec
    raise ValueError(f"a checkpoint of model family {family!r}, which no family here owns")


def checkpoint_family(names) -> str:
    """The recorded family a full state dict's names belong to (the default family's if no
    other family claims them)."""
    names = set(names)
    for spec in all_specs():
        if spec.name != DEFAULT_FAMILY and (found := spec.family_of_names(names)):
            return found
    return get_spec(DEFAULT_FAMILY).family_of_names(names) or DEFAULT_FAMILY


def vocab_sized_names() -> frozenset[str]:
    """Every family's vocab-sized tensors (their padding rows are dropped and restored)."""
    return frozenset(n for spec in all_specs() for n in spec.vocab_sized)
