"""One address per name (issue 45): a name is imported from the module that defines it, not
from a module that imported it in turn (a re-export). A package's __init__.py may gather its
modules' names (`from megatron import mpu; mpu.ColumnParallelLinear`)."""

import ast

from tests.helpers.paths import ROOT

_TREES = ("megatron", "tests", "tools", "tasks", "examples", "bench", "scripts")


def _source_of(module: str):
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def _borrowed_names(module: str, cache: dict) -> dict[str, str]:
    """The names `module` (a plain module, not a package) imports from megatron -> their home."""
    if module not in cache:
        path, cache[module] = _source_of(module), {}
        if path is not None:
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                    cache[module].update({a.asname or a.name: node.module for a in node.names})
    return cache[module]


def _second_addresses(source: str, cache: dict) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            borrowed = _borrowed_names(node.module, cache)
            found += [
                f"{a.name} from {node.module} (its home: {borrowed[a.name]})"
                for a in node.names
                if a.name in borrowed
            ]
    return found


def test_every_name_is_imported_from_its_home():
    cache: dict = {}
    found = []
    for tree in _TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            for what in _second_addresses(path.read_text(encoding="utf-8"), cache):
                found.append(f"{path.relative_to(ROOT)}: {what}")
    assert not found, "import these from their home module:\n" + "\n".join(found)


def test_a_re_export_is_found():
    cache = {"megatron.config.schema": {"ConfigError": "megatron.config.declare"}}
    source = "def f():\n    from megatron.config.schema import ConfigError, ModelConfig\n"
    assert _second_addresses(source, cache) == [
        "ConfigError from megatron.config.schema (its home: megatron.config.declare)"
    ]
