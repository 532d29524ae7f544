"""One line of ``mrl doctor``'s output, shared by the checks and the report triage."""

from __future__ import annotations

from dataclasses import dataclass

from mrl_plugins.errors import choices

STATUSES = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Check:
    """One doctor line: ``status`` is ``ok``, ``warn`` or ``fail``."""

    status: str
    name: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {choices(STATUSES)}")

    def line(self) -> str:
        """``'warn  ports: ...'``."""
        return f"{self.status:<5} {self.name}: {self.detail}"


__all__ = ["STATUSES", "Check"]
