import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _triton_interpreter_only_for_kernel_tests(request, monkeypatch):
    """The kernel tests set TRITON_INTERPRET=1 at import (it must precede importing triton).
    Every other test runs without it, so the model's dispatch (which follows that variable)
    keeps the fast torch path there, in this process and in the ranks it spawns."""
    if request.node.get_closest_marker("triton") is None and "TRITON_INTERPRET" in os.environ:
        monkeypatch.delenv("TRITON_INTERPRET")
    yield
