"""Megatron-LM v1.1.5's examples/ds_pretrain_gpt2_pipe.sh (TP 2 x PP 2 under the deepspeed
launcher), scaled to a CPU as tests/helpers/v1_scripts.py says."""

import json

import pytest

from tests.helpers.v1_scripts import (
    DS_CONFIG,
    check,
    deepspeed_cmd,
    ds_options,
    on_cpu,
    run,
)


@pytest.mark.slow
def test_ds_pretrain_gpt2_pipe_sh(workdir):
    pytest.importorskip("deepspeed")
    mp_size, pp_size, batch, gas, world = 2, 2, 4, 16, 4  # v1.x: the same, 16 GPUs (DP 4)
    config_json = workdir / "examples" / "ds_config.json"
    config_json.write_text(json.dumps(on_cpu(DS_CONFIG, batch * gas)))  # DP 1 (v1.x: 256)
    ck = "checkpoints/gpt2_345m_ds_pipe"
    options = ds_options(mp_size, pp_size, batch, gas, ck)
    check(run(deepspeed_cmd(world, config_json, options), workdir), batch * gas, workdir / ck)
