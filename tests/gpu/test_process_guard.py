"""The guard of the fast tests (tests/helpers/process_guard.py, installed by tests/conftest.py):
a process the test starts itself fails it; one a library starts for its own work (Triton's
`ldconfig -p` on its first compile, a compiler) does not. On the first H100 run the guard raised
inside Triton and five CUDA tests compared torch with torch.

These tests must stay unmarked to run under the guard, and the automatic `slow` marking marks
any test that names the process modules: the probes' code is therefore compiled from strings,
into modules named after where the call would come from."""

import sys
import types

import pytest

from tests.helpers.process_guard import first_caller_outside_stdlib, refusing

POPEN = """
import subprocess

def start():
    return subprocess.run(["true"], check=True).returncode
"""
PROCESS = """
import multiprocessing

def start():
    multiprocessing.Process(target=print).start()
"""


def _probe(module_name: str, source: str) -> types.ModuleType:
    """A module called `module_name` (its functions' frames carry that name) running `source`."""
    module = types.ModuleType(module_name)
    exec(compile(source, f"<probe {module_name}>", "exec"), module.__dict__)
    return module


def test_the_first_caller_outside_the_standard_library_decides():
    assert first_caller_outside_stdlib(sys._getframe()) == __name__
    build = _probe("triton.runtime.build", "import sys\ndef frame():\n    return sys._getframe()")
    assert first_caller_outside_stdlib(build.frame()) == "triton.runtime.build"
    # a standard-library frame (as subprocess's, ctypes.util's) is skipped: its caller decides
    relay = _probe("json.relay", "def call(f):\n    return f()")
    frame = relay.call(lambda: sys._getframe(1))
    assert frame.f_globals["__name__"] == "json.relay"
    assert first_caller_outside_stdlib(frame) == __name__


@pytest.mark.parametrize("library", ["triton.backends.nvidia.driver", "torch._inductor.codecache"])
def test_a_librarys_own_process_start_passes_the_guard(library):
    """Triton's driver runs `ldconfig -p` on its first compile; here `true`, started for real
    under the guard this (unmarked) test runs with."""
    assert _probe(library, POPEN).start() == 0


@pytest.mark.parametrize("caller", [__name__, "tests.helpers.fake", "megatron.fake", "tritonx"])
def test_a_process_the_test_starts_itself_still_fails_it(caller):
    with pytest.raises(AssertionError, match=r"add @pytest.mark.slow") as raised:
        _probe(caller, POPEN).start()
    assert f"called from {caller}" in str(raised.value)


def test_multiprocessing_starts_are_judged_the_same_way(request, monkeypatch):
    """A stand-in `start` behind the guard: reaching it means the guard let the call through,
    and no process is started either way."""
    import multiprocessing.process as mp

    class Reached(Exception):
        pass

    def start(self):
        raise Reached

    monkeypatch.setattr(mp.BaseProcess, "start", refusing(request.node.nodeid, start))
    with pytest.raises(Reached):
        _probe("torch._inductor.compile_worker", PROCESS).start()
    with pytest.raises(AssertionError, match=r"called from tests\.helpers\.fake"):
        _probe("tests.helpers.fake", PROCESS).start()
