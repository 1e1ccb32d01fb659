import importlib.util
import inspect
import multiprocessing.process
import os
import subprocess

import pytest
import torch

from tests.helpers.process_guard import refusing
from tests.helpers.serving import make_checkpoint
from tests.helpers.training import counting_corpus

# The kernel tests set TRITON_INTERPRET=1 when pytest imports them (it must precede importing
# triton). Collection imports every module first, so the variable would stay set for the whole
# run: module-scoped fixtures (which run before any function-scoped one) would spawn ranks that
# dispatch the model to Triton's slow CPU interpreter. It is taken out once collection is done
# and put back only around the tests marked `triton`.
_INTERPRET = {"set": False}


def pytest_collection_finish(session):
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        # Triton decides at its first import whether its own language helpers (tl.max, tl.sum:
        # @triton.jit functions) are interpreted. Imported later with the variable taken out
        # (torch.compile imports it), they would be compiled-mode helpers that no interpreted
        # kernel can call ("Cannot call @triton.jit'd outside of the scope of a kernel").
        import triton.language  # noqa: F401
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


# --- shared fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """The toy counting corpus of tests/helpers/training.py (its `flags` train on it)."""
    return counting_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT with the fixture tokenizer, saved the way the trainer saves it."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


# --- `slow`, applied automatically -------------------------------------------------------------
# A test is slow when it (or a fixture it uses) can reach code that starts another process: the
# gloo rank spawner, subprocess, multiprocessing. Found by walking the names each test function
# refers to, through the helpers defined in tests/ (tests/helpers/ and the conftest.py files
# included: every module named tests.*), so nobody has to remember the marker; the guard below
# fails a test the walk missed, so `make test-fast` stays free of process starts.

_SPAWN_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
_SPAWN_NAMES = {"Popen", "check_output", "check_call", "run_distributed", "start_processes"}


def _reaches_a_spawn(obj, seen: set[int]) -> bool:
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if inspect.ismodule(obj):
        return obj.__name__ in _SPAWN_MODULES
    if inspect.isclass(obj):
        if not obj.__module__.startswith("tests"):
            return False
        return any(_reaches_a_spawn(v, seen) for v in vars(obj).values() if callable(v))
    func = inspect.unwrap(getattr(obj, "__func__", obj))
    if getattr(func, "__module__", None) in _SPAWN_MODULES:
        return True
    code = getattr(func, "__code__", None)
    if code is None or not func.__module__.startswith("tests"):
        return False
    codes, names = [code], set()
    while codes:
        c = codes.pop()
        names |= set(c.co_names) | set(c.co_freevars)
        codes += [k for k in c.co_consts if inspect.iscode(k)]
    if names & (_SPAWN_NAMES | _SPAWN_MODULES):  # also `import subprocess` inside a function
        return True
    scope = {**func.__globals__, **_closure_vars(func)}
    return any(_reaches_a_spawn(scope[n], seen) for n in names if n in scope)


def _closure_vars(func) -> dict:
    cells = func.__closure__ or ()
    out = {}
    for name, cell in zip(func.__code__.co_freevars, cells, strict=False):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info else ():
            funcs += [d.func for d in defs if d.argname != "_fast_tests_start_no_process"]
        seen: set[int] = set()
        if any(f is not None and _reaches_a_spawn(f, seen) for f in funcs):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """A test not marked slow that starts a process fails, naming what to mark; a library's own
    process start (Triton's `ldconfig -p`, a compiler) is let through (tests/helpers/
    process_guard.py)."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    nodeid = request.node.nodeid
    popen, process = subprocess.Popen, multiprocessing.process.BaseProcess
    monkeypatch.setattr(popen, "_execute_child", refusing(nodeid, popen._execute_child))
    monkeypatch.setattr(process, "start", refusing(nodeid, process.start))
    yield


def _requested_device() -> torch.device:
    """MEGATRON_TEST_DEVICE (cpu | cuda | cuda:N; default cpu): where tests/gpu/test_cuda.py
    runs."""
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
    """The device of tests/gpu/test_cuda.py (MEGATRON_TEST_DEVICE, default cpu)."""
    return _requested_device()
