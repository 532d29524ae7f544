"""Configuration of the weight-sync stage (``weight_sync:`` section).

Defaults for chunk and bucket sizes come from measurements on the development machine (2 vCPU
EPYC shared with other jobs, load average 4-6 during the runs, so memcpy ran at 4-6 GB/s instead
of the 12 GB/s of an idle machine; torch 2.13 CPU, one torch thread per process). ``None`` means
"the transport's default":

==========  ============  ============  ===================================================
transport   chunk_bytes   bucket_bytes  measured (median GB/s; see ``python -m benchmarks weights``)
==========  ============  ============  ===================================================
shm         4 MiB         (unused)      publish+load, 177 MB bf16, one process: 1 MiB 2.69,
                                        4 MiB 3.31, 16 MiB 2.74, 64 MiB 2.40 (checksums on)
directory   64 MiB        (unused)      4/16/64 MiB within noise (0.3-0.7 GB/s, disk bound);
                                        64 MiB keeps the file count low
broadcast   4 MiB         16 MiB        988 MB Qwen2.5-0.5B-like list, 2 processes, xxh3
                                        checksums on, x per_param in the same interleaved
                                        runs (3 runs, load average 3-4.5 from other jobs):
                                        bucket 1 MiB x1.04-1.18, 4 MiB x1.26-1.34, 16 MiB
                                        x1.25-1.42, 64 MiB x1.27-1.41 (no checksums: 4 MiB
                                        x1.58-1.73). The bucket is one tagged gloo send/recv;
                                        tensors >= 1 MiB go from their own memory by rows
per_param   (unused)      (unused)      one collective per parameter (baseline)
==========  ============  ============  ===================================================

crc32c (the shard format's checksum, 4.9 GB/s under the load above) is the main cost of ``verify_checksum`` on
the shm path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.config_fields import check_fields, fill_derived, internal, section_from_dict
from mrl_plugins.errors import ConfigError, choices

KNOWN_TRANSPORTS = ("shm", "directory", "broadcast", "per_param", "vllm")
STAGING_CHOICES = ("device", "host")

#: per-transport defaults (see the module docstring)
DEFAULT_CHUNK_BYTES = {"shm": 4 << 20, "directory": 64 << 20, "broadcast": 4 << 20, "per_param": 4 << 20}
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
