"""Per-field compression of experience frames, with an overflow guard that never clamps.

Codecs (``comm.codec``):

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
finite range (``|x| <= 65504`` for fp16). The check reads the source -- ``torch.aminmax`` as the
fast path, and only when that returns a non-finite bound (the field holds -inf/inf/nan of its own,
e.g. masked logprobs) an exact pass over the finite values. It never inspects the cast result for
inf, because NPUs before Ascend 910B saturate to 65504 instead of producing inf. A field that does
not fit is sent in its original dtype, bit-exact, and counted (``fallbacks``). Values are never
clamped. inf/-inf/nan already in the source are preserved by the casts.

Keep any field lossless with ``comm.lossless_fields: [old_per_token_logps, ...]`` (or
``Codec(..., lossless_fields=...)``); ints and bools are lossless under every codec. Casts use
torch (numpy's float16 conversion is ~10x slower), writing straight into the destination buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mrl_plugins.errors import ConfigError, choices

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
    fallback: bool = False


@functools.lru_cache(maxsize=64)
def _raw(dt: torch.dtype) -> FieldChoice:
    return FieldChoice(RAW, dt)


@functools.lru_cache(maxsize=64)
def _cast(dt: torch.dtype) -> FieldChoice:
    return FieldChoice(CAST, dt)


class Codec:
    """Chooses per field how a tensor is sent. Stateless apart from its counters.

    :param name: ``"raw"``, ``"fp16"`` or ``"bf16"``.
    :param lossless_fields: names never cast to a lossy dtype.
    """

    def __init__(self, name: str = "fp16", lossless_fields: Iterable[str] = ()) -> None:
        if name not in _LOSSY_TARGET:
            raise ConfigError(f"comm.codec: unknown codec {name!r}; valid: {choices(_LOSSY_TARGET)}")
        self.name = name
        self.target = _LOSSY_TARGET[name]
        self.lossless_fields = frozenset(lossless_fields)
        self.fallbacks = 0
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, lossless_fields={sorted(self.lossless_fields)!r})"

    def __reduce__(self):  # picklable without its counters
        return (Codec, (self.name, tuple(self.lossless_fields)))

    def choose(self, name: str, t: torch.Tensor) -> FieldChoice:
        """Pick the wire representation of field ``name`` (a CPU tensor). Counts float fallbacks."""
        dt = t.dtype
        if self.target is None or t.numel() == 0:
            return _raw(dt)
        if dt == torch.bool:
            return FieldChoice(BITPACK, torch.uint8)
        if dt in _INT_SOURCES:
            lo, hi = torch.aminmax(t)
            lo, hi = lo.item(), hi.item()
            size = dt.itemsize
            for cand, csize, cmin, cmax in _NARROW_INTS:
                if csize >= size:
                    break
                if cmin <= lo and hi <= cmax:
                    return _cast(cand)
            return _raw(dt)
        if dt in _FLOAT_SOURCES and name not in self.lossless_fields:
            if fits_finite_range(t, self.target, self._scratch):
                return _cast(self.target)
            self.fallbacks += 1
            return FieldChoice(RAW, dt, fallback=True)
        return _raw(dt)


def fits_finite_range(t: torch.Tensor, target: torch.dtype, scratch: dict | None = None) -> bool:
    """True when every finite value of ``t`` lies within ``target``'s finite range (source check, no clamp).

    ``scratch`` (dtype -> tensor) lets the exact pass reuse one buffer instead of faulting in fresh
    pages on every call.
    """
    fmax = _FMAX.get(target) or torch.finfo(target).max
    lo, hi = torch.aminmax(t)
    lo, hi = lo.item(), hi.item()
    if -fmax <= lo and hi <= fmax:  # both finite and in range (nan compares False)
        return True
    if math.isfinite(lo) and math.isfinite(hi):
        return False  # finite bounds outside the range
    # the field holds inf/nan of its own: look at its finite values only
    n = t.numel()
    buf = scratch.get(t.dtype) if scratch is not None else None
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, 1 << 16), dtype=t.dtype)
        if scratch is not None:
            scratch[t.dtype] = buf
    view = buf[:n].view(t.shape)
    torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0, out=view)
    lo, hi = torch.aminmax(view)
    return -fmax <= lo.item() and hi.item() <= fmax


def make_codec(config=None, name: str | None = None) -> Codec:
    """Codec from a :class:`~mrl_plugins.comm.config.CommConfig` (or defaults), optionally overriding its name."""
    cname = name or (config.codec if config is not None else "fp16")
    lossless = config.lossless_fields if config is not None else ()
    return Codec(cname, lossless)
