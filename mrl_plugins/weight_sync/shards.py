"""Versioned weight shards in safetensors format.

A published version is a stream of *shards*. Each shard is a complete, valid safetensors file:

* an 8-byte little-endian header length, a JSON header padded with spaces so that the data region
  starts on a 64-byte boundary, then the data region;
* every tensor entry starts on a 64-byte boundary; gaps are explicit ``__pad_<i>__`` ``U8`` entries
  (safetensors rejects holes between entries);
* ``__metadata__`` holds ``uuid, model_id, version, shard_index, shard_count, checksum`` (crc32c of
  the data region, 8 hex digits). Numbers are zero padded to a fixed width so that a header can be
  rendered before the checksum and the shard count are known and patched in place afterwards
  without moving the data. Shards always use crc32c; :func:`checksum` also offers xxh3-64, which
  the ``broadcast`` transport uses (and names in its control messages).

A tensor larger than a chunk is split by rows (dim 0) into chunks of at most ``chunk_bytes``; each
row chunk is the single entry of its own shard, keyed ``"<name>#rows=<r0>-<r1>/<rows>"``. Smaller
tensors are grouped into shards of up to ``chunk_bytes``. The chunk is therefore the unit of
checksum and of retry.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch
import xxhash

from mrl_plugins.errors import MrlError, choices

ALIGN = 64
ROWS_TAG = "#rows="
PAD_PREFIX = "__pad_"
#: checksum algorithms of :func:`checksum` (``crc32c``: the shard format's; ``xxh3``: xxh3-64)
CHECKSUM_ALGOS = ("crc32c", "xxh3")

#: torch dtype <-> safetensors dtype string
DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _st
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}

#: a destination: a mapping name -> tensor to copy into
Dest = Mapping[str, torch.Tensor]


class WeightSyncError(MrlError):
    """A weight version could not be published or received whole (bad shard, missing tensor, ...)."""


class VersionGoneError(WeightSyncError):
    """The asked-for version was replaced by a newer one before it could be read (a slow reader)."""


def check_newer(model_id: str, version: int, latest: int | None) -> None:
    """Raise :class:`WeightSyncError` unless ``version`` is newer than the ``latest`` published one."""
    if latest is not None and version <= latest:
        raise WeightSyncError(f"model_id={model_id}: version {version} is not newer than the published {latest}")


def align(n: int, a: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (0-d and bool included)."""
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(torch.uint8)


def checksum(buf: torch.Tensor, algo: str = "crc32c") -> int:
    """``algo`` (crc32c, 32 bits, or xxh3: xxh3-64, 64 bits) of a contiguous CPU ``uint8`` tensor."""
    if buf.numel() == 0:
        return 0
    if algo == "crc32c":
        return crc32c.crc32c(memoryview(buf.numpy()))
    if algo == "xxh3":
        return xxhash.xxh3_64_intdigest(memoryview(buf.numpy()))
    raise WeightSyncError(f"unknown checksum algorithm {algo!r}; valid: {choices(CHECKSUM_ALGOS)}")


def chunk_checksums(buf: torch.Tensor, chunk_bytes: int, algo: str) -> list[int]:
    """:func:`checksum` of every ``chunk_bytes`` slice of a flat ``uint8`` tensor (one per chunk, in order)."""
    return [checksum(buf[i : i + chunk_bytes], algo) for i in range(0, buf.numel(), chunk_bytes)]


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; a clear error for an unsupported one."""
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise WeightSyncError(
            f"dtype {dtype} cannot be published; supported: {', '.join(str(d) for d in DTYPE_TO_ST)}"
        ) from None


def row_split(rows: int, row_bytes: int, limit: int) -> list[tuple[int, int]]:
    """Row ranges of about equal size, each at most ``limit`` bytes (at least one row)."""
    per = max(1, limit // max(1, row_bytes))
    per = -(-rows // -(-rows // per))  # as many pieces, of about equal rows
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


@dataclass
class Entry:
    """One tensor (or row chunk of one) inside a shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # shape of this entry (the chunk)
    offset: int  # from the start of the data region
    nbytes: int
    row0: int = 0
    rows_total: int | None = None  # set when the entry is a row chunk of a larger tensor

    @property
    def key(self) -> str:
        if self.rows_total is None:
            return self.name
        return f"{self.name}{ROWS_TAG}{self.row0}-{self.row0 + self.shape[0]}/{self.rows_total}"


@dataclass
class ShardMeta:
    """The identity of a shard, kept in its ``__metadata__``."""

    uuid: str
    model_id: str
    version: int
    shard_index: int
    shard_count: int = 0
    checksum: int = 0

    def render(self) -> dict[str, str]:
        return {
            "uuid": self.uuid,
            "model_id": self.model_id,
            "version": f"{self.version:020d}",
            "shard_index": f"{self.shard_index:010d}",
            "shard_count": f"{self.shard_count:010d}",
            "checksum": f"{self.checksum:08x}",
        }


def layout(items: Iterable[tuple[str, torch.Tensor, int, int | None]]) -> tuple[list[Entry], int]:
    """Place ``(name, tensor, row0, rows_total)`` items one after another, 64-byte aligned."""
    entries, off = [], 0
    for name, t, row0, rows_total in items:
        entries.append(Entry(name, t.dtype, tuple(t.shape), off, t.nbytes, row0, rows_total))
        off = align(off + t.nbytes)
    return entries, off


def render_header(entries: list[Entry], meta: ShardMeta, data_len: int) -> bytes:
    """The 8-byte length + JSON header of a shard (padded so that the data starts 64-aligned)."""
    hdr: dict[str, Any] = {"__metadata__": meta.render()}
    pos, pad_i = 0, 0
    for e in entries:
        if e.offset > pos:
            hdr[f"{PAD_PREFIX}{pad_i}__"] = {"dtype": "U8", "shape": [e.offset - pos], "data_offsets": [pos, e.offset]}
            pad_i += 1
        hdr[e.key] = {
            "dtype": st_dtype(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
        pos = e.offset + e.nbytes
    if data_len > pos:
        hdr[f"{PAD_PREFIX}{pad_i}__"] = {"dtype": "U8", "shape": [data_len - pos], "data_offsets": [pos, data_len]}
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    total = align(8 + len(raw))
    raw = raw + b" " * (total - 8 - len(raw))
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class ParsedShard:
    """A shard read back: its metadata and ``(Entry, view)`` pairs over the caller's buffer."""

    meta: ShardMeta
    entries: list[tuple[Entry, torch.Tensor]] = field(default_factory=list)


def parse_shard(buf: torch.Tensor, *, verify: bool = True, where: str = "shard") -> ParsedShard:
    """Parse and check one shard held in a CPU ``uint8`` tensor; raise :class:`WeightSyncError` if broken.

    The returned entry views alias ``buf`` (no copy).
    """
    n = buf.numel()
    if n < 8:
        raise WeightSyncError(f"{where}: truncated ({n} bytes, no header)")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
    if 8 + hlen > n:
        raise WeightSyncError(f"{where}: header length {hlen} runs past the shard end ({n} bytes)")
    try:
        hdr = json.loads(bytes(buf[8 : 8 + hlen].numpy()))
        md = hdr.pop("__metadata__")
        meta = ShardMeta(
            uuid=md["uuid"],
            model_id=md["model_id"],
            version=int(md["version"]),
            shard_index=int(md["shard_index"]),
            shard_count=int(md["shard_count"]),
            checksum=int(md["checksum"], 16),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise WeightSyncError(f"{where}: unreadable header ({exc})") from None
    start = 8 + hlen
    data = buf[start:]
    if verify:
        got = checksum(data)
        if got != meta.checksum:
            raise WeightSyncError(
                f"{where}: checksum mismatch (header {meta.checksum:08x}, data {got:08x}) for model_id="
                f"{meta.model_id} version={meta.version} shard {meta.shard_index}/{meta.shard_count}"
            )
    out = ParsedShard(meta=meta)
    for key, spec in hdr.items():
        if key.startswith(PAD_PREFIX):
            continue
        try:
            dtype = ST_TO_DTYPE[spec["dtype"]]
            s, e = spec["data_offsets"]
            shape = tuple(int(x) for x in spec["shape"])
        except (KeyError, ValueError, TypeError) as exc:
            raise WeightSyncError(f"{where}: bad entry {key!r} ({exc})") from None
        if not (0 <= s <= e <= data.numel()):
            raise WeightSyncError(f"{where}: entry {key!r} offsets {s}-{e} outside the data ({data.numel()} bytes)")
        name, row0, rows_total = key, 0, None
        if ROWS_TAG in key:
            name, rng = key.rsplit(ROWS_TAG, 1)
            r, tot = rng.split("/")
            row0, rows_total = int(r.split("-")[0]), int(tot)
        view = data[s:e].view(dtype).view(shape) if e > s else torch.empty(shape, dtype=dtype)
        out.entries.append((Entry(name, dtype, shape, s, e - s, row0, rows_total), view))
    return out


def dest_tensor(dest: Dest, name: str, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """The tensor of ``dest`` that receives the whole tensor ``name`` (``dtype``, ``shape``); :class:`WeightSyncError`
    when ``dest`` has no such name or its tensor does not match."""
    target = dest.get(name)
    if target is None:
        raise WeightSyncError(
            f"received tensor {name!r} has no destination (check name_map or the mrl_weight_sync_map_name hook)"
        )
    if target.dtype != dtype or tuple(target.shape) != tuple(shape):
        raise WeightSyncError(
            f"{name}: received {dtype}{tuple(shape)}, destination is {target.dtype}{tuple(target.shape)}"
        )
    return target


def copy_entry(dest: Dest, entry: Entry, view: torch.Tensor) -> None:
    """Copy one received entry (a whole tensor or a row chunk of one) into ``dest``."""
    rows = entry.rows_total
    target = dest_tensor(dest, entry.name, view.dtype, tuple(view.shape) if rows is None else (rows, *view.shape[1:]))
    if rows is not None:
        target = target[entry.row0 : entry.row0 + entry.shape[0]]
    target.copy_(view)


class ShardWriter:
    """Turn a stream of named tensors into shards written through a *sink*.

    With ``checksums=False`` the header's checksum is ``00000000`` (the receiver must not verify).
    The sink provides ``reserve(nbytes) -> (handle, uint8 CPU tensor)`` (where the shard's bytes go)
    and ``write_header(handle, header_bytes)``. Large tensors are copied straight from the source
    into the reserved space (one copy); tensors smaller than a chunk are cloned until their group
    (at most ``chunk_bytes``) is full, so the writer never holds more than one chunk.
    """

    def __init__(
        self, sink: Any, *, model_id: str, version: int, uuid: str, chunk_bytes: int, checksums: bool = True
    ) -> None:
        self.sink, self.model_id, self.version, self.uuid = sink, model_id, version, uuid
        self.checksums = checksums
        self.chunk_bytes = chunk_bytes
        self.shards: list[tuple[Any, list[Entry], ShardMeta, int]] = []  # handle, entries, meta, data_len
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self.nbytes = 0
        self.names: set[str] = set()

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.names:
            raise WeightSyncError(f"tensor {name!r} published twice in version {self.version}")
        self.names.add(name)
        st_dtype(t.dtype)
        t = t.detach()
        self.nbytes += t.nbytes
        if t.nbytes > self.chunk_bytes and t.dim() > 0:
            self.flush()
            rows = t.shape[0]
            for r0, r1 in row_split(rows, t.nbytes // rows, self.chunk_bytes):
                part = t[r0:r1]
                self._emit([(name, part, r0, rows if (r0, r1) != (0, rows) else None)])
            return
        if self._pending_bytes + align(t.nbytes) > self.chunk_bytes:
            self.flush()
        self._pending.append((name, t.clone()))
        self._pending_bytes += align(t.nbytes)

    def flush(self) -> None:
        if self._pending:
            self._emit([(n, t, 0, None) for n, t in self._pending])
            self._pending, self._pending_bytes = [], 0

    def _emit(self, items: list[tuple[str, torch.Tensor, int, int | None]]) -> None:
        entries, data_len = layout(items)
        hlen = len(render_header(entries, ShardMeta("0" * 32, self.model_id, 0, 0), data_len))  # any meta: same length
        handle, buf = self.sink.reserve(hlen + data_len)
        data = buf[hlen : hlen + data_len]
        for (_, t, _, _), e in zip(items, entries):
            if e.nbytes:
                dst = data[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape if t.dim() else (1,))
                dst.copy_(t if t.dim() else t.reshape(1))
        crc = checksum(data) if self.checksums else 0
        meta = ShardMeta(self.uuid, self.model_id, self.version, len(self.shards), 0, crc)
        self.shards.append((handle, entries, meta, data_len))
        self.sink.write_header(handle, render_header(entries, meta, data_len))

    def finish(self) -> int:
        """Flush, then patch every shard header with the final shard count. Returns the shard count."""
        self.flush()
        n = len(self.shards)
        for handle, entries, meta, data_len in self.shards:
            meta.shard_count = n
            self.sink.write_header(handle, render_header(entries, meta, data_len))
        return n


def read_shards(
    blobs: Iterable[torch.Tensor],
    dest: Dest,
    *,
    model_id: str,
    version: int,
    count: int,
    uuid: str,
    verify: bool,
) -> int:
    """Verify and copy ``count`` shards (each a ``uint8`` tensor) into ``dest``; return the tensor bytes copied."""
    nbytes, seen = 0, 0
    for i, blob in enumerate(blobs):
        where = f"model_id={model_id} version={version} shard {i}/{count}"
        parsed = parse_shard(blob, verify=verify, where=where)
        expected = ShardMeta(uuid, model_id, version, i, count, parsed.meta.checksum)
        if parsed.meta != expected:
            raise WeightSyncError(f"{where}: shard identity {parsed.meta} does not match the expected {expected}")
        for entry, view in parsed.entries:
            copy_entry(dest, entry, view)
            nbytes += entry.nbytes
        seen += 1
    if seen != count:
        raise WeightSyncError(f"model_id={model_id} version={version}: got {seen} of {count} shards")
    return nbytes
