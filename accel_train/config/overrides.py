"""Values into typed keys: a recipe's YAML tree into the dataclasses, and `key=value` overrides (text from the
command line, read as YAML) onto them, each value checked against its field's type; and back: a value spelled as an
override takes it, a tree as dotted keys."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import yaml

from accel_train.config.schema import Config, fields_of, hints_of, is_mapping, is_union, type_name
from accel_train.errors import UserError, did_you_mean


def apply_overrides(config: Config, overrides: list[str]) -> set[str]:
    """Set each `key=value` on `config`; the keys given."""
    given = set()
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise UserError(f"override '{override}' is not of the form key=value (e.g. train.lr=0.01)")
        _set(config, key.strip(), raw)
        given.add(key.strip())
    return given


def build(cls: type, tree: dict, prefix: str) -> Any:
    if not isinstance(tree, dict):
        raise UserError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {tree!r}")
    fields, hints = fields_of(cls), hints_of(cls)
    kwargs = {}
    for key, value in tree.items():
        if key not in fields:
            raise UserError(_unknown_key(prefix + key, cls))
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = build(hints[key], value or {}, prefix + key + ".")
        else:
            kwargs[key] = _coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def _set(config: Config, dotted: str, raw: str) -> None:
    """Set `section.key=value`; `section.mapping.name=value` sets one entry of a mapping (model.args.depth=3)."""
    parts = dotted.split(".")
    node, prefix = config, ""
    for index, part in enumerate(parts):
        hints, rest = hints_of(type(node)), parts[index + 1:]
        if part not in hints:
            raise UserError(_unknown_key(prefix + part, type(node)))
        key, hint = prefix + part, hints[part]
        if dataclasses.is_dataclass(hint):
            if not rest:
                sub = ", ".join(f"{key}.{name}" for name in fields_of(hint))
                raise UserError(f"'{key}' is a section, not a value; set one of its keys: {sub}")
            node, prefix = getattr(node, part), key + "."
            continue
        if rest and is_mapping(hint):
            entries = getattr(node, part)
            for name in rest[:-1]:
                entries = entries.setdefault(name, {})
                if not isinstance(entries, dict):
                    raise UserError(f"{dotted}: {key} has a value, not a mapping, at '{name}'")
            entries[rest[-1]] = _yaml_value(dotted, raw)
            return
        if rest:
            raise UserError(f"unknown config key '{dotted}': '{key}' is a value, not a section")
        setattr(node, part, _coerce(key, hint, raw, from_text=True))
        return


def _unknown_key(key: str, cls: type) -> str:
    """The line for a mistyped key: the key it was probably meant to be, else every key of its section."""
    prefix = key.rpartition(".")[0]
    valid = [(f"{prefix}." if prefix else "") + name for name in fields_of(cls)]
    close = did_you_mean(key, valid)
    if close:
        return f"unknown config key '{key}'{close}; accel-train keys lists every key"
    return f"unknown config key '{key}'; valid keys here: {', '.join(valid)}"


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _yaml_value(key: str, raw: str) -> Any:
    """A command-line value read as YAML: 3 -> int, 0.5 -> float, true -> bool, [1, 2] -> list, text -> str."""
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise UserError(f"{key}: '{raw}' is not a valid value ({str(err).splitlines()[0]})") from None


def _coerce(key: str, hint: Any, value: Any, from_text: bool = False) -> Any:
    """Check `value` against the field's type; text from the command line is parsed first."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if is_union(hint) and type(None) in args:
        if value is None or (from_text and str(value).lower() in ("null", "none", "")):
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) > 1:  # e.g. int | Literal["auto"]: the first member the value fits
            return _coerce_any(key, members, value, from_text)
        (hint,) = members
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    elif is_union(hint):
        return _coerce_any(key, list(args), value, from_text)
    if origin is list:
        value = _yaml_value(key, value) if from_text else value
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(item, (int, float)) and not isinstance(item, bool) for item in value):
            raise UserError(f"{key}: expected a list of numbers, e.g. {key}=[0.5,0.5,0.5], got {value!r}")
        return [float(item) for item in value]
    if is_mapping(hint):
        value = _yaml_value(key, value) if from_text else value
        if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
            raise UserError(f"{key}: expected a mapping of names to values, e.g. {key}={{depth: 3}}, got {value!r}")
        return dict(value)
    if origin is Literal:
        text = str(value)
        if text not in args:
            raise UserError(f"{key}: '{text}' is not a valid choice; choose one of {', '.join(args)}")
        return text
    try:
        if hint is bool:
            text = str(value).lower()
            if isinstance(value, bool):
                return value
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.strip())
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
        raise UserError(f"{key}: expected {name}, got {value!r}") from None
    raise TypeError(f"unsupported config type {hint} for {key}")


def _coerce_any(key: str, members: list, value: Any, from_text: bool) -> Any:
    for member in members:
        try:
            return _coerce(key, member, value, from_text)
        except UserError:
            continue
    raise UserError(f"{key}: expected {' or '.join(type_name(member) for member in members)}, got {value!r}")


def spelled(value: Any) -> str:
    """A value as an override takes it: null, true, 0.001, [0.5, 0.5], {depth: 3}, text unquoted."""
    if isinstance(value, str):
        return value if value else '""'
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.1}} -> {"train.lr": 0.1}; mappings that are values (model.args) are walked too."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
