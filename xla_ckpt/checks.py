"""Checks of config values, shared by every component's config dataclass.

Each refusal raises :class:`~xla_ckpt.errors.ConfigError` naming the dotted key
(``<section>.<name>``) and the value given.
"""

from __future__ import annotations

from typing import Any, Sequence

from xla_ckpt.errors import ConfigError


def check_int(section: str, name: str, value: Any, lo: int) -> None:
    """Refuse ``value`` unless it is an ``int`` (not a bool) >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{section}.{name} must be an integer >= {lo}, got {value!r}")


def check_number(section: str, name: str, value: Any, *, positive: bool = True) -> None:
    """Refuse ``value`` unless it is an int or float (not a bool, not NaN) > 0, or >= 0 with
    ``positive=False``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not ok or (positive and value <= 0) or (not positive and value < 0):
        raise ConfigError(f"{section}.{name} must be a number {'>' if positive else '>='} 0, "
                          f"got {value!r}")


def check_choice(section: str, name: str, value: Any, choices: Sequence[str]) -> None:
    """Refuse ``value`` unless it is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{section}.{name} must be one of {', '.join(choices)}; got {value!r}")
