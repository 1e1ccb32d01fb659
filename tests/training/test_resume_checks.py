"""A resume refuses a checkpoint whose recorded model arguments this run would silently change:
an MoE model's router (--moe-router-topk, --moe-router-score-function) included, unless
--finetune starts a new run from the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.checkpoint.storage import (
    CheckpointError,
    checkpoint_dir,
    finalize_checkpoint,
    save_shard,
)
from megatron.config.cli import parse_args
from megatron.training.checkpoint_args import check_model_args, checkpoint_args
from megatron.training.state import load_training_state
from tests.helpers.training import BASE

MOE = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "4"]
MOE += ["--num-experts", "4", "--moe-router-topk", "2"]

# One process at TP = PP = DP = 1: what load_training_state reads of the runtime.
_ONE = dict(
    tp_size=1, pp_size=1, virtual_pp_size=None, dp_size=1, cp_size=1, ep_size=1, pipeline_v=False
)
_RT = SimpleNamespace(
    state=SimpleNamespace(**_ONE, etp_size=1, tp_rank=0, pp_rank=0, rank=0, world_size=1),
    device="cpu",
)


def _saved_moe(root) -> str:
    """A checkpoint (iteration 3) that records the args of `MOE` (top-2, softmax router)."""
    args = checkpoint_args(parse_args(MOE, world_size=1))
    save_shard(root, 3, {"args": args, "model": {}}, tp_rank=0, pp_rank=0, pp_size=1, write=True)
    finalize_checkpoint(root, 3, barrier=lambda: None, is_rank0=True)
    return checkpoint_dir(root, 3)


@pytest.mark.parametrize(
    "changed, was, now",
    [
        (["--moe-router-topk", "1"], "--moe-router-topk 2", "--moe-router-topk 1"),
        (
            ["--moe-router-score-function", "sigmoid"],
            "--moe-router-score-function softmax",
            "--moe-router-score-function sigmoid",
        ),
    ],
)
def test_a_changed_moe_router_is_refused_on_resume_naming_flag_value_and_override(
    tmp_path, changed, was, now
):
    where = _saved_moe(str(tmp_path))
    cfg = parse_args([*MOE, *changed, "--load", str(tmp_path)], world_size=1)
    with pytest.raises(CheckpointError) as err:
        load_training_state(cfg, _RT, model=None, optimizer=None, scheduler=None)
    msg = str(err.value)
    assert msg.startswith(f"{where}: the checkpoint's MoE router was trained with {was}, "), msg
    assert f"this run has {now}" in msg
    assert f"Fix: resume with {was}, or pass --finetune" in msg
    # --finetune starts a new run from the weights: the router may change (as Megatron-LM
    # skips its checkpoint-argument check with --finetune).
    finetune = parse_args([*MOE, *changed, "--load", str(tmp_path), "--finetune"], world_size=1)
    saved = {"args": checkpoint_args(parse_args(MOE, world_size=1))}
    check_model_args(saved, finetune, where)


def test_a_resume_compares_the_moe_layer_pattern_not_its_spelling():
    """--moe-layer-freq '[1]*4' makes the same 4 layers MoE as the checkpoint's 1 (and '([1,0]*2)'
    the same as an older checkpoint's int 2): the resume goes on; another pattern is refused."""
    saved = {"args": checkpoint_args(parse_args(MOE, world_size=1))}
    for same in ("[1]*4", "([1]*2+[1]*2)", "[1,1,1,1]"):
        check_model_args(saved, parse_args([*MOE, "--moe-layer-freq", same], world_size=1), "c")
    older = {"args": checkpoint_args(parse_args([*MOE, "--moe-layer-freq", "2"], world_size=1))}
    older["args"]["model"]["moe_layer_freq"] = 2  # the int older checkpoints recorded
    check_model_args(older, parse_args([*MOE, "--moe-layer-freq", "([1,0]*2)"], world_size=1), "c")
    changed = parse_args([*MOE, "--moe-layer-freq", "[1,0,1,1]"], world_size=1)
    with pytest.raises(
        CheckpointError, match=r"trained with --moe-layer-freq 1, but this run has "
    ):
        check_model_args(saved, changed, "c")


MLA = [*MOE[:-4], "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8"]
MLA += ["--qk-pos-emb-head-dim", "8", "--v-head-dim", "8", "--position-embedding-type", "rope"]
YARN = ["--rotary-scaling-factor", "4", "--original-max-position-embeddings", "8"]
YARN_SAID = "--rotary-scaling-factor 4.0 --original-max-position-embeddings 8"


@pytest.mark.parametrize(
    "saved_with, resumed_with, was, now",
    [
        (YARN, ["--rope-type", "rope"], f"--rope-type yarn {YARN_SAID}", "--rope-type rope"),
        (YARN, [*YARN, "--mscale-all-dim", "1"], "--mscale-all-dim 0.0", "--mscale-all-dim 1.0"),
        (["--rope-type", "rope"], YARN, "--rope-type rope", f"--rope-type yarn {YARN_SAID}"),
    ],
)  # fmt: skip
def test_changed_rope_under_trained_mla_weights_is_refused_unless_finetune(
    saved_with, resumed_with, was, now
):
    """Before: the resume went on with other rotary frequencies under the trained weights."""
    saved = {"args": checkpoint_args(parse_args([*MLA, *saved_with], world_size=1))}
    cfg = parse_args([*MLA, *resumed_with], world_size=1)
    with pytest.raises(CheckpointError) as err:
        check_model_args(saved, cfg, "ck")
    msg = str(err.value)
    assert msg.startswith(f"ck: the checkpoint's multi-latent attention was trained with {was}, ")
    assert f"this run has {now}; " in msg and f"Fix: resume with {was}, or pass --finetune" in msg
    check_model_args(saved, parse_args([*MLA, *resumed_with, "--finetune"], world_size=1), "ck")
    check_model_args(saved, parse_args([*MLA, *saved_with], world_size=1), "ck")  # the same
    # the default (yarn) spelled out is the same RoPE
    if saved_with is YARN:
        check_model_args(saved, parse_args([*MLA, *YARN, "--rope-type", "yarn"], 1), "ck")
