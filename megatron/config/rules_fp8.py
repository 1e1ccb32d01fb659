"""Rules of --fp8-format / --fp8-recipe (float8 GEMMs through torchao, megatron.model.fp8).
The device, and torchao being installed, are checked when the model is built (apply_fp8)."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig, PrecisionConfig

SUPPORTED_RECIPES = ("tensorwise", "rowwise")


def validate_fp8_precision(p: PrecisionConfig) -> None:
    """The precision section's fp8 rules (what any caller of apply_fp8 must also meet)."""
    if p.fp8_format is None:
        if p.fp8_recipe is not None:
            fail(
                "--fp8-recipe",
                "given without --fp8-format (float8 is off)",
                "add --fp8-format e4m3 or --fp8-format hybrid, or drop --fp8-recipe",
            )
        return
    if p.fp8_scaling not in SUPPORTED_RECIPES:
        fail(
            f"--fp8-recipe {p.fp8_recipe}",
            "is a Transformer Engine recipe of Megatron-core; float8 here runs through "
            "torchao, which scales each tensor when it is cast",
            f"use --fp8-recipe {' or '.join(SUPPORTED_RECIPES)}",
        )
    if not p.bf16:
        fail(
            f"--fp8-format {p.fp8_format}",
            "needs --bf16: the float8 GEMMs take and return bf16 activations, the rest of the "
            "model runs in bf16",
            "add --bf16" + (" instead of --fp16" if p.fp16 else ""),
        )


def validate_fp8(cfg: MegatronConfig) -> None:
    validate_fp8_precision(cfg.precision)
    refuse_pairs(cfg, "--fp8-format")  # --deepspeed, MoE: megatron.config.rules_pairs
