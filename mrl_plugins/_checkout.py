"""Imports from a source checkout: the ``package-dir`` mapping without an install.

Installed (a wheel, or ``pip install -e .`` with its own finder), ``mrl_plugins.hookspecs`` / ``.adapters`` /
``.configs`` are found by the import system. A process that imports this package straight from a checkout with
a non-editable install beside it (the test suite under tox: the repository root first on ``sys.path``) finds
``mrl_plugins/`` without them; :func:`install` then adds a finder for exactly those three names, mapped to the
checkout's top-level folders as ``pyproject.toml``'s ``package-dir`` maps them. Nothing else at the top level of
the checkout becomes importable as ``mrl_plugins.<name>``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

#: the package-dir mapping of pyproject.toml: subpackage -> top-level folder of the checkout
MAPPED = {"mrl_plugins.hookspecs": "hookspecs", "mrl_plugins.adapters": "adapters", "mrl_plugins.configs": "configs"}


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds the mapped subpackages in the checkout rooted at ``root`` (asked after every other finder)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(where, "__init__.py"), submodule_search_locations=[where]
        )


def install(package_dir: str) -> None:
    """Add the finder when ``package_dir`` (this package, imported from a checkout) lacks the mapped folders."""
    root = os.path.dirname(package_dir)
    if os.path.isdir(os.path.join(package_dir, "hookspecs")):
        return  # an installed copy: the mapped subpackages are inside it
    if not os.path.isfile(os.path.join(root, "hookspecs", "__init__.py")):
        return
    if not any(isinstance(f, CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.append(CheckoutFolders(root))
