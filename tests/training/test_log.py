"""What a training run says once at start (megatron/training/log.py start_lines)."""

from megatron.config.cli import parse_args
from megatron.model.families import get_spec
from megatron.models.gpt.model import GPTModel
from megatron.training.log import start_lines
from tests.helpers.training import flags


def test_start_lines_give_the_parameter_count_and_say_there_is_no_save():
    cfg = parse_args(flags("data/x"), world_size=1)
    n = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    lines = start_lines(cfg, get_spec("gpt"))
    assert lines[0] == f" number of parameters: {n / 1e6:.2f}M ({n:,}, the whole model)"
    assert lines[1].startswith("note: no --save: this run writes no checkpoint")
    saving = parse_args(flags("data/x", "--save", "ck"), world_size=1)
    assert len(start_lines(saving, get_spec("gpt"))) == 1
