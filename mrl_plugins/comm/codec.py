"""Per-field compression of experience frames, with an overflow guard that never clamps.

Codecs (``comm.codec``; the default ``auto`` is ``raw`` on the shared-memory and queue transports and ``fp16``
on network transports, see :func:`resolve_codec`):

* ``raw`` -- every field is sent in its own dtype, byte for byte (lossless, fastest on shared memory).
* ``fp16`` / ``bf16`` -- lossy for floats, lossless for everything else:

  ======================  ==========================  =============================================
  source field            sent as                     worst-case error after the round trip
  ======================  ==========================  =============================================
  float32 / float64       float16 (``fp16``)          relative 2**-11 (4.9e-4) of |x| for
                                                      6.1e-5 <= |x| <= 65504; absolute 2**-25 (3e-8)
                                                      below (subnormal range, |x| < 3e-8 -> 0).
                                                      Log-probabilities in [-16, 0]: abs <= 2**-8 (3.9e-3),
                                                      in [-32, -16]: abs <= 2**-7 (0.4% / 0.8% on the
                                                      probability ratio); a prototype measured max
                                                      7e-3 on GRPO logprobs. Rewards/advantages in
                                                      [-8, 8]: abs <= 2**-9 (2e-3).
  float32 / float64       bfloat16 (``bf16``)         relative 2**-8 (3.9e-3) of |x| over the whole
                                                      fp32 range; logprobs in [-16, 0]: abs <= 2**-5
                                                      (~3% on the ratio -- prefer ``fp16``).
  float16 / bfloat16      unchanged                   none
  int64 / int32 / int16   int8/int16/int32, the       none (lossless; chosen from the field's
                          smallest that holds the     min/max, e.g. 0/1 masks -> int8, token ids of a
                          field's min and max         150k vocabulary -> int32)
  bool                    bit-packed (8 per byte)     none
  other (uint*, complex)  unchanged                   none
  ======================  ==========================  =============================================

Overflow guard: a float field is cast only when every *finite* source value fits the target's
finite range (``|x| <= 65504`` for fp16). The check reads the source with numpy's SIMD reductions
(about twice as fast as ``torch.aminmax`` here): max and min as the fast path; a side whose bound
is non-finite (the field holds -inf/inf/nan of its own, e.g. masked logprobs) is checked exactly:
the values below -65504 must all be -inf (their max, a masked reduction, is -inf), likewise the
values above 65504 must all be +inf; nan compares false. A field that held -inf in its previous
frame skips the min (a speed hint only; the answer is the same). It never inspects the cast result
for inf, because NPUs before Ascend 910B saturate to 65504 instead of producing inf. A field that
does not fit is sent in its original dtype, bit-exact, and counted by the consumer from the frame
(``fallbacks``, :meth:`Codec.fallbacks_among`). Values are never clamped. inf/-inf/nan already in the source are
preserved by the casts.

Integers are narrowed from one pass in the usual case: the max of the values read as unsigned
(numpy's SIMD max) is their max when none is negative; a field with a negative value is sized from
its signed min and max.

Keep any field lossless with ``comm.lossless_fields: [old_per_token_logps, ...]`` (or
``Codec(..., lossless_fields=...)``); ints and bools are lossless under every codec. The casts themselves are
written by :mod:`mrl_plugins.comm.frame`, straight into the destination buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from mrl_plugins.errors import ConfigError, choices

from .config import LOCAL_COMM_TRANSPORTS, CommConfig

#: wire methods
RAW, CAST, BITPACK = 0, 1, 2

_LOSSY_TARGET: dict[str, torch.dtype | None] = {"raw": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_NARROW_INTS = tuple(
    (d, d.itemsize, torch.iinfo(d).min, torch.iinfo(d).max) for d in (torch.int8, torch.int16, torch.int32)
)
_FMAX = {d: torch.finfo(d).max for d in (torch.float16, torch.bfloat16)}
_INT_SOURCES = (torch.int16, torch.int32, torch.int64)
_FLOAT_SOURCES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class FieldChoice:
    """How one field goes on the wire: ``method`` (RAW/CAST/BITPACK) and the wire dtype."""

    method: int
    wire_dtype: torch.dtype


@functools.lru_cache(maxsize=64)
def _raw(dt: torch.dtype) -> FieldChoice:
    return FieldChoice(RAW, dt)


_BITPACKED = FieldChoice(BITPACK, torch.uint8)
_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # itemsize -> unsigned view of a signed int array
_SIGN = {2: 2**15, 4: 2**31, 8: 2**63}
_CASTS = {d: FieldChoice(CAST, d) for d in (torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)}


class Codec:
    """Chooses per field how a tensor is sent. Stateless apart from its scratch buffer and the -inf speed hint.

    :param name: ``"raw"``, ``"fp16"`` or ``"bf16"``.
    :param lossless_fields: names never cast to a lossy dtype.
    """

    def __init__(self, name: str = "fp16", lossless_fields: Iterable[str] = ()) -> None:
        if name not in _LOSSY_TARGET:
            raise ConfigError(f"comm.codec: unknown codec {name!r}; valid: {choices(_LOSSY_TARGET)}")
        self.name = name
        self.target = _LOSSY_TARGET[name]
        self.lossless_fields = frozenset(lossless_fields)
        self._fmax = _FMAX[self.target] if self.target is not None else 0.0
        self._scratch: dict[str, np.ndarray] = {}
        self._neginf: set[str] = set()  # float fields that held -inf in their last frame (a speed hint)

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, lossless_fields={sorted(self.lossless_fields)!r})"

    def choose(self, name: str, t: torch.Tensor, a: np.ndarray | None = None) -> FieldChoice:
        """Pick the wire representation of field ``name`` (a CPU tensor).

        ``a``: a numpy view of ``t`` if the caller already has one (saves making it again).
        """
        dt = t.dtype
        if self.target is None or t.numel() == 0:
            return _raw(dt)
        if dt == torch.bool:
            return _BITPACKED
        if dt in _INT_SOURCES:
            return _narrowest_int(t.numpy() if a is None else a, dt)
        if dt in _FLOAT_SOURCES and name not in self.lossless_fields:
            fits, neginf = _fits(t.numpy() if a is None else a, self._fmax, self._scratch, name in self._neginf)
            if neginf:
                self._neginf.add(name)
            else:
                self._neginf.discard(name)
            if fits:
                return _CASTS[self.target]
        return _raw(dt)  # also a float that does not fit: an overflow-guard fallback

    def fallbacks_among(self, raw_floats: Iterable[str]) -> int:
        """How many of the float fields a frame carried in their own dtype (``decode_frame(raw_floats=...)``)
        were overflow-guard fallbacks under this codec: all but the ``lossless_fields`` (none under ``raw``)."""
        if self.target is None:
            return 0
        return sum(1 for name in raw_floats if name not in self.lossless_fields)


def _narrowest_int(a: np.ndarray, dt: torch.dtype) -> FieldChoice:
    """The narrowest integer dtype that holds every value of ``a`` (lossless), else ``dt`` itself (the method: the
    module docstring; a negative value read as unsigned is >= 2**(bits-1))."""
    hi = int(np.maximum.reduce(a.view(_UNSIGNED[a.dtype.itemsize]), axis=None))
    if hi < _SIGN[a.dtype.itemsize]:  # the usual case: non-negative ids and masks
        if hi < 128:
            return _CASTS[torch.int8]
        if hi < 32768 and dt.itemsize > 2:
            return _CASTS[torch.int16]
        if hi < 2**31 and dt.itemsize > 4:
            return _CASTS[torch.int32]
        return _raw(dt)
    lo, hi = int(np.minimum.reduce(a, axis=None)), int(np.maximum.reduce(a, axis=None))
    for cand, csize, cmin, cmax in _NARROW_INTS:
        if csize >= dt.itemsize:
            break
        if cmin <= lo and hi <= cmax:
            return _CASTS[cand]
    return _raw(dt)


def _fits(a: np.ndarray, fmax: float, scratch: dict, expect_neginf: bool) -> tuple[bool, bool]:
    """``(every finite value of a is within [-fmax, fmax], a holds -inf)``, reading the source only (the method:
    the module docstring's overflow guard). ``expect_neginf``: the field held -inf last time, so the min is skipped;
    the second item is that hint for the next call. ``scratch`` lends the mask buffer (:func:`_mask`)."""
    hi = float(np.maximum.reduce(a, axis=None))  # nan if the field holds one
    if not hi <= fmax and math.isfinite(hi):
        return False, expect_neginf  # a finite bound above the range
    if not expect_neginf:
        lo = float(np.minimum.reduce(a, axis=None))
        if -fmax <= lo and hi <= fmax:  # nan compares False
            return True, False
        if not -fmax <= lo and math.isfinite(lo):
            return False, False  # a finite bound below the range
    mask = _mask(a, scratch)
    if not hi <= fmax:  # +inf or nan: the values above the range must all be +inf
        np.greater(a, fmax, out=mask)
        if np.minimum.reduce(a, axis=None, where=mask, initial=math.inf) != math.inf:
            return False, expect_neginf
    # the values below the range must all be -inf: their max (fmax ignores the nan start) is -inf,
    # or nan when there are none
    np.less(a, -fmax, out=mask)
    below = float(np.fmax.reduce(a, axis=None, where=mask, initial=math.nan))
    if below == -math.inf:
        return True, True
    return below != below, False


def _mask(a: np.ndarray, scratch: dict) -> np.ndarray:
    """A bool array shaped like ``a``: a view of one reused buffer, grown when ``a`` is larger (no fresh pages per
    call)."""
    buf = scratch.get("mask")
    if buf is None or buf.size < a.size:
        buf = scratch["mask"] = np.empty(max(a.size, 1 << 16), dtype=np.bool_)
    return buf[: a.size].reshape(a.shape)


def resolve_codec(name: str, transport: str) -> str:
    """The codec ``comm.codec`` means on ``transport``: ``auto`` is ``raw`` on the local transports
    (:data:`~mrl_plugins.comm.config.LOCAL_COMM_TRANSPORTS`), where frames stay in this host's memory and a lossy codec
    costs CPU and saves no time (``python -m benchmarks comm``: fp16 0.7-0.8x raw's batches/s on the shm ring), and
    ``fp16`` (overflow-guarded) on network transports (``torch_distributed``, third-party ones), where bytes cost
    time (``python -m benchmarks comm --link 1gbit``: fp16 2.4x raw's batches/s); other names are returned as they
    are."""
    if name != "auto":
        return name
    return "raw" if transport in LOCAL_COMM_TRANSPORTS else "fp16"


def make_codec(config: CommConfig, name: str | None = None) -> Codec:
    """Codec from a :class:`~mrl_plugins.comm.config.CommConfig`, optionally overriding its name (the built-in
    codecs' registered factory binds ``name``); ``auto`` is resolved for the config's transport."""
    return Codec(resolve_codec(name or config.codec, config.transport), config.lossless_fields)
