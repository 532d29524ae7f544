"""Directory weight transport: safetensors shard files plus an atomically replaced manifest.

Layout under ``<directory>/<run_id>/<model_id>/``::

    weight_v{N}/shard_{i:05d}.safetensors   one valid safetensors file per shard (see .shards)
    manifest.json                           {"model_id", "version", "uuid", "shard_count", "nbytes",
                                             "files": [[name, size], ...], "writer_pid", "writer_host", "time"}

A version is written into ``.weight_v{N}.tmp-<host>-<pid>``, renamed to ``weight_v{N}`` when complete, and
only then announced by writing ``manifest.json.tmp-<host>-<pid>`` and ``os.replace``-ing it over the
manifest, so a reader sees either the old or the new manifest, never a partial one, and never a
manifest naming an incomplete version. Older versions beyond ``keep_versions`` are deleted after the
new manifest is in place. Works on local disk and shared filesystems (pools that poll).

Disk: the sender removes its model's folder (and the run's folder once empty) at ``close()``: ``run_id`` is new
on every pool start, and a reader of a finished run needs none of it. A starting sender sweeps what writers that died
on this machine and in this pid namespace left under ``directory``: their temp folders and manifests, and the
folders of their runs (entries of other machines or containers are never judged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid as uuidlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mrl_plugins._proc import pid_alive, pid_namespace, wait_until
from mrl_plugins.hookspecs import PublishReport

from .config import WeightSyncConfig
from .shards import Dest, ShardWriter, VersionGoneError, WeightSyncError, check_newer, read_shards

LOG = logging.getLogger("mrl_plugins.weight_sync")

MANIFEST = "manifest.json"
_TMP_RE = re.compile(r"^(\.weight_v\d+|manifest\.json)\.tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)$")


def _safe(s: str) -> str:
    """``s`` as one path component: characters outside [A-Za-z0-9_.] become ``_`` (48 at most)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(s))[:48]


class _FileSink:
    """Each shard is built in a reusable host buffer and written to its own file."""

    def __init__(self, folder: str) -> None:
        self.folder, self.files, self._buf = folder, [], torch.empty(0, dtype=torch.uint8)
        self._cur: tuple[str, int] | None = None

    def reserve(self, n: int) -> tuple[str, torch.Tensor]:
        self.close()
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.uint8)
        name = f"shard_{len(self.files):05d}.safetensors"
        self.files.append(name)
        self._cur = (name, n)
        return name, self._buf[:n]

    def write_header(self, name: str, hb: bytes) -> None:
        if self._cur is not None and self._cur[0] == name:
            self._buf[: len(hb)] = torch.frombuffer(bytearray(hb), dtype=torch.uint8)
            return
        with open(os.path.join(self.folder, name), "r+b") as f:  # patch the final shard count in place
            f.write(hb)

    def close(self) -> None:
        """Write the shard being built to its file."""
        if self._cur is not None:
            name, n = self._cur
            with open(os.path.join(self.folder, name), "wb") as f:
                f.write(memoryview(self._buf[:n].numpy()))
            self._cur = None


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _host() -> str | None:
    """Where this process's pids mean something: the machine's boot and the pid namespace (containers on one
    machine, even with one hostname, have their own), so a sweep never judges another namespace's pid; None where
    that cannot be known (no ``/proc``): then nothing is swept."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:16]
    except OSError:
        return None
    ns = pid_namespace()
    return None if ns is None else f"{boot}.{ns}"


def _sweep_dead(directory: str) -> None:
    """Remove what dead writers of this machine and pid namespace left in ``directory/<run>/<model>/``: temp
    entries, and the model folders whose manifest names a dead writer (a killed trainer's run), then such a run's
    folder once empty. Anything else, other writers' entries and unrelated folders, is left alone; a folder that
    vanishes or cannot be read meanwhile (another sender sweeping, another user's) is skipped."""
    host = _host()
    if host is None:
        return
    try:
        runs = os.listdir(directory)
    except OSError:
        return
    for run in runs:
        run_dir = os.path.join(directory, run)
        try:
            models = [] if run.startswith(".") else os.listdir(run_dir)
        except OSError:  # not a folder, gone, or not ours to read
            continue
        removed = False
        for model in models:
            root = os.path.join(run_dir, model)
            try:
                with open(os.path.join(root, MANIFEST), "rb") as f:
                    m = json.loads(f.read())
                if m.get("writer_host") == host and not pid_alive(int(m.get("writer_pid", 0))):
                    shutil.rmtree(root, ignore_errors=True)
                    removed = True
                    continue
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # no manifest yet, or not one of ours
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for n in names:
                t = _TMP_RE.match(n)
                if t and t["host"] == host and not pid_alive(int(t["pid"])):
                    path = os.path.join(root, n)
                    with contextlib.suppress(OSError):
                        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        if removed:
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)  # the dead writer's run, empty now


class DirectorySender:
    """Publish versions as ``weight_v{N}`` folders of safetensors shards plus ``manifest.json``; removes them at
    ``close()``."""

    def __init__(self, config: WeightSyncConfig, *, model_id: str = "policy", run_id: str = "run", **_: Any) -> None:
        if not config.directory:
            raise WeightSyncError("the 'directory' transport needs weight_sync.directory")
        self.config, self.model_id, self.run_id = config, model_id, run_id
        self.root = os.path.join(config.directory, _safe(run_id), _safe(model_id))
        if os.path.isdir(config.directory):
            _sweep_dead(config.directory)
        os.makedirs(self.root, exist_ok=True)
        self._tmp = f"tmp-{_host() or 'unknown'}-{os.getpid()}"
        self._closed = False
        self.chunk_bytes = config.chunk_for("directory")
        self._latest: int | None = None

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Write all shards of ``version``, rename the folder into place, then replace the manifest."""
        check_newer(self.model_id, version, self._latest)
        t0 = time.perf_counter()
        final = os.path.join(self.root, f"weight_v{version}")
        if self._closed:
            raise WeightSyncError("directory sender is closed")
        tmp = os.path.join(self.root, f".weight_v{version}.{self._tmp}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            sink = _FileSink(tmp)
            uid = uuidlib.uuid4().hex
            writer = ShardWriter(
                sink,
                model_id=self.model_id,
                version=version,
                uuid=uid,
                chunk_bytes=self.chunk_bytes,
                checksums=self.config.verify_checksum,
            )
            for name, t in named_tensors:
                writer.add(name, t)
            writer.flush()
            sink.close()
            count = writer.finish()
            files = [[f, os.path.getsize(os.path.join(tmp, f))] for f in sink.files]  # checksums: in the shards
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        manifest = {
            "model_id": self.model_id,
            "version": version,
            "uuid": uid,
            "shard_count": count,
            "nbytes": writer.nbytes,
            "files": files,
            "writer_pid": os.getpid(),
            "writer_host": _host(),
            "time": time.time(),
        }
        mtmp = os.path.join(self.root, f"{MANIFEST}.{self._tmp}")
        with open(mtmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, os.path.join(self.root, MANIFEST))
        _fsync_dir(self.root)
        self._latest = version
        self._gc(version)
        return PublishReport(self.model_id, version, writer.nbytes, time.perf_counter() - t0, count)

    def _gc(self, newest: int) -> None:
        versions = [int(n[8:]) for n in os.listdir(self.root) if n.startswith("weight_v") and n[8:].isdigit()]
        keep = set(sorted(v for v in versions if v <= newest)[-self.config.keep_versions :])
        for v in versions:
            if v not in keep and v < newest:
                shutil.rmtree(os.path.join(self.root, f"weight_v{v}"), ignore_errors=True)

    def receiver_handle(self) -> DirectoryHandle:
        return DirectoryHandle(
            self.root,
            self.model_id,
            float(self.config.timeout_s),
            self.config.verify_checksum,
            self.config.max_retries,
        )

    def close(self) -> None:
        """Remove this model's folder, and the run's once no other model is left in it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):  # another model of the run is still there
            os.rmdir(os.path.dirname(self.root))


@dataclass(frozen=True)
class DirectoryHandle:
    """Picklable address of a directory transport (a folder path)."""

    root: str
    model_id: str
    timeout_s: float
    verify: bool = True
    max_retries: int = 2

    def attach(self) -> DirectoryReceiver:
        return DirectoryReceiver(self)


class DirectoryReceiver:
    """Reader side of :class:`DirectorySender`."""

    def __init__(self, handle: DirectoryHandle) -> None:
        self.h = handle
        self._buf = torch.empty(0, dtype=torch.uint8)

    def manifest(self) -> dict | None:
        """The current manifest, or ``None`` before the first publish."""
        try:
            with open(os.path.join(self.h.root, MANIFEST), "rb") as f:
                m = json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError as exc:  # cannot happen with os.replace; kept as a clear error
            raise WeightSyncError(f"{self.h.root}/{MANIFEST}: unreadable ({exc})") from None
        if m.get("model_id") != self.h.model_id:
            raise WeightSyncError(f"{self.h.root}/{MANIFEST} is for model_id={m.get('model_id')!r}")
        return m

    def latest_version(self) -> int | None:
        m = self.manifest()
        return None if m is None else int(m["version"])

    def fetch_into(self, version: int, dest: Dest, timeout: float | None = None) -> int:
        """Read, verify and copy ``version``; wait up to ``timeout`` s for its manifest."""
        timeout = self.h.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        seen: list[dict | None] = [None]

        def published() -> dict | None:
            m = seen[0] = self.manifest()
            return m if m is not None and m["version"] >= version else None

        attempts = 0
        while True:
            m = wait_until(
                published,
                deadline,
                lambda: (
                    f"model_id={self.h.model_id}: version {version} not published in {self.h.root} within "
                    f"{timeout:.1f}s (latest {None if seen[0] is None else seen[0]['version']})"
                ),
                sleep=0.01,
            )
            if m["version"] != version:  # newer: this reader came too late for ``version``
                raise VersionGoneError(
                    f"model_id={self.h.model_id}: asked for version {version}, manifest is at {m['version']}"
                )
            try:
                return read_shards(
                    self._blobs(m),
                    dest,
                    model_id=self.h.model_id,
                    version=version,
                    count=int(m["shard_count"]),
                    uuid=m["uuid"],
                    verify=self.h.verify,
                )
            except (WeightSyncError, FileNotFoundError) as exc:
                now = self.manifest()
                if isinstance(exc, FileNotFoundError) and now is not None and now["version"] > version:
                    raise VersionGoneError(
                        f"model_id={self.h.model_id}: version {version} was replaced by {now['version']} and removed "
                        "while it was read"
                    ) from None
                attempts += 1
                if attempts > self.h.max_retries:
                    if isinstance(exc, FileNotFoundError):
                        raise WeightSyncError(
                            f"model_id={self.h.model_id} version {version}: missing shard {exc.filename}"
                        ) from None
                    raise
                # a shared filesystem may show a file before all of it arrived: read again a little later
                LOG.warning(
                    "model_id=%s version %d: read %d of %d failed (%s); retrying",
                    self.h.model_id, version, attempts, self.h.max_retries + 1, exc,
                )  # fmt: skip
                time.sleep(max(0.0, min(0.05 * attempts, deadline - time.monotonic())))

    def _blobs(self, m: dict) -> Iterable[torch.Tensor]:
        folder = os.path.join(self.h.root, f"weight_v{m['version']}")
        for name, size, *_ in m["files"]:  # [name, size] (a crc32c third before: in the shard header too)
            path = os.path.join(folder, name)
            if self._buf.numel() < size:
                self._buf = torch.empty(size, dtype=torch.uint8)
            view = self._buf[:size]
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(view.numpy()))
            if got != size:
                raise WeightSyncError(f"{path}: {got} bytes, manifest says {size}")
            yield view

    def close(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)


__all__ = ["DirectoryHandle", "DirectoryReceiver", "DirectorySender"]
