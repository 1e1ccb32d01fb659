"""The size limits of the code (issue 45, shared/STYLE.md): no module of megatron/ over 500
lines, no function or method over 80. One that grows past them is split by responsibility."""

import ast

from tests.helpers.paths import ROOT

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted((ROOT / "megatron").rglob("*.py"))


def _long_functions(source: str) -> dict[str, int]:
    """name:line -> length of every function, method, closure or async route over the limit."""
    long = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long[f"{node.name}:{node.lineno}"] = lines
    return long


def test_no_module_is_over_500_lines():
    long = {}
    for path in _modules():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_FILE_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"split these by responsibility (lines): {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in _modules():
        for where, lines in _long_functions(path.read_text(encoding="utf-8")).items():
            long[f"{path.relative_to(ROOT)} {where}"] = lines
    assert not long, f"split these by responsibility (lines): {long}"


def test_a_nested_async_function_over_the_limit_is_found():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"def outer():\n    async def inner():\n{body}"
    assert _long_functions(source) == {
        "outer:1": MAX_FUNCTION_LINES + 2,
        "inner:2": MAX_FUNCTION_LINES + 1,
    }
