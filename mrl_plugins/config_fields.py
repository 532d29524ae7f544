"""What a config field is to a user: a setting (``metadata["help"]``), or internal (``metadata["internal"]``).

An internal field is not a setting: its value follows from the deployment (derived when the config is loaded,
:meth:`mrl_plugins.config.MrlConfig.derive`) or is a measured constant. It stays an attribute of its section, so the
code, the transports and third-party plugins read it where they always did (``config.comm.ring_slots``), and code
may set it (the tests do: ``CommConfig(ring_slots=1)``); a user's YAML or dict that sets it gets one error saying why
it is none and what decides it instead, and ``docs/config.md`` does not list it.

``MRL_ALLOW_INTERNAL_KEYS=1`` lets a config file set internal fields too: the repository's tests and benchmarks
need that for runs in other processes (``mrl run`` of a test, ``mrl compare --quick``'s runs). It is no user
setting and carries no promise across releases.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

#: the environment variable that lets a config set internal fields (tests and benchmarks)
INTERNAL_ENV = "MRL_ALLOW_INTERNAL_KEYS"


def internal(why: str, *, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is not a user setting; ``why`` completes "``<key>`` is not a setting: ...".

    A default of ``None`` on a derived field means "derive it when the config is loaded"."""
    kwargs: dict[str, Any] = {"metadata": {"internal": why}}
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def is_internal(f: dataclasses.Field) -> bool:
    """Whether ``f`` is an internal field (see the module docstring)."""
    return "internal" in f.metadata


def user_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` a user sets (its settings)."""
    return [f for f in dataclasses.fields(cls) if not is_internal(f)]


def internal_allowed() -> bool:
    """Whether ``MRL_ALLOW_INTERNAL_KEYS`` lets this process's configs set internal fields."""
    return os.environ.get(INTERNAL_ENV, "").strip().lower() in ("1", "true", "yes")


def internal_keys_in(cls: type, data: Any) -> list[tuple[str, str]]:
    """``(key, why)`` of the internal fields of ``cls`` that the mapping ``data`` sets."""
    if not isinstance(data, dict):
        return []
    whys = {f.name: f.metadata["internal"] for f in dataclasses.fields(cls) if is_internal(f)}
    return [(k, whys[k]) for k in sorted(data, key=str) if k in whys]


__all__ = ["INTERNAL_ENV", "internal", "internal_allowed", "internal_keys_in", "is_internal", "user_fields"]
