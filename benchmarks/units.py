"""Rates and human-readable sizes for the lab (link budgets, ``python -m benchmarks plan``); sizes are read by the
product's :func:`mrl_plugins.cli.units.parse_size`, whose number parsing these rates share.

Rates: bits per second ``bit/s Kbit/s Mbit/s Gbit/s Tbit/s`` (also written ``Gbit``, ``Gb/s``, ``Gbps``) and bytes
per second ``B/s KB/s MB/s GB/s TB/s`` (decimal) and ``KiB/s MiB/s GiB/s TiB/s`` (binary).
"""

from __future__ import annotations

from mrl_plugins.cli.units import BINARY, DECIMAL, parse_size, split_quantity
from mrl_plugins.errors import ConfigError

__all__ = ["RATE_UNITS", "format_count", "format_rate", "format_size", "parse_rate", "parse_size"]


def _rate_units() -> dict[str, float]:
    """Unit spelling -> bytes per second for one unit."""
    units: dict[str, float] = {}
    for prefix, mult in (DECIMAL | BINARY).items():
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


def parse_rate(text: str) -> float:
    """Bytes per second of a link or rate such as ``10Gbit``, ``25 Gb/s``, ``1.25GB/s``, ``800MB/s``, ``100Mbps``.

    ``b``/``bit`` is bits, ``B`` is bytes; K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024. ``bit``,
    ``bps`` and ``bytes`` are matched case-insensitively (``10gbit``), the others exactly (``Gb`` is not ``GB``).
    ConfigError naming the valid units for a missing or unknown unit, zero or a negative number.
    """
    valid = ", ".join(RATE_UNITS_SHOWN)
    value, unit = split_quantity(text, "rate", valid)
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
