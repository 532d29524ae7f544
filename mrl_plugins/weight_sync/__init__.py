"""Weight-sync stage: versioned sharded safetensors, transports, double-buffered receiver, sources.

Heavy optional libraries (deepspeed, peft) are imported lazily.
"""

from .broadcast import BroadcastSender, PerParamSender
from .config import WeightSyncConfig
from .directory import DirectorySender
from .receiver import DoubleBufferedReceiver, PollInterval
from .shards import VersionGoneError, WeightSyncError
from .shm import ShmSender
from .sources import iter_trainer_weights

__all__ = [
    "BroadcastSender",
    "DirectorySender",
    "DoubleBufferedReceiver",
    "PerParamSender",
    "PollInterval",
    "ShmSender",
    "VersionGoneError",
    "WeightSyncConfig",
    "WeightSyncError",
    "iter_trainer_weights",
]
