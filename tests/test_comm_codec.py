"""Codec range checks: exact against a plain reference at every boundary, on every internal path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mrl_plugins.comm import Codec, decode_frame, encode_frame
from mrl_plugins.comm.codec import _fits
from mrl_plugins.comm.frame import _NP_HALF_MAX, _NP_RESTORE_SMALL, FramePlan

NARROW = (torch.int8, torch.int16, torch.int32)


def _expected_int_wire(t: torch.Tensor) -> torch.dtype:
    """Reference: the narrowest of int8/int16/int32 (narrower than the source) holding min and max."""
    lo, hi = int(t.min()), int(t.max())
    for d in NARROW:
        if d.itemsize >= t.dtype.itemsize:
            break
        if torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max:
            return d
    return t.dtype


def _reference_fits(t: torch.Tensor, target: torch.dtype) -> bool:
    finite = t[torch.isfinite(t)]
    return finite.numel() == 0 or finite.abs().max().item() <= torch.finfo(target).max


def _wire(plan: FramePlan, name: str) -> torch.dtype:
    return {f[0].rstrip(b"\0").decode(): f[4] for f in plan.fields}[name]


EDGES = [0, 1, 126, 127, 128, 255, 256, 32767, 32768, 65535, 2**31 - 1, 2**31, 2**32, 2**62]


INT_CASES = [
    (src, v)
    for src in (torch.int16, torch.int32, torch.int64)
    for v in sorted({s * e for e in EDGES for s in (1, -1)} | {-(2**15) - 1, -(2**31) - 1, -(2**63)})
    if torch.iinfo(src).min <= v <= torch.iinfo(src).max
]


@pytest.mark.parametrize(("src", "v"), INT_CASES)
def test_int_narrowing_exact_at_every_power_of_two_edge(src, v):
    for other in (0, 5, -1):  # batches without negatives take the one-pass (OR) path
        t = torch.tensor([[other, v], [v, other]], dtype=src)
        codec = Codec("fp16")
        plan = FramePlan({"x": t}, {}, codec)
        assert _wire(plan, "x") == _expected_int_wire(t), (v, other)
        _, out = decode_frame(encode_frame({"x": t}, {}, codec))
        assert out["x"].dtype == src and torch.equal(out["x"], t)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arr=hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=9),
        elements=st.one_of(
            st.integers(-(2**63), 2**63 - 1), st.integers(-200, 300), st.integers(0, 2**31), st.sampled_from(EDGES)
        ),
    )
)
def test_int_narrowing_matches_min_max_reference(arr):
    t = torch.from_numpy(arr)
    assert _wire(FramePlan({"x": t}, {}, Codec("fp16")), "x") == _expected_int_wire(t)
    assert _wire(FramePlan({"x": t[::2]}, {}, Codec("bf16")), "x") == _expected_int_wire(t[::2])


FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-70000, 70000),
    st.sampled_from([65504.0, -65504.0, 65505.0, -65505.0, 3.3895313892515355e38, 3.4e38, -math.inf, math.inf]),
    st.sampled_from([math.nan, -0.0, 0.0]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(FLOATS, min_size=1, max_size=40),
    dtype=st.sampled_from([np.float32, np.float64]),
    target=st.sampled_from([torch.float16, torch.bfloat16]),
    strided=st.booleans(),
)
def test_float_range_check_matches_reference_on_both_paths(values, dtype, target, strided):
    with np.errstate(over="ignore"):
        a = np.array(values, dtype=dtype)
    t = torch.from_numpy(a)
    if strided:
        t, a = t[::2], a[::2]
    want = _reference_fits(t, target)
    fmax = torch.finfo(target).max
    # the min/max path and the -inf hint path (counts first) give the same answer
    assert _fits(a, fmax, {}, False)[0] is want
    assert _fits(a, fmax, {}, True)[0] is want


def test_neginf_hint_never_changes_a_choice():
    codec = Codec("fp16")
    lp = -torch.rand(64, 8) * 12
    lp[0, 0] = -math.inf

    def wire(x: torch.Tensor) -> torch.dtype:
        return _wire(FramePlan({"lp": x}, {}, codec), "lp")

    assert wire(lp) == torch.float16 and "lp" in codec._neginf  # hint set: next check counts first
    bad = lp.clone()
    bad[3, 3] = -70000.0  # finite and out of range, next to -inf
    assert wire(bad) == torch.float32  # a fallback
    plain = lp.clone()
    plain[0, 0] = -1.0  # no -inf any more
    assert wire(plain) == torch.float16 and "lp" not in codec._neginf
    big = plain.clone()
    big[1, 1] = -70000.0
    assert wire(big) == torch.float32
    pos = lp.clone()
    pos[2, 2] = 70000.0  # out of range above while the hint skips the min
    assert wire(lp) == torch.float16 and wire(pos) == torch.float32


@pytest.mark.parametrize("n", [_NP_HALF_MAX, _NP_HALF_MAX + 1, _NP_RESTORE_SMALL - 1, _NP_RESTORE_SMALL + 5])
@pytest.mark.parametrize("kind", ["torch", "numpy", "strided"])
def test_casts_on_either_side_of_the_numpy_torch_switch_are_exact(n, kind):
    """Small and large fields take different cast kernels (numpy vs torch); both give torch's cast."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2 * n, generator=g) * 300
    x[::97] = -math.inf
    batch = {
        "f32": x,
        "f64": x.double(),
        "i8": torch.randint(-128, 128, (2 * n,), generator=g),
        "i16": torch.randint(-(2**15), 2**15, (2 * n,), generator=g),
        "i32": torch.randint(0, 151_000, (2 * n,), generator=g),
    }
    if kind == "strided":
        batch = {k: v[::2] for k, v in batch.items()}
    else:
        batch = {k: v[:n] for k, v in batch.items()}
    if kind == "numpy":
        batch = {k: v.numpy() for k, v in batch.items()}
    plan = FramePlan(batch, {}, Codec("fp16"))
    assert [_wire(plan, k) for k in batch] == [torch.float16, torch.float16, torch.int8, torch.int16, torch.int32]
    buf = bytearray(plan.nbytes)
    plan.write_into(buf)
    _, out = decode_frame(buf)
    for k, v in batch.items():
        src = torch.as_tensor(v)
        got = torch.as_tensor(out[k])
        assert type(out[k]) is type(v) and got.dtype == src.dtype and got.shape == src.shape
        if src.is_floating_point():
            torch.testing.assert_close(got, src.to(torch.float16).to(src.dtype), rtol=0, atol=0)
        else:
            assert torch.equal(got, src)


def test_consumer_side_fallback_count_from_the_frame_header():
    import torch

    from mrl_plugins.comm.codec import Codec
    from mrl_plugins.comm.frame import decode_frame, encode_frame

    batch = {
        "big": torch.tensor([1e6, -2.0]),  # overflows fp16: sent as fp32
        "lp": torch.tensor([-0.5, -1.0]),  # fits: cast
        "kept": torch.tensor([0.25]),  # lossless by configuration
        "empty": torch.empty(0),  # empty fields always travel raw: not a fallback
        "ids": torch.arange(4),
    }
    codec = Codec("fp16", lossless_fields=["kept"])
    raw_floats: list[str] = []
    decode_frame(encode_frame(batch, {}, codec), raw_floats=raw_floats)
    assert sorted(raw_floats) == ["big", "kept"]
    assert codec.fallbacks_among(raw_floats) == 1  # what the consumer counts: 'big' ('kept' is lossless)
    assert Codec("raw").fallbacks_among(raw_floats) == 0


@pytest.mark.parametrize(("transport", "expected"), [("shm", "raw"), ("queue", "raw"), ("torch_distributed", "fp16")])
def test_auto_codec_is_raw_in_memory_and_fp16_on_the_network(transport, expected):
    """The default ``comm.codec: auto``: compression only where bytes cost time (a link), with fp16's overflow
    guard (a field that does not fit is sent as it is)."""
    from mrl_plugins.comm.codec import make_codec, resolve_codec
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.comm.plugin import CommPlugin

    cfg = CommConfig(transport=transport).validate()
    assert cfg.codec == "auto" and resolve_codec("auto", transport) == expected
    auto = {c.name: c for c in CommPlugin().mrl_comm_register_codecs()}["auto"]
    assert make_codec(cfg).name == auto.factory(cfg).name == expected
    assert make_codec(cfg, "bf16").name == "bf16"  # a named codec is what it names, on any transport
    raw_floats: list[str] = []
    decode_frame(encode_frame({"logps": torch.tensor([-1.5, 1e6])}, {}, make_codec(cfg)), raw_floats=raw_floats)
    assert make_codec(cfg).fallbacks_among(raw_floats) == (1 if expected == "fp16" else 0)  # 1e6 does not fit fp16
