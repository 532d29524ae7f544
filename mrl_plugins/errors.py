"""Errors raised by mrl-plugins. Each names the problem and, where there is a choice, the valid choices."""

from __future__ import annotations

from collections.abc import Iterable


class MrlError(Exception):
    """Base class of every mrl-plugins error."""


class ConfigError(MrlError, ValueError):
    """A configuration key or value is invalid (raised before anything is applied)."""


class PluginError(MrlError):
    """A plugin is unknown, blocked, duplicated or does not provide the requested stage."""


class UnsupportedVersionError(MrlError):
    """A host library (TRL, torch_npu, ...) is outside the supported range."""


class DeviceError(MrlError):
    """A requested device is not present or not usable."""


class StageTimeoutError(MrlError, TimeoutError):
    """A wait on another process ran past its timeout (the peer is dead or stuck)."""


def choices(values: Iterable[str]) -> str:
    """Format valid choices for an error message: ``'a', 'b' or 'c'``."""
    vals = [repr(v) for v in sorted(set(values))]
    if not vals:
        return "(none available)"
    if len(vals) == 1:
        return vals[0]
    return ", ".join(vals[:-1]) + " or " + vals[-1]
