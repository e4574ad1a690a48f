"""Typed configuration on plain dataclasses, shared by every service and by job configs.

A config is a tree of dataclasses. `load_config` builds one in four layers, each overriding the
previous: field defaults -> a YAML file -> environment variables -> `key.sub=value` overrides
(CLI flags). The result is type-checked and validated before anything starts, and every problem
is a `ConfigError` naming the full dotted key, so a typo fails loudly instead of being ignored.

Supported field types: bool, int, float, str, pathlib.Path, Enum subclasses, Literal[...] choices,
nested dataclasses, `X | None`, list[X], tuple[X, ...], dict[str, X] and Any.

Per-field checks go in field metadata (see `setting` and the check helpers below); checks that
involve several fields go in an optional `validate(self)` method raising `ConfigError` with a key
relative to that dataclass. A dataclass may also check itself on construction, raising a ValueError
that carries `field` and `problem` (lorarl.contract.errors.SpecError): it becomes a ConfigError there.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from lorarl.contract.fields import CHECK_KEY, Check, setting  # noqa: F401  (re-exported: sections import them here)

T = TypeVar("T")

ENV_PREFIX = "LORARL_"
ENV_SEPARATOR = "__"
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NONE_WORDS = frozenset({"", "~", "null", "none", "None", "NULL"})


class ConfigError(ValueError):
    """A configuration problem, tied to the full dotted key it concerns ('' for the whole file)."""

    def __init__(self, key: str, problem: str, *, origin: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.origin = origin
        message = f"{key}: {problem}" if key else problem
        super().__init__(f"{message} (from {origin})" if origin else message)

    def under(self, prefix: str) -> ConfigError:
        """The same problem, with its key moved below `prefix` (used for nested sections)."""
        return ConfigError(_join(prefix, self.key), self.problem, origin=self.origin)


class RawText(str):
    """A value given as text (env var or CLI override); parsed according to the target field type."""

    origin: str

    def __new__(cls, text: str, origin: str) -> RawText:
        obj = super().__new__(cls, text)
        obj.origin = origin
        return obj


# --------------------------------------------------------------------------------------------
# Field helpers and checks


def in_range(low: float | None = None, high: float | None = None) -> Check:
    """Accepts numbers with low <= value <= high (either bound optional)."""

    def check(value: Any) -> str | None:
        if value is None:
            return None
        if (low is not None and value < low) or (high is not None and value > high):
            if low is not None and high is not None:
                return f"a value in {low}..{high}, got {value!r}"
            if low is not None:
                return f"a value >= {low}, got {value!r}"
            return f"a value <= {high}, got {value!r}"
        return None

    return check


def port_number(*, allow_zero: bool = True, allow_disabled: bool = False) -> Check:
    """A TCP port; 0 means "pick a free one", and -1 / null mean "disabled" when allowed."""

    def check(value: Any) -> str | None:
        if value is None or (allow_disabled and value == -1):
            return None
        low = 0 if allow_zero else 1
        if low <= value <= 65535:
            return None
        choices = [f"a port in {low}..65535"]
        if allow_zero:
            choices.append("0 for any free port")
        if allow_disabled:
            choices.append("-1 or null to disable")
        return f"{', '.join(choices)}; got {value!r}"

    return check


def existing_file(value: Any) -> str | None:
    """Accepts None or the path of an existing regular file."""
    if value is None or Path(value).is_file():
        return None
    return f"an existing file, but {str(value)!r} does not exist or is not a file"


def multiple_of(step: int) -> Check:
    """Accepts None or integers divisible by ``step`` (0 included)."""

    def check(value: Any) -> str | None:
        if value is None or value % step == 0:
            return None
        return f"a multiple of {step}, got {value!r}"

    return check


def existing_dir(value: Any) -> str | None:
    """Accepts None or the path of an existing directory."""
    if value is None or Path(value).is_dir():
        return None
    return f"an existing directory, but {str(value)!r} does not exist or is not a directory"


def matches(pattern: str, description: str) -> Check:
    """Accepts None or strings fully matching `pattern`."""
    compiled = re.compile(pattern)

    def check(value: Any) -> str | None:
        if value is None or compiled.fullmatch(value):
            return None
        return f"{description}, got {value!r}"

    return check


def all_of(*checks: Check) -> Check:
    """Applies several checks; the first problem wins."""

    def check(value: Any) -> str | None:
        for one in checks:
            problem = one(value)
            if problem:
                return problem
        return None

    return check


# --------------------------------------------------------------------------------------------
# Loading


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> T:
    """Builds and validates a `cls` from defaults, a YAML file, the environment and overrides.

    `env` defaults to os.environ; pass {} to ignore the environment. Environment variables look
    like `LORARL_SERVER__PORT=8080` (sections separated by a double underscore); variables whose
    first section is not a field of `cls` are left alone, since they may belong to another
    service sharing the environment.
    """
    raw = read_yaml(path) if path is not None else {}
    apply_env(raw, cls, os.environ if env is None else env, prefix=env_prefix)
    apply_overrides(raw, overrides)
    return from_dict(cls, raw)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML file (an empty file is an empty mapping)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {str(file)!r} not found") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {str(file)!r}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"config file {str(file)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {str(file)!r} must hold a mapping, got {_kind(data)}")
    return data


def apply_env(raw: dict[str, Any], cls: type, env: Mapping[str, str], *, prefix: str = ENV_PREFIX) -> None:
    """Sets `raw` entries from `<PREFIX><SECTION>__<KEY>` environment variables (in place)."""
    sections = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(env):
        if not name.startswith(prefix) or ENV_SEPARATOR not in name[len(prefix) :]:
            continue
        parts = name[len(prefix) :].lower().split(ENV_SEPARATOR)
        if parts[0] not in sections or not all(parts):
            continue
        _set_path(raw, parts, RawText(env[name], origin=f"environment variable {name}"))


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """Applies `key.sub=value` strings to `raw` in order (in place); values are parsed by type."""
    for override in overrides:
        key, value = parse_override(override)
        _set_path(raw, key.split("."), RawText(value, origin=f"override {override!r}"))


def parse_override(override: str) -> tuple[str, str]:
    """Splits `key.sub=value` into its dotted key and its text value."""
    key, sep, value = override.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[\w-]+)*", key):
        raise ConfigError(key if sep else "", f"override {override!r} must look like key.sub=value")
    return key, value


def _set_path(raw: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    node = raw
    for index, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or isinstance(child, RawText):
            child = node[part] = {}
        elif not isinstance(child, dict):
            key = ".".join(parts[: index + 1])
            raise ConfigError(key, f"is a value, not a section; cannot set {'.'.join(parts)!r}")
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------------------------
# Conversion and validation


def from_dict(cls: type[T], data: Mapping[str, Any] | T, key: str = "") -> T:
    """Builds a validated `cls` from a (possibly partial) mapping; `key` prefixes error keys."""
    return _convert(data, cls, key)


def _convert(value: Any, tp: Any, key: str) -> Any:
    if not isinstance(value, RawText):
        return _convert_value(value, tp, key)
    try:
        return _convert_value(_parse_text(value, tp, key), tp, key)
    except ConfigError as exc:
        if exc.origin is not None:
            raise
        raise ConfigError(exc.key, exc.problem, origin=value.origin) from None


def _convert_value(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, key)
    if value is None and isinstance(tp, type) and dataclasses.is_dataclass(tp):
        value = {}  # an empty section (`trainer:` with every key commented out) means defaults
    if value is None:
        raise ConfigError(key, f"expected {_describe(tp)}, got null")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            raise ConfigError(key, f"expected one of {_choices(choices)}, got {value!r}")
        return value
    if origin in (list, tuple, Sequence):
        return _convert_sequence(value, tp, key)
    if origin in (dict, Mapping):
        return _convert_mapping(value, tp, key)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _convert_enum(value, tp, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"expected a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_show(value)} (quote it in YAML)")
        return str(value)
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(key, f"expected a path, got {_show(value)}")
        return Path(value)
    raise TypeError(f"{key}: unsupported config field type {tp!r}")


def _parse_text(text: RawText, tp: Any, key: str) -> Any:
    """Text from env/CLI: kept as-is for string-like targets, else parsed as a YAML scalar/flow."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        if str(text) in _NONE_WORDS:
            return None
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else tp
    if _is_text_like(tp):
        return str(text)
    try:
        return yaml.safe_load(str(text))
    except yaml.YAMLError:
        raise ConfigError(key, f"cannot parse {str(text)!r} as {_describe(tp)}") from None


def _is_text_like(tp: Any) -> bool:
    if tp in (str, Path):
        return True
    if typing.get_origin(tp) is Literal:
        return all(isinstance(c, str) for c in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def _convert_union(value: Any, tp: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(key, f"expected {_describe(tp)}, got null")
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return _convert(value, options[0], key)
    for option in options:
        try:
            return _convert(value, option, key)
        except ConfigError:
            continue
    raise ConfigError(key, f"expected {_describe(tp)}, got {_show(value)}")


def _convert_sequence(value: Any, tp: Any, key: str) -> Any:
    if not isinstance(value, list | tuple):
        raise ConfigError(key, f"expected a list, got {_show(value)}")
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
        if len(value) != len(args):
            raise ConfigError(key, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    item_type = args[0] if args else Any
    items = [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _convert_mapping(value: Any, tp: Any, key: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_show(value)}")
    args = typing.get_args(tp)
    key_type, value_type = args if args else (Any, Any)
    return {
        _convert(k, key_type, _join(key, str(k))): _convert(v, value_type, _join(key, str(k))) for k, v in value.items()
    }


def _convert_enum(value: Any, tp: type[enum.Enum], key: str) -> enum.Enum:
    if isinstance(value, tp):
        return value
    for member in tp:
        if value == member.value or (
            isinstance(value, str) and value.lower() in (member.name.lower(), str(member.value).lower())
        ):
            return member
    raise ConfigError(key, f"expected one of {_choices([m.value for m in tp])}, got {_show(value)}")


def _build_dataclass(cls: type[T], value: Any, key: str) -> T:
    if isinstance(value, cls):
        value = to_dict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a section (mapping of {_field_list(cls)}), got {_show(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name, given in value.items():
        if name not in fields:
            origin = given.origin if isinstance(given, RawText) else None
            raise ConfigError(_join(key, str(name)), _unknown_key_problem(str(name), cls), origin=origin)
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        sub_key = _join(key, name)
        default = _default_of(field)
        if name in value:
            item = value[name]
            if isinstance(item, Mapping) and dataclasses.is_dataclass(default):
                item = _deep_merge(to_dict(default), item)
            kwargs[name] = _convert(item, hints[name], sub_key)
        elif dataclasses.is_dataclass(default) and not isinstance(default, type):
            kwargs[name] = _convert(to_dict(default), type(default), sub_key)
        elif default is dataclasses.MISSING:
            raise ConfigError(sub_key, f"missing required key ({_describe(hints[name])})")
    try:
        instance = cls(**kwargs)
    except ValueError as exc:
        # A class that validates itself on construction (lorarl.contract's specs) names the field it refused.
        if not (isinstance(getattr(exc, "field", None), str) and isinstance(getattr(exc, "problem", None), str)):
            raise
        field_name = exc.field.split(".", 1)[0]
        given = value.get(field_name)
        origin = given.origin if isinstance(given, RawText) else None
        raise ConfigError(_join(key, exc.field), exc.problem, origin=origin) from None
    for name, field in fields.items():
        check: Check | None = field.metadata.get(CHECK_KEY)
        if check is not None:
            problem = check(getattr(instance, name))
            if problem:
                given = value.get(name)
                origin = given.origin if isinstance(given, RawText) else None
                raise ConfigError(_join(key, name), f"expected {problem}", origin=origin)
    validate = getattr(instance, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as exc:
            raise exc.under(key) from None
    return instance


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, item in update.items():
        if isinstance(item, Mapping) and isinstance(merged.get(name), dict):
            merged[name] = _deep_merge(merged[name], item)
        else:
            merged[name] = item
    return merged


def _unknown_key_problem(name: str, cls: type) -> str:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key; expected one of {', '.join(names)}{hint}"


# --------------------------------------------------------------------------------------------
# Dumping


def to_dict(config: Any) -> Any:
    """Plain YAML/JSON-ready data (dicts, lists, scalars) for a config tree."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, enum.Enum):
        return config.value
    if isinstance(config, Path):
        return str(config)
    if isinstance(config, list | tuple):
        return [to_dict(item) for item in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def dump_yaml(config: Any) -> str:
    """The config as YAML, in field order; loading it back gives an equal config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------------------------
# Messages


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _field_list(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.init)


def _choices(choices: Sequence[Any]) -> str:
    return ", ".join(repr(c) for c in choices)


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _show(value: Any) -> str:
    if isinstance(value, Mapping | list | tuple):
        return _kind(value)
    return repr(value)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return f"one of {_choices(typing.get_args(tp))}"
    if origin in (list, tuple, Sequence):
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if tp is type(None):
        return "null"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}
    if tp in names:
        return names[tp]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a section ({_field_list(tp)})"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {_choices([m.value for m in tp])}"
    return str(tp)


# --------------------------------------------------------------------------------------------
# Reference


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One leaf key of a config tree, as a reference page lists it."""

    key: str
    kind: str
    default: Any
    doc: str
    section_doc: str


def describe_keys(cls: type, prefix: str = "", section_doc: str = "") -> list[KeyDoc]:
    """Every leaf key of the config class ``cls``, depth first in field order, with its type, default and doc:
    the one source a generated key reference is made from, so it cannot drift from what `load_config` accepts."""
    hints = typing.get_type_hints(cls)
    out: list[KeyDoc] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key, tp = _join(prefix, field.name), hints[field.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += describe_keys(tp, key, _first_line(tp.__doc__ or ""))
            continue
        out.append(KeyDoc(key, _describe(tp), to_dict(_default_of(field)), field.metadata.get("doc", ""), section_doc))
    return out


def _first_line(doc: str) -> str:
    """A class docstring's summary (dataclasses give undocumented classes their signature as __doc__)."""
    line = doc.strip().split("\n\n", 1)[0].replace("\n", " ")
    return "" if "(" in line.split(" ", 1)[0] else " ".join(line.split())
