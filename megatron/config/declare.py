"""One declaration per setting: a dataclass field made with `setting()` carries its default,
help, flag spelling and Megatron aliases, and everything else is derived from it here: the
argparse options (one argument group per section), config-file keys (`section.key`), type
checks and the suggestions for misspelled keys.

A setting's own constraints (`choices=`, `min=`/`max=` inclusive, `above=`/`below=` exclusive)
are declared with it too, and checked whenever a section is built, from flags, files or code
(`Section.__post_init__`), with one generated message naming the flag, the value, the limit and
the fix. Rules between settings are megatron.config.rules'.

A new flag is one field in megatron/config/schema.py plus its use; nothing here changes.
Standard library only, so every layer (the data tools included) may import it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass
from types import NoneType, UnionType


class ConfigError(ValueError):
    """A flag combination that cannot work; the message names the flag and the fix."""


def fail(flag: str, problem: str, fix: str) -> typing.NoReturn:
    """Raise the ConfigError every rule raises: "FLAG: PROBLEM. Fix: FIX."."""
    raise ConfigError(f"{flag}: {problem}. Fix: {fix}.")


def setting(
    default,
    help: str,
    *aliases: str,
    flag: str | None = None,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
    metavar: str | tuple[str, ...] | None = None,
    shortcuts: dict[str, tuple[object, str]] | None = None,
    from_env: bool = False,
    resolved: bool = False,
    requires: tuple[str, object] | None = None,
    nonfinite: bool = False,
):
    """A config field with everything the command line and config files need to know.

    `flag`: the main spelling when it is not `--field-name` (booleans that default to True get
    `--no-field-name`). `aliases`: other spellings of the same option (Megatron's old names).
    `shortcuts`: {flag: (value, help)}, a flag without argument that sets this field to value
    (`--checkpoint-activations` = recompute granularity full); it wins over the main flag.
    `from_env`: set by the launcher's environment, neither a flag nor a config-file key.
    `resolved`: read by the resolution step (megatron.config.rules.validate) from a file another
    setting names; neither a flag nor a config-file key, and not part of the hash.
    `choices`: the accepted values (a tuple, or a live container such as a registry's names,
    read when a value is checked: megatron.schedules.registry.Names). `requires`: (sibling
    field, value): given (not its default) the setting means something only when that field has
    that value, and `check_requires` refuses it otherwise. `min`/`max`: inclusive limits,
    `above`/`below`: exclusive ones (a probability in [0, 1) is min=0, below=1); None (an unset
    optional) is never checked.
    A float setting refuses nan and inf (they pass every comparison with a limit and then poison
    the run) unless `nonfinite` says it takes them.
    The help says what the value means; the builder appends the limits and the default.
    """
    if (min is not None and above is not None) or (max is not None and below is not None):
        raise TypeError("a setting has one lower limit (min or above) and one upper (max or below)")
    meta = {
        "help": help,
        "aliases": aliases,
        "flag": flag,
        "choices": tuple(choices) if isinstance(choices, (list, tuple, set)) else choices,
        "bounds": Bounds(min, max, above, below),
        "metavar": metavar,
        "shortcuts": dict(shortcuts or {}),
        "from_env": from_env or resolved,
        "resolved": resolved,
        "requires": requires,
        "nonfinite": nonfinite,
    }
    return dataclasses.field(default=default, metadata=meta, hash=False if resolved else None)


@dataclass(frozen=True)
class Bounds:
    """A setting's numeric limits: min/max inclusive, above/below exclusive (None: no limit)."""

    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None

    def __str__(self) -> str:
        """'>= 1', '> 0', 'in [0, 1)', ... ('' without limits)."""
        lo = ("[", self.min) if self.min is not None else ("(", self.above)
        hi = (self.max, "]") if self.max is not None else (self.below, ")")
        if lo[1] is not None and hi[0] is not None:
            return f"in {lo[0]}{lo[1]:g}, {hi[0]:g}{hi[1]}"
        if lo[1] is not None:
            return f"{'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
        if hi[0] is not None:
            return f"{'<=' if hi[1] == ']' else '<'} {hi[0]:g}"
        return ""

    def admit(self, value) -> bool:
        return not (
            (self.min is not None and value < self.min)
            or (self.above is not None and value <= self.above)
            or (self.max is not None and value > self.max)
            or (self.below is not None and value >= self.below)
        )


@dataclass(frozen=True)
class Setting:
    """One leaf of the config tree, as derived from its field."""

    path: str  # place in the tree and config-file key: "model.hidden_size"
    name: str
    kind: type  # bool | int | float | str (a tuple's element type)
    optional: bool  # None is a valid value
    nargs: int | str | None  # None: a scalar; "*" or n: a tuple
    default: object
    flags: tuple[str, ...]
    help: str
    choices: tuple | None
    bounds: Bounds
    metavar: object
    shortcuts: dict
    from_env: bool  # not a flag or a file key (the launcher or the resolution step sets it)
    resolved: bool

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else self.path


def _unpack_type(hint) -> tuple[type, bool, int | str | None]:
    """(element type, optional, nargs) of an annotation such as `tuple[int, int] | None`."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, UnionType):
        args = typing.get_args(hint)
        optional = NoneType in args
        (hint,) = [a for a in args if a is not NoneType]
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0], optional, "*"
        return args[0], optional, len(args)
    return hint, optional, None


def _main_flag(f: dataclasses.Field, kind: type) -> str:
    if f.metadata["flag"] is not None:
        return f.metadata["flag"]
    dashed = f.name.replace("_", "-")
    return f"--no-{dashed}" if kind is bool and f.default is True else f"--{dashed}"


def _make_setting(f: dataclasses.Field, hint, path: str) -> Setting:
    kind, optional, nargs = _unpack_type(hint)
    meta = f.metadata
    if "help" not in meta:
        raise TypeError(f"{path}: declare it with setting(default, help, ...)")
    flag = _main_flag(f, kind)
    return Setting(
        path=path,
        name=f.name,
        kind=kind,
        optional=optional,
        nargs=nargs,
        default=f.default,
        flags=() if meta["from_env"] else (flag, *meta["aliases"]),
        help=meta["help"],
        choices=meta["choices"],
        bounds=meta["bounds"],
        metavar=meta["metavar"],
        shortcuts=meta["shortcuts"],
        from_env=meta["from_env"],
        resolved=meta["resolved"],
    )


class Section:
    """Base of every config section: building one, from flags, a file or code, checks each
    setting's declared choices and limits (a ConfigError naming the flag, value, limit, fix)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if "help" in f.metadata:
                _check_declared(f, getattr(self, f.name))


def _check_declared(f: dataclasses.Field, value) -> None:
    meta = f.metadata
    bounds, choices = meta["bounds"], meta["choices"]
    for v in value if isinstance(value, tuple) else (value,):
        if v is None or isinstance(v, bool):
            continue
        if choices is not None and v not in choices:
            raise ConfigError(
                f"{_flag_of(f)}: {v!r} is not a valid choice. "
                f"Fix: use one of {', '.join(map(str, choices))}"
            )
        if isinstance(v, float) and not math.isfinite(v) and not meta["nonfinite"]:
            raise ConfigError(
                f"{_flag_of(f)}: must be a finite number, got {v}. Fix: pass a finite "
                f"{_flag_of(f)}{f' (default {f.default})' if f.default is not None else ''}"
            )
        if isinstance(v, (int, float)) and not bounds.admit(v):
            raise ConfigError(out_of_bounds(_flag_of(f), v, bounds, f.default))


def check_requires(section) -> None:
    """Refuse a setting given (not its default) without the sibling value it `requires`, in
    `section` and every section below it."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    for f in fields.values():
        if dataclasses.is_dataclass(getattr(section, f.name)):
            check_requires(getattr(section, f.name))
            continue
        need = f.metadata.get("requires")
        if need is None or getattr(section, f.name) == f.default:
            continue
        other, wanted = need
        if getattr(section, other) != wanted:
            flag = _flag_of(fields[other])
            fail(
                _flag_of(f), f"given with {flag} {getattr(section, other)}", f"add {flag} {wanted}"
            )


def _flag_of(f: dataclasses.Field) -> str:
    if f.metadata["from_env"]:
        return f.name.replace("_", " ")
    return _main_flag(f, type(f.default))


def out_of_bounds(flag: str, value, bounds: Bounds, default=None) -> str:
    """The one message of a value outside its declared limits."""
    default_text = f" (default {default})" if default is not None else ""
    return f"{flag}: must be {bounds}, got {value}. Fix: pass {flag} {bounds}{default_text}."


def _is_section(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


class Tree:
    """The settings and sections of a config dataclass, indexed by dotted path."""

    def __init__(self, root: type):
        self.root = root
        self.settings: dict[str, Setting] = {}
        self.sections: dict[str, type] = {"": root}
        self._walk(root, "")

    def _walk(self, cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            if _is_section(hints[f.name]):
                self.sections[path] = hints[f.name]
                self._walk(hints[f.name], path + ".")
            else:
                self.settings[path] = _make_setting(f, hints[f.name], path)

    # --- the command line ---

    def add_arguments(self, parser: argparse.ArgumentParser, *, given_only: bool, title=None):
        """One argument group per section. `given_only`: flags not on the command line stay
        out of the namespace (argparse.SUPPRESS), so `given()` sees only what the user typed."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for s in self.settings.values():
            if s.from_env:
                continue
            section = s.path.rpartition(".")[0]
            if section not in groups:
                doc = (self.sections[section].__doc__ or "").strip().splitlines()
                name = section or title or self.root.__name__
                groups[section] = parser.add_argument_group(name, doc[0] if doc else None)
            _add_argument(groups[section], s, given_only)

    def given(self, ns: argparse.Namespace) -> dict[str, object]:
        """{path: value} of the settings in `ns`, checked; shortcuts win over their field."""
        values, shortcut = {}, {}
        for key, value in vars(ns).items():
            path, _, short = key.partition(_SHORTCUT)
            if path not in self.settings:
                continue
            if short:
                if value is not None:
                    shortcut[path] = value
            else:
                values[path] = self.check(path, value, self.settings[path].flag)
        values.update(shortcut)
        return values

    # --- values from anywhere ---

    def lookup(self, path: str, where: str, as_section: bool = False) -> Setting:
        """The setting at `path`, or a ConfigError naming the closest valid key (or section,
        when `as_section`: a file gave it a mapping)."""
        if path in self.settings and not self.settings[path].from_env:
            return self.settings[path]
        if path in self.sections:
            raise ConfigError(f"{where}: {path!r} is a section, not a key. Fix: set its keys")
        if path in self.settings:
            who = "the run reads it" if self.settings[path].resolved else "the launcher sets it"
            raise ConfigError(
                f"{where}: {path} is not a config key ({self.settings[path].help}). "
                f"Fix: drop it; {who}"
            )
        section, _, key = path.rpartition(".")
        if section not in self.sections or as_section:
            return self._unknown_section(path + ".*" if as_section else path, where)
        hint = self._closest(key, section)
        raise ConfigError(f"{where}: unknown key {path!r}. Fix: {hint}")

    def _unknown_section(self, path: str, where: str):
        """Raise for the first component of `path` that is not a section, with the closest."""
        parts = path.split(".")
        known = ""
        for i in range(len(parts) - 1):
            candidate = ".".join(parts[: i + 1])
            if candidate not in self.sections:
                choices = [p for p in self.sections if p.rpartition(".")[0] == known and p]
                close = difflib.get_close_matches(candidate, choices, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}?" if close else f"use one of {choices}"
                raise ConfigError(f"{where}: unknown section {candidate!r}. Fix: {hint}")
            known = candidate
        raise ConfigError(f"{where}: unknown key {path!r}. Fix: see --help for the valid keys")

    def _closest(self, key: str, section: str) -> str:
        """A suggestion for an unknown key: a close key of its own section, else the closest
        key of any section (a setting put under the wrong section is the common mistake)."""
        key = key.replace("-", "_")  # a flag's spelling
        leaf = {p: p.rpartition(".")[2] for p in self.settings if not self.settings[p].from_env}
        own = [k for p, k in leaf.items() if p.rpartition(".")[0] == section]
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.6)
        if close:
            return f"did you mean {'.'.join(filter(None, (section, close[0])))!r}?"
        close = difflib.get_close_matches(key, sorted(set(leaf.values())), n=1, cutoff=0.6)
        paths = [p for p, k in leaf.items() if close and k == close[0]]
        return f"did you mean {paths[0]!r}?" if paths else "see --help for the valid keys"

    def check(self, path: str, value, where: str):
        """`value` converted to the setting's type, or a ConfigError naming the key."""
        s = self.settings[path]
        if value is None:
            if s.optional or s.nargs == "*":
                return None if s.optional else ()
            raise ConfigError(f"{where}: {path} cannot be empty. Fix: give it a value")
        if s.nargs is None:
            return _scalar(s, value, where)
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if s.nargs != "*" and len(items) != s.nargs:
            raise ConfigError(
                f"{where}: {path} takes {s.nargs} values, got {len(items)}. "
                f"Fix: write a list of {s.nargs} values, e.g. [{', '.join(['1'] * s.nargs)}]"
            )
        return tuple(_scalar(s, v, where) for v in items)

    def build(self, values: dict[str, object], prefix: str = ""):
        """The (frozen) config of `values` ({path: checked value}); defaults elsewhere."""
        cls = self.sections[prefix.rstrip(".")]
        kwargs = {}
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            if path in self.sections:
                kwargs[f.name] = self.build(values, path + ".")
            elif path in values:
                kwargs[f.name] = values[path]
        return cls(**kwargs)

    def to_dict(self, obj) -> dict:
        """Nested {section: {key: value}} of a config (tuples as lists): what a file holds;
        settings from the environment are left out (a file does not set them)."""
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out[f.name] = self.to_dict(value)
            elif not f.metadata.get("from_env"):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


_SHORTCUT = "!"  # dest of a shortcut flag: "<path>!<flag>"


def _add_argument(group, s: Setting, given_only: bool) -> None:
    kw: dict = {"dest": s.path, "help": _help(s)}
    if s.kind is bool and s.nargs is None:
        kw["action"] = "store_false" if s.default is True else "store_true"
        kw["default"] = s.default  # None stays None: "not given, something else decides"
    else:
        default = list(s.default) if isinstance(s.default, tuple) else s.default
        metavar = s.metavar or (None if s.choices else s.name.upper())
        kw.update(default=default, nargs=s.nargs, metavar=metavar, choices=s.choices)
        if s.kind is not str:
            kw["type"] = s.kind
    if given_only:
        kw["default"] = argparse.SUPPRESS
    group.add_argument(*s.flags, **{k: v for k, v in kw.items() if v is not None or k == "default"})
    for flag, (value, help_text) in s.shortcuts.items():
        group.add_argument(
            flag,
            action="store_const",
            const=value,
            dest=s.path + _SHORTCUT + flag,
            default=argparse.SUPPRESS if given_only else None,
            help=help_text.replace("%", "%%"),
        )


def _help(s: Setting) -> str:
    text = s.help
    if str(s.bounds):
        text += f" ({s.bounds})"
    if s.default is not None and not isinstance(s.default, bool) and s.default != ():
        text += f" (default: {s.default})"
    return text.replace("%", "%%")


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _scalar(s: Setting, value, where: str):
    out = _convert(s.kind, value)
    if out is _BAD:
        raise ConfigError(
            f"{where}: {s.path} = {value!r} is not {_KIND_NAMES.get(s.kind, s.kind.__name__)}. "
            f"Fix: give {s.path} {_KIND_NAMES.get(s.kind, 'a value')} (default {s.default!r})"
        )
    if s.choices is not None and out not in s.choices:
        raise ConfigError(
            f"{where}: {s.path} = {value!r} is not a valid choice. "
            f"Fix: use one of {', '.join(map(str, s.choices))}"
        )
    return out


_BAD = object()


def _convert(kind: type, v):
    """v as `kind`; numbers may come as strings ('1e-4', which YAML 1.1 reads as a string)."""
    if isinstance(v, bool) or kind is bool:
        return v if kind is bool and isinstance(v, bool) else _BAD
    if kind is str:
        return str(v) if isinstance(v, (str, int, float)) else _BAD
    if kind is float:
        try:
            return float(v) if isinstance(v, (int, float, str)) else _BAD
        except ValueError:
            return _BAD
    if kind is int:
        if isinstance(v, int):
            return v
        if isinstance(v, str):
            with contextlib.suppress(ValueError):
                return int(v)
        try:  # 4e7 or 40000000.0: a whole number written as a float
            f = float(v) if isinstance(v, (float, str)) else None
        except ValueError:
            return _BAD
        return int(f) if f is not None and f.is_integer() else _BAD
    return v if isinstance(v, kind) else _BAD


def add_section_args(parser: argparse.ArgumentParser, cls: type, title: str | None = None):
    """The flags of one config section (e.g. TokenizerConfig for the data tools), with their
    defaults in the namespace; `section_from_args` turns the namespace back into the section."""
    Tree(cls).add_arguments(parser, given_only=False, title=title)


def section_from_args(cls: type, ns: argparse.Namespace):
    """The section `cls` from a namespace filled by add_section_args (types checked)."""
    tree = Tree(cls)
    return tree.build(tree.given(ns))
