"""The guard of `make test-fast`: a test not marked `slow` that starts a process fails.

The test's own process starts are refused (its code, tests/helpers, or this project's code
called from it: those make a test slow and belong under the marker). A library's own process
start is not the test's: Triton's first compile runs `ldconfig -p` and a C compiler, inductor
and `torch.utils.cpp_extension` run compilers. Which one it is, the first caller outside the
standard library decides (subprocess, multiprocessing, ctypes.util, threading... are skipped):
in one of LIBRARIES it is let through, anywhere else it is refused.
"""

from __future__ import annotations

import sys
from types import FrameType

# Libraries whose own process starts a fast test may trigger: JIT compilers and their drivers.
LIBRARIES = (
    "triton",
    "torch._inductor",
    "torch.utils.cpp_extension",
    "setuptools",  # a compiler driver (Triton's and torch's extension builds may go through it)
)


def _module_of(frame: FrameType) -> str:
    return frame.f_globals.get("__name__") or "<unknown>"


def first_caller_outside_stdlib(frame: FrameType | None) -> str | None:
    """The module of the first frame, from `frame` outwards, that is not the standard library's
    (None when every frame is)."""
    while frame is not None:
        name = _module_of(frame)
        if name.split(".")[0] not in sys.stdlib_module_names:
            return name
        frame = frame.f_back
    return None


def is_a_library(module: str | None) -> bool:
    return module is not None and any(
        module == lib or module.startswith(lib + ".") for lib in LIBRARIES
    )


def refusing(nodeid: str, original):
    """A stand-in for `subprocess.Popen._execute_child` or `BaseProcess.start` (`original`):
    it calls `original` when a library in LIBRARIES starts the process, else raises."""

    def guarded(*args, **kwargs):
        caller = first_caller_outside_stdlib(sys._getframe(1))
        if is_a_library(caller):
            return original(*args, **kwargs)
        what = args[1] if len(args) > 1 else args[0] if args else "a process"
        raise AssertionError(
            f"{nodeid} starts a process ({what!r}, called from {caller}) but is not marked slow "
            "(the automatic marking in tests/conftest.py did not see it): add @pytest.mark.slow. "
            f"Only these libraries may start their own processes in a fast test: {LIBRARIES}"
        )

    return guarded
