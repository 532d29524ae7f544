"""mrl-plugins: accelerator-aware rollout, weight-sync and experience-transfer stages for TRL."""

from __future__ import annotations

import os
from typing import Any

from mrl_plugins import _checkout

__version__ = "0.1.0"

# ``mrl_plugins.hookspecs`` / ``.adapters`` / ``.configs`` when imported straight from a source checkout (the
# ``package-dir`` mapping without an install): exactly those three, see ``_checkout``
_checkout.install(os.path.dirname(os.path.abspath(__file__)))


def enable(trainer: Any, config: Any = None) -> Any:
    """Switch the plugins on for an existing TRL ``GRPOTrainer`` or ``RLOOTrainer`` (the one line).

    ``config`` is a YAML path, a dict, or an :class:`mrl_plugins.config.MrlConfig`; ``None`` reads
    ``$MRL_PLUGINS`` (a path) or uses the defaults. Returns the trainer.
    """
    from mrl_plugins.adapters.trl import enable as _enable

    return _enable(trainer, config)


def disable(trainer: Any) -> None:
    """Switch the plugins off for ``trainer``: its rollout workers and shared memory are released now and TRL's
    own methods put back (``train()`` releases them at its end anyway, as do garbage collection and exit)."""
    from mrl_plugins.adapters.trl import disable as _disable

    _disable(trainer)


__all__ = ["__version__", "disable", "enable"]
