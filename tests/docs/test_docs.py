"""The docs stay true to the code: docs/flags.md is what the declarations generate, it names every
flag the command line accepts, the file map of docs/architecture.md lists every module of
megatron/, every relative link in README.md and docs/*.md resolves, and the README stays short."""

import re
from pathlib import Path

from megatron.config import flag_doc
from megatron.config.cli import build_parser
from tests.helpers.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than - and _ dropped, spaces -> -,
    a repeated id gets -1, -2, ..."""
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        yield slug if count == 0 else f"{slug}-{count}"


def test_flag_reference_is_current():
    written = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert written == flag_doc.render(), (
        f"docs/flags.md is stale (a setting was added or changed). Fix: run `{flag_doc.COMMAND}`"
    )


def test_flag_reference_names_every_flag_of_the_command_line():
    """Read from argparse, not from the declarations the generator walks."""
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    own = {"-h", "--help", "-c", "--config", "-o", "--print-config"}
    flags = {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option not in own
    }
    assert len(flags) > 150
    missing = sorted(f for f in flags if f"`{f}`" not in text)
    assert not missing, f"docs/flags.md lacks {missing}. Fix: run `{flag_doc.COMMAND}`"


def test_relative_links_in_readme_and_docs_resolve():
    broken = []
    for doc in DOCS:
        for number, line in _prose_lines(doc):
            for target in _LINK.findall(_INLINE_CODE.sub("", line)):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (doc.parent / file_part).resolve() if file_part else doc
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in set(_anchors(dest)):
                    broken.append(f"{where} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _mapped_modules(block: str) -> set[str]:
    """Paths under megatron/ named by the file map: entries sit at even indents (two spaces a
    level), several to a line when separated by ", "; wrapped descriptions sit deeper."""
    found, stack = set(), []  # stack: (indent, directory)
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent % 2 or indent > 8:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        names = re.split(r"\s{2,}", line.strip())[0].split(", ")
        prefix = "/".join(d for _, d in stack)
        for name in names:
            if name.endswith("/"):
                stack.append((indent, name.rstrip("/")))
            elif name.endswith(".py"):
                found.add(f"{prefix}/{name}" if prefix else name)
    return found


def test_architecture_file_map_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Packages and files", 1)[1].split("```")[1]
    mapped = _mapped_modules(block)
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "megatron").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert modules & mapped, "the file map parser found none of the modules"
    missing = sorted(modules - mapped)
    assert not missing, (
        f"docs/architecture.md's file map does not list {missing}. Fix: add each under its "
        "package in the 'Packages and files' block, with one line saying what it holds"
    )


def test_the_readme_stays_a_first_ten_minutes_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, (
        f"README.md has {lines} lines. Fix: move the detail into the topic's page in docs/ "
        "and link it (the README is the pitch, the two commands, one multi-GPU run, the status "
        "table and links)"
    )
