"""Model families by name, for the entry points, tools and users (`get_spec("bert")`).

The table itself lives in megatron.model.families, on the floor of the trainer, checkpoint and
inference code that read it (they sit below this package); this module re-exports it, so the
names stay where they were imported from. Each family is a folder `megatron/models/<name>/`
whose `spec.py` registers its ModelSpec; a built-in family is imported on first use.

Adding a family: a folder with its model (built from ModelConfig + BuildContext), datasets
provider, forward step and, if it has a Hugging Face twin, the mapping; a `spec.py` ending in
`SPEC = register(ModelSpec(...))`; its name in megatron.model.families.FAMILIES (or, outside
this repository, importing its spec.py registers it); an entry point that calls
`pretrain(cfg, family=get_spec(name))`.
"""

from __future__ import annotations

from megatron.model.families import (
    DEFAULT_FAMILY,
    FAMILIES,
    ModelSpec,
    all_specs,
    checkpoint_family,
    family_names,
    get_spec,
    register,
    spec_of_checkpoint_family,
    vocab_sized_names,
)

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "ModelSpec",
    "all_specs",
    "checkpoint_family",
    "family_names",
    "get_spec",
    "register",
    "spec_of_checkpoint_family",
    "vocab_sized_names",
]
