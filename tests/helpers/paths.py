"""Where the repository and the test fixtures are, wherever the test module sits."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"  # files other programs wrote
MMAP = FIXTURES / "megatron-mmap"  # Megatron's mmap data and the GPT-2 BPE vocab/merges


def load_tool(name: str) -> ModuleType:
    """tools/NAME.py imported as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
