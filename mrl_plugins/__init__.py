"""mrl-plugins: accelerator-aware rollout, weight-sync and experience-transfer stages for TRL."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def enable(trainer: Any, config: Any = None) -> Any:
    """Switch the plugins on for an existing TRL ``GRPOTrainer`` or ``RLOOTrainer`` (the one line).

    ``config`` is a YAML path, a dict, or an :class:`mrl_plugins.config.MrlConfig`; ``None`` reads
    ``$MRL_PLUGINS`` (a path) or uses the defaults. Returns the trainer.
    """
    from mrl_plugins.adapters.trl import enable as _enable

    return _enable(trainer, config)


__all__ = ["__version__", "enable"]
