"""Megatron-LM v1.x (v1.1.5) run-time flags: each accepted and honoured (tested by its effect), or
refused with its reason. The multi-rank checks share one gloo spawn per backend."""

import contextlib
import os

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.compat_v1 import REFUSED
from megatron.config.declare import ConfigError
from megatron.config.deepspeed_json import build_ds_config
from megatron.config.rules import validate
from megatron.training.loop import pretrain, resolve_vocab
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import MMAP
from tests.helpers.training import _losses, _train, flags, refusal

VOCAB_JSON, MERGES = str(MMAP / "vocab.json"), str(MMAP / "merges.txt")
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
BASE += ["--vocab-size", "128", "--train-iters", "4", "--lr", "1e-3"]


def _without(argv: list[str], flag: str, nargs: int = 1) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + nargs :]


# ---- the command line: aliases, refusals, rules ----


def test_help_lists_the_v1_spellings_as_aliases(capsys):
    import pretrain_gpt2

    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt2.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for current, old in (
        ("--pipeline-model-parallel-size PIPELINE_MODEL_PARALLEL_SIZE", "--pipe-parallel-size"),
        ("--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE", "--model-parallel-size"),
        ("--micro-batch-size MICRO_BATCH_SIZE", "--batch-size"),
        ("--gradient-accumulation-steps GRADIENT_ACCUMULATION_STEPS", "--gas"),
        ("--min-loss-scale MIN_LOSS_SCALE", "--min-scale"),
        ("--ddp-impl {local,torch}", "--DDP-impl"),
        ("--distribute-saved-activations", "--distribute-checkpointed-activations"),
        ("--cpu_torch_adam", "--cpu-torch-adam"),
    ):
        assert f"{current}, {old}" in text, old
    for flag in (
        "--fp32-allreduce",
        "--use-cpu-initialization",
        "--no-save-optim",
        "--no-save-rng",
    ):
        assert flag in text
    assert "--deepspeed-activation-checkpointing" in text and "--cpu-optimizer" in text
    assert "--lazy-mpu-init X refused:" in text
    assert "--mask-prob MASK_PROB" in text  # pretrain_bert.py's, refused by pretrain_gpt2.py


def test_aliases_set_the_current_settings():
    cfg = parse_args(
        [*BASE, "--pipe-parallel-size", "2", "--batch-size", "3", "--gas", "4"]
        + ["--min-scale", "8", "--allreduce-dtype", "params"]
        + ["--fp32-allreduce", "--use-cpu-initialization", "--no-save-optim", "--no-save-rng"],
        world_size=4,
    )
    assert cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.training.micro_batch_size == 3  # v1.x --batch-size: the batch of one forward
    assert cfg.training.resolved_global_batch_size(2) == 3 * 2 * 4  # micro x DP x gas
    assert cfg.optimizer.min_loss_scale == 8.0
    assert cfg.distributed.allreduce_dtype == "fp32"  # --fp32-allreduce wins, as a shortcut
    assert cfg.distributed.use_cpu_initialization
    assert cfg.checkpoint.no_save_optim and cfg.checkpoint.no_save_rng
    one = parse_args([*BASE, "--pipe-parallel-size", "0", "--DDP-impl", "torch"], world_size=1)
    assert one.parallel.pipeline_model_parallel_size == 1  # v1.x: 0 = no pipeline
    assert one.distributed.ddp_impl == "torch"


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_v1_flags_say_why(flag):
    nargs = REFUSED[flag][0]
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, flag, *([] if nargs == 0 else ["1"])], world_size=1)
    message = str(err.value)
    assert message.startswith(f"{flag}: ") and "Fix:" in message
    if flag.startswith("--adlr"):
        assert "--exit-signal-handler" in message


DEEPSPEED_ONLY = [
    ["--zero-stage", "1"],
    ["--zero-reduce-scatter"],
    ["--zero-contigious-gradients"],
    ["--zero-reduce-bucket-size", "100"],
    ["--zero-allgather-bucket-size", "100"],
    ["--partition-activations"],
    ["--checkpoint-in-cpu"],
    ["--contigious-checkpointing"],
    ["--synchronize-each-layer"],
    ["--profile-backward"],
    ["--deepspeed-activation-checkpointing"],
]


@pytest.mark.parametrize("extra", DEEPSPEED_ONLY, ids=[e[0] for e in DEEPSPEED_ONLY])
def test_deepspeed_only_flags_need_deepspeed(extra):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, "--checkpoint-activations", *extra], world_size=1)
    assert str(err.value).startswith(f"{extra[0]}: ") and "add --deepspeed" in str(err.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--gas", "2", "--global-batch-size", "8"], "--gas/--global-batch-size"),
        (["--deepspeed", "--partition-activations"], "add --checkpoint-activations"),
        (["--distribute-checkpointed-activations"], "add --checkpoint-activations"),
        (["--DDP-impl", "torch", "--bf16"], "--DDP-impl torch: torch DDP accumulates"),
        (["--DDP-impl", "torch", "--pipe-parallel-size", "2"], "use --DDP-impl local"),
        (["--DDP-impl", "torch", "--deepspeed"], "DeepSpeed's engine does the data"),
        (["--deepspeed", "--no-save-optim"], "--no-save-optim: DeepSpeed's engine"),
        (["--cpu_torch_adam"], "add --cpu-optimizer"),
    ],
)
def test_contradictions_between_v1_flags_fail_fast(extra, message):
    assert message in refusal(*extra)


def test_gas_and_the_deepspeed_json_must_agree(tmp_path):
    path = tmp_path / "ds.json"
    for body, key in (
        ('{"gradient_accumulation_steps": 4}', "gradient_accumulation_steps=4"),
        ('{"train_batch_size": 64}', "train_batch_size=64"),
    ):
        path.write_text(body)
        cfg = parse_args(
            [*BASE, "--gas", "2", "--deepspeed", "--deepspeed_config", str(path)], world_size=2
        )
        with pytest.raises(ConfigError) as err:
            build_ds_config(cfg)
        assert key in str(err.value) and "contradicts --gas" in str(err.value)
    path.write_text('{"train_batch_size": 8, "gradient_accumulation_steps": 2}')
    cfg = parse_args(
        [*BASE, "--batch-size", "2", "--gas", "2", "--deepspeed", "--deepspeed_config", str(path)],
        world_size=2,
    )
    ds = build_ds_config(cfg)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (2, 8)


def test_a_json_optimizer_section_fills_the_flags_it_does_not_contradict(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        '{"optimizer": {"type": "Adam", "params": {"lr": 0.001, "max_grad_norm": 1.0,'
        ' "betas": [0.9, 0.95]}}}'
    )
    cfg = parse_args([*BASE, "--deepspeed", "--deepspeed_config", str(path)], world_size=1)
    assert (cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2) == (0.9, 0.95)
    assert "optimizer" not in build_ds_config(cfg)  # our AdamW, built from these values, runs
    with pytest.raises(ConfigError, match="betas.1.=0.95 in the DeepSpeed JSON contradicts"):
        parse_args(
            [*BASE, "--adam-beta2", "0.999", "--deepspeed", "--deepspeed_config", str(path)],
            world_size=1,
        )


def test_gpt2_bpe_is_the_default_tokenizer_when_a_vocab_file_is_given():
    no_size = _without(BASE, "--vocab-size")
    cfg = parse_args([*no_size, "--vocab-file", VOCAB_JSON, "--merge-file", MERGES], world_size=1)
    assert cfg.data.tokenizer.tokenizer_type == "GPT2BPETokenizer"
    resolved, tokenizer = resolve_vocab(cfg)
    assert resolved.model.vocab_size == tokenizer.vocab_size == 8192
    # Pre-tokenized ids keep working: no --vocab-file, --vocab-size N, no tokenizer.
    assert resolve_vocab(parse_args(BASE, world_size=1))[1] is None
    for argv, flag in (
        ([*no_size, "--vocab-file", VOCAB_JSON], "--merge-file"),
        ([*no_size, "--vocab-file", "missing.json", "--merge-file", MERGES], "--vocab-file"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve_vocab(parse_args(argv, world_size=1))
        assert str(err.value).startswith(f"{flag}: ")
    with pytest.raises(ConfigError) as err:
        validate(parse_args(no_size, world_size=1), "train-gpt")
    assert str(err.value).startswith("--vocab-file: ") and "--vocab-size N" in str(err.value)


# ---- distributed checkpoint (mpu): 1/TP of the input kept, same gradients ----


def _distributed_checkpoint_check(group) -> None:
    from megatron.mpu.random import distributed_checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(4, 3, 6, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = distributed_checkpoint(layer, x, group=group)
    assert saved == [x.numel() // torch.distributed.get_world_size(group)], saved
    out.sum().backward()
    grads = [x.grad.clone(), layer[0].weight.grad.clone()]
    x.grad, layer[0].weight.grad = None, None
    torch.manual_seed(1)  # the same dropout mask, no checkpoint
    layer(x).sum().backward()
    torch.testing.assert_close(grads, [x.grad, layer[0].weight.grad], rtol=0, atol=0)


# ---- native backend at DP2 / TP2: one spawn ----


@contextlib.contextmanager
def _all_reduce_dtypes():
    """Record the dtype of every gradient all-reduce the data-parallel wrapper launches."""
    import megatron.data_parallel.ddp as ddp

    seen, real = [], ddp.dist.all_reduce

    def spy(tensor, *args, **kwargs):
        if kwargs.get("async_op"):  # the gradient buckets (the other all-reduces are scalars)
            seen.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    ddp.dist.all_reduce = spy
    try:
        yield seen
    finally:
        ddp.dist.all_reduce = real


def _weights(model) -> dict:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run(rank, world, argv):
    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    result = pretrain(cfg, out=open(os.devnull, "w"))
    return _losses(result.history), _weights(result.model), result.model


def _native_worker(rank, world, argv, save_dir):
    import megatron.models.gpt.train as gpt_train

    out = {}
    out["local"], w_local, _ = _run(rank, world, argv)
    out["torch"], w_torch, model = _run(rank, world, argv + ["--DDP-impl", "torch"])
    assert type(model.forward_chunk).__name__ == "DistributedDataParallel"
    out["torch_weights"] = max(float((w_local[k] - w_torch[k]).abs().max()) for k in w_local)
    for name, extra in (
        ("fp32", ["--fp32-allreduce"]),
        ("params", ["--allreduce-dtype", "params"]),
    ):
        with _all_reduce_dtypes() as seen:
            out[f"bf16_{name}"] = _run(rank, world, argv + ["--bf16", *extra])[0]
        out[f"dtypes_{name}"] = sorted(set(map(str, seen)))
    # --cpu-optimizer and --use-cpu-initialization together: each must leave the run unchanged.
    devices, real_build = [], gpt_train.build_model
    gpt_train.build_model = lambda cfg, ctx: devices.append(str(ctx.device)) or real_build(cfg, ctx)
    try:
        cpu = ["--cpu-optimizer", "--use-cpu-initialization"]
        out["cpu"], w_cpu, _ = _run(rank, world, argv + cpu)
    finally:
        gpt_train.build_model = real_build
    out["cpu_init_device"] = devices
    out["cpu_weights"] = max(float((w_local[k] - w_cpu[k]).abs().max()) for k in w_local)
    tp2 = argv + ["--tensor-model-parallel-size", "2", "--checkpoint-activations"]
    out["tp2_recompute"] = _run(rank, world, tp2)[0]
    out["tp2_distributed"] = _run(rank, world, tp2 + ["--distribute-checkpointed-activations"])[0]
    _distributed_checkpoint_check(None if world == 1 else torch.distributed.group.WORLD)
    out["no_save"] = _no_save_checks(rank, world, argv, save_dir)
    return out


def _no_save_checks(rank, world, argv, save_dir) -> dict:
    from megatron.checkpoint.reading import load_shard
    from megatron.checkpoint.storage import CheckpointError

    short = [a if a != "6" else "2" for a in argv]
    _run(rank, world, short + ["--save", save_dir, "--no-save-optim", "--no-save-rng"])
    shard = load_shard(save_dir, 2, tp_rank=0, pp_rank=0, pp_size=1)
    out = {"keys": sorted(k for k in ("optimizer", "rng_state", "model") if k in shard)}
    for extra in ([], ["--no-load-optim"]):
        try:
            _run(rank, world, argv + ["--load", save_dir, *extra])
        except CheckpointError as e:
            out[" ".join(extra) or "plain"] = str(e)
    out["resumed"] = _run(
        rank, world, argv + ["--load", save_dir, "--no-load-optim"] + ["--no-load-rng"]
    )[0]
    return out


@pytest.mark.slow
def test_native_v1_flags_take_effect_at_dp2_and_tp2(data_prefix, tmp_path):
    argv = flags(data_prefix, "--adam-eps", "1e-4")
    for out in run_distributed(_native_worker, 2, argv, str(tmp_path / "ck")):
        ref = out["local"]
        np.testing.assert_allclose(out["torch"], ref, rtol=1e-6, err_msg="--DDP-impl torch")
        assert out["torch_weights"] < 1e-6, "same updated weights through torch DDP"
        np.testing.assert_allclose(out["cpu"], ref, rtol=1e-6, err_msg="--cpu-optimizer")
        assert out["cpu_weights"] < 1e-6 and out["cpu_init_device"] == ["cpu"]
        assert out["dtypes_fp32"] == ["torch.float32"], "--fp32-allreduce reduces in fp32"
        assert out["dtypes_params"] == ["torch.bfloat16"], "--allreduce-dtype params: in bf16"
        np.testing.assert_allclose(out["bf16_params"], out["bf16_fp32"], rtol=2e-2)
        np.testing.assert_allclose(out["tp2_distributed"], out["tp2_recompute"], rtol=1e-6)
        no_save = out["no_save"]
        assert no_save["keys"] == ["model"], "--no-save-optim --no-save-rng: weights only"
        assert "--no-save-optim / --no-save-rng" in no_save["plain"]
        assert "Fix: resume with --no-load-optim --no-load-rng" in no_save["plain"]
        assert "Fix: resume with --no-load-rng" in no_save["--no-load-optim"]
        assert len(no_save["resumed"]) == 4  # iterations 3..6 after the saved 2


# ---- --deepspeed: the flags reach the engine and deepspeed.checkpointing (one spawn) ----

ZERO_FLAGS = ["--zero-stage", "1", "--zero-reduce-bucket-size", "1000"]
ZERO_FLAGS += ["--zero-allgather-bucket-size", "2000", "--zero-reduce-scatter"]
ZERO_FLAGS += ["--zero-contigious-gradients", "--cpu-optimizer", "--cpu_torch_adam"]
DS_RECOMPUTE = ["--partition-activations", "--checkpoint-in-cpu", "--contigious-checkpointing"]
DS_RECOMPUTE += ["--synchronize-each-layer", "--profile-backward"]


def _ds_worker(rank, world, argv, save_dir):
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    calls, real = [], deepspeed.checkpointing.checkpoint
    deepspeed.checkpointing.checkpoint = lambda *a: calls.append(1) or real(*a)
    out = {}
    try:
        ds = argv + ["--deepspeed", "--checkpoint-activations"]
        out["mpu"] = _run(rank, world, ds)[0]  # recompute through our mpu checkpoint
        out["mpu_calls"], out["configured_plain"] = len(calls), ds_ckpt.is_configured()
        out["ds"] = _run(rank, world, ds + ["--deepspeed-activation-checkpointing"])[0]
        out["ds_calls"] = len(calls)
        out["full"], _, engine = _run(rank, world, ds + ZERO_FLAGS + DS_RECOMPUTE)
    finally:
        deepspeed.checkpointing.checkpoint = real
    out["engine"] = [
        engine.zero_optimization_stage(),
        engine.zero_reduce_bucket_size(),
        engine.zero_allgather_bucket_size(),
        engine.zero_reduce_scatter(),
        engine.zero_contiguous_gradients(),
        getattr(
            engine.zero_offload_optimizer().device, "value", engine.zero_offload_optimizer().device
        ),
        type(engine.optimizer.optimizer).__name__,
    ]
    out["checkpointing"] = [
        ds_ckpt.is_configured(),
        ds_ckpt.PARTITION_ACTIVATIONS,
        ds_ckpt.CPU_CHECKPOINT,
        ds_ckpt.CONTIGUOUS_CHECKPOINTING,
        ds_ckpt.SYNCHRONIZE,
        ds_ckpt.PROFILE_TIME,
        ds_ckpt.num_layers,
    ]
    out["no_save_rng"] = _ds_no_save_rng(rank, world, argv + ["--deepspeed"], save_dir)
    # On the CPU the comm layer was set up without compiling DeepSpeed's shared-memory
    # all-reduce op (a minute of both cores; megatron/training/deepspeed/engine.py).
    from deepspeed.comm import comm as ds_comm

    out["shm_op"] = getattr(ds_comm.cdb, "shm_comm_op", "no attribute")
    return out


def _ds_no_save_rng(rank, world, argv, save_dir) -> str:
    """--no-save-rng through the engine: its client state has no RNG, a resume says so."""
    from megatron.checkpoint.storage import CheckpointError

    _run(rank, world, argv + ["--save", save_dir, "--no-save-rng"])
    try:
        _run(rank, world, argv + ["--load", save_dir])
    except CheckpointError as e:
        return str(e)
    return "resumed without complaint"


@pytest.mark.slow
def test_deepspeed_v1_flags_reach_the_engine(data_prefix, tmp_path):
    pytest.importorskip("deepspeed")
    argv = flags(data_prefix, "--adam-eps", "1e-4", iters=3)
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    for out in run_distributed(_ds_worker, 2, argv, str(tmp_path / "ck")):
        assert out["mpu_calls"] == 0 and not out["configured_plain"], "v1.x: mpu checkpoint"
        assert out["ds_calls"] > 0, "--deepspeed-activation-checkpointing: DeepSpeed's checkpoint"
        for name in ("mpu", "ds", "full"):
            np.testing.assert_allclose(out[name], _losses(ref), rtol=2e-5, err_msg=name)
        assert out["engine"] == [1, 1000, 2000, True, True, "cpu", "AdamW"]
        assert out["checkpointing"] == [True, True, True, True, True, True, 2]
        assert "no rng_state state (saved with --no-save-rng" in out["no_save_rng"]
        assert "Fix: resume with --no-load-rng" in out["no_save_rng"]
        assert out["shm_op"] is None, "DeepSpeed compiled its shared-memory op on the CPU"
