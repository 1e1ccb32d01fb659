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
