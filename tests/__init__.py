"""Test package of mrl-plugins (a package so tests can share ``tests.marks`` and ``tests.fakes``).

pytest puts the repository root on ``sys.path`` to import this package. The repository's
``mrl_plugins/`` folder is not the whole package: ``mrl_plugins.hookspecs``, ``.adapters`` and
``.configs`` live in the top-level ``hookspecs/``, ``adapters/`` and ``configs/`` folders and are
mapped in by the installation (``package-dir``). So ``mrl_plugins`` is imported here with the root
left out of ``sys.path``: the installed package (a wheel under tox, the editable mapping in
development) wins, and every test runs against what a user installs.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _import_installed_package() -> None:
    if "mrl_plugins" in sys.modules:
        return
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        import mrl_plugins  # noqa: F401
    except ImportError:
        pass  # not installed: the later import falls back to the source tree
    finally:
        sys.path[:] = saved


_import_installed_package()
