"""The overlapped forward / backward pair (megatron.mpu.overlap), without ranks: the two sides
take turns at hand_over() (one at a time, in a fixed order), an error on either side reaches
the caller without a hang, and each side sees its own random generators, so a pair draws what
the sequential order draws."""

import threading

import pytest
import torch

from megatron.mpu import overlap
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker

_PAIRS = overlap.PairOverlap()  # what the sides below hand over through


def _side(name, steps, log, running):
    """A side that logs each segment, checks it runs alone, and hands over between segments."""

    def run():
        for i in range(steps):
            assert not running, f"{name}{i} ran beside {running}"
            running.append(name)
            log.append(f"{name}{i}")
            running.remove(name)
            _PAIRS.hand_over()

    return run


def test_the_two_sides_alternate_at_hand_overs_and_the_longer_runs_to_its_end():
    for f_steps, b_steps in ((3, 3), (2, 4), (4, 1), (0, 2)):
        log, running = [], []
        before = overlap.counts()
        _PAIRS.run(_side("F", f_steps, log, running), _side("B", b_steps, log, running))
        pairs = [f"{s}{i}" for i in range(max(f_steps, b_steps)) for s in "FB"]
        expected = [x for x in pairs if int(x[1:]) < (f_steps if x[0] == "F" else b_steps)]
        assert log == expected, (f_steps, b_steps)
        assert overlap.counts()["pairs"] == before["pairs"] + 1
    _PAIRS.hand_over()  # outside a pair: nothing happens


def test_the_backward_runs_in_a_second_thread_and_the_forward_in_the_callers():
    seen = {}
    _PAIRS.run(
        lambda: seen.setdefault("F", threading.get_ident()),
        lambda: seen.setdefault("B", threading.get_ident()),
    )
    assert seen["F"] == threading.get_ident() != seen["B"]


@pytest.mark.parametrize("failing", ["F", "B"])
def test_an_error_on_either_side_reaches_the_caller_and_releases_the_other(failing):
    log = []

    def side(name):
        def run():
            for i in range(3):
                log.append(f"{name}{i}")
                if name == failing and i == 1:
                    raise ValueError(f"{name} broke")
                _PAIRS.hand_over()

        return run

    with pytest.raises(ValueError, match=f"{failing} broke"):
        _PAIRS.run(side("F"), side("B"))
    assert log == ["F0", "B0", "F1", "B1"][: 3 if failing == "F" else 4]  # the other stopped
    _PAIRS.run(lambda: None, lambda: None)  # and the next pair runs


def _forward(out, tracker):
    def run():
        for _ in range(3):
            out.append(torch.rand(2))  # dropout on replicated tensors
            with tracker.fork():
                out.append(torch.rand(2))  # dropout on TP-split tensors
            _PAIRS.hand_over()

    return run


def _backward(out, tracker):
    def run():  # a recompute: set the saved states, draw, put back what it found
        found = torch.get_rng_state(), tracker.get_states()
        for _ in range(3):
            torch.manual_seed(99)
            tracker.set_states({MODEL_PARALLEL_RNG: torch.get_rng_state()})
            out.append(torch.rand(2))
            _PAIRS.hand_over()
        torch.set_rng_state(found[0])
        tracker.set_states(found[1])

    return run


def test_each_side_keeps_its_random_generators_so_the_pair_draws_the_sequential_numbers():
    """The forward draws from the default generator and a tracker stream across hand-overs;
    the backward, like a checkpoint's recompute, sets both to a saved state between them. The
    numbers drawn and the generators after the pair are those of forward then backward."""
    results = []
    for paired in (False, True):
        torch.manual_seed(5)
        tracker = RNGStatesTracker("cpu")
        tracker.add(MODEL_PARALLEL_RNG, 11)
        f_out, b_out = [], []
        if paired:
            _PAIRS.run(_forward(f_out, tracker), _backward(b_out, tracker), [tracker])
        else:
            _forward(f_out, tracker)()
            _backward(b_out, tracker)()
        after = torch.rand(3), tracker.get_states()[MODEL_PARALLEL_RNG]
        results.append([*f_out, *b_out, *after])
    assert len(results[0]) == 6 + 3 + 2
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_only_the_running_pairs_hand_over_passes_the_turn_and_only_given_layers_hold_it():
    """A PairOverlap is no global mode: another one's hand-over does nothing while this one
    runs a pair, and `given_to` hands its hook to the MoE layers of that model only, for as
    long as it is given."""
    other, log = overlap.PairOverlap(), []

    def forward():
        log.append("F0")
        other.hand_over()  # not the running pair's: the forward keeps the turn
        log.append("F1")

    _PAIRS.run(forward, lambda: log.append("B0"))
    assert log == ["F0", "F1", "B0"]

    from megatron.config.schema import ModelConfig
    from megatron.model.context import BuildContext
    from megatron.model.moe import moe_layers
    from megatron.models.gpt.model import GPTModel

    cfg = ModelConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
        num_experts=2,
    )  # fmt: skip
    given, beside = GPTModel(cfg, BuildContext()), GPTModel(cfg, BuildContext())
    with _PAIRS.given_to(given):
        assert [m.hand_over for _, m in moe_layers(given)] == [_PAIRS.hand_over] * 2
        assert [m.hand_over for _, m in moe_layers(beside)] == [None] * 2
    assert [m.hand_over for _, m in moe_layers(given)] == [None] * 2
