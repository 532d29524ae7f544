"""``mrl doctor``'s ``supported versions`` check: TRL, transformers, torch and accelerate against the ranges.

TRL's range is the adapter's own (:data:`mrl_plugins.adapters.trl.SUPPORTED_TRL`, checked by
:func:`~mrl_plugins.adapters.trl.check_trl_version`, which refuses anything else at ``enable()``); the others
are the requirements this installed ``mrl-plugins`` declares (its ``trl`` extra included). Versions are read
from the installed distributions' metadata: nothing is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, requires

from mrl_plugins.device.probe import _dist_version as _installed
from mrl_plugins.errors import UnsupportedVersionError

DISTRIBUTION = "mrl-plugins"
#: checked in this order; TRL's range comes from the adapter
PACKAGES = ("trl", "transformers", "torch", "accelerate")


def declared_ranges(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """Package name -> specifier declared by ``distribution`` (extras included), e.g. ``{"torch": ">=2.4"}``."""
    from packaging.requirements import Requirement

    try:
        reqs = requires(distribution) or []
    except PackageNotFoundError:
        return {}
    out: dict[str, str] = {}
    for line in reqs:
        req = Requirement(line)
        if str(req.specifier):
            out[req.name.lower()] = str(req.specifier)
    return out


def version_problems(
    installed: Callable[[str], str | None] = _installed, ranges: dict[str, str] | None = None
) -> tuple[list[str], list[str], list[str]]:
    """``(ok, missing, unsupported)`` descriptions, one per package of :data:`PACKAGES`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    from mrl_plugins.adapters.trl import SUPPORTED_TRL, check_trl_version

    ranges = {**(declared_ranges() if ranges is None else ranges), "trl": ",".join(SUPPORTED_TRL)}
    ok: list[str] = []
    missing: list[str] = []
    bad: list[str] = []
    for name in PACKAGES:
        spec = ranges.get(name)
        got = installed(name)
        if got is None:
            missing.append(f"{name} not installed" + (f" (supported: {name}{SpecifierSet(spec)})" if spec else ""))
            continue
        if name == "trl":
            try:
                check_trl_version(got)
            except UnsupportedVersionError as exc:
                bad.append(str(exc))
                continue
        elif spec:
            try:
                supported = SpecifierSet(spec).contains(got.split("+")[0], prereleases=True)
            except InvalidVersion:
                supported = False
            if not supported:
                bad.append(f"{name} {got} is outside the supported range {name}{SpecifierSet(spec)}")
                continue
        ok.append(f"{name} {got}" + (f" ({name}{SpecifierSet(spec)})" if spec else ""))
    return ok, missing, bad


def trl_version_notes(installed: Callable[[str], str | None] = _installed) -> list[str]:
    """Known limits of the installed TRL release on this machine (see ``trl_members.VERSION_NOTES``)."""
    import importlib.util

    got = installed("trl")
    if got is not None and got.startswith("1.15.") and importlib.util.find_spec("triton") is None:
        return [
            f"TRL {got} computes every log-probability with a Triton-only kernel: without Triton (a CUDA build of "
            "torch brings it) vanilla TRL cannot train on this machine, with or without the plugins; use TRL 1.14 or "
            "1.16 on CPU"
        ]
    return []
