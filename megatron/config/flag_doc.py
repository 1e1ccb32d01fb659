"""docs/flags.md, written from the declarations: every setting of MegatronConfig, section by
section, with its flag, aliases, default, choices and help, then the refused v1.x flags.

    python -m megatron.config.flag_doc > docs/flags.md

tests/docs/test_docs.py regenerates it and fails, naming this command, when the file is stale.
"""

from __future__ import annotations

import sys

from megatron.config.compat_v1 import REFUSED
from megatron.config.declare import Setting, Tree
from megatron.config.schema import MegatronConfig

COMMAND = "python -m megatron.config.flag_doc > docs/flags.md"

_HEADER = f"""\
# Flag reference

Generated from the declarations in `megatron/config/` (`setting(default, help, *aliases)`);
do not edit by hand. Regenerate with `{COMMAND}`
(`tests/docs/test_docs.py` fails when this file is stale).

Every flag below is also a run-config key: the **key** column is what a `-c FILE` (YAML or JSON,
nested by section) and `-o section.key=value` take, and what `--print-config` prints. Precedence,
lowest first: defaults < `-c FILE` < flags on the command line < `-o` (see
[configuration.md](configuration.md)). A flag of the form `--no-x` turns off a setting that is on
by default (its key then defaults to `true`; the default column is always the key's value).
Aliases are other spellings of the same option, mostly Megatron-LM's older names;
**shortcuts** are switches that set the key to one value.

`pretrain_gpt2.py` and `pretrain_bert.py` take all of them. The inference tools
(`tools/generate_text.py`, `tools/evaluate.py`, `tools/run_text_generation_server.py`, ...) take
the same declarations for the training flags a Megatron user passes them, and check them against
the checkpoint ([inference.md](inference.md#training-flags-in-the-inference-tools)); their own
flags are in each tool's `--help`. The `data.tokenizer` section is also the tokenizer flags of
`tools/preprocess_data.py` and the other data tools.
"""


def _code(text: object) -> str:
    return f"`{text}`"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _default(s: Setting) -> str:
    if s.default is None:
        return "not set"
    if s.default == () and s.nargs == "*":
        return "none"
    return _code(_value(s.default))


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, one line."""
    return " ".join(text.replace("|", "\\|").split())


def _flag_cell(s: Setting) -> str:
    if s.from_env:
        return "(launcher environment)"
    main, *aliases = s.flags
    cell = _code(main)
    if aliases:
        cell += " (" + ", ".join(map(_code, aliases)) + ")"
    return cell


def _help_cell(s: Setting) -> str:
    parts = [s.help.rstrip(".")]
    if s.choices is not None:
        parts.append("choices: " + ", ".join(_code(c) for c in s.choices))
    if str(s.bounds):
        parts.append(f"must be {s.bounds}")
    for flag, (value, text) in s.shortcuts.items():
        parts.append(f"shortcut {_code(flag)} = {_code(_value(value))}: {text.rstrip('.')}")
    return _cell("; ".join(parts))


def _section_title(path: str) -> str:
    return path.rpartition(".")[2]


def render() -> str:
    """The whole of docs/flags.md."""
    tree = Tree(MegatronConfig)
    by_section: dict[str, list[Setting]] = {}
    for s in tree.settings.values():
        by_section.setdefault(s.path.rpartition(".")[0], []).append(s)
    links = [f"[{p}](#{p.replace('.', '')})" for p in (*by_section, "refused")]
    out = [_HEADER, "Sections: " + ", ".join(links), ""]
    for path, settings in by_section.items():
        doc = (tree.sections[path].__doc__ or "").strip().splitlines()
        out += [f"## {path}", ""]
        if doc:
            out += [doc[0], ""]
        out += ["| flag (aliases) | key | default | meaning |", "| --- | --- | --- | --- |"]
        for s in settings:
            out.append(f"| {_flag_cell(s)} | {_code(s.path)} | {_default(s)} | {_help_cell(s)} |")
        out.append("")
    out += [
        "## refused",
        "",
        "Megatron-LM v1.x flags that are accepted by the parser only to fail before any work, "
        "with this reason ([migrating-from-v1.md](migrating-from-v1.md)).",
        "",
        "| flags | reason |",
        "| --- | --- |",
    ]
    by_reason: dict[str, list[str]] = {}
    for flag, (_, reason) in REFUSED.items():
        by_reason.setdefault(reason, []).append(_code(flag))
    for reason, flags in by_reason.items():
        out.append(f"| {', '.join(flags)} | {_cell(reason)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
