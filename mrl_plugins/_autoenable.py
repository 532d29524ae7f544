"""Start-up activation for ``MRL_PLUGINS`` (loaded by ``mrl_plugins_autoenable.pth`` only when it is set).

Installs an import hook: when TRL's GRPO/RLOO trainer modules are imported, their ``__init__`` is
wrapped to call :func:`mrl_plugins.enable` with ``$MRL_PLUGINS`` after TRL's own initialisation.
Nothing heavy is imported here; TRL itself is not imported until the user's script does.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

TARGETS = {"trl.trainer.grpo_trainer": "GRPOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer"}


def patch_trainer_class(cls: type) -> None:
    """Wrap ``cls.__init__`` so every new trainer is enabled with ``$MRL_PLUGINS`` (idempotent)."""
    if getattr(cls.__init__, "_mrl_wrapped", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is cls and os.environ.get("MRL_PLUGINS"):
            from mrl_plugins.adapters.trl import enable_from_env

            enable_from_env(self)

    __init__._mrl_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader, attr: str) -> None:
        self._wrapped = wrapped
        self._attr = attr

    def create_module(self, spec: Any) -> Any:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._wrapped.exec_module(module)
        patch_trainer_class(getattr(module, self._attr))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, TARGETS[fullname])
                return spec
        return None


def install() -> None:
    """Install the import hook once; patch trainer modules already imported."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, attr in TARGETS.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, attr):
            patch_trainer_class(getattr(module, attr))
