"""Sizes, read one way everywhere: ``parse_size`` (``mrl doctor --peak``; the benchmarks' rates and formats build on
:func:`split_quantity` and the prefixes here, in ``benchmarks/units.py``).

Sizes: ``B``, ``KB`` ... (decimal) and ``KiB`` ... (binary); a bare number is bytes.
"""

from __future__ import annotations

import math
import re

from mrl_plugins.errors import ConfigError, choices

DECIMAL = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
SIZE_UNITS: dict[str, float] = {"B": 1.0} | {p + "B": m for p, m in (DECIMAL | BINARY).items() if p}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z/]*)\s*$")


def split_quantity(text: str, what: str, valid: str) -> tuple[float, str]:
    """``(positive finite number, unit text)`` of ``text``; ConfigError naming ``what`` and the ``valid`` units."""
    if not isinstance(text, str):
        raise ConfigError(f"{what}: expected text like '10Gbit', got {type(text).__name__}; valid units: {valid}")
    m = _QUANTITY.match(text)
    if m is None:
        raise ConfigError(f"{what}: cannot read {text!r} as a number with a unit; valid units: {valid}")
    value = float(m.group(1))
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}: {text!r} must be a positive number; valid units: {valid}")
    return value, m.group(2)


def parse_size(text: str | float | int) -> float:
    """Bytes of ``512``, ``512B``, ``4KiB``, ``1.5MB`` (a bare number is bytes); ConfigError for bad input."""
    valid = choices(SIZE_UNITS)
    if isinstance(text, bool):
        raise ConfigError(f"size: expected a number of bytes, got {text!r}; valid units: {valid}")
    if isinstance(text, int | float):
        text = repr(text)
    value, unit = split_quantity(text, "size", valid)
    if not unit:
        return value
    if unit not in SIZE_UNITS:
        raise ConfigError(f"size {text!r}: unknown unit {unit!r}; valid units: {valid}")
    return value * SIZE_UNITS[unit]
