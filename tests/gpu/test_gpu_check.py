"""bench/gpu_check.sh --smoke: every step of the GPU check runs on the CPU at tiny sizes, so
wrong imports, flags, shapes or tables are found here and not in a half hour on a GPU."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from megatron.config.schema import ModelConfig
from megatron.training.log import model_flops_per_sample
from tests.helpers.paths import ROOT

STEPS = ["install", "tests", "profile", "kernels", "mfu_small", "train", "mfu", "moe"]


def _gpu_check(*args, env):
    return subprocess.run(
        ["bash", "bench/gpu_check.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step_and_prints_one_table(tmp_path):
    """As on the GPU: --prepare first (the data; the wheels need no fetching on the CPU), then
    every step, with the logs apart from $OUT (which keeps the one archive of them)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "LOGS": str(logs)}
    env.pop("TRITON_INTERPRET", None)
    prepared = _gpu_check("--smoke", "--prepare", env=env)
    assert prepared.returncode == 0, f"{prepared.stdout[-3000:]}\n{prepared.stderr[-2000:]}"
    assert (out / "data" / "corpus_text_document.idx").exists()
    done = _gpu_check("--smoke", env=env)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    table = done.stdout.split("gpu_check summary")[-1].splitlines()
    rows = {line.split()[0]: line.split(None, 3) for line in table[2:] if line[:1].isalpha()}
    rows.pop("total", None)
    assert list(rows) == STEPS, done.stdout[-3000:]
    for name, (_, status, seconds, *headline) in rows.items():
        assert status in ("ok", "skipped"), f"{name}: {status} {headline}"
        assert int(seconds) >= 0 and headline, name
        assert (logs / f"{name}.log").exists()
    assert rows["tests"][1] == "ok" and "passed" in rows["tests"][3]
    assert "failed" not in rows["tests"][3]
    assert "created: 2/2 workers" in (logs / "tests.log").read_text()
    assert rows["kernels"][3].startswith("slowest kernel")
    assert rows["profile"][1] == "ok" and rows["profile"][3].startswith("busy ")
    assert rows["train"][3].startswith("loss ") and "tokens/s" in rows["train"][3]
    assert "training data ready in" in (logs / "train.log").read_text(), "not the prepared data"
    assert rows["moe"][3].startswith("MoE step: looped ") and "tokens/s" in rows["moe"][3]
    assert rows["mfu_small"][3].startswith("MFU") and rows["mfu"][3].startswith("MFU")
    assert json.loads((logs / "mfu_small.json").read_text())["rows"]

    # Every log in one archive in $OUT, beside the table.
    with tarfile.open(out / "gpu_check_logs.tgz") as tar:
        archived = {os.path.basename(n) for n in tar.getnames()}
    expected = {f"{n}.log" for n in STEPS} | {"tests.xml", "mfu_small.json", "mfu.json"}
    assert expected | {"summary.tsv"} <= archived, archived
    assert (out / "summary.tsv").read_text() == (logs / "summary.tsv").read_text()

    # mfu_small runs every variant (MFU_SMALL_VARIANTS' default), mfu the default and best.
    small = json.loads((logs / "mfu_small.json").read_text())
    ran = {r["system"] for r in small["rows"]}
    assert {f"ours ({v})" for v in small["variants"] if v != "default"} <= ran, ran
    mfu = json.loads((logs / "mfu.json").read_text())
    systems = {r["system"]: r for r in mfu["rows"] + small["rows"]}
    variants = [s for s in systems if s.startswith("ours (")]
    assert {"ours", "ours (best)", "trainer", "mcore", "mcore+TE", "hf"} <= set(systems)
    for name in ("ours", "ours (compile)", "trainer", "hf"):
        r = systems[name]
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu_989_full"] > r["mfu_989"] > 0
        assert r.get("params", systems["ours"]["params"]) == systems["ours"]["params"], name
    for name in variants:  # measured, or refused by the trainer on this device (with why)
        r = systems[name]
        assert "step_s" in r or "refused" in r, r
    assert "source distribution only" in systems["mcore+TE"]["skipped"]
    if rows["install"][1] == "ok":  # megatron-core installed: its model built, same size
        assert "forward needs CUDA" in systems["mcore"]["skipped"]
        assert f"{systems['ours']['params']:,} parameters equal ours" in systems["mcore"]["skipped"]
    else:
        assert "registry could not be reached" in rows["install"][3]


@pytest.mark.slow
def test_gpu_check_refuses_what_it_would_not_run(tmp_path):
    """An unknown step, a pointless flag combination and a shape bench/mfu.py lacks fail with
    the fix, instead of running something else or nothing."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = _gpu_check("--steps", "install,mfu-small", env=env)
    assert done.returncode == 2 and "--steps mfu-small: no such step" in done.stderr
    done = _gpu_check("--smoke", "--fetch-wheels", env=env)
    assert done.returncode == 2 and "Fix: --fetch-wheels alone" in done.stderr
    done = _gpu_check("--smoke", "--steps", "mfu", env={**env, "MFU_SHAPES": "gpt-13b"})
    assert done.returncode == 1, done.stdout
    assert "FAIL(2)" in done.stdout and "bench/mfu.py has no shape ['gpt-13b']" in done.stdout
    assert "Fix: set MFU_SHAPES" in (tmp_path / "mfu.log").read_text()
    done = _gpu_check("--smoke", "--steps", "mfu", env={**env, "MFU_ARGS": "--no-such-flag"})
    assert done.returncode == 1 and "FAIL(2)" in done.stdout, done.stdout
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "mfu.log").read_text()


@pytest.mark.parametrize("swiglu, groups", [(False, None), (True, 2)])
def test_mfu_counts_megatrons_model_flops(swiglu, groups):
    """bench/mfu.py's count is Megatron-LM's: the trainer's (which counts the whole s^2 attention
    core) less the half that the causal mask skips; GPT-2 small by hand."""
    from bench.mfu_common import megatron_flops_per_sample

    cfg = ModelConfig(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        seq_length=1024,
        vocab_size=50257,
        swiglu=swiglu,
        num_query_groups=groups,
    )
    s, q = 1024, 768
    assert megatron_flops_per_sample(cfg, s) == pytest.approx(
        model_flops_per_sample(cfg, s) - 3 * 2 * 12 * s * s * q, rel=1e-12
    )
    if not swiglu:  # 6 FLOPs per token per matmul weight (QKV, proj, MLP, logits) + attention
        matmul_params = 12 * (4 * 768 * 768 + 8 * 768 * 768) + 768 * 50304
        assert megatron_flops_per_sample(cfg, s) == pytest.approx(
            6 * s * matmul_params + 6 * 12 * s * s * q, rel=1e-12
        )
