"""bench/mfu.py's variants are the trainer's own flags: they reach the trainer's config through
its parser, an unknown one gives an ERROR row (never a silent default run), a refused one the
trainer's reason; the trainer row's flags and log parsing; Megatron-core's micro-batch halving."""

import importlib.util
import json

import pytest
import torch

from bench.mfu_common import SHAPES
from bench.mfu_ours import VARIANTS, parse_config, shape_argv, variant_table
from bench.mfu_trainer import trainer_argv, window_ms
from megatron.training.log import iteration_line
from tests.helpers.paths import ROOT

TINY = SHAPES["tiny"]

# variant -> the config fields its flags must set (helpers add these flags in their branches).
EXPECTED = {
    "compile": {("kernels", "torch_compile"): True},
    "cudagraphs": {("kernels", "torch_compile"): True, ("kernels", "enable_cuda_graph"): True},
    "fused-linear-ce": {("kernels", "cross_entropy_fusion_impl"): "linear"},
    "fp8": {
        ("precision", "fp8_format"): "e4m3",
        ("precision", "fp8_recipe"): "tensorwise",
        ("kernels", "torch_compile"): True,
    },
    "fp8-rowwise": {
        ("precision", "fp8_format"): "e4m3",
        ("precision", "fp8_recipe"): "rowwise",
        ("kernels", "torch_compile"): True,
    },
    "fp8-eager": {
        ("precision", "fp8_format"): "e4m3",
        ("precision", "fp8_recipe"): "tensorwise",
        ("kernels", "torch_compile"): False,
    },
    "liger": {("kernels", "kernel_library"): "liger"},
}


def test_the_compile_variant_reaches_the_kernel_config():
    base = shape_argv(TINY, iters=3)
    assert parse_config(base).kernels.torch_compile is False
    cfg = parse_config(base + VARIANTS["compile"])
    assert cfg.kernels.torch_compile is True
    assert cfg.precision.bf16 and cfg.training.micro_batch_size == TINY.batch
    assert cfg.model.padded_vocab_size(1) == 1024  # 1000 padded to a multiple of 128


def test_every_variant_has_its_expected_fields():
    assert set(EXPECTED) == set(VARIANTS) - {"default"}


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_each_variant_sets_its_fields(variant):
    cfg = parse_config(shape_argv(TINY, iters=3) + VARIANTS[variant])  # every flag is merged
    for (section, field), value in EXPECTED[variant].items():
        assert getattr(getattr(cfg, section), field) == value, (variant, section, field)


def test_best_and_ad_hoc_variants_are_flag_lists():
    table = variant_table("--torch-compile --seed 5", ["mine=--attention-backend unfused"])
    assert table["best"] == ["--torch-compile", "--seed", "5"]
    assert parse_config(shape_argv(TINY, 3) + table["mine"]).kernels.attention_backend == "unfused"
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        variant_table("", ["no-equals-sign"])


def test_unknown_and_refused_flags_are_rows_not_crashes(tmp_path, capsys):
    from bench.mfu import main

    out = tmp_path / "mfu.json"
    rc = main(
        [
            "--smoke", "--systems", "ours", "--ours-variants", "default",
            "--variant-flags", "bogus=--no-such-flag 3",
            "--variant-flags", "tp2=--tensor-model-parallel-size 2",
            "--json", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed  # an unknown flag or a refusal is a row, not a failure
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["ours", "ours (bogus)", "ours (tp2)"]
    assert rows["ours"]["step_s"] > 0 and rows["ours"]["params"] > 0
    assert rows["ours"]["mfu_989_full"] > rows["ours"]["mfu_989"] > 0
    bogus = rows["ours (bogus)"]
    assert bogus["error_kind"] == "unknown-flag" and "step_s" not in bogus
    assert "ERROR: unknown flag --no-such-flag" in printed
    assert "tensor-model-parallel-size" in rows["ours (tp2)"]["refused"]
    assert "variants with flags unknown here: bogus" in printed


def test_the_trainer_row_takes_the_trainer_flags_and_reads_its_log():
    argv = trainer_argv(TINY, VARIANTS["compile"], "/data/x", iters=6, interval=2, smoke=True)
    cfg = parse_config(argv)
    assert cfg.kernels.torch_compile and cfg.data.data_path == ("/data/x",)
    assert cfg.training.train_iters == 6 and cfg.training.eval_iters == 0
    line = iteration_line(
        iteration=2, train_iters=6, consumed=4, ms_per_iter=12.5, lr=1e-4, global_batch=2,
        loss=6.9, loss_scale=1.0, grad_norm=1.0, skipped=0, nan=0, tokens_per_s=5.0,
        tflops=1.0, mfu=22.6,
    )  # fmt: skip
    assert window_ms(f"noise\n{line}\n{line.replace('12.5', '10.0')}") == ([12.5, 10.0], 22.6)


def test_megatron_core_arm_halves_the_micro_batch_until_it_fits():
    spec = importlib.util.spec_from_file_location("mcore_arm", f"{ROOT}/bench/mcore_arm.py")
    arm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arm)  # stdlib imports only: it never imports this repository
    tried = []

    def attempt(micro):
        tried.append(micro)
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 0.5

    assert arm.largest_fitting(8, attempt) == (0.5, 2, [8, 4])
    assert tried == [8, 4, 2]
    assert arm.largest_fitting(2, lambda m: (_ for _ in ()).throw(torch.OutOfMemoryError())) == (
        None,
        0,
        [2, 1],
    )
