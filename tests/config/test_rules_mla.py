"""Multi-latent attention's bad input, refused before any work with the flag and the fix: its
settings without it, grouped-query / head-size flags with it, heads that do not split over
TP, an odd RoPE part, YaRN settings under plain RoPE; and on resume a checkpoint saved
without MLA loaded into an MLA model (and back, and other MLA sizes)."""

from __future__ import annotations

import pytest

from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate_model
from megatron.training.checkpoint_args import check_model_args, checkpoint_args
from tests.helpers.models import tiny_gpt
from tests.helpers.training import BASE

RUN = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "4"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8"]
MLA += ["--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]


@pytest.mark.parametrize(
    "flags, flag, fix",
    [
        (["--kv-lora-rank", "16"], "--kv-lora-rank", "add --multi-latent-attention, or drop it"),
        (["--q-lora-rank", "8"], "--q-lora-rank", "add --multi-latent-attention"),
        (["--rope-type", "yarn"], "--rope-type", "add --multi-latent-attention"),
        (["--mscale-all-dim", "1"], "--mscale-all-dim", "add --multi-latent-attention"),
        ([*MLA, "--num-query-groups", "2"], "--num-query-groups", "drop --num-query-groups"),
        ([*MLA, "--kv-channels", "8"], "--kv-channels", "drop --kv-channels"),
        ([*MLA, "--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim", "use an even size"),
        (
            [*MLA, "--rope-type", "rope", "--rotary-scaling-factor", "40"],
            "--rotary-scaling-factor",
            "pass --rope-type yarn",
        ),
        (["--rope-type", "rope"], "--rope-type rope", "add --position-embedding-type rope"),
    ],
)
def test_bad_mla_flags_are_refused_naming_flag_and_fix(flags, flag, fix):
    with pytest.raises(ConfigError) as err:
        parse_args([*RUN, *flags], world_size=1)
    msg = str(err.value)
    assert msg.startswith(f"{flag}: "), msg
    assert "Fix: " in msg and fix in msg, msg


def test_mla_heads_that_do_not_split_over_tp_are_refused():
    cfg = tiny_gpt(multi_latent_attention=True, num_attention_heads=6, hidden_size=48)
    validate_model(cfg, tp=2)  # 6 heads split over 2
    with pytest.raises(ConfigError, match=r"^--num-attention-heads: 6 multi-latent attention"):
        validate_model(cfg, tp=4)


def test_mla_defaults_are_megatron_lms():
    cfg = parse_args([*RUN, "--multi-latent-attention"], world_size=1).model
    sizes = (cfg.q_lora_rank, cfg.kv_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_dim)
    assert sizes == (None, 32, 128, 64, 128)
    assert cfg.mla_rope_type == "yarn" and cfg.rotary_scaling_factor == 1.0


@pytest.mark.parametrize(
    "saved, now, message",
    [
        ([], MLA, "saved without --multi-latent-attention and this run is with it"),
        (MLA, [], "saved with --multi-latent-attention and this run is without it"),
        (MLA, [*MLA, "--kv-lora-rank", "8"], "--kv-lora-rank 16 but this run has --kv-lora-rank 8"),
    ],
)
def test_a_checkpoint_with_other_attention_is_refused_on_resume(saved, now, message):
    args = checkpoint_args(parse_args([*RUN, *saved], world_size=1))
    cfg = parse_args([*RUN, *now], world_size=1)
    with pytest.raises(CheckpointError, match=message):
        check_model_args({"args": args}, cfg, "ckpt/iter_0000003")


def test_a_checkpoint_from_before_mla_resumes_a_model_without_it():
    args = checkpoint_args(parse_args(RUN, world_size=1))
    for name in ("multi_latent_attention", "kv_lora_rank", "q_lora_rank"):
        del args["model"][name]  # as a checkpoint written before these fields existed
    check_model_args({"args": args}, parse_args(RUN, world_size=1), "ckpt")
    with pytest.raises(CheckpointError, match="without --multi-latent-attention"):
        check_model_args({"args": args}, parse_args([*RUN, *MLA], world_size=1), "ckpt")
