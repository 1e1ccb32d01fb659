"""Run configs: `-c run.yaml` (nested by section, JSON accepted), `-o section.key=value`
overrides, and the resolved config written back as YAML (`--print-config`, run_config.yaml
beside the checkpoints). The keys are the declarations of megatron.config.schema, so a file
and the command line always agree on names, types and defaults.
"""

from __future__ import annotations

import json

import yaml

from megatron.config.declare import ConfigError, Tree

RUN_CONFIG_NAME = "run_config.yaml"


def read_config_file(path: str, tree: Tree) -> dict[str, object]:
    """{path: checked value} of a YAML/JSON run config; an unknown section or key, or a value
    of the wrong type, is a ConfigError naming it (and the closest valid key)."""
    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}). Fix: check the path") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}:{e.lineno}: invalid JSON ({e.msg}). Fix: correct it") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where}{line}: invalid YAML ({e}). Fix: correct it") from None
    values: dict[str, object] = {}
    _flatten(data if data is not None else {}, "", tree, where, values)
    return values


def _flatten(node, prefix: str, tree: Tree, where: str, out: dict) -> None:
    if not isinstance(node, dict):
        name = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"{where}: {name} must be a mapping of keys to values, got {node!r}. "
            f"Fix: nest the settings by section, e.g. model: {{hidden_size: 1024}}"
        )
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in tree.sections:
            _flatten(value if value is not None else {}, path + ".", tree, where, out)
        else:
            # Raises, naming the closest valid key (or section, for a mapping), if unknown.
            tree.lookup(path, where, as_section=isinstance(value, dict))
            out[path] = tree.check(path, value, f"{where}: {path}")


def parse_overrides(items: list[str], tree: Tree) -> dict[str, object]:
    """`-o section.key=value` (repeatable; the value is read as YAML: 3, 1e-4, [a, b], null)."""
    values: dict[str, object] = {}
    for item in items:
        where = f"-o {item}"
        path, eq, text = item.partition("=")
        if not eq or not path.strip():
            raise ConfigError(
                f"{where}: expected section.key=value. Fix: e.g. -o model.num_layers=24"
            )
        path = path.strip()
        tree.lookup(path, where)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text  # not YAML: the raw string (the type check still applies)
        values[path] = tree.check(path, value, where)
    return values


def to_yaml(cfg, header: str = "") -> str:
    """The config as YAML, nested by section, `header` as comments; loading it with -c gives
    the same config (settings from the environment, such as the world size, are comments)."""
    tree = Tree(type(cfg))
    body = yaml.safe_dump(tree.to_dict(cfg), sort_keys=False, default_flow_style=False)
    lines = [f"# {line}" for line in header.splitlines()]
    env = {s.path: s for s in tree.settings.values() if s.from_env and not s.resolved}
    for path, s in env.items():
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        lines.append(f"# {path} = {value}: {s.help}; not read from this file")
    return "\n".join([*lines, body])
