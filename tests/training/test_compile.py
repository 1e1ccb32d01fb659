"""--torch-compile: whole chunks compiled (embedding, layers, head, loss) train like eager, on
one process and across TP and PP; the other compute switches (--enable-cuda-graph,
--sdpa-backend) refuse what they cannot run, naming the flag."""

import numpy as np
import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from tests.helpers.distributed import run_distributed
from tests.helpers.training import BASE, _losses, _train, flags

COMPILE = ["--torch-compile", "--torch-compile-backend", "aot_eager"]


def _eager_and_compiled(rank, world, argvs):
    """Each argv trained eagerly, then compiled: [(eager history, compiled history)]."""
    return [(_train(rank, world, a)[0], _train(rank, world, a + COMPILE)[0]) for a in argvs]


def _assert_equal_runs(pairs, names, rank):
    for name, (eager, compiled) in zip(names, pairs, strict=True):
        what = f"{name} rank {rank}"
        np.testing.assert_allclose(_losses(compiled), _losses(eager), rtol=1e-5, err_msg=what)
        norms = [[h["grad_norm"] for h in run] for run in (compiled, eager)]
        np.testing.assert_allclose(*norms, rtol=1e-4, err_msg=what)


@pytest.mark.parametrize(
    "world,layouts",
    [
        (1, {"one process": [], "full recompute": ["--recompute-granularity", "full"]}),
        (
            2,
            {
                "tp2": ["--tensor-model-parallel-size", "2"],
                "pp2": ["--pipeline-model-parallel-size", "2"],
            },
        ),
    ],
)
def test_compiled_chunks_train_like_eager(data_prefix, world, layouts):
    argvs = [flags(data_prefix, *extra, iters=4) for extra in layouts.values()]
    for rank, pairs in enumerate(run_distributed(_eager_and_compiled, world, argvs)):
        _assert_equal_runs(pairs, list(layouts), rank)


GRAPHS = ["--torch-compile", "--enable-cuda-graph", "--hidden-dropout", "0"]
GRAPHS += ["--attention-dropout", "0"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--enable-cuda-graph"], "replays the compiled chunks. Fix: add --torch-compile"),
        (GRAPHS + ["--torch-compile-backend", "eager"], "--torch-compile-backend inductor"),
        (GRAPHS + ["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 1"),
        (GRAPHS + ["--tensor-model-parallel-size", "2"], "TP = CP = 1 only"),
        (GRAPHS + ["--num-experts", "2"], "drop --num-experts"),
        (GRAPHS[:2], "--hidden-dropout 0 --attention-dropout 0"),
        (GRAPHS + ["--recompute-granularity", "full"], "drop --recompute-granularity"),
        (GRAPHS + ["--deepspeed"], "drop --deepspeed"),
        (
            GRAPHS + ["--use-distributed-optimizer", "--overlap-param-gather"],
            "drop --overlap-param-gather",
        ),
        (["--torch-compile-backend", "aot_eager"], "add --torch-compile"),
        (["--sdpa-backend", "math", "--attention-backend", "fused"], "--attention-backend sdpa"),
        (["--sdpa-backend", "flash", "--context-parallel-size", "2"], "drop --sdpa-backend"),
    ],
)
def test_compute_switches_refuse_what_they_cannot_run_naming_the_flag(argv, match):
    flag = "--torch-compile-backend" if argv[0] == "--torch-compile-backend" else argv[0]
    flag = "--enable-cuda-graph" if "--enable-cuda-graph" in argv else flag
    with pytest.raises(ConfigError, match=flag) as err:
        parse_args(BASE + argv, world_size=2)
    assert match in str(err.value)


def test_cuda_graphs_take_a_small_single_gpu_run():
    cfg = parse_args(BASE + GRAPHS + ["--use-distributed-optimizer"], world_size=2)
    assert cfg.kernels.enable_cuda_graph and cfg.kernels.torch_compile
