"""Reads Compose files the way `docker compose config` does, for checks that run without Docker.

Covers what deploy/ uses: YAML anchors and merge keys, `${VAR}` interpolation (with :-, -, :?,
?, :+, + and $$), and merging override files in order. Merge rules are the Compose
Specification's for the keys that occur here: mappings merge key by key; `command`,
`entrypoint` and `healthcheck.test` are replaced; other sequences (devices, volumes, ports, ...)
are concatenated without duplicates. An override's `!reset` drops the key it tags and `!override`
replaces instead of merging (Compose 2.24+), e.g. `ports: !reset []` under host networking.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

#: Sequences an override replaces instead of extending.
REPLACED = frozenset({"command", "entrypoint", "test"})
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


class ComposeError(ValueError):
    """A Compose file cannot be read, interpolated or merged."""


class Reset:
    """`!reset`: the key is removed from the merged project."""


class Override:
    """`!override value`: the value replaces the base's instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Loader(yaml.SafeLoader):
    pass


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    return Reset()


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))  # type: ignore[arg-type]


_Loader.add_constructor("!reset", _reset)
_Loader.add_constructor("!override", _override)


def interpolate(value: Any, env: Mapping[str, str], where: str = "") -> Any:
    """`value` with every `${VAR...}` in its strings (keys included) replaced from `env`."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: _substitute(m, env, where), value)
    if isinstance(value, Mapping):
        return {interpolate(k, env, where): interpolate(v, env, f"{where}.{k}".lstrip(".")) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Override):
        return Override(interpolate(value.value, env, where))
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str], where: str) -> str:
    if match["escaped"]:
        return "$"
    name = match["braced"] or match["plain"]
    op, arg = match["op"], match["arg"] or ""
    value = env.get(name)
    unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
    if op in (":-", "-"):
        return arg if unset_or_empty else value  # type: ignore[return-value]
    if op in (":?", "?"):
        if unset_or_empty:
            raise ComposeError(f"{where}: required variable {name} is missing a value: {arg}")
        return value  # type: ignore[return-value]
    if op in (":+", "+"):
        return "" if unset_or_empty else arg
    return value or ""


def merge(base: Any, override: Any, key: str = "") -> Any:
    """`override` merged onto `base` with the Compose merge rules described in the module docstring."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(base)
        for name, value in override.items():
            if isinstance(value, Reset):
                merged.pop(name, None)
            elif isinstance(value, Override):
                merged[name] = value.value
            else:
                merged[name] = merge(merged[name], value, name) if name in merged else _plain(value)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in REPLACED:
        return base + [item for item in override if item not in base]
    return override


def _plain(value: Any) -> Any:
    """A value new to the project, with any `!reset` / `!override` inside it resolved."""
    if isinstance(value, Mapping):
        return {k: _plain(v.value if isinstance(v, Override) else v) for k, v in value.items()
                if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value.value if isinstance(value, Override) else value


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Compose file's top-level mapping, anchors and merge keys resolved, not yet interpolated."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader with 2 tags
    except (OSError, yaml.YAMLError) as exc:
        raise ComposeError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ComposeError(f"{path}: a Compose file holds a mapping")
    return data


def load(paths: Sequence[str | os.PathLike[str]], env: Mapping[str, str]) -> dict[str, Any]:
    """The project `docker compose -f A -f B config` would see: each file interpolated, then merged."""
    if not paths:
        raise ComposeError("no Compose file given")
    project: dict[str, Any] = {}
    for path in paths:
        project = merge(project, interpolate(read(path), env))
    return _plain(project)


def depends_on(service: Mapping[str, Any]) -> list[str]:
    """Names a service depends on (short list form or long mapping form)."""
    value = service.get("depends_on") or []
    return list(value)


def start_order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Service names with every dependency before its dependents (file order among equals)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ComposeError(f"services: dependency cycle through {name!r}")
        visiting.add(name)
        for dependency in depends_on(services.get(name, {})):
            visit(dependency)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order
