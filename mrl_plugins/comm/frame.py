"""Experience frames: a fixed-layout binary header followed by 64-byte aligned fields.

Layout (little-endian, offsets from the frame start)::

    0    fixed header  <4s H H I Q q q I I I I 16s 64s>  (136 bytes)
         magic b"MRLF", format version, flags (bit 0: payload checksum present, bit 1: it is the low
         32 bits of xxh3-64 instead of crc32c), header_len,
         total_len, weight version, seq, field count, extra count, payload crc32c,
         header crc32c (computed with this slot zeroed), uuid (16 bytes), model_id (utf-8, <= 64 bytes)
    136  extras: n_extra x <32s q>      small integer metadata (name <= 32 bytes)
    ...  fields: n_fields x <64s B B B B I 8q Q Q Q> (160 bytes each)
         name (utf-8, <= 64 bytes), original dtype, wire dtype, method (raw/cast/bitpack),
         kind (torch/numpy), ndim (<= 8), shape, offset, nbytes, numel
    header_len (multiple of 64): payload; each field starts at a multiple of 64.

The payload checksum (``xxh3``: low 32 bits of xxh3-64, ~4x faster than crc32c here; or ``crc32c``) covers
``[header_len, total_len)``; the header has its own crc32c,
so a corrupted header or payload raises :class:`FrameError` instead of returning wrong values.

:func:`decode_frame` returns zero-copy views onto the buffer for fields sent raw (valid as long as
the buffer is; pass ``copy=True`` to own them). Cast or bit-packed fields are materialised in
their original dtype.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import uuid as _uuid
import warnings
from collections.abc import Mapping
from typing import Any

import crc32c
import numpy as np
import torch

from mrl_plugins.errors import MrlError

from .codec import BITPACK, CAST, RAW, Codec
from .config import CHECKSUMS

MAGIC = b"MRLF"
FORMAT_VERSION = 1
ALIGN = 64
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHHIQqqIIII16s64s")
_EXTRA = struct.Struct("<32sq")
_FIELD = struct.Struct("<64sBBBBI8qQQQ")
_ZEROS = (0,) * MAX_NDIM  # shape padding of a field entry
_HCRC_OFF = 4 + 2 + 2 + 4 + 8 + 8 + 8 + 4 + 4 + 4  # offset of the header crc slot
FLAG_CHECKSUM = 1
FLAG_XXH3 = 2


def _payload_sum(data: memoryview, flags: int) -> int:
    if flags & FLAG_XXH3:
        import xxhash

        return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF
    return crc32c.crc32c(data)


KIND_TORCH, KIND_NUMPY = 0, 1
_RESERVED_META = ("model_id", "version", "seq", "uuid")

_DTYPES: list[torch.dtype] = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
#: torch dtype -> numpy dtype, for the dtypes numpy has (all but bfloat16)
_NP = {dt: torch.empty(0, dtype=dt).numpy().dtype for dt in _DTYPES if dt != torch.bfloat16}
#: wire dtypes whose casts numpy does at least as fast as torch (ints); numpy's float16 casts are ~10x slower
_NP_WIRE = frozenset({torch.int8, torch.int16, torch.int32, torch.int64})
#: decode: wire dtypes restored by numpy (fewer fixed costs; torch is faster for large int8 -> int64)
_NP_RESTORE = frozenset({torch.int16, torch.int32})
_NP_RESTORE_SMALL = 32768
#: float32 -> float16 casts of at most this many values go through numpy (same rounding, fewer fixed costs)
_NP_HALF_MAX = 256


class FrameError(MrlError, ValueError):
    """A frame cannot be encoded or decoded: bad magic, format version, layout or checksum."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_tensor(name: str, value: Any) -> tuple[torch.Tensor, np.ndarray | None, int]:
    """CPU tensor view of a field value, a numpy view of it (``None`` for dtypes numpy lacks, e.g.
    bfloat16) and its kind (torch or numpy)."""
    if type(value) is torch.Tensor and value.dtype in _NP and value.is_cpu and not value.requires_grad:
        try:  # the common case, in short
            return value, value.numpy(), KIND_TORCH
        except RuntimeError:  # a conjugate view: torch resolves it when copying
            return value, None, KIND_TORCH
    if isinstance(value, torch.Tensor):
        t = value.detach() if value.requires_grad else value
        if not t.is_cpu:
            t = t.cpu()
        if t.dtype not in _CODE:
            raise FrameError(f"field {name!r}: dtype {t.dtype} is not supported; supported: {_DTYPES}")
        if t.dtype in _NP:
            try:
                return t, t.numpy(), KIND_TORCH
            except RuntimeError:  # a conjugate view: torch resolves it when copying
                pass
        return t, None, KIND_TORCH
    if isinstance(value, np.ndarray):
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        try:
            with warnings.catch_warnings():  # read-only arrays: we never write through this view
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(value)
        except TypeError as exc:
            raise FrameError(f"field {name!r}: numpy dtype {value.dtype} is not supported ({exc})") from None
        return t, value, KIND_NUMPY
    raise FrameError(f"field {name!r}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


@functools.lru_cache(maxsize=1024)
def _enc_name(s: str, limit: int, what: str) -> bytes:
    if not isinstance(s, str):
        raise FrameError(f"{what} must be a str, got {type(s).__name__}")
    b = s.encode("utf-8")
    if not b or len(b) > limit or b"\x00" in b:
        raise FrameError(f"{what} {s!r} must be 1..{limit} utf-8 bytes without NUL")
    return b


class FramePlan:
    """The layout of one frame, computed before writing so it can go straight into shared memory.

    :param batch: field name -> tensor or array (any supported dtype/shape, contiguous or not).
    :param meta: ``model_id`` (str), ``version`` (int), ``seq`` (int), optional ``uuid`` (16 bytes,
        hex str or UUID) and other small ``int`` entries (names <= 32 bytes).
    :param codec: per-field wire choice; ``None`` = raw.
    :param checksum: ``"xxh3"``, ``"crc32c"`` or ``"none"``.
    """

    def __init__(
        self,
        batch: Mapping[str, Any],
        meta: Mapping[str, Any],
        codec: Codec | None = None,
        checksum: str = "xxh3",
    ) -> None:
        if checksum not in CHECKSUMS:
            raise FrameError(f"unknown checksum {checksum!r}; valid: {', '.join(CHECKSUMS)}")
        self.checksum = checksum != "none"
        self.flags = (FLAG_CHECKSUM if self.checksum else 0) | (FLAG_XXH3 if checksum == "xxh3" else 0)
        self.model_id = _enc_name(str(meta.get("model_id", "policy")), 64, "meta model_id")
        self.version = _meta_int(meta, "version", 0)
        self.seq = _meta_int(meta, "seq", 0)
        u = meta.get("uuid")
        if u is None:
            u4 = bytearray(os.urandom(16))  # a version-4 UUID without the uuid module's overhead
            u4[6] = (u4[6] & 0x0F) | 0x40
            u4[8] = (u4[8] & 0x3F) | 0x80
            self.uuid = bytes(u4)
        elif isinstance(u, _uuid.UUID):
            self.uuid = u.bytes
        elif isinstance(u, (bytes, bytearray)) and len(u) == 16:
            self.uuid = bytes(u)
        elif isinstance(u, str):
            self.uuid = _uuid.UUID(u).bytes
        else:
            raise FrameError(f"meta uuid must be a UUID, 16 bytes or a hex string, got {u!r}")
        self.extras = []
        for k, v in meta.items():
            if k in _RESERVED_META:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise FrameError(f"meta {k!r}: extra metadata must be int, got {type(v).__name__}")
            self.extras.append((_enc_name(k, 32, "meta key"), int(v)))
        self.fields: list[tuple] = []
        off = _align(_FIXED.size + _EXTRA.size * len(self.extras) + _FIELD.size * len(batch))
        self.header_len = off
        body = [_EXTRA.pack(k, v) for k, v in self.extras]  # the header after its fixed part
        fields = self.fields
        choose = codec.choose if codec is not None else None
        for name, value in batch.items():
            bname = _enc_name(name, 64, "field name")
            t, a, kind = _as_tensor(name, value)
            if a is not None:
                shape, numel = a.shape, a.size
            else:
                shape, numel = tuple(t.shape), t.numel()
            ndim = len(shape)
            if ndim > MAX_NDIM:
                raise FrameError(f"field {name!r}: {ndim} dimensions, at most {MAX_NDIM} supported")
            dt = t.dtype
            if choose is None:
                method, wire = RAW, dt
            else:
                choice = choose(name, t, a)
                method, wire = choice.method, choice.wire_dtype
            nbytes = (numel + 7) // 8 if method == BITPACK else numel * wire.itemsize
            if a is not None and (
                method == RAW
                or wire in _NP_WIRE
                or (wire == torch.float16 and numel <= _NP_HALF_MAX and a.dtype == np.float32)
            ):
                np_dst = _NP[wire]  # written by numpy (fewer fixed costs)
            else:
                np_dst = None
            fields.append((bname, t, kind, method, wire, off, nbytes, numel, a, np_dst, shape))
            body.append(
                _FIELD.pack(
                    bname, _CODE[dt], _CODE[wire], method, kind, ndim, *shape, *_ZEROS[ndim:], off, nbytes, numel
                )
            )
            off = (off + nbytes + ALIGN - 1) & -ALIGN
        self.nbytes = off
        body.append(bytes(self.header_len - _FIXED.size - sum(map(len, body))))
        self._header_body = b"".join(body)

    def write_into(self, buf: memoryview | bytearray) -> int:
        """Write the frame at the start of ``buf`` (writable, >= :attr:`nbytes`); return its length."""
        mv = memoryview(buf).cast("B")
        if len(mv) < self.nbytes:
            raise FrameError(f"frame of {self.nbytes} bytes does not fit a buffer of {len(mv)} bytes")
        for _bname, t, _kind, method, wire, off, nbytes, numel, a, np_dst, shape in self.fields:
            if not numel:
                continue
            if np_dst is not None:
                np.ndarray(shape, np_dst, mv, off)[...] = a  # a cast (unsafe casting) or a copy
            elif method == BITPACK:
                mv[off : off + nbytes] = np.packbits(t.reshape(-1).numpy()).data
            else:
                # a torch cast (float16/bfloat16) into a numpy view of the buffer: fewer fixed costs than
                # torch.frombuffer (numpy has no bfloat16: its bits go through a uint16 view)
                npw = _NP.get(wire)
                if npw is not None:
                    torch.from_numpy(np.ndarray(shape, npw, mv, off)).copy_(t)
                else:
                    torch.from_numpy(np.ndarray(shape, np.uint16, mv, off)).view(wire).copy_(t)
        hl = self.header_len
        mv[_FIXED.size : hl] = self._header_body
        pcrc = _payload_sum(mv[hl : self.nbytes], self.flags) if self.checksum else 0
        _FIXED.pack_into(
            mv, 0, MAGIC, FORMAT_VERSION, self.flags, hl, self.nbytes,
            self.version, self.seq, len(self.fields), len(self.extras), pcrc, 0, self.uuid, self.model_id,
        )  # fmt: skip
        struct.pack_into("<I", mv, _HCRC_OFF, crc32c.crc32c(mv[:hl]))
        return self.nbytes


def _meta_int(meta: Mapping[str, Any], key: str, default: int) -> int:
    v = meta.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise FrameError(f"meta {key!r} must be an int, got {v!r}")
    return int(v)


def encode_frame(
    batch: Mapping[str, Any], meta: Mapping[str, Any], codec: Codec | None = None, checksum: str = "xxh3"
) -> bytearray:
    """Encode ``batch`` + ``meta`` into a new frame (see :class:`FramePlan`)."""
    plan = FramePlan(batch, meta, codec, checksum)
    out = bytearray(plan.nbytes)
    plan.write_into(out)
    return out


def decode_frame(
    buf: memoryview | bytes | bytearray, *, copy: bool = False, raw_floats: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode a frame into ``(meta, batch)`` with original dtypes, shapes and kinds restored.

    Raw fields are zero-copy views onto ``buf`` unless ``copy`` is true (a read-only ``buf`` such
    as ``bytes`` is copied once). ``raw_floats``: if given, the names of the non-empty float32/float64
    fields that travelled in their own dtype are appended (under a lossy codec: the overflow guard's
    fallbacks, or ``lossless_fields``; see :meth:`Codec.fallbacks_among`). Raises :class:`FrameError`
    naming what is wrong.
    """
    mv = memoryview(buf).cast("B")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    if len(mv) < _FIXED.size:
        raise FrameError(f"truncated frame: {len(mv)} bytes, the header alone is {_FIXED.size}")
    (magic, ver, flags, hlen, total, version, seq, nf, nx, pcrc, hcrc, uid, model_id) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not an mrl frame or corrupted")
    if ver != FORMAT_VERSION:
        raise FrameError(f"unsupported frame format version {ver} (this build reads version {FORMAT_VERSION})")
    if not _FIXED.size <= hlen <= len(mv):
        raise FrameError(f"bad frame layout: header_len={hlen} for a buffer of {len(mv)} bytes")
    hdr = bytearray(mv[:hlen])
    hdr[_HCRC_OFF : _HCRC_OFF + 4] = b"\x00\x00\x00\x00"
    if crc32c.crc32c(hdr) != hcrc:
        raise FrameError("frame header checksum mismatch: the header is corrupted")
    if total > len(mv) or hlen > total or hlen < _FIXED.size + _EXTRA.size * nx + _FIELD.size * nf:
        raise FrameError(f"bad frame layout: header_len={hlen}, total_len={total}, buffer={len(mv)} bytes")
    if flags & FLAG_CHECKSUM and _payload_sum(mv[hlen:total], flags) != pcrc:
        raise FrameError(f"frame payload checksum mismatch (seq={seq}): the payload is corrupted")
    meta: dict[str, Any] = {
        "model_id": bytes(model_id).rstrip(b"\x00").decode("utf-8", "replace"),
        "version": version,
        "seq": seq,
        "uuid": bytes(uid).hex(),
    }
    pos = _FIXED.size
    for _ in range(nx):
        k, v = _EXTRA.unpack_from(mv, pos)
        meta[k.rstrip(b"\x00").decode("utf-8", "replace")] = v
        pos += _EXTRA.size
    batch: dict[str, Any] = {}
    for _ in range(nf):
        name_b, odt, wdt, method, kind, ndim, *rest = _FIELD.unpack_from(mv, pos)
        pos += _FIELD.size
        name = name_b.rstrip(b"\x00").decode("utf-8", "replace")
        shape, (off, nbytes, numel) = tuple(rest[:ndim]), rest[MAX_NDIM:]
        if odt >= len(_DTYPES) or wdt >= len(_DTYPES) or method not in (RAW, CAST, BITPACK) or ndim > MAX_NDIM:
            raise FrameError(f"bad field entry {name!r}: dtype/method/ndim codes {odt}/{wdt}/{method}/{ndim}")
        orig, wire = _DTYPES[odt], _DTYPES[wdt]
        want = (numel + 7) // 8 if method == BITPACK else numel * wire.itemsize
        if (
            math.prod(shape) != numel
            or nbytes != want
            or off < hlen
            or off % ALIGN
            or off + nbytes > total
            or name in batch
        ):
            raise FrameError(f"bad layout of field {name!r}: shape={shape} offset={off} nbytes={nbytes}")
        batch[name] = _decode_field(mv, orig, wire, method, kind, shape, off, nbytes, numel, copy)
        if raw_floats is not None and method == RAW and numel and orig in (torch.float32, torch.float64):
            raw_floats.append(name)
    return meta, batch


def _decode_field(mv, orig, wire, method, kind, shape, off, nbytes, numel, copy):
    if numel == 0:
        t = torch.empty(shape, dtype=orig)
    elif method == BITPACK:
        bits = np.unpackbits(np.frombuffer(mv, np.uint8, count=nbytes, offset=off), count=numel)
        t = torch.from_numpy(bits.view(np.bool_).reshape(shape))
    else:
        npw = _NP.get(wire)
        a = np.ndarray(shape, np.uint16 if npw is None else npw, mv, off)  # a view on the buffer
        if method == CAST and (wire in _NP_RESTORE or (wire in _NP_WIRE and numel < _NP_RESTORE_SMALL)):
            a = a.astype(_NP[orig])
            return a if kind == KIND_NUMPY else torch.from_numpy(a)
        if kind == KIND_NUMPY and method == RAW:
            return a.copy() if copy else a
        t = torch.from_numpy(a) if npw is not None else torch.from_numpy(a).view(torch.bfloat16)
        if method == CAST:
            t = t.to(orig)
        elif copy:
            t = t.clone()
        else:
            # a view on the frame buffer: make it one torch knows as a view (``_base`` set), so that
            # ``comm.base.owned`` copies exactly these fields out before the buffer is released
            t = t[...]
    return t.numpy() if kind == KIND_NUMPY else t
