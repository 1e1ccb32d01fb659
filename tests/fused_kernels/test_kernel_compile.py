"""The kernels compile for an H100 (sm_90) on this CPU: Triton's front end, LLVM and the ptxas
that ships in Triton's wheel build what the first call on the GPU would (bench/kernel_compile.py,
one config per kernel and width here; the script alone builds them all)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> Path | None:
    """Triton's bundled ptxas, found without importing triton here (at collection: the other
    kernel tests must import it first, under TRITON_INTERPRET=1)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (and its ptxas) is absent")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [
            sys.executable,
            "bench/kernel_compile.py",
            "--first-only",
            "--widths",
            "768,2048",
            "--arch",
            "90",
            "--dtype",
            "bf16",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    compiled = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == 2 * 10, done.stdout  # 2 widths x fwd and bwd of 5 ops
    assert "0 configs failed to compile for sm_90" in done.stdout
