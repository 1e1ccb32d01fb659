"""The DeepSeek-V3 recipe on four ranks: multi-latent attention, one MTP depth, a dense first
layer, and the sigmoid router with the expert bias and group-limited routing, trained through
pretrain() with the distributed optimizer at TP 2 x DP 2 x EP 2 and PP 2 x DP 2 x EP 2. Each
equals one process in the logged LM loss, MTP loss and grad norm at every step (the expert bias
moves after every step, so a wrong bias shows in the later losses). The per-piece tests
(test_mla_parallel.py, test_mtp.py, test_router.py, test_moe_parallel.py) compare gradients and
weights layout by layout; this one checks that the pieces compose."""

import numpy as np

from tests.helpers.distributed import run_distributed
from tests.helpers.training import _train, assert_same_run, flags

DEEPSEEK = [
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
    "--rope-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--mtp-num-layers", "1",
    "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "2",
    "--moe-router-group-topk", "1", "--moe-layer-freq", "([0]*1+[1]*1)",
]  # fmt: skip
LAYOUTS = {
    "tp2-dp2-ep2": ["--tensor-model-parallel-size", "2"],
    "pp2-dp2-ep2": ["--pipeline-model-parallel-size", "2"],
}
SHARDED = ["--use-distributed-optimizer", "--expert-model-parallel-size", "2"]


def test_the_deepseek_v3_pieces_compose_on_four_ranks_as_one_process(data_prefix):
    argv = flags(data_prefix, "--adam-eps", "1e-4", *DEEPSEEK, iters=4)
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"], "the toy run must learn"
    for name, layout in LAYOUTS.items():
        results = run_distributed(_train, 4, argv + layout + SHARDED)
        assert any(history for history, _, _ in results), name
        for rank, (history, _, _) in enumerate(results):
            if not history:  # only the ranks that log keep a history
                continue
            assert_same_run(history, ref, f"{name} rank {rank}")
            np.testing.assert_allclose(
                [h["mtp_1 loss"] for h in history],
                [h["mtp_1 loss"] for h in ref],
                rtol=2e-5,
                err_msg=f"{name} rank {rank}: MTP loss",
            )
