"""Rules of multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor) against the
model and the layout; each setting's own limits are declared on it (megatron.config.schema)."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig, ModelConfig


def validate_mtp_model(m: ModelConfig) -> None:
    """The MTP settings among themselves (what a checkpoint's model needs at any layout)."""
    if m.mtp_num_layers is None:
        if m.mtp_loss_scaling_factor != 0.1:
            fail(
                "--mtp-loss-scaling-factor",
                "given without --mtp-num-layers (the model has no MTP modules)",
                "add --mtp-num-layers D or drop it",
            )
        return
    if m.mtp_num_layers >= m.seq_length:
        fail(
            "--mtp-num-layers",
            f"depth {m.mtp_num_layers} leaves no target inside --seq-length {m.seq_length} "
            "(depth k predicts the token k + 1 places ahead)",
            "use a depth below the sequence length",
        )


def validate_mtp(cfg: MegatronConfig) -> None:
    """MTP against the layout and the backends (training and conversion)."""
    validate_mtp_model(cfg.model)
    if cfg.model.mtp_num_layers is not None and cfg.data.sequence_packing != "concat":
        fail(
            "--sequence-packing",
            f"{cfg.data.sequence_packing} with --mtp-num-layers: the MTP depths' shifted "
            "targets do not stop at document ends yet, so they would train across documents",
            "use --sequence-packing concat, or drop --mtp-num-layers",
        )
    refuse_pairs(cfg, "--mtp-num-layers")  # megatron.config.rules_pairs
