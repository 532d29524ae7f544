"""What a config field is to a user: a setting (``metadata["help"]``), or internal (``metadata["internal"]``); the
rules of its value (``metadata``: ``choices``, bounds ``ge``/``gt``/``le``/``lt``; :func:`check_fields`, one message
format); and the one parser of a section (:func:`section_from_dict`: removed, unknown, internal and wrongly typed
keys refused). A section's ``validate()`` starts with :func:`check_fields` and writes only its cross-field rules.

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
import functools
import math
import operator
import os
import types
import typing
from typing import Any

from mrl_plugins.errors import ConfigError, choices

#: the environment variable that lets a config set internal fields (tests and benchmarks)
INTERNAL_ENV = "MRL_ALLOW_INTERNAL_KEYS"


def internal(
    why: str, *, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING, **rules: Any
) -> Any:
    """A dataclass field that is not a user setting; ``why`` completes "``<key>`` is not a setting: ...";
    ``rules``: its value's ``choices`` / bounds, as a setting's metadata.

    A default of ``None`` on a derived field means "derive it when the config is loaded"."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"internal": why, **rules})


def is_internal(f: dataclasses.Field) -> bool:
    """Whether ``f`` is an internal field (see the module docstring)."""
    return "internal" in f.metadata


def internal_allowed() -> bool:
    """Whether ``MRL_ALLOW_INTERNAL_KEYS`` lets this process's configs set internal fields."""
    return os.environ.get(INTERNAL_ENV, "").strip().lower() in ("1", "true", "yes")


#: the path of the top level in error messages
TOP = "config"


def _type_ok(value: Any, tp: Any) -> bool:
    """Loose runtime check of a YAML value against a dataclass field annotation."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return isinstance(value, list | tuple) and all(_type_ok(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:  # every float field: finite (an infinite wait overflows the waits derived from it)
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def fill_derived(section: Any, standalone: dict[str, Any]) -> None:
    """A section's ``__post_init__``: its derived fields that were not given (None) take their ``standalone`` value
    (a value, or a function of the section), and the section remembers which (``_derivable``): loading a config
    derives exactly those from the settings, so a value code set is kept even where it equals the standalone one."""
    unset = [key for key in standalone if getattr(section, key) is None]
    for key in unset:
        value = standalone[key]
        setattr(section, key, value(section) if callable(value) else value)
    section._derivable = frozenset(unset)


#: metadata bound -> (test, how the range is written: as a lower or an upper end)
BOUNDS = {
    "ge": (operator.ge, ">=", "["),
    "gt": (operator.gt, ">", "("),
    "le": (operator.le, "<=", "]"),
    "lt": (operator.lt, "<", ")"),
}


def rule_text(f: dataclasses.Field) -> str | None:
    """What ``f``'s metadata allows, as the errors and ``docs/config.md`` say it: ``valid: 'a' or 'b'``, ``>= 1``,
    ``in [0, 1)``; None without a rule."""
    if "choices" in f.metadata:
        valid = f.metadata["choices"]
        return "valid: " + (choices(valid) if all(isinstance(v, str) for v in valid) else ", ".join(map(repr, valid)))
    ends = [(op, f.metadata[op]) for op in BOUNDS if op in f.metadata]
    if len(ends) == 2:
        return f"in {BOUNDS[ends[0][0]][2]}{ends[0][1]}, {ends[1][1]}{BOUNDS[ends[1][0]][2]}"
    return " ".join(f"{BOUNDS[op][1]} {bound}" for op, bound in ends) or None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any, path: str) -> None:
    """Every field of the dataclass ``obj`` against its type and its metadata's rules (None passes the rules: a
    derived field not yet derived, or a null that means "the default"); ConfigError ``<key>: 'x' invalid; valid:
    'a' or 'b'`` / ``<key>: must be >= 1, got 0`` otherwise. Nested sections are checked by their own validate()."""
    for f in dataclasses.fields(obj):
        key, value, tp = _join(path, f.name), getattr(obj, f.name), _hints(type(obj))[f.name]
        if dataclasses.is_dataclass(tp):
            continue
        _check_type(key, value, tp)
        rule = rule_text(f)
        if value is None or rule is None:
            continue
        if "choices" in f.metadata:
            if value not in f.metadata["choices"]:
                raise ConfigError(f"{key}: {value!r} invalid; {rule}")
        elif not all(BOUNDS[op][0](value, f.metadata[op]) for op in BOUNDS if op in f.metadata):
            raise ConfigError(f"{key}: must be {rule}, got {value!r}")


def _check_type(key: str, value: Any, tp: Any) -> None:
    if not _type_ok(value, tp):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


#: public keys that were removed: dotted key -> why, and what to use instead (one error naming it, not "unknown key")
REMOVED_KEYS: dict[str, str] = {
    "comm.prefetch": (
        "was removed: nothing received batches ahead on a background thread (the rollout overlaps generation "
        "with training: rollout.max_staleness >= 1); delete the key"
    ),
    "ports": (
        "was removed (2026-12-04): nothing in a run bound a port from it; give the table to "
        "`mrl doctor --ports name=port,...`"
    ),
    "rollout.launcher": (
        "was removed (2026-12-04): set rollout.ray_address (auto | local | HOST:PORT) to have Ray start the remote "
        "workers; without it they are started by hand (`mrl worker --connect`)"
    ),
    "rollout.model_priorities": (
        "was removed (2026-12-04): a run generates with one model, the policy, first in first out; delete the key"
    ),
    "rollout.switch_throttle": (
        "was removed (2026-12-04): a weight switch no longer holds back requests (each names the version it "
        "needs); delete the key"
    ),
    "comm.full_policy": (
        "was removed (2026-12-04): a full ring always waits for space (comm.send_timeout_s); its 'drop_newest' "
        "dropped an answer the trainer then waited for until rollout.timeout_s failed the run; delete the key"
    ),
}


def section_from_dict(cls: type, data: Any, path: str, *, validate: bool = True) -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting removed and unknown keys and wrongly typed or non-finite
    values: the one parser of every section (``validate``: then call the object's ``validate()``).

    An unknown key is ``unknown <section> key 'x'; valid keys: ...`` naming the keys a user may set (internal ones
    too where ``MRL_ALLOW_INTERNAL_KEYS`` lets them be set)."""
    if data is None:
        data = {}
    if isinstance(data, cls):  # an object built in code: check it like the mapping it stands for
        data = {f.name: getattr(data, f.name) for f in dataclasses.fields(cls)}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    _check_removed(data, path)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        settable = [n for n, f in fields.items() if not is_internal(f) or internal_allowed()]
        section = "top-level" if path == TOP else path
        raise ConfigError(f"unknown {section} key {unknown[0]!r}; valid keys: {choices(settable)}")
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _nested(tp, value, _join(path, key))
            continue
        _check_type(_join(path, key), value, tp)
        kwargs[key] = float(value) if tp is float else value
    obj = cls(**kwargs)
    if validate and getattr(obj, "validate", None) is not None:
        try:
            obj.validate()
        except ConfigError as exc:
            if path == TOP or str(exc).startswith((path, f"unknown {path}")):
                raise
            raise ConfigError(f"{path}: {exc}") from None
    return obj


def _check_removed(data: Any, path: str) -> None:
    """A removed public key is one error saying so (and what replaces it), whichever parser reads the section."""
    for key in sorted(data) if isinstance(data, dict) else ():
        gone = REMOVED_KEYS.get(_join(path, str(key)))
        if gone:
            raise ConfigError(f"{_join(path, str(key))} {gone}")


def _join(path: str, key: str) -> str:
    """Dotted key path; top-level keys are named bare (``mode``, not ``config.mode``)."""
    return key if path == TOP else f"{path}.{key}"


def _check_internal(cls: type, data: Any, path: str) -> None:
    """A user's config that sets an internal field: one error saying it is none and what decides it instead
    (:mod:`mrl_plugins.config_fields`; ``MRL_ALLOW_INTERNAL_KEYS=1`` lets the tests and benchmarks set them)."""
    if internal_allowed() or not isinstance(data, dict):
        return
    whys = {f.name: f.metadata["internal"] for f in dataclasses.fields(cls) if is_internal(f)}
    for key in sorted(data, key=str):
        if key in whys:
            raise ConfigError(f"{_join(path, key)} is not a setting (since 2026-12-04): {whys[key]}")


def _nested(cls: type, value: Any, path: str) -> Any:
    """The section ``cls`` from the user's mapping ``value`` (removed and internal keys refused) or an object built
    in code (taken as the mapping of its fields)."""
    if value is not None and not isinstance(value, dict | cls):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
    if not isinstance(value, cls):
        _check_internal(cls, value, path)
    return section_from_dict(cls, value, path)
