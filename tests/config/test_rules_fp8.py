"""--fp8-format / --fp8-recipe: parsed as Megatron-core spells them, refused with the reason
where they cannot run (megatron.config.rules_fp8)."""

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate

TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
TRAIN += ["--seq-length", "32", "--vocab-size", "100", "--train-iters", "2", "--lr", "1e-3"]


def _validated(*extra):
    return validate(parse_args([*TRAIN, *extra], world_size=1), "train-gpt")


def test_the_flags_parse_to_the_precision_section():
    p = _validated("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise").precision
    assert (p.fp8_format, p.fp8_recipe, p.fp8_scaling) == ("hybrid", "rowwise", "rowwise")
    p = _validated("--bf16", "--fp8-format", "e4m3").precision
    assert (p.fp8_format, p.fp8_recipe, p.fp8_scaling) == ("e4m3", None, "tensorwise")
    assert _validated("--bf16").precision.fp8_format is None


REFUSED = [
    # (flags, what the message must say)
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "delayed"], "tensorwise or rowwise"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "Transformer Engine"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise"),
    (["--fp8-format", "hybrid"], "needs --bf16"),
    (["--fp16", "--fp8-format", "hybrid"], "add --bf16 instead of --fp16"),
    (["--bf16", "--fp8-recipe", "rowwise"], "given without --fp8-format"),
    (["--bf16", "--fp8-format", "e4m3", "--deepspeed"], "drop --deepspeed"),
    (["--bf16", "--fp8-format", "e4m3", "--num-experts", "2"], "token count changes"),
]


@pytest.mark.parametrize("extra,reason", REFUSED, ids=[r[1] for r in REFUSED])
def test_what_fp8_cannot_do_is_refused_with_the_reason(extra, reason):
    with pytest.raises(ConfigError) as err:
        _validated(*extra)
    assert reason in str(err.value) and "Fix:" in str(err.value)


def test_formats_outside_megatron_cores_choices_fail_at_parsing(capsys):
    with pytest.raises(SystemExit):
        parse_args([*TRAIN, "--bf16", "--fp8-format", "e5m2"], world_size=1)
    assert "e4m3" in capsys.readouterr().err


def test_the_inference_tools_refuse_it_as_a_training_only_flag():
    """Inference builds the model in bf16 from the checkpoint (whose weights fp8 never
    changed): --fp8-format there would be a flag that parses and does nothing."""
    import argparse

    from megatron.config.inference import parse_with_training_flags

    with pytest.raises(ConfigError, match="--fp8-format: a training setting"):
        parse_with_training_flags(argparse.ArgumentParser(), ["--bf16", "--fp8-format", "e4m3"])
