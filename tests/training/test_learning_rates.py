"""AnnealingLR against closed forms written here, plus checkpoint rules, flag conversion and
the schedule flags' rules (megatron.config.rules)."""

import dataclasses
import io
import math
import warnings

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.lr_schedule import scheduler_steps
from megatron.config.rules import validate
from megatron.training.learning_rates import AnnealingLR

MAX_LR, MIN_LR, WARMUP, DECAY, WSD = 1.0, 0.1, 10, 110, 40


def reference_lr(n: int, style: str, wsd_style: str | None = None) -> float:
    """The schedule spelled out piece by piece for MAX_LR, MIN_LR, WARMUP, DECAY, WSD."""
    if n <= WARMUP:
        return MAX_LR * n / WARMUP
    if style == "constant":
        return MAX_LR
    if n > DECAY:
        return MIN_LR
    if style == "inverse-square-root":
        return max(MIN_LR, MAX_LR * (WARMUP / n) ** 0.5)
    done = (n - WARMUP) / (DECAY - WARMUP)  # fraction of the decay phase done
    if style == "linear":
        return MAX_LR - done * (MAX_LR - MIN_LR)
    if style == "cosine":
        return MIN_LR + (MAX_LR - MIN_LR) * (1 + math.cos(math.pi * done)) / 2
    # WSD: flat at MAX_LR until DECAY - WSD, then anneal over the last WSD steps
    if n <= DECAY - WSD:
        return MAX_LR
    s = 1 - (DECAY - n) / WSD
    shape = {
        "linear": 1 - s,
        "cosine": (1 + math.cos(math.pi * s)) / 2,
        "exponential": 2 * 2 ** (-s) - 1,
        "minus_sqrt": 1 - math.sqrt(s),
    }[wsd_style]
    return MIN_LR + (MAX_LR - MIN_LR) * shape


def make_optimizer(lr_mults=(1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr_mult": m} for m in lr_mults]
    return torch.optim.SGD(groups, lr=123.0)


def make_scheduler(optimizer=None, **kwargs) -> AnnealingLR:
    config = dict(max_lr=MAX_LR, min_lr=MIN_LR, warmup_steps=WARMUP, decay_steps=DECAY)
    config.update(kwargs)
    return AnnealingLR(optimizer or make_optimizer(), **config)


STYLES = [
    ("linear", None),
    ("cosine", None),
    ("constant", None),
    ("inverse-square-root", None),
    *[("WSD", s) for s in ("linear", "cosine", "exponential", "minus_sqrt")],
]
SAMPLED_STEPS = [0, 1, WARMUP // 2, WARMUP, 30, (WARMUP + DECAY) // 2, 80, 95, DECAY, DECAY + 1]


@pytest.mark.parametrize("style,wsd_style", STYLES)
def test_lr_matches_closed_form(style, wsd_style):
    kwargs = dict(decay_style=style)
    if style == "WSD":
        kwargs.update(wsd_decay_steps=WSD, wsd_decay_style=wsd_style)
    sched = make_scheduler(**kwargs)
    for n in SAMPLED_STEPS + [DECAY + 500]:
        assert sched.get_lr(n) == pytest.approx(reference_lr(n, style, wsd_style), abs=1e-12), n
    # Stepping one at a time puts the same values on the optimizer.
    for n in range(DECAY + 5):
        assert sched.num_steps == n
        assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(
            reference_lr(n, style, wsd_style), abs=1e-12
        )
        sched.step()


def test_hand_computed_anchors():
    cosine = make_scheduler(decay_style="cosine")
    assert cosine.get_lr(5) == pytest.approx(0.5)  # half way through warmup
    assert cosine.get_lr(35) == pytest.approx(MIN_LR + 0.9 * (1 + math.sqrt(0.5)) / 2)
    assert cosine.get_lr(60) == pytest.approx(0.55)  # half way through decay
    assert make_scheduler(decay_style="linear").get_lr(85) == pytest.approx(0.325)
    wsd = make_scheduler(decay_style="WSD", wsd_decay_steps=WSD)
    assert wsd.get_lr(70) == 1.0 and wsd.get_lr(DECAY) == pytest.approx(MIN_LR)
    assert wsd.get_lr(90) == pytest.approx(MIN_LR + 0.9 * (2 * 0.5**0.5 - 1))
    isr = make_scheduler(decay_style="inverse-square-root", min_lr=0.0)
    assert isr.get_lr(40) == pytest.approx(0.5)
    no_warmup = make_scheduler(decay_style="inverse-square-root", warmup_steps=0, min_lr=0.0)
    assert no_warmup.get_lr(0) == no_warmup.get_lr(1) == 1.0 and no_warmup.get_lr(4) == 0.5


def test_is_an_lr_scheduler_starting_at_step_zero():
    optimizer = make_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about misordered step() calls
        sched = make_scheduler(optimizer)
        assert isinstance(sched, torch.optim.lr_scheduler._LRScheduler)
        assert sched.optimizer is optimizer
        assert (sched.num_steps, sched.last_epoch, sched.get_last_lr()) == (0, 0, [0.0])
        for k in range(3):  # the k-th optimizer step runs with get_lr(k)
            assert optimizer.param_groups[0]["lr"] == pytest.approx(MAX_LR * k / WARMUP)
            optimizer.step()
            sched.step()
        assert sched.last_epoch == 3 and sched.get_last_lr() == [pytest.approx(0.3)]


def test_lr_mult_per_group_and_weight_decay_untouched():
    optimizer = make_optimizer(lr_mults=(1.0, 0.5))
    optimizer.param_groups[0]["weight_decay"] = 0.1
    optimizer.param_groups[1]["weight_decay"] = 0.0  # a no-decay group (biases, norms)
    decays = [g["weight_decay"] for g in optimizer.param_groups]
    sched = make_scheduler(optimizer)
    for n in range(0, 130, 7):
        sched.step(increment=n - sched.num_steps)
        lr = reference_lr(n, "linear")
        assert sched.get_last_lr() == [pytest.approx(lr), pytest.approx(lr * 0.5)]
        assert [g["weight_decay"] for g in optimizer.param_groups] == decays


@pytest.mark.parametrize("k", [1, 3, 8, 25])
def test_increment_equals_k_single_steps(k):
    bulk = make_scheduler(decay_style="cosine")
    single = make_scheduler(decay_style="cosine")
    for _ in range(130 // k):
        bulk.step(increment=k)
        for _ in range(k):
            single.step()
        assert bulk.num_steps == single.num_steps == bulk.last_epoch
        assert bulk.get_last_lr() == single.get_last_lr()


def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("style,wsd_style", STYLES)
def test_state_dict_roundtrip_resumes_identically(style, wsd_style):
    kwargs = dict(decay_style=style)
    if style == "WSD":
        kwargs.update(wsd_decay_steps=WSD, wsd_decay_style=wsd_style)
    original = make_scheduler(**kwargs)
    original.step(increment=37)
    state = original.state_dict()
    assert all(v is None or type(v) in (int, float, str) for v in state.values())
    resumed = make_scheduler(**kwargs)
    resumed.load_state_dict(roundtrip(state))
    assert resumed.num_steps == resumed.last_epoch == 37
    assert resumed.get_last_lr() == original.get_last_lr()
    for _ in range(50):
        original.step()
        resumed.step()
        assert resumed.get_last_lr() == original.get_last_lr()


def test_checkpoint_rules():
    old = make_scheduler(decay_style="cosine")
    old.step(increment=42)
    state = old.state_dict()

    with pytest.raises(ValueError, match="max_lr") as err:
        make_scheduler(decay_style="cosine", max_lr=2.0).load_state_dict(state)
    assert "--override-lr-scheduler" in str(err.value)
    assert "--use-checkpoint-lr-scheduler" in str(err.value)
    with pytest.raises(ValueError, match="decay_style"):
        make_scheduler(decay_style="linear").load_state_dict(state)

    override = make_scheduler(decay_style="linear", max_lr=2.0, override_lr_scheduler=True)
    override.load_state_dict(state)
    assert (override.max_lr, override.decay_style, override.num_steps) == (2.0, "linear", 42)
    assert override.get_last_lr() == [pytest.approx(2.0 - 0.32 * (2.0 - MIN_LR))]

    use_ckpt = make_scheduler(decay_style="linear", max_lr=2.0, use_checkpoint_lr_scheduler=True)
    use_ckpt.load_state_dict(state)
    assert (use_ckpt.max_lr, use_ckpt.decay_style, use_ckpt.num_steps) == (1.0, "cosine", 42)
    assert use_ckpt.get_last_lr() == old.get_last_lr()

    with pytest.raises(ValueError, match="override_lr_scheduler.*use_checkpoint_lr_scheduler"):
        make_scheduler(override_lr_scheduler=True, use_checkpoint_lr_scheduler=True)


def test_classic_and_current_megatron_keys_load():
    classic = {"start_lr": 1.0, "warmup_iter": 10, "num_iters": 42}
    classic |= {"decay_style": "cosine", "end_iter": 110, "min_lr": 0.1}
    sched = make_scheduler(decay_style="cosine")
    sched.load_state_dict(classic)
    assert sched.num_steps == 42
    assert sched.get_last_lr() == [pytest.approx(reference_lr(42, "cosine"))]
    with pytest.raises(ValueError, match="decay_steps"):
        make_scheduler(decay_style="cosine", decay_steps=200).load_state_dict(classic)

    current = {"max_lr": 1.0, "lr_warmup_steps": 10, "num_steps": 7, "lr_decay_steps": 110}
    current |= {"lr_decay_style": "linear", "min_lr": 0.1}
    sched = make_scheduler()
    sched.load_state_dict(current)
    assert sched.get_last_lr() == [pytest.approx(0.7)]
    with pytest.raises(ValueError, match="num_steps"):
        make_scheduler().load_state_dict({"max_lr": 1.0})


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(max_lr=0.01, min_lr=0.1), "min_lr"),
        (dict(min_lr=-1.0), "min_lr"),
        (dict(decay_steps=0), "decay_steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(warmup_steps=110), "warmup_steps"),
        (dict(decay_style="polynomial"), "decay_style"),
        (dict(decay_style="WSD"), "wsd_decay_steps"),
        (dict(decay_style="WSD", wsd_decay_steps=101), "wsd_decay_steps"),
        (dict(decay_style="WSD", wsd_decay_steps=0), "wsd_decay_steps"),
        (dict(decay_style="WSD", wsd_decay_steps=5, wsd_decay_style="x"), "wsd_decay_style"),
    ],
)
def test_invariants_name_the_argument(kwargs, argument):
    """The scheduler guards its own arguments; the flags' rules are validate(cfg, "train-gpt")'s."""
    with pytest.raises(ValueError, match=argument):
        make_scheduler(**kwargs)


def test_constant_allows_warmup_past_decay_and_bad_checkpoint_is_rejected():
    sched = make_scheduler(decay_style="constant", warmup_steps=200)
    assert sched.get_lr(100) == 0.5 and sched.get_lr(300) == MAX_LR
    sched = make_scheduler(use_checkpoint_lr_scheduler=True)
    with pytest.raises(ValueError, match="checkpoint's lr scheduler state.*decay_style"):
        sched.load_state_dict({"num_steps": 3, "decay_style": "polynomial"})
    with pytest.raises(ValueError, match="increment"):
        sched.step(increment=-1)


def test_scheduler_steps_iterations():
    assert scheduler_steps(train_iters=1000) == dict(
        warmup_steps=0, decay_steps=1000, wsd_decay_steps=None, increment=1
    )
    got = scheduler_steps(train_iters=1000, lr_decay_iters=800, lr_warmup_iters=50)
    assert (got["warmup_steps"], got["decay_steps"]) == (50, 800)
    assert scheduler_steps(train_iters=1000, lr_warmup_fraction=0.01)["warmup_steps"] == 10
    assert scheduler_steps(train_iters=1000, warmup=0.05)["warmup_steps"] == 50
    got = scheduler_steps(train_iters=1000, lr_decay_iters=600, lr_warmup_fraction=0.1)
    assert got["warmup_steps"] == 60  # a fraction of the decay length, not of training
    assert scheduler_steps(train_iters=10, lr_wsd_decay_iters=4)["wsd_decay_steps"] == 4


def test_scheduler_steps_samples():
    got = scheduler_steps(train_samples=8000, global_batch_size=8, lr_warmup_samples=80)
    assert got == dict(warmup_steps=80, decay_steps=8000, wsd_decay_steps=None, increment=8)
    got = scheduler_steps(
        train_samples=8000,
        global_batch_size=8,
        lr_decay_samples=4000,
        lr_warmup_fraction=0.25,
        lr_wsd_decay_samples=800,
    )
    assert got == dict(warmup_steps=1000, decay_steps=4000, wsd_decay_steps=800, increment=8)


def test_sample_mode_schedule_matches_iteration_mode():
    gbs, common = 8, dict(max_lr=1.0, min_lr=0.1, decay_style="WSD", wsd_decay_style="cosine")
    by_iter = scheduler_steps(train_iters=100, lr_warmup_fraction=0.1, lr_wsd_decay_iters=30)
    by_sample = scheduler_steps(
        train_samples=800, global_batch_size=gbs, lr_warmup_fraction=0.1, lr_wsd_decay_samples=240
    )
    inc_i, inc_s = by_iter.pop("increment"), by_sample.pop("increment")
    it = AnnealingLR(make_optimizer(), **common, **by_iter)
    sa = AnnealingLR(make_optimizer(), **common, **by_sample)
    for _ in range(110):
        assert sa.get_last_lr() == [pytest.approx(it.get_last_lr()[0], abs=1e-12)]
        it.step(increment=inc_i)
        sa.step(increment=inc_s)
    assert sa.num_steps == 110 * gbs


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
MODEL += ["--seq-length", "16", "--vocab-size", "100", "--lr", "1e-3", "--min-lr", "1e-4"]
ITERS, SAMPLES = ["--train-iters", "100"], ["--train-samples", "800", "--global-batch-size", "8"]
SCHEDULE_RULES = [
    # (flags, the flag the ConfigError must name)
    ([], "--train-iters"),
    ([*ITERS, "--train-samples", "80"], "--train-samples"),
    ([*ITERS, "--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "--lr-warmup-iters"),
    ([*ITERS, "--warmup", "0.1", "--lr-warmup-fraction", "0.1"], "--warmup"),
    ([*ITERS, "--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction"),
    ([*ITERS, "--lr-decay-samples", "80"], "--lr-decay-samples"),
    ([*ITERS, "--lr-warmup-samples", "8"], "--lr-warmup-samples"),
    ([*ITERS, "--lr-wsd-decay-samples", "8"], "--lr-wsd-decay-samples"),
    ([*SAMPLES, "--lr-decay-iters", "10"], "--lr-decay-iters"),
    ([*SAMPLES, "--lr-warmup-iters", "1"], "--lr-warmup-iters"),
    ([*SAMPLES, "--lr-wsd-decay-iters", "1"], "--lr-wsd-decay"),
    ([*SAMPLES, "--lr-warmup-samples", "8", "--warmup", "0.1"], "--lr-warmup-samples"),
    ([*ITERS, "--min-lr", "1e-2"], "--min-lr"),
    ([*ITERS, "--min-lr", "-1"], "--min-lr"),
    ([*ITERS, "--lr-decay-iters", "0"], "--lr-decay-iters"),
    ([*ITERS, "--lr-warmup-iters", "-1"], "--lr-warmup-iters"),
    ([*ITERS, "--lr-warmup-iters", "110"], "--lr-warmup-iters"),
    ([*SAMPLES, "--lr-warmup-samples", "800"], "--lr-warmup-samples"),
    ([*ITERS, "--lr-warmup-init", "1"], "--lr-warmup-init"),
    ([*ITERS, "--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    ([*ITERS, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "101"], "--lr-wsd-decay-iters"),
    ([*ITERS, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"], "--lr-wsd-decay-iters"),
    ([*SAMPLES, "--lr-decay-style", "WSD"], "--lr-wsd-decay-samples"),
]


@pytest.mark.parametrize(
    "extra,flag", SCHEDULE_RULES, ids=[f"{r[1]}{i}" for i, r in enumerate(SCHEDULE_RULES)]
)
def test_schedule_rules_name_the_flag(extra, flag):
    with pytest.raises(ConfigError) as err:
        validate(parse_args([*MODEL, *extra], world_size=1), "train-gpt")
    assert flag in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("lr_decay_style", "polynomial", "--lr-decay-style"),
        ("lr_wsd_decay_style", "x", "--lr-wsd"),
    ],
)
def test_unknown_schedule_styles_from_code_name_the_flag(field, value, flag):
    """argparse refuses them on the command line; a section built in code checks its choices."""
    cfg = parse_args([*MODEL, *ITERS], world_size=1)
    with pytest.raises(ConfigError, match=flag):
        dataclasses.replace(cfg.optimizer, **{field: value})


def test_valid_schedules_pass_and_give_the_scheduler_valid_arguments():
    from megatron.training.step import make_scheduler as scheduler_of

    for extra in (
        [*ITERS, "--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine"],
        [*SAMPLES, "--lr-warmup-samples", "80", "--lr-decay-samples", "400"],
        [*ITERS, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30"],
        [*ITERS, "--lr-decay-style", "constant", "--lr-warmup-iters", "200"],
    ):
        cfg = parse_args([*MODEL, *extra], world_size=1)
        validate(cfg, "train-gpt")
        scheduler = scheduler_of(cfg, 1, make_optimizer())  # its own checks pass too
        assert (scheduler.max_lr, scheduler.decay_style) == (1e-3, cfg.optimizer.lr_decay_style)


def test_scheduler_steps_needs_one_mode_and_a_batch_for_samples():
    with pytest.raises(ValueError, match="train_iters and train_samples"):
        scheduler_steps()
    with pytest.raises(ValueError, match="global_batch_size"):
        scheduler_steps(train_samples=80)


def test_first_update_uses_lr_warmup_init_as_megatron_lm():
    """Megatron-LM's OptimizerParamScheduler: step(0) when built, step() after each update, and
    lr = init + (max - init) * n / W in warmup; so the first update runs with --lr-warmup-init
    (0 by default; nanoGPT's first update uses lr / (W + 1) instead)."""
    from megatron.training.step import make_scheduler as scheduler_of

    for extra, first in (([], 0.0), (["--lr-warmup-init", "1e-4"], 1e-4)):
        cfg = parse_args([*MODEL, *ITERS, "--lr-warmup-iters", "10", *extra], world_size=1)
        validate(cfg, "train-gpt")
        optimizer = make_optimizer()
        scheduler = scheduler_of(cfg, 1, optimizer)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(first)  # the first update's
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(first + (1e-3 - first) / 10)
