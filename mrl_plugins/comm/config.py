"""Configuration of the experience-communication stage (``comm:`` section of the run config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.errors import ConfigError, choices

CODECS: tuple[str, ...] = ("auto", "raw", "fp16", "bf16")
CHECKSUMS: tuple[str, ...] = ("xxh3", "crc32c", "none")


@dataclass
class CommConfig:
    """How experience batches move from rollout processes to the trainer.

    Sizing of the shared-memory ring: every producer owns ``ring_slots`` slots of ``slot_bytes``
    bytes (segment size ``n_producers * ring_slots * slot_bytes`` plus a few KiB of headers), all
    allocated and pre-faulted once when the consumer is created. A frame larger than
    ``slot_bytes`` is refused with an error naming the frame size; a GRPO batch of 64 sequences x
    (256 prompt + 1024 completion) tokens is 1.6 MB uncompressed, 0.6 MB with ``fp16``.
    """

    transport: str = field(
        default="shm",
        metadata={"help": "experience transport: 'shm' (one host), 'queue' (pickle baseline), 'torch_distributed'"},
    )
    codec: str = field(
        default="auto",
        metadata={
            "help": "frame codec: 'auto' ('raw' on the shm and queue transports, 'fp16' on network transports such "
            "as torch_distributed), 'raw' (lossless, fastest on shared memory), 'fp16' or 'bf16' (floats cast, "
            "ints narrowed when the values fit, bools bit-packed; fp16 guards overflow by sending such fields "
            "as they are; see mrl_plugins.comm.codec for error bounds)"
        },
    )
    lossless_fields: list[str] = field(
        default_factory=list,
        metadata={"help": "field names never sent in a lossy dtype (ints/bools stay lossless anyway)"},
    )
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "torch_distributed: address the trainer's receiving end listens on and hands to producers "
            "(this host's IP reachable from remote rollout workers)"
        },
    )
    ring_slots: int = field(default=4, metadata={"help": "frames in flight per producer in the shm ring (>= 1)"})
    slot_bytes: int = field(
        default=8 << 20, metadata={"help": "bytes per ring slot = largest frame accepted (>= 4096)"}
    )
    send_timeout_s: float = field(default=60.0, metadata={"help": "longest a send waits for ring space (s)"})
    receive_timeout_s: float = field(default=60.0, metadata={"help": "longest a receive waits for a frame (s)"})
    heartbeat_interval_s: float = field(default=0.25, metadata={"help": "how often each end stamps its heartbeat"})
    heartbeat_timeout_s: float = field(
        default=5.0, metadata={"help": "a peer whose heartbeat is older than this is reported dead (PeerDeadError)"}
    )
    start_timeout_s: float = field(
        default=60.0,
        metadata={"help": "how long a peer that has not stamped its first heartbeat yet counts as starting, not dead"},
    )
    checksum: str = field(
        default="xxh3",
        metadata={"help": "payload checksum: 'xxh3' (low 32 bits of xxh3-64, fastest), 'crc32c' or 'none'"},
    )

    def validate(self) -> CommConfig:
        """Check every field; raise :class:`ConfigError` naming the key and the valid values."""
        if not isinstance(self.transport, str) or not self.transport:
            raise ConfigError(f"comm.transport must be a non-empty string, got {self.transport!r}")
        if not isinstance(self.codec, str) or not self.codec:
            # names are checked against the registered codecs by the plugin manager (plugins may add codecs)
            raise ConfigError(
                f"comm.codec must be a non-empty string (built in: {choices(CODECS)}), got {self.codec!r}"
            )
        if not isinstance(self.lossless_fields, (list, tuple)) or not all(
            isinstance(f, str) and f for f in self.lossless_fields
        ):
            raise ConfigError(f"comm.lossless_fields must be a list of field names, got {self.lossless_fields!r}")
        for key, lo in (("ring_slots", 1), ("slot_bytes", 4096)):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ConfigError(f"comm.{key} must be an integer >= {lo}, got {val!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"comm.host must be a host name or IP address, got {self.host!r}")
        for key in (
            "send_timeout_s",
            "receive_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "start_timeout_s",
        ):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
                raise ConfigError(f"comm.{key} must be a number > 0, got {val!r}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"comm.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                f"comm.heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"comm.checksum: unknown checksum {self.checksum!r}; valid: {choices(CHECKSUMS)}")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CommConfig:
        """Build and validate from a mapping; unknown keys raise :class:`ConfigError` listing the valid keys."""
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise ConfigError(f"comm: unknown key {key!r}; valid keys: {choices(names)}")
        if "lossless_fields" in d and isinstance(d["lossless_fields"], tuple):
            d["lossless_fields"] = list(d["lossless_fields"])
        return cls(**d).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (picklable, YAML-friendly)."""
        return dataclasses.asdict(self)
