"""Megatron-LM v1.1.5's examples/ds_pretrain_gpt2.sh (ZeRO stage 2 JSON) under the deepspeed
launcher, scaled to a CPU as tests/helpers/v1_scripts.py says (a file of its own: the slowest
of the v1 scripts, so xdist's workers run it beside the others)."""

import json

import pytest

from tests.helpers.v1_scripts import (
    DS_ZERO_STAGE_2_CONFIG,
    check,
    deepspeed_cmd,
    ds_options,
    on_cpu,
    run,
)


@pytest.mark.slow
def test_ds_pretrain_gpt2_sh(workdir):
    pytest.importorskip("deepspeed")
    mp_size, batch, world = 2, 2, 2  # v1.x: mp_size=4, BATCHSIZE=9, 8 GPUs
    config_json = workdir / "examples" / "ds_zero_stage_2_config.json"
    config_json.write_text(json.dumps(on_cpu(DS_ZERO_STAGE_2_CONFIG, batch * world // mp_size)))
    ck = "checkpoints/gpt2_345m_ds"
    out = run(
        deepspeed_cmd(world, config_json, ds_options(mp_size, None, batch, None, ck)), workdir
    )
    check(out, batch, workdir / ck)  # DP = 2 ranks / mp 2 = 1
