"""Megatron-LM v1.1.5's examples/pretrain_gpt2.sh and pretrain_gpt2_distributed.sh, run as
shipped but scaled to a CPU (tests/helpers/v1_scripts.py says what changes); the DeepSpeed
scripts are in test_v1_ds_scripts.py and test_v1_ds_pipe_script.py."""

import sys

import pytest

from tests.helpers.v1_scripts import (
    PRETRAIN,
    check,
    gpt_options,
    run,
)


@pytest.mark.slow
def test_pretrain_gpt2_sh_one_process(workdir):
    ck = "checkpoints/gpt2_345m"
    cmd = [sys.executable, PRETRAIN]
    cmd += gpt_options(
        ck, "data/webtext/webtext_text_document", "gpt2-vocab.json", "gpt2-merges.txt"
    )
    out = run(cmd, workdir)
    check(out, 2, workdir / ck)
    assert "loss scale: 4294967296.0" in out and "loss scale: 2147483648.0" in out, "fp16 dynamic"


@pytest.mark.slow
def test_pretrain_gpt2_distributed_sh_with_torch_distributed_launch(workdir):
    gpus_per_node, nnodes, node_rank = 2, 1, 0  # v1.x: GPUS_PER_NODE=8
    from tests.helpers.distributed import free_port

    distributed_args = ["--nproc_per_node", str(gpus_per_node), "--nnodes", str(nnodes)]
    distributed_args += ["--node_rank", str(node_rank), "--master_addr", "localhost"]
    distributed_args += ["--master_port", str(free_port())]  # v1.x: 6000
    ck = "checkpoints/gpt2_345m_dist"
    options = gpt_options(
        ck, "data/webtext/webtext_text_document", "gpt2-vocab.json", "gpt2-merges.txt"
    )
    cmd = [sys.executable, "-m", "torch.distributed.launch", *distributed_args, PRETRAIN]
    cmd += ["--model-parallel-size", "1", *options]
    check(run(cmd, workdir), 2 * 2, workdir / ck)  # batch 2 x DP 2
