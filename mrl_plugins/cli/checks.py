"""One line of ``mrl doctor``'s output, shared by the checks and the report triage; the checked argparse type the
``mrl`` commands share."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """One doctor line: ``status`` is ``ok``, ``warn`` or ``fail``."""

    status: str
    name: str
    detail: str

    def line(self) -> str:
        """``'warn  ports: ...'``."""
        return f"{self.status:<5} {self.name}: {self.detail}"


def checked_type(cast: Any, ok: Any, need: str) -> Any:
    """An argparse type: ``cast(text)`` that ``ok`` accepts, else one error saying what is needed (``cast`` may raise
    ValueError, or ConfigError as the project's own parsers do)."""
    from mrl_plugins.errors import ConfigError

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except (ValueError, ConfigError):
            value = None
        if value is None or not ok(value):  # nan fails every comparison
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
        return value

    return parse
