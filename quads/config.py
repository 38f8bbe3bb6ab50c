"""Typed dataclass configs from YAML files and CLI flags, mapped one to one onto fields.

``add_dataclass_args(parser, Cls)`` adds ``--field-name`` for every field of ``Cls`` (nested dataclass
fields become ``--section.field-name``); ``build_config(Cls, yaml_path, args)`` resolves defaults <- YAML
<- flags and validates through ``__post_init__``. Unknown YAML keys and wrong types raise ``ValueError``
naming the field and what was expected.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

_MISSING = object()


def _base_type(tp: Any) -> Any:
    """Strip ``Optional[...]`` / ``X | None`` to ``X``; leave other types as they are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (from YAML or a CLI string) to the annotated type ``tp`` or raise ValueError."""
    if value is None:
        if _is_optional(tp) or tp is Any:
            return None
        raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got null")
    if isinstance(value, str) and value.lower() in ("none", "null") and _is_optional(tp):
        return None
    base = _base_type(tp)
    origin = typing.get_origin(base)
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if not isinstance(value, str | int | float):
                raise ValueError
            return str(value)
        if origin in (tuple, list):
            items = value.split(",") if isinstance(value, str) else list(value)
            args = typing.get_args(base)
            elem = args[0] if args else str
            out = [coerce(v.strip() if isinstance(v, str) else v, elem, where) for v in items if v != ""]
            return tuple(out) if origin is tuple else out
        if typing.get_origin(base) is typing.Literal:
            choices = typing.get_args(base)
            if isinstance(value, str) and any(isinstance(c, bool) for c in choices):  # e.g. Literal["auto", True, False]
                value = {"true": True, "false": False}.get(value.lower(), value)
            if not any(value == c and type(value) is type(c) for c in choices):
                raise ValueError(f"{where}: expected one of {list(choices)}, got {value!r}")
            return value
    except (TypeError, ValueError) as e:
        if str(e).startswith(where):
            raise
        raise ValueError(
            f"{where}: expected {getattr(base, '__name__', base)}, got {value!r} ({type(value).__name__})"
        ) from None
    return value


def field_comments(cls: type) -> dict[str, str]:
    """``{field: trailing comment}`` read from the dataclass source (``x: int = 1  # what x is``).

    Configs document each field with a trailing comment (STYLE.md item 10); the CLI help reuses it so
    ``--help`` and the code cannot disagree. Returns ``{}`` when the source is unavailable.
    """
    import inspect
    import re

    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for m in re.finditer(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", src, flags=re.MULTILINE):
        if m.group(1) in names and m.group(1) not in out:
            out[m.group(1)] = m.group(2).strip()
    return out


def _metavar(base: Any, choices: list | None) -> str:
    if choices:
        return "|".join(map(str, choices))
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        args = typing.get_args(base)
        elem = getattr(args[0], "__name__", "V").upper() if args else "V"
        return f"{elem},{elem},..."
    return getattr(base, "__name__", "V").upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per field; defaults are left unset so YAML values are not overridden by them."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(_base_type(tp)):
            add_dataclass_args(parser, _base_type(tp), prefix=f"{prefix}{f.name}.")
            continue
        help_ = f.metadata.get("help", comments.get(f.name, ""))
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        base = _base_type(tp)
        choices = f.metadata.get("choices")
        if typing.get_origin(base) is typing.Literal:
            choices = list(typing.get_args(base))
        parser.add_argument(
            _flag(prefix + f.name),
            dest=prefix + f.name,
            default=argparse.SUPPRESS,
            metavar=f.metadata.get("metavar", _metavar(base, choices)),
            help=(f"{help_} " if help_ else "") + f"(default: {default!r})"
            + (f"; choices: {', '.join(map(str, choices))}" if choices else ""),
        )


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build ``cls`` from a (possibly nested) dict, rejecting unknown keys with the valid ones listed."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"{where or cls.__name__}: unknown field(s) {unknown}; valid fields are {sorted(names)}"
        )
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        here = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(_base_type(tp)):
            kwargs[key] = value if dataclasses.is_dataclass(value) else from_dict(_base_type(tp), value, here)
        else:
            kwargs[key] = coerce(value, tp, here)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain (YAML-safe) dict of a dataclass config; tuples become lists."""

    def clean(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return clean(dataclasses.asdict(cfg))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_config(cls: type, yaml_path: str | Path | None = None, args: argparse.Namespace | None = None,
                 skip: tuple[str, ...] = ()) -> Any:
    """defaults <- YAML file <- CLI flags; returns a validated ``cls`` instance."""
    data: dict[str, Any] = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; pass an existing YAML file")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"config file {str(path)!r}{where}: not valid YAML ({problem}); fix the file") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r}: expected a mapping at top level, got {type(loaded).__name__}")
        data = loaded
    if args is not None:
        flat = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip and k != "command"}
        names = {f.name for f in dataclasses.fields(cls)}
        flat = {k: v for k, v in flat.items() if k.split(".")[0] in names}
        data = _merge(data, _nest(flat))
    return from_dict(cls, data)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    from quads.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
