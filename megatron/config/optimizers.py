"""The table of optimizers (--optimizer): one entry per name, read by every floor.

An entry says what the rest of the code needs to know of an optimizer without building it:
its builder, the per-parameter state it keeps (the resume check refuses a checkpoint whose
state another optimizer wrote; the planner counts its bytes), whether it updates whole
matrices (Muon: every backend then hands its builder a way to see each matrix whole, and the
rules refuse what cannot gather them), and what DeepSpeed's JSON calls it. The setting's
choices are this table's names (`NAMES`, a live view: a name registered later is a choice).

Adding an optimizer is one builder and one `register(OptimizerKind(...))`: the builder is
`build(groups, cfg, feed) -> torch.optim.Optimizer`, where `groups` are the torch param groups
(each with its `wd_mult`: 1 for matrices, 0 for biases and norms), `cfg` the OptimizerConfig
and `feed` the backend's megatron.optim.matrices.Feed (where the fp32 pieces live; a whole-matrix
optimizer asks it for its matrices whole). A built-in entry names its builder as
"module:function", imported on first use, so this table, and config with it, never imports torch.
Standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer, as the table knows it.

    `build`: the builder, or "module:function" where it is (built-ins: imported on first use).
    `state_keys`: the per-element state one parameter keeps, in the order the optimizer
    creates it (the first tells it apart from another optimizer's on resume).
    `matrix_state_keys`: the same for the parameters it updates as whole matrices.
    `state_bytes(settings)`: fp32 bytes of state per parameter (`settings`: anything with the
    OptimizerConfig fields it reads); an upper bound where matrices keep less.
    `whole_matrices`: it updates (some) weights as whole matrices (Newton-Schulz), not element
    by element: sharded backends gather them, and DeepSpeed or the CPU optimizer cannot.
    `deepspeed_types`: the DeepSpeed JSON "optimizer.type"s (lower case) that mean it.
    """

    name: str
    build: str | Callable
    state_keys: tuple[str, ...]
    state_bytes: Callable[[object], int]
    matrix_state_keys: tuple[str, ...] = ()
    whole_matrices: bool = False
    deepspeed_types: tuple[str, ...] = ()

    def builder(self) -> Callable:
        """build(groups, cfg, feed) -> the torch optimizer ("module:function" imported here)."""
        if isinstance(self.build, str):
            module, _, function = self.build.partition(":")
            return getattr(importlib.import_module(module), function)
        return self.build


_TABLE: dict[str, OptimizerKind] = {}


def register(kind: OptimizerKind) -> OptimizerKind:
    """Enter an optimizer in the table (a later entry of the same name replaces it)."""
    _TABLE[kind.name] = kind
    return kind


def get_kind(name: str) -> OptimizerKind:
    if name not in _TABLE:
        raise ValueError(f"--optimizer {name}: unknown; choose one of {', '.join(_TABLE)}")
    return _TABLE[name]


def kinds() -> tuple[OptimizerKind, ...]:
    """Every registered optimizer, in the order of registration."""
    return tuple(_TABLE.values())


class _Names:
    """The registered names, read when asked: the setting's `choices`."""

    def __contains__(self, name: object) -> bool:
        return name in _TABLE

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_TABLE))

    def __len__(self) -> int:
        return len(_TABLE)


NAMES = _Names()

_ADAM_STATE = ("exp_avg", "exp_avg_sq")

register(
    OptimizerKind(
        "adam",
        "megatron.optim.elementwise:adamw",
        _ADAM_STATE,
        lambda settings: 8,
        deepspeed_types=("adam", "adamw"),  # DeepSpeed's "Adam" is AdamW unless adam_w_mode=false
    )
)
register(
    OptimizerKind(
        "sgd",
        "megatron.optim.elementwise:sgd",
        ("momentum_buffer",),
        lambda settings: 4 if settings.sgd_momentum else 0,
    )
)
register(
    OptimizerKind(
        "muon",
        "megatron.optim.muon:build",
        _ADAM_STATE,  # the parameters AdamW takes
        lambda settings: 8,  # its matrices hold 4 bytes, not 8: an upper bound
        matrix_state_keys=("momentum_buffer",),
        whole_matrices=True,
    )
)
