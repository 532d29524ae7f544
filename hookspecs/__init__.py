"""The mrl-plugins hook contract (installed as ``mrl_plugins.hookspecs``).

:mod:`~mrl_plugins.hookspecs.spec` -- the hooks; :mod:`~mrl_plugins.hookspecs.channels` -- the typed ends the
stage hooks return (sender, receiver, producer, consumer, runtime) and their capabilities;
:mod:`~mrl_plugins.hookspecs.types` -- registrations, results and the per-run context.
"""

from mrl_plugins.hookspecs import channels, spec
from mrl_plugins.hookspecs.channels import (
    Capabilities,
    Experience,
    ExperienceConsumer,
    ExperienceProducer,
    RolloutHost,
    RolloutRuntime,
    RolloutSetup,
    WeightReceiver,
    WeightSender,
)
from mrl_plugins.hookspecs.spec import PROJECT_NAME, STAGE_HOOKS, hookimpl, hookspec
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
    "PROJECT_NAME",
    "REGISTRATION_HOOKS",
    "STAGES",
    "STAGE_HOOKS",
    "Capabilities",
    "CommCodec",
    "CommTransport",
    "Experience",
    "ExperienceConsumer",
    "ExperienceProducer",
    "PublishReport",
    "RolloutEngine",
    "RolloutHost",
    "RolloutResult",
    "RolloutRuntime",
    "RolloutSetup",
    "StageContext",
    "SwitchReport",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
    "channels",
    "hookimpl",
    "hookspec",
    "spec",
]
