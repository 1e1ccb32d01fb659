"""The benchmark scripts' own flags do what their help says (on the CPU, at the smoke sizes)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mfu_flags_reach_the_run():
    mfu = _bench("mfu")
    args = mfu.parse(
        [
            "--shapes", "gpt2-small-b64,gpt-1.3b", "--best-flags", "--torch-compile --seed 9",
            "--trainer-variants", "compile", "--trainer-iters", "12", "--trainer-timeout", "40",
            "--compile-backend", "aot_eager",
        ]
    )  # fmt: skip
    assert args.shapes == "gpt2-small-b64,gpt-1.3b"
    assert args.variants["best"] == ["--torch-compile", "--seed", "9"]
    assert args.trainer_variants == ["compile"] or args.trainer_variants == "compile"
    assert (args.trainer_iters, args.trainer_timeout, args.compile_backend) == (12, 40, "aot_eager")
    with pytest.raises(SystemExit):
        mfu.parse(["--shapes", "gpt-13b"])  # a shape it lacks


def test_profile_step_writes_the_trace_it_was_asked_for(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert _bench("profile_step").main(["--smoke", "--trace", str(trace)]) == 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert "tiny" in capsys.readouterr().out  # --smoke's shape


@pytest.mark.slow
def test_kernels_runs_only_the_ops_and_passes_asked_for():
    cmd = [
        sys.executable, "bench/kernels.py", "--smoke", "--dtype", "fp32", "--ops", "norms",
        "--passes", "fwd", "--skip-compile", "--skip-liger", "--skip-e2e",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "dtype: fp32" in out and "liger column empty: --skip-liger" in out
    ops = ("add + ", "bias + ", "SwiGLU", "causal", "cross-entropy")
    rows = [x for x in out.splitlines() if x.startswith(ops) and "|" in x]  # measured rows
    assert rows and all(x.startswith("add + ") and " fwd " in x for x in rows), rows
    assert "end to end" not in out
