"""Units of sizes and rates, read and written one way everywhere: ``parse_size`` (``mrl doctor --peak``),
``parse_rate`` and the ``format_*`` helpers (the benchmarks' link budgets, ``python -m benchmarks plan``).

Rates: bits per second ``bit/s Kbit/s Mbit/s Gbit/s Tbit/s`` (also written ``Gbit``, ``Gb/s``, ``Gbps``) and bytes
per second ``B/s KB/s MB/s GB/s TB/s`` (decimal) and ``KiB/s MiB/s GiB/s TiB/s`` (binary). Sizes: ``B``, ``KB`` ...
(decimal) and ``KiB`` ... (binary); a bare number is bytes.
"""

from __future__ import annotations

import math
import re

from mrl_plugins.errors import ConfigError, choices

_DECIMAL = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def _rate_units() -> dict[str, float]:
    """Unit spelling -> bytes per second for one unit."""
    units: dict[str, float] = {}
    for prefix, mult in (_DECIMAL | _BINARY).items():
        for form in ("bit/s", "bit", "bps"):
            units[prefix + form] = mult / 8.0
        if prefix:
            units[prefix + "b/s"] = mult / 8.0
        for form in ("B/s", "Bps"):
            units[prefix + form] = mult
    units["bytes/s"] = 1.0
    return units


RATE_UNITS: dict[str, float] = _rate_units()
#: What error messages list (the other spellings in RATE_UNITS are accepted too).
RATE_UNITS_SHOWN: tuple[str, ...] = (
    "bit/s", "Kbit/s", "Mbit/s", "Gbit/s", "Tbit/s", "Gb/s", "Gbps",
    "B/s", "KB/s", "MB/s", "GB/s", "TB/s", "KiB/s", "MiB/s", "GiB/s",
)  # fmt: skip
SIZE_UNITS: dict[str, float] = {"B": 1.0} | {p + "B": m for p, m in (_DECIMAL | _BINARY).items() if p}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z/]*)\s*$")


def _split(text: str, what: str, valid: str) -> tuple[float, str]:
    if not isinstance(text, str):
        raise ConfigError(f"{what}: expected text like '10Gbit', got {type(text).__name__}; valid units: {valid}")
    m = _QUANTITY.match(text)
    if m is None:
        raise ConfigError(f"{what}: cannot read {text!r} as a number with a unit; valid units: {valid}")
    value = float(m.group(1))
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}: {text!r} must be a positive number; valid units: {valid}")
    return value, m.group(2)


def parse_rate(text: str) -> float:
    """Bytes per second of a link or rate such as ``10Gbit``, ``25 Gb/s``, ``1.25GB/s``, ``800MB/s``, ``100Mbps``.

    ``b``/``bit`` is bits, ``B`` is bytes; K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024. ``bit``,
    ``bps`` and ``bytes`` are matched case-insensitively (``10gbit``), the others exactly (``Gb`` is not ``GB``).
    ConfigError naming the valid units for a missing or unknown unit, zero or a negative number.
    """
    valid = ", ".join(RATE_UNITS_SHOWN)
    value, unit = _split(text, "rate", valid)
    if not unit:
        raise ConfigError(f"rate {text!r} has no unit (bits or bytes?); valid units: {valid}")
    mult = RATE_UNITS.get(unit)
    if mult is None:
        low = unit.lower()
        for name, m in RATE_UNITS.items():
            if name.lower() == low and any(k in low for k in ("bit", "bps", "bytes")):
                mult = m
                break
    if mult is None:
        raise ConfigError(f"rate {text!r}: unknown unit {unit!r}; valid units: {valid}")
    return value * mult


def parse_size(text: str | float | int) -> float:
    """Bytes of ``512``, ``512B``, ``4KiB``, ``1.5MB`` (a bare number is bytes); ConfigError for bad input."""
    valid = choices(SIZE_UNITS)
    if isinstance(text, bool):
        raise ConfigError(f"size: expected a number of bytes, got {text!r}; valid units: {valid}")
    if isinstance(text, int | float):
        text = repr(text)
    value, unit = _split(text, "size", valid)
    if not unit:
        return value
    if unit not in SIZE_UNITS:
        raise ConfigError(f"size {text!r}: unknown unit {unit!r}; valid units: {valid}")
    return value * SIZE_UNITS[unit]


def format_rate(bytes_per_s: float) -> str:
    """``13107200`` -> ``'13.1 MB/s'`` (decimal units, three significant digits)."""
    for unit, mult in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= mult:
            return f"{bytes_per_s / mult:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def format_size(n_bytes: float) -> str:
    """``1e9`` -> ``'1 GB'`` (decimal units)."""
    for unit, mult in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= mult:
            return f"{n_bytes / mult:.3g} {unit}"
    return f"{n_bytes:.3g} B"


def format_count(n: float) -> str:
    """``5e8`` -> ``'500M'``, ``1.5e9`` -> ``'1.5G'``."""
    for unit, mult in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= mult:
            return f"{n / mult:.4g}{unit}"
    return f"{n:.4g}"
