"""The mrl-plugins hook contract (installed as ``mrl_plugins.hookspecs``)."""

from mrl_plugins.hookspecs import spec
from mrl_plugins.hookspecs.spec import ADJUSTMENT_HOOKS, PROJECT_NAME, STAGE_HOOKS, hookimpl, hookspec
from mrl_plugins.hookspecs.types import (
    REGISTRATION_HOOKS,
    STAGES,
    CommCodec,
    CommTransport,
    PublishReport,
    RolloutEngine,
    RolloutResult,
    StageContext,
    SwitchReport,
    WeightTransport,
)

__all__ = [
    "ADJUSTMENT_HOOKS",
    "PROJECT_NAME",
    "REGISTRATION_HOOKS",
    "STAGES",
    "STAGE_HOOKS",
    "CommCodec",
    "CommTransport",
    "PublishReport",
    "RolloutEngine",
    "RolloutResult",
    "StageContext",
    "SwitchReport",
    "WeightTransport",
    "hookimpl",
    "hookspec",
    "spec",
]
