"""Availability probes and environment facts, without importing torch_npu at module import.

torch_npu is special: since torch 2.5 it registers a ``torch.backends`` entry point
(``torch_npu = torch_npu:_autoload``), so once it is installed ``import torch`` imports it too; without the
CANN toolkit (``set_env.sh`` not sourced) that makes ``import torch`` itself fail. This module therefore

* finds torch_npu with :func:`importlib.util.find_spec` (no import),
* imports it only inside a function, in ``try/except``, when a caller asks whether it is usable,
* reads versions through :mod:`importlib.metadata` (no import),
* detects the CANN toolkit from ``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` and the default install paths.

Nothing here is cached at module level; every call probes afresh (imports already done are cheap because
they sit in ``sys.modules``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: The torch_npu functions that limit cube/vector cores (Ascend Extension for PyTorch 7.2.0, i.e. torch_npu
#: 2.6.0.post3 / 2.7.1 and later; defined in ``torch_npu/npu/npu_config.py``, exported as ``torch_npu.npu.*``
#: and, once torch_npu is imported, as ``torch.npu.*``).
CORE_LIMIT_APIS: tuple[str, ...] = (
    "set_device_limit",
    "get_device_limit",
    "set_stream_limit",
    "reset_stream_limit",
    "get_stream_limit",
)

#: Default CANN toolkit locations (``set_env.sh`` of ascend-toolkit / cann packages points here).
DEFAULT_CANN_HOMES: tuple[str, ...] = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
    "/usr/local/Ascend/latest",
)

CANN_ENV_VARS: tuple[str, ...] = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
#: torch_npu installed without a CANN toolkit: what is missing and the fix (:func:`npu_status`, ``mrl doctor``)
NO_CANN = f"no CANN toolkit was found ({' / '.join(CANN_ENV_VARS)} unset, no {DEFAULT_CANN_HOMES[0]})"
CANN_FIX = (
    "source the CANN toolkit's set_env.sh before starting Python (e.g. `source "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh`, which sets ASCEND_TOOLKIT_HOME), or, on a machine without NPUs, "
    "`pip uninstall torch_npu` (TORCH_DEVICE_BACKEND_AUTOLOAD=0 also stops torch from loading it)"
)
#: the torch_npu releases that have :data:`CORE_LIMIT_APIS` (what the messages about their absence name)
CORE_LIMIT_RELEASES = "torch_npu >= 2.6.0.post3 / 2.7.1"


# The seams: the only places that touch the real torch_npu (tests replace them with monkeypatch).


def _torch_npu_spec() -> Any:
    """``importlib.util.find_spec('torch_npu')`` without importing it (``None`` when not installed)."""
    try:
        return importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        return None


def _import_torch_npu() -> ModuleType:
    """Import torch and torch_npu (torch_npu attaches ``torch.npu``). Raises whatever the import raises."""
    import torch  # noqa: F401  (torch_npu needs torch first)

    return importlib.import_module("torch_npu")


def _dist_version(name: str) -> str | None:
    """Installed version of distribution ``name`` from its metadata, without importing it."""
    import importlib.metadata  # lazily: it costs ~25 ms at import

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class NpuStatus:
    """What a probe of torch_npu found.

    ``installed``: the module can be found; ``usable``: it imported and reports at least one NPU;
    ``reason``: why it is not usable (``None`` when usable or not installed); ``device_count``: NPUs visible.
    """

    installed: bool
    usable: bool
    reason: str | None
    device_count: int


def torch_npu_installed() -> bool:
    """True when a ``torch_npu`` module can be found (it is not imported)."""
    return _torch_npu_spec() is not None


def npu_status() -> NpuStatus:
    """Probe torch_npu: find it, import it in ``try/except``, ask it for devices. Never raises."""
    if _torch_npu_spec() is None:
        return NpuStatus(installed=False, usable=False, reason=None, device_count=0)
    hint = "" if cann_home() else f" Likely cause: {NO_CANN}; {CANN_FIX}."
    try:
        mod = _import_torch_npu()
    except Exception as exc:  # any failure of a native extension import: ImportError, OSError, RuntimeError ...
        return NpuStatus(True, False, f"import torch_npu failed: {type(exc).__name__}: {exc}.{hint}", 0)
    npu = getattr(mod, "npu", None)
    if npu is None:
        return NpuStatus(True, False, "torch_npu has no 'npu' namespace (unsupported torch_npu build)", 0)
    try:
        count = int(npu.device_count()) if npu.is_available() else 0
    except Exception as exc:
        return NpuStatus(True, False, f"torch_npu.npu.is_available() failed: {type(exc).__name__}: {exc}.{hint}", 0)
    if count <= 0:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        extra = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return NpuStatus(True, False, f"torch_npu imported but reports no NPU{extra}.{hint}", 0)
    return NpuStatus(True, True, None, count)


def is_torch_npu_available() -> bool:
    """True when torch_npu is installed, imports cleanly and sees at least one NPU.

    Probed with :func:`importlib.util.find_spec` first; torch_npu is imported only when it is installed,
    inside ``try/except`` (a broken install answers ``False``, never raises).
    """
    return npu_status().usable


def core_limit_apis() -> dict[str, bool]:
    """Which torch_npu core-limit functions exist (``torch_npu.npu.<name>``). All False without torch_npu.

    torch_npu is imported only if installed and only when a CANN toolkit is present (an import without CANN
    can fail in ways that leave the process unusable).
    """
    npu = None
    if _torch_npu_spec() is not None and ("torch_npu" in sys.modules or cann_home() is not None):
        try:
            npu = getattr(_import_torch_npu(), "npu", None)
        except Exception:
            pass
    return {name: callable(getattr(npu, name, None)) for name in CORE_LIMIT_APIS}  # all False without npu


def is_cuda_available() -> bool:
    """``torch.cuda.is_available()`` (torch imported lazily; False when torch cannot be imported)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without CUDA)."""
    if not is_cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())


def cann_home(env: Mapping[str, str] | None = None) -> str | None:
    """The CANN toolkit folder: ``ASCEND_TOOLKIT_HOME`` or ``ASCEND_HOME_PATH`` if it exists, else the first of
    :data:`DEFAULT_CANN_HOMES` that exists."""
    env = os.environ if env is None else env
    for var in CANN_ENV_VARS:
        path = env.get(var)
        if path and os.path.isdir(path):
            return path
    for path in DEFAULT_CANN_HOMES:
        if os.path.isdir(path):
            return path
    return None


_INSTALL_INFO = re.compile(r"^ascend_.*_install\.info$")
_VERSION_LINE = re.compile(r"^\s*(?:version|Version)\s*=\s*(\S+)")


def cann_version(env: Mapping[str, str] | None = None) -> str | None:
    """CANN version from the toolkit's ``ascend_*_install.info`` (``version=8.0.RC3``) or ``version.info`` files.

    Looks in :func:`cann_home` and at most three folder levels below it (bounded, cheap). ``None`` when no
    toolkit or no version file is found.
    """
    home = cann_home(env)
    if home is None:
        return None
    root = os.path.realpath(home)
    base_depth = root.rstrip(os.sep).count(os.sep)
    candidates: list[str] = []
    visited = 0
    for dirpath, dirnames, filenames in os.walk(root):
        visited += 1
        if dirpath.rstrip(os.sep).count(os.sep) - base_depth >= 3 or visited > 2000:
            dirnames[:] = []
        for name in sorted(filenames):
            if _INSTALL_INFO.match(name) or name == "version.info":
                candidates.append(os.path.join(dirpath, name))
    # install.info files first (what torch_npu's collect_env reads), then version.info files, shallowest first.
    candidates.sort(key=lambda p: (not _INSTALL_INFO.match(os.path.basename(p)), p.count(os.sep), p))
    for path in candidates:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    m = _VERSION_LINE.match(line)
                    if m:
                        return m.group(1)
        except OSError:
            continue
    return None


def torch_npu_without_cann(env: Mapping[str, str] | None = None) -> bool:
    """True when the torch_npu distribution is installed but no CANN toolkit is found.

    That is the hazard that makes ``import torch`` fail (torch autoloads torch_npu through its
    ``torch.backends`` entry point). Decided without importing torch or torch_npu.
    """
    installed = _dist_version("torch_npu") is not None or _torch_npu_spec() is not None
    return installed and cann_home(env) is None


def versions(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Versions for ``mrl doctor``: python, torch, torch_npu, CANN, CUDA (``None`` where absent).

    torch and torch_npu versions come from package metadata (no import). The CUDA version needs
    ``torch.version.cuda``; torch is imported for it only when that is safe (not in the torch_npu-without-CANN
    case, where the import itself would fail).
    """
    cuda: str | None = None
    torch_mod = sys.modules.get("torch")
    if torch_mod is None and not torch_npu_without_cann(env):
        try:
            import torch as torch_mod  # noqa: PLC0415
        except Exception:
            torch_mod = None
    if torch_mod is not None:
        cuda = getattr(getattr(torch_mod, "version", None), "cuda", None)
    return {
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "torch": _dist_version("torch"),
        "torch_npu": _dist_version("torch_npu") or _dist_version("torch-npu"),
        "cann": cann_version(env),
        "cuda": cuda,
    }
