"""Start-up activation for ``MRL_PLUGINS`` (loaded by ``mrl_plugins_autoenable.pth`` only when it is set).

Installs an import hook: when TRL's GRPO/RLOO trainer modules are imported, their ``__init__`` is
wrapped to call :func:`mrl_plugins.enable` with ``$MRL_PLUGINS`` after TRL's own initialisation, and so is the
``__init__`` of every subclass a script defines (``class MyTrainer(GRPOTrainer)``): a trainer is enabled once, when
the ``__init__`` of its most derived class that defines one returns. Code that enables trainers itself (``mrl
run``) builds them inside :func:`suppressed`. Nothing heavy is imported here; TRL itself is not imported until the
user's script does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

TARGETS = {"trl.trainer.grpo_trainer": "GRPOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer"}

_suppressed = 0  # > 0 while a caller that enables trainers itself builds one (suppressed())


@contextlib.contextmanager
def suppressed() -> Any:
    """Trainers built inside are not enabled from ``$MRL_PLUGINS`` (their builder decides)."""
    global _suppressed
    _suppressed += 1
    try:
        yield
    finally:
        _suppressed -= 1


def _init_owner(cls: type) -> type:
    """The most derived class of ``cls``'s MRO that defines ``__init__``: its ``__init__`` returns last."""
    return next(c for c in cls.__mro__ if "__init__" in c.__dict__)


def _wrap_init(cls: type) -> None:
    """Wrap ``cls.__init__``, when ``cls`` defines one, to enable the trainer with ``$MRL_PLUGINS`` once the
    ``__init__`` of the trainer's own class returns (idempotent)."""
    own = cls.__dict__.get("__init__")
    if own is None or getattr(own, "_mrl_wrapped", False):
        return

    @functools.wraps(own)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        own(self, *args, **kwargs)
        if _init_owner(type(self)) is cls and not _suppressed and os.environ.get("MRL_PLUGINS"):
            from mrl_plugins.adapters.trl import enable_from_env

            enable_from_env(self)

    __init__._mrl_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def patch_trainer_class(cls: type) -> None:
    """Wrap the ``__init__`` of a TRL trainer class and of its subclasses, those defined already and those defined
    later (``__init_subclass__``), so every new trainer is enabled with ``$MRL_PLUGINS`` (idempotent)."""
    _wrap_init(cls)
    if "_mrl_subclasses_patched" in cls.__dict__:
        return
    previous = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__get__(None, sub)(**kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)  # type: ignore[misc]
        _wrap_init(sub)

    cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    cls._mrl_subclasses_patched = True  # type: ignore[attr-defined]
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        _wrap_init(sub)
        stack += sub.__subclasses__()


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
