"""--deepspeed: ZeRO 1/2/3, the pipeline engine and DeepSpeed recompute against our own path;
engine checkpoints that resume exactly; the JSON and the flags never disagree silently."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.deepspeed_json import build_ds_config
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.training import (
    _CALLS,
    _losses,
    _poison_third_micro_batch_on_rank1,
    _train,
    flags,
    train_run,
)

deepspeed = pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed (make test "
    "installs it; pip install --no-build-isolation deepspeed)",
)

CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--vocab-size",
    "128",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]


def _precision_flags(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    return [f"--{p}" for p in ("fp16", "bf16") if data.get(p, {}).get("enabled")]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_each_shipped_config_is_valid_for_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = parse_args(
        [
            *BASE,
            "--deepspeed",
            "--deepspeed_config",
            str(path),
            "--global-batch-size",
            "8",
            *_precision_flags(path),
        ],
        world_size=1,
    )
    ds = build_ds_config(cfg)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 8
    parsed = DeepSpeedConfig(ds, mpu=None)  # DeepSpeed's own checks (one process, no dist)
    assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]


def _ds_cfg(tmp_path, json_body, *extra, world=2):
    path = tmp_path / "ds.json"
    path.write_text(json_body)
    return parse_args(
        [*BASE, "--deepspeed", "--deepspeed_config", str(path), *extra], world_size=world
    )


@pytest.mark.parametrize(
    "body,extra,message",
    [
        (
            '{"train_micro_batch_size_per_gpu": 4}',
            ["--micro-batch-size", "2"],
            "train_micro_batch_size_per_gpu=4 in the DeepSpeed JSON contradicts --micro-batch-size",
        ),
        (
            '{"train_batch_size": 64}',
            ["--global-batch-size", "8"],
            "contradicts --global-batch-size",
        ),
        ('{"gradient_clipping": 0.5}', [], "contradicts --clip-grad"),
        ('{"fp16": {"enabled": true}}', [], "fp16.enabled=True in the DeepSpeed JSON contradicts"),
        (
            '{"zero_optimization": {"stage": 2}}',
            ["--pipeline-model-parallel-size", "2"],
            "DeepSpeed's pipeline engine does not support ZeRO-2/3",
        ),
        ('{"optimizer": {"type": "Lamb"}}', [], "'optimizer' in the DeepSpeed JSON"),
        ('{"optimizer": {"params": {"lr": 0.5}}}', [], "optimizer.params.lr=0.5 in the"),
        ('{"zero_optimization": {"stage": 0}}', ["--cpu-optimizer"], "needs ZeRO stage 1"),
        ('{"zero_optimization": {\n  "stage": 1,,\n}}', [], "ds.json:2: invalid JSON"),
        (
            "{}",
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "4",
            ],
            "no interleaved schedule",
        ),
        (
            '{"zero_optimization": {"stage": 3}}',
            ["--num-experts", "4"],
            "DeepSpeed does not support MoE with ZeRO-3",
        ),
        (
            "{}",
            ["--num-experts", "4", "--pipeline-model-parallel-size", "2"],
            "pipeline engine is not given our expert groups",
        ),
        (
            "{}",
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--bf16"],
            "leaves the expert gradients out of the gradient norm",
        ),
        (
            '{"zero_optimization": {"stage": 1, "reduce_scatter": false}}',
            ["--num-experts", "4", "--expert-model-parallel-size", "2"],
            "only on its reduce-scatter path",
        ),
        (
            "{}",
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
            + ["--expert-tensor-parallel-size", "2"],
            "--expert-tensor-parallel-size 2: DeepSpeed's MoE path keeps whole experts",
        ),
    ],
)
def test_contradictions_between_json_and_flags_fail_fast(tmp_path, body, extra, message):
    with pytest.raises(ConfigError) as err:
        build_ds_config(_ds_cfg(tmp_path, body, *extra))
    assert message in str(err.value)


def test_experts_stay_whole_over_tp_under_deepspeed_unless_asked(tmp_path):
    """Megatron-DeepSpeed replicates experts over TP; Megatron-core (our native backend)
    splits them by default."""
    moe = ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
    ds = _ds_cfg(tmp_path, "{}", *moe)
    assert ds.parallel.expert_tp_size == 1 and build_ds_config(ds)
    native = parse_args([*BASE, *moe], world_size=2)
    assert native.parallel.expert_tp_size == 2


def test_classic_zero_flags_override_the_json_and_fill_it(tmp_path):
    cfg = _ds_cfg(
        tmp_path,
        '{"zero_optimization": {"stage": 1}}',
        "--zero-stage",
        "2",
        "--zero-reduce-bucket-size",
        "1000",
        "--cpu-optimizer",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--checkpoint-activations",
        "--partition-activations",
    )
    ds = build_ds_config(cfg)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1000
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 4)
    assert ds["activation_checkpointing"]["partition_activations"] is True


def _ds_worker(rank, world, argv, save_dir):
    runs = {}
    for stage in (1, 2, 3):
        runs[f"zero{stage}"] = _train(
            rank, world, argv + ["--deepspeed", "--zero-stage", str(stage)]
        )[0]
    ds = argv + ["--deepspeed", "--zero-stage", "1"]
    runs["recompute"] = _train(rank, world, ds + ["--checkpoint-activations"])[0]
    six = [a if a != "6" else "3" for a in ds]
    _train(rank, world, six + ["--save", save_dir])
    runs["resumed"] = _train(rank, world, ds + ["--load", save_dir])[0]
    runs["pipe"] = _train(
        rank,
        world,
        argv + ["--deepspeed", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
    )[0]
    # bf16 at ZeRO-0 (DeepSpeed's FP16_UnfusedOptimizer in bf16) against our bf16 at DP 2.
    runs["bf16 native"] = _train(rank, world, argv + ["--bf16"])[0]
    runs["bf16 zero0"] = _train(rank, world, argv + ["--bf16", "--deepspeed", "--zero-stage", "0"])[
        0
    ]
    # Promise 5 in every precision: rank 1's 3rd micro batch (iteration 2) has a NaN loss.
    for name, extra in (("nan fp32 zero0", []), ("nan bf16 zero1", ["--bf16"])):
        _CALLS["n"] = 0
        stage = "0" if "zero0" in name else "1"
        ds = [*argv, "--deepspeed", "--zero-stage", stage, *extra]
        result = train_run(rank, world, ds, _poison_third_micro_batch_on_rank1)
        runs[name] = result.history
        runs[name + " finite"] = all(p.isfinite().all() for p in result.model.parameters())
    return runs


@pytest.mark.slow
def test_zero_stages_pipeline_recompute_and_resume_match_our_path(data_prefix, tmp_path):
    argv = flags(data_prefix, "--adam-eps", "1e-4")
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    for rank, runs in enumerate(run_distributed(_ds_worker, 2, argv, str(tmp_path / "ck"))):
        for name in ("zero1", "zero2", "zero3", "recompute", "pipe"):
            np.testing.assert_allclose(
                _losses(runs[name]), _losses(ref), rtol=2e-5, err_msg=f"{name} rank {rank}"
            )
        assert _losses(runs["resumed"]) == _losses(runs["zero1"])[3:], "engine resume is exact"
        # bf16 gradients rounded, accumulated and reduced in bf16 (DeepSpeed) or fp32 (ours)
        # differ by ~1e-5 in the loss; the wrapper's warm-up Adam step drifted 4e-4 by step 3.
        bf16, ref16 = runs["bf16 zero0"], runs["bf16 native"]
        np.testing.assert_allclose(_losses(bf16), _losses(ref16), rtol=1e-4, err_msg="bf16 zero0")
        norms, ref_norms = ([h["grad_norm"] for h in r] for r in (bf16, ref16))
        np.testing.assert_allclose(norms, ref_norms, rtol=2e-3, err_msg="bf16 zero0 grad norm")
        for name in ("nan fp32 zero0", "nan bf16 zero1"):
            history = runs[name]
            assert [h["updated"] for h in history] == [True, False, True, True, True, True], name
            assert history[1]["grad_norm"] is None and runs[name + " finite"], name
            assert all(np.isfinite(_losses(history)[2:])), name
    marker = tmp_path / "ck" / "iter_0000003" / "complete"
    assert marker.exists() and (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()


def _run_with_weights(rank, world, argv):
    """(history, this rank's parameters after training in model order, then the MoE expert
    biases (--moe-router-enable-expert-bias), as numpy arrays)."""
    result = train_run(rank, world, argv)
    model = result.model
    tensors = [*model.parameters()]
    tensors += [b for n, b in model.named_buffers() if n.endswith("expert_bias")]
    return result.history, [t.detach().float().numpy().copy() for t in tensors]


_EP2, _TP2 = ["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]
_DS = ["--deepspeed", "--zero-stage"]
# DeepSeek-V3's auxiliary-loss-free bias, moved after DeepSpeed's step as after ours
_BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
_BIAS += ["--moe-router-bias-update-rate", "0.01"]
# (name, flags, native twin): an MoE GPT under DeepSpeed against our backend at the same layout
_MOE_RUNS = (
    ("dp4 ep2 zero0", _EP2 + _DS + ["0"], "dp4 ep2"),
    ("dp4 ep2 zero1", _EP2 + _DS + ["1"], "dp4 ep2"),
    ("dp4 ep2 zero2", _EP2 + _DS + ["2"], "dp4 ep2"),
    ("tp2 ep2 zero2", _TP2 + _EP2 + _DS + ["2"], "tp2 ep2"),
    ("dp4 ep2 bf16 zero1", _EP2 + ["--bf16"] + _DS + ["1"], "dp4 ep2 bf16"),
    ("tp2 ep2 bf16 zero2", _TP2 + _EP2 + ["--bf16"] + _DS + ["2"], "tp2 ep2 bf16"),
    ("dp4 ep2 zero2 expert bias", _EP2 + _BIAS + _DS + ["2"], "dp4 ep2 expert bias"),
)
# Our backend at DeepSpeed's layout: experts whole on each TP rank (ETP 1, DeepSpeed's default).
_ETP1 = ["--expert-tensor-parallel-size", "1"]
_NATIVE = {"dp4 ep2": _EP2, "tp2 ep2": _TP2 + _EP2 + _ETP1, "dp4 ep2 bf16": _EP2 + ["--bf16"]}
_NATIVE["tp2 ep2 bf16"] = _TP2 + _EP2 + _ETP1 + ["--bf16"]
_NATIVE["dp4 ep2 expert bias"] = _EP2 + _BIAS


def _four_rank_worker(rank, world, argv, moe_argv, save_dir):
    """Every 4-rank DeepSpeed run in one spawn: ZeRO-1 x TP 2 (dense), then the MoE GPT."""
    from megatron.checkpoint.storage import CheckpointError

    out = {"tp2 zero1": _train(rank, world, argv + _DS + ["1"] + _TP2)[0]}
    for name, extra in _NATIVE.items():
        out[name] = _run_with_weights(rank, world, moe_argv + extra)
    for name, extra, _ in _MOE_RUNS:
        out[name] = _run_with_weights(rank, world, moe_argv + extra)
    # Engine checkpoints with experts: 2 steps + save, then resumed for steps 3-4 (ZeRO-0 fp32
    # keeps its optimizer in DeepSpeed's per-EP-rank file; ZeRO-2 in its per-rank ZeRO files).
    for stage in ("0", "2"):
        ds = moe_argv + _EP2 + _DS + [stage]
        two = list(ds)
        two[two.index("--train-iters") + 1] = "2"
        d = f"{save_dir}/zero{stage}"
        _train(rank, world, two + ["--save", d])
        out[f"resumed zero{stage}"] = _run_with_weights(rank, world, ds + ["--load", d])
    try:  # at another EP size: refused, naming the fix
        _train(rank, world, moe_argv + _DS + ["2", "--load", f"{save_dir}/zero2"])
        out["ep1 resume"] = "accepted"
    except CheckpointError as e:
        out["ep1 resume"] = str(e)
    return out


def _assert_same_run(run, ref, name, rtol, atol=0.0):
    (history, weights), (ref_history, ref_weights) = run, ref
    np.testing.assert_allclose(_losses(history), _losses(ref_history), rtol=rtol, err_msg=name)
    norms = [h["grad_norm"] for h in history]
    ref_norms = [h["grad_norm"] for h in ref_history]
    np.testing.assert_allclose(norms, ref_norms, rtol=rtol, err_msg=f"{name} grad norm")
    assert len(weights) == len(ref_weights), name
    for i, (w, r) in enumerate(zip(weights, ref_weights, strict=True)):
        np.testing.assert_allclose(w, r, rtol=rtol, atol=atol, err_msg=f"{name} parameter {i}")


@pytest.mark.slow
def test_four_ranks_tensor_parallel_zero1_and_moe_with_expert_parallelism(data_prefix, tmp_path):
    """ZeRO-1 at TP 2 x DP 2 against one process; an MoE GPT (4 experts, aux loss, clipping
    that bites) at DP 4 x EP 2 with ZeRO 0 (fp32), 1 and 2 and TP 2 x EP 2 with ZeRO-2, fp32
    and bf16, and DP 4 x EP 2 ZeRO-2 with the auxiliary-loss-free expert bias (the biases
    compared too): loss, grad norm and every updated weight equal to our backend at the same layout
    (itself equal to one process, tests/model/test_moe_parallel.py); engine checkpoints with
    experts resume exactly; a resume at another EP size is refused."""
    argv = flags(data_prefix, "--adam-eps", "1e-4")
    moe = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--clip-grad", "0.5"]
    moe_argv = flags(data_prefix, "--adam-eps", "1e-4", *moe, iters=4)
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    outs = run_distributed(_four_rank_worker, 4, argv, moe_argv, str(tmp_path), timeout=900)
    for rank, out in enumerate(outs):
        np.testing.assert_allclose(
            _losses(out["tp2 zero1"]), _losses(ref), rtol=2e-5, err_msg=f"tp2 zero1 rank {rank}"
        )
        assert min(h["grad_norm"] for h in out["dp4 ep2"][0]) > 0.5, "clipping is active"
        for name, _, native in _MOE_RUNS:
            bf16 = "bf16" in name  # bf16 weights: rounding of the two optimizers' masters
            rtol, atol = (2e-3, 1e-2) if bf16 else (2e-5, 1e-6)
            _assert_same_run(out[name], out[native], f"{name} rank {rank}", rtol, atol)
        for stage in ("0", "2"):
            (resumed, weights), (straight, final) = (
                out[f"resumed zero{stage}"],
                out[f"dp4 ep2 zero{stage}"],
            )
            assert _losses(resumed) == _losses(straight)[2:], f"zero{stage} resume is exact"
            for w, r in zip(weights, final, strict=True):
                assert np.array_equal(w, r), f"zero{stage} resumed weights, rank {rank}"
        assert "resume at the EP size it was saved with" in out["ep1 resume"], out["ep1 resume"]
