"""DualPipeV's overlapped pairs in the trainer (megatron.training.pipeline with
megatron.mpu.overlap), without ranks: when the flag turns them on, and the order their sends
leave in. Their equivalence on ranks is tests/training/test_zero_bubble.py's."""

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.config.rules_pipeline import overlaps_moe_pairs
from tests.helpers.training import BASE

_PP2 = ["--pipeline-model-parallel-size", "2"]


def test_dualpipev_overlaps_its_pairs_where_there_are_all_to_alls_and_the_flag_is_honoured():
    moe = [*BASE, "--num-experts", "4", "--pipeline-schedule", "dualpipev", *_PP2]
    moe += ["--lr", "1e-3", "--train-iters", "10", "--global-batch-size", "8"]
    ep2 = [*moe, "--expert-model-parallel-size", "2"]

    def cfg(argv):
        c = parse_args(argv, world_size=4)
        validate(c, "train-gpt")
        return c

    assert overlaps_moe_pairs(cfg(ep2)) and overlaps_moe_pairs(
        cfg([*ep2, "--overlap-moe-expert-parallel-comm"])
    )
    assert not overlaps_moe_pairs(cfg([*ep2, "--no-overlap-moe-expert-parallel-comm"]))
    assert not overlaps_moe_pairs(cfg(moe))  # EP 1: nothing to hide, pairs run in turn
    allgather = [*ep2, "--moe-token-dispatcher-type", "allgather"]
    for argv, match in (
        ([*allgather, "--overlap-moe-expert-parallel-comm"], "no MoE token all-to-alls"),
        ([*moe, "--overlap-moe-expert-parallel-comm"], "no MoE token all-to-alls"),
        (
            [a if a != "dualpipev" else "zbv" for a in ep2]
            + ["--overlap-moe-expert-parallel-comm"],
            "only the dualpipev schedule",
        ),
    ):
        with pytest.raises(ConfigError, match=match) as err:
            cfg(argv)
        assert "--overlap-moe-expert-parallel-comm" in str(err.value) and "Fix:" in str(err.value)


class _HandOver(torch.autograd.Function):
    """Identity with a hand-over in forward or in backward (where an all-to-all would be)."""

    @staticmethod
    def forward(ctx, x, in_forward, log, hand_over):
        ctx.log, ctx.hand_over = log, hand_over
        if in_forward:
            log.append("F")
            hand_over()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append("B")
        ctx.hand_over()
        return grad, None, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, log, forward_hand_overs, backward_hand_overs):
        super().__init__()
        self.w, self.x, self.log = torch.nn.Parameter(torch.ones(2)), None, log
        self.counts = forward_hand_overs, backward_hand_overs
        self.hand_over = None  # the pipeline's PairOverlap gives its hook (as to an MoE layer)

    def set_input_tensor(self, x):
        self.x = x

    def forward(self):
        y = (torch.ones(2) if self.x is None else self.x) * self.w
        for _ in range(self.counts[0]):
            y = _HandOver.apply(y, True, self.log, self.hand_over)
        for _ in range(self.counts[1]):
            y = _HandOver.apply(y, False, self.log, self.hand_over)
        return y


def test_an_overlapped_pair_sends_the_forwards_output_before_the_backwards_gradient():
    """Stage 0 of a PP 2 V: the pair F(chunk 0, mb 1) + B(chunk 1, mb 0), both sending to stage
    1, whose backward ends first (one hand-over against the forward's three): its gradient is
    held and sent after the forward's output, the order stage 1 receives in."""
    from types import SimpleNamespace

    from megatron.training.pipeline import _Runner, _SharedBatches

    log = []

    class Comm:
        state, timers, quiet, sent = SimpleNamespace(pp_size=2, pp_rank=0), None, False, []
        device = torch.device("cpu")

        def send(self, tensor, stage, message):
            self.sent.append((message, list(log)))

        def recv(self, stage, message):
            return torch.ones(2)

    def forward_step(data, chunk):
        next(data)
        return chunk(), lambda out: (out.sum(), {})

    chunks = torch.nn.ModuleList([_Chunk(log, 3, 0), _Chunk(log, 0, 1)])
    run = _Runner(chunks, Comm(), _SharedBatches(iter(range(9))), forward_step, "dualpipev", 4)
    with run.modes(split=False, overlap=True):
        run.forward(1, 0)  # the last virtual stage: the loss
        run.pair((0, 1), (1, 0))
    (first, when_first), (second, when_second) = Comm.sent
    assert (first, second) == (("F", 1, 1), ("B", 2, 0))
    assert when_first == when_second == ["F", "B", "F", "F"]  # B had ended before F sent
