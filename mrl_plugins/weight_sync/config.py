"""Configuration of the weight-sync stage (``weight_sync:`` section).

Chunk and bucket sizes left at ``None`` are the transport's default (:data:`DEFAULT_CHUNK_BYTES`,
:data:`DEFAULT_BUCKET_BYTES`), chosen from the measurements in docs/architecture.md ("Weight transports").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.config_fields import check_fields, fill_derived, internal, section_from_dict
from mrl_plugins.errors import ConfigError, choices

KNOWN_TRANSPORTS = ("shm", "directory", "broadcast", "per_param", "vllm")
STAGING_CHOICES = ("device", "host")

#: per-transport defaults (measured: see the module docstring); per_param and vllm read no chunk or bucket size
DEFAULT_CHUNK_BYTES = {"shm": 4 << 20, "directory": 64 << 20, "broadcast": 4 << 20}
DEFAULT_BUCKET_BYTES = {"broadcast": 16 << 20}


@dataclass
class WeightSyncConfig:
    """How trainer weights reach the inference copy."""

    transport: str = field(
        default="auto",
        metadata={
            "help": "weight transport: 'auto' ('shm' for workers on this host; with rollout.remote_workers "
            "'directory' when weight_sync.directory is set, else 'broadcast'), 'shm', 'directory', 'broadcast', "
            "'per_param', 'vllm' (into rollout.engine 'vllm' through vLLM's weight-transfer protocol) or a "
            "plugin's (the manager checks the name against registered transports)"
        },
    )
    chunk_bytes: int | None = internal(
        "each transport's measured chunk (DEFAULT_CHUNK_BYTES) is the unit of checksum and retry", default=None, ge=64
    )
    bucket_bytes: int | None = internal(
        "broadcast sends 16 MiB messages (DEFAULT_BUCKET_BYTES, measured)", default=None, ge=64
    )
    staging: str = field(
        default="device",
        metadata={
            "help": "where the staging copy lives: 'device' (2x weights on device, O(#params) pointer "
            "switch) or 'host' (1x on device + 1x host, switch copies host->device)",
            "choices": STAGING_CHOICES,
        },
    )
    poll_interval_s: float | None = internal(
        "an idle worker polls at 3/8 of the measured interval between versions (every publish also sends a "
        "notice, and every request names the version it needs)",
        default=None,
        gt=0,
    )
    vllm_backend: str = internal(
        "vLLM's weight-transfer backend follows from the device: nccl on CUDA, hccl on Ascend, mrl_gloo on CPU",
        default="auto",
    )
    timeout_s: float | None = internal(
        "the top-level timeout_s bounds every wait of a transfer (derived)", default=None, gt=0
    )
    directory: str | None = field(
        default=None,
        metadata={
            "help": "root folder of the 'directory' transport (local disk or shared filesystem); only that transport "
            "reads it"
        },
    )
    max_retries: int = internal(
        "a version is read again twice after a checksum or missing-shard error", default=2, ge=0
    )
    verify_checksum: bool | None = internal(
        "the top-level checksums switches weights' checksums (derived)", default=None
    )
    keep_versions: int = internal("the directory transport keeps the last 2 versions on disk", default=2, ge=1)

    def __post_init__(self) -> None:
        """Standalone values of the derived fields not given (a loaded config derives them: mrl_plugins.config)."""
        fill_derived(self, {"timeout_s": 120.0, "verify_checksum": True})

    def validate(self) -> WeightSyncConfig:
        """The fields' types, choices and bounds (their metadata), then the rules between fields."""
        check_fields(self, "weight_sync")
        if not self.transport:
            raise ConfigError(f"weight_sync.transport must be a non-empty string, e.g. {choices(KNOWN_TRANSPORTS)}")
        if not self.vllm_backend:
            raise ConfigError(
                f"weight_sync.vllm_backend must be 'auto' or a vLLM weight-transfer backend name, got "
                f"{self.vllm_backend!r}"
            )
        if self.vllm_backend != "auto" and self.transport != "vllm":
            raise ConfigError(
                f"weight_sync.vllm_backend {self.vllm_backend!r} is read by weight_sync.transport 'vllm' only "
                f"(transport is {self.transport!r}); remove it or set transport: vllm"
            )
        if self.directory == "":
            raise ConfigError("weight_sync.directory must be a non-empty path or null, got ''")
        if self.transport == "directory" and self.directory is None:
            raise ConfigError("weight_sync.directory must be set when weight_sync.transport is 'directory'")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> WeightSyncConfig:
        """Build and validate from a mapping (:func:`mrl_plugins.config_fields.section_from_dict`, the one parser)."""
        return section_from_dict(cls, d, "weight_sync")

    def chunk_for(self, transport: str) -> int:
        """Effective chunk size for ``transport`` (a plugin's transport without a measured default: 4 MiB)."""
        return self.chunk_bytes if self.chunk_bytes is not None else DEFAULT_CHUNK_BYTES.get(transport, 4 << 20)

    def bucket_for(self, transport: str) -> int:
        """Effective bucket size for ``transport`` (a plugin's transport without a measured default: 64 MiB)."""
        return self.bucket_bytes if self.bucket_bytes is not None else DEFAULT_BUCKET_BYTES.get(transport, 64 << 20)


__all__ = ["KNOWN_TRANSPORTS", "STAGING_CHOICES", "WeightSyncConfig"]
