"""Configuration of the experience-communication stage (``comm:`` section of the run config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.config_fields import check_fields, fill_derived, internal, section_from_dict
from mrl_plugins.errors import ConfigError, choices

#: experience transports between processes of one host (a heartbeat older than 5 s there means a hung process)
LOCAL_COMM_TRANSPORTS = ("shm", "queue")

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
        default="auto",
        metadata={
            "help": "experience transport: 'auto' ('shm' for workers on this host, 'torch_distributed' with "
            "rollout.remote_workers), 'shm' (one host), 'queue' (pickle baseline), 'torch_distributed'"
        },
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
    lossless_fields: list[str] = internal(
        "every frame carries the same fields; comm.codec: raw sends them all bit-exact", default_factory=list
    )
    host: str | None = internal(
        "experience listens on the host of rollout.rendezvous, the address remote workers reach (derived)",
        default=None,
    )
    ring_slots: int = internal("a producer has 4 frames in flight (its 2 requests and their answers)", default=4, ge=1)
    slot_bytes: int = field(
        default=8 << 20, metadata={"help": "bytes per ring slot = largest frame accepted", "ge": 4096}
    )
    send_timeout_s: float | None = internal("the top-level timeout_s bounds a send (derived)", default=None, gt=0)
    receive_timeout_s: float | None = internal(
        "the top-level timeout_s bounds a receive (derived)", default=None, gt=0
    )
    heartbeat_interval_s: float = internal("each end stamps its heartbeat every 0.25 s", default=0.25, gt=0)
    heartbeat_timeout_s: float | None = internal(
        "a peer is dead after min(timeout_s, 5 s) without a heartbeat on one host, timeout_s across hosts (derived)",
        default=None,
        gt=0,
    )
    start_timeout_s: float = internal("a peer that never beat counts as starting for 60 s", default=60.0, gt=0)
    checksum: str | None = internal(
        "the top-level checksums switches experience checksums (xxh3, the fastest; derived)",
        default=None,
        choices=CHECKSUMS,
    )

    def __post_init__(self) -> None:
        """Standalone values of the derived fields not given (a loaded config derives them: mrl_plugins.config)."""
        fill_derived(self, {"host": "127.0.0.1", "send_timeout_s": 120.0, "receive_timeout_s": 120.0,
                            "heartbeat_timeout_s": 5.0, "checksum": "xxh3"})  # fmt: skip

    def validate(self) -> CommConfig:
        """The fields' types, choices and bounds (their metadata), then the rules between fields."""
        check_fields(self, "comm")
        if not self.transport:
            raise ConfigError(f"comm.transport must be a non-empty string, got {self.transport!r}")
        if not self.codec:
            # names are checked against the registered codecs by the plugin manager (plugins may add codecs)
            raise ConfigError(
                f"comm.codec must be a non-empty string (built in: {choices(CODECS)}), got {self.codec!r}"
            )
        if not all(self.lossless_fields):
            raise ConfigError(f"comm.lossless_fields must be a list of field names, got {self.lossless_fields!r}")
        if self.host == "":
            raise ConfigError("comm.host must be a host name or IP address, got ''")
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"comm.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                f"comm.heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CommConfig:
        """Build and validate from a mapping (:func:`mrl_plugins.config_fields.section_from_dict`, the one parser)."""
        return section_from_dict(cls, d, "comm")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (picklable, YAML-friendly)."""
        return dataclasses.asdict(self)
