"""The declaration's own checks: a float setting takes no nan or inf unless it says so."""

import dataclasses
import re

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError, Section, setting
from megatron.config.schema import ModelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from tests.helpers.training import BASE


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--muon-momentum", "nan"),
        ("--muon-extra-scale-factor", "inf"),
        ("--weight-decay", "inf"),
        ("--clip-grad", "nan"),
        ("--moe-router-bias-update-rate", "nan"),
        ("--adam-eps", "inf"),
    ],
)
def test_nan_and_inf_are_refused_naming_the_flag(flag, value):
    want = f"{flag}: must be a finite number, got {float(value)}"
    with pytest.raises(ConfigError, match=re.escape(want)):
        parse_args([*BASE, flag, value], world_size=1)


def test_nan_is_refused_from_files_and_code_too(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("optimizer: {weight_decay: .inf}\n")
    with pytest.raises(ConfigError, match="--weight-decay: must be a finite number, got inf"):
        parse_args([*BASE, "-c", str(run)], world_size=1)
    with pytest.raises(ConfigError, match="--lr: must be a finite number, got nan"):
        OptimizerConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match="--rotary-base: must be a finite number"):
        ModelConfig(rotary_base=float("inf"))


def test_a_setting_that_says_so_takes_nan_and_inf():
    @dataclasses.dataclass(frozen=True)
    class Limits(Section):
        ceiling: float = setting(float("inf"), "no ceiling by default", nonfinite=True)
        floor: float = setting(0.0, "a finite floor")

    assert Limits(ceiling=float("nan")).ceiling != Limits().ceiling
    with pytest.raises(ConfigError, match="--floor: must be a finite number, got -inf"):
        Limits(floor=float("-inf"))
