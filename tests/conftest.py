import os

import pytest
import torch

# The kernel tests set TRITON_INTERPRET=1 when pytest imports them (it must precede importing
# triton). Collection imports every module first, so the variable would stay set for the whole
# run: module-scoped fixtures (which run before any function-scoped one) would spawn ranks that
# dispatch the model to Triton's slow CPU interpreter. It is taken out once collection is done
# and put back only around the tests marked `triton`.
_INTERPRET = {"set": False}


def pytest_collection_finish(session):
    _INTERPRET["set"] = os.environ.pop("TRITON_INTERPRET", None) == "1"


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _triton_interpreter_only_for_kernel_tests(request, monkeypatch):
    """TRITON_INTERPRET=1 for the tests marked `triton` (if their module asked for it); every
    other test, and the ranks it spawns, runs the model's fast torch path."""
    if request.node.get_closest_marker("triton") is not None and _INTERPRET["set"]:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif "TRITON_INTERPRET" in os.environ:
        monkeypatch.delenv("TRITON_INTERPRET")
    yield


def _requested_device() -> torch.device:
    """MEGATRON_TEST_DEVICE (cpu | cuda | cuda:N; default cpu): where tests/test_cuda.py runs."""
    name = os.environ.get("MEGATRON_TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise pytest.UsageError(f"MEGATRON_TEST_DEVICE={name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"MEGATRON_TEST_DEVICE={name!r}: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"MEGATRON_TEST_DEVICE={name}: torch sees no CUDA device "
            f"(torch {torch.__version__}). Fix: unset it to run on the CPU"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    """The device of tests/test_cuda.py (MEGATRON_TEST_DEVICE, default cpu)."""
    return _requested_device()
