"""Loading a config: YAML file, ``key=value`` overrides, ``${VAR}`` expansion, strict types.

Loading (``load_config(path, overrides=["checkpoint.keep_interval_updates=5"])``):

* a missing section or key keeps the dataclass default;
* an unknown key anywhere, a value of the wrong type, or a value that
  ``__post_init__`` refuses is a :class:`ConfigError` naming the file and the
  dotted key (``checkpoint.keep_interval_updates``);
* ``${VAR}`` / ``${VAR:-default}`` in string values are replaced from the
  environment (an unset ``${VAR}`` without default is an error naming the key);
* an override is ``dotted.key=value`` with ``value`` parsed as YAML
  (``3`` -> int, ``true`` -> bool, ``null`` -> None, ``gs://b/run`` -> str).

Typing is strict: ``int`` fields refuse ``bool`` and ``3.5``; ``float`` fields
accept ints; ``bool`` fields accept only ``true``/``false``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Any, Literal, Mapping, Sequence

import yaml

from xla_ckpt.config.sections import Config
from xla_ckpt.errors import ConfigError
from xla_ckpt.restore.config import RestoreConfig

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                cls: type = Config, environ: Mapping[str, str] | None = None) -> Any:
    """Build ``cls`` (default :class:`Config`) from a YAML file plus ``key=value`` overrides.

    Args:
        path: YAML file; None starts from the dataclass defaults.
        overrides: ``"checkpoint.keep_interval_updates=3"`` strings, applied in order
            after the file (the CLI's ``--set`` / trailing ``key=value`` arguments).
        cls: the dataclass to fill.
        environ: variables for ``${VAR}`` expansion (``os.environ`` by default).

    Raises:
        ConfigError: unreadable file or YAML, unknown key, wrong type, bad value
            (the message names the file and the dotted key).
    """
    where = str(path) if path is not None else "<defaults>"
    data: Any = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"{where}: cannot read config file: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: top level must be a mapping of sections "
                              f"({', '.join(f.name for f in dataclasses.fields(cls))}), "
                              f"got {type(data).__name__}")
        data = _expand_env(data, (), os.environ if environ is None else environ, where)
    data = apply_overrides(data, overrides, cls=cls)
    return config_from_dict(data, cls, where=where)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str], *,
                    cls: type = Config) -> dict:
    """Return a copy of ``data`` with ``dotted.key=value`` overrides applied.

    Raises:
        ConfigError: malformed override, or a key that is not a field of ``cls``.
    """
    out = _deepcopy_dict(data)
    for ov in overrides:
        if not isinstance(ov, str) or "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value")
        key, raw = ov.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ConfigError(f"override {ov!r}: empty key")
        try:
            _field_type_at(cls, parts)
        except ConfigError as e:
            raise ConfigError(f"override {ov!r}: {e}") from None
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {e}") from None
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                if nxt is not None:
                    raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is not a "
                                      "section in the loaded config")
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = value
    return out


def config_from_dict(data: Any, cls: type = Config, *, where: str = "<dict>",
                     prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly (see module docstring).

    Raises:
        ConfigError: unknown key, wrong type or a value ``__post_init__`` refuses
            (names ``where`` and the dotted key).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {prefix or 'top level'} must be a mapping, "
                          f"got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{where}: unknown key {_dotted(prefix, str(k))!r}; valid keys "
                          f"under {prefix or 'the top level'}: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], _dotted(prefix, name), where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def config_to_dict(cfg: Any) -> dict:
    """A dataclass config as plain YAML-able data (the inverse of :func:`config_from_dict`)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    """YAML text of a config (``xla-ckpt demo --print-config``)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# ---- internals -------------------------------------------------------------------------

def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config dataclass (``RestoreConfig`` resolved lazily)."""
    return typing.get_type_hints(cls, localns={"RestoreConfig": RestoreConfig})


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _deepcopy_dict(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deepcopy_dict(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy_dict(v) for v in data]
    return data


def _field_type_at(cls: type, parts: Sequence[str]) -> Any:
    tp: Any = cls
    for i, p in enumerate(parts):
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            raise ConfigError(f"unknown key {'.'.join(parts)!r}: {'.'.join(parts[:i])} "
                              "is a value, not a section")
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        if p not in names:
            under = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown key {'.'.join(parts)!r}; valid keys under {under}: "
                              f"{', '.join(sorted(names))}")
        tp = _hints(tp)[p]
    return tp


def _expand_env(node: Any, path: tuple, environ: Mapping[str, str], where: str) -> Any:
    if isinstance(node, dict):
        return {k: _expand_env(v, path + (str(k),), environ, where) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v, path + (str(i),), environ, where) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in environ and environ[name] != "":
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{where}: {'.'.join(path)} uses ${{{name}}}, which is not set; "
                          f"export {name} or write ${{{name}:-default}}")

    return _VAR.sub(sub, node)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` (and convert int -> float, dict -> dataclass)."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: {key} must be {_type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, key, where)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return config_from_dict(value, tp, where=where, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list):
            raise bad
        (arg, *_rest) = typing.get_args(tp) or (Any,)
        items = [_convert(v, arg, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise bad
        _k, varg = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(v, varg, f"{key}.{k}", where) for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{where}: {key}: unsupported field type {tp!r} (a bug in xla_ckpt)")
