"""The mrl-plugins hook contract (installed as ``mrl_plugins.hookspecs``).

:mod:`~mrl_plugins.hookspecs.spec` -- the hooks; :mod:`~mrl_plugins.hookspecs.channels` -- the stages and the
typed ends they open (sender, receiver, producer, consumer, runtime) and their capabilities;
:mod:`~mrl_plugins.hookspecs.types` -- registrations, results and the per-run context.
"""

from mrl_plugins.hookspecs import channels, spec
from mrl_plugins.hookspecs.channels import (
    STAGE_PROTOCOLS,
    Capabilities,
    CommStage,
    Experience,
    ExperienceConsumer,
    ExperienceProducer,
    RolloutHost,
    RolloutRuntime,
    RolloutSetup,
    RolloutStage,
    WeightReceiver,
    WeightSender,
    WeightSyncStage,
)
from mrl_plugins.hookspecs.spec import PROJECT_NAME, hookimpl, hookspec
from mrl_plugins.hookspecs.types import (
    REGISTRATION_HOOKS,
    STAGE_HOOKS,
    STAGES,
    CommCodec,
    CommTransport,
    PublishReport,
    RolloutEngine,
    RolloutResult,
    StageContext,
    StagePlugin,
    SwitchReport,
    WeightTransport,
)

__all__ = [
    "PROJECT_NAME",
    "REGISTRATION_HOOKS",
    "STAGES",
    "STAGE_HOOKS",
    "STAGE_PROTOCOLS",
    "Capabilities",
    "CommCodec",
    "CommStage",
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
    "RolloutStage",
    "StageContext",
    "StagePlugin",
    "SwitchReport",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncStage",
    "WeightTransport",
    "channels",
    "hookimpl",
    "hookspec",
    "spec",
]
