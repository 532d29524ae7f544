"""Experience communication stage: frames, codecs, transports (shm ring, queue, torch.distributed).
See :mod:`mrl_plugins.comm.plugin` for the hook implementations."""

from __future__ import annotations

from .base import ChannelClosedError, PeerDeadError, Received
from .codec import Codec
from .config import CommConfig
from .frame import FrameError, FramePlan, decode_frame, encode_frame

__all__ = [
    "ChannelClosedError",
    "Codec",
    "CommConfig",
    "FrameError",
    "FramePlan",
    "PeerDeadError",
    "Received",
    "decode_frame",
    "encode_frame",
]
