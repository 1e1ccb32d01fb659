"""Model families as the generic code sees them: ModelSpec and the table the families fill.

The trainer, checkpoint and inference code sit below megatron/models/ (the families use the
trainer's data loading and backends), so what they need from a family lives here, on their
floor: each family's `spec.py` registers its ModelSpec (`SPEC = register(ModelSpec(...))`), and
the generic code asks this table by name (the entry point's choice, or the one a checkpoint
records). A built-in family is imported by its name on first use, so a checkpoint of any of
them loads without its entry point; a family outside this repository registers itself when its
own code is imported. This module imports nothing of megatron; the entry points and tools
import it too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

FAMILIES = ("gpt", "bert")  # the built-in families: megatron/models/<name>/spec.py
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


_REGISTERED: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Enter a family in the table (its spec.py calls this when imported); returns `spec`."""
    _REGISTERED[spec.name] = spec
    return spec


def family_names() -> tuple[str, ...]:
    """The built-in families, then any other registered one."""
    return FAMILIES + tuple(n for n in _REGISTERED if n not in FAMILIES)


def get_spec(name: str) -> ModelSpec:
    """The spec of family `name` (a built-in one is imported on first use)."""
    if name not in _REGISTERED and name in FAMILIES:  # its spec.py registers SPEC on import
        register(importlib.import_module(f"megatron.models.{name}.spec").SPEC)
    if name not in _REGISTERED:
        raise ValueError(
            f"unknown model family {name!r}; the families are {', '.join(family_names())} "
            "(a family of your own registers itself: megatron.model.families.register)"
        )
    return _REGISTERED[name]


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in family_names()]


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
