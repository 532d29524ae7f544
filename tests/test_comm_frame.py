"""Frames and codecs: property round trips, overflow guard, corruption, zero-copy, config."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mrl_plugins.comm import Codec, CommConfig, FrameError, decode_frame, encode_frame
from mrl_plugins.comm.frame import FramePlan
from mrl_plugins.errors import ConfigError

NP_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]
FLOAT_EXTREMES = [0.0, -0.0, 1e-30, -1e-8, 65504.0, 65505.0, -7e4, 3e38, -3.4e38, math.inf, -math.inf, math.nan]


def _bytes(x) -> bytes:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    if x.numel() == 0:
        return b""
    return x.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def fields(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
    if dtype.kind == "f":
        elems = st.one_of(st.floats(width=dtype.itemsize * 8, allow_nan=True), st.sampled_from(FLOAT_EXTREMES))
        with np.errstate(over="ignore"):
            arr = draw(hnp.arrays(dtype, shape, elements=elems.map(lambda v: dtype.type(v))))
    else:
        arr = draw(hnp.arrays(dtype, shape))
    kind = draw(st.sampled_from(["numpy", "torch", "torch_bf16", "torch_strided"]))
    if kind == "numpy":
        return arr
    t = torch.from_numpy(arr.copy())
    if kind == "torch_bf16" and dtype.kind == "f":
        return t.to(torch.bfloat16)
    if kind == "torch_strided" and t.dim() >= 2:
        return t.transpose(0, 1)  # non-contiguous
    if kind == "torch_strided" and t.dim() == 1:
        return t[::2]
    return t


batches = st.dictionaries(st.text("abcdefghij_", min_size=1, max_size=12), fields(), max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, seq=st.integers(-(2**63), 2**63 - 1))
def test_raw_round_trip_is_bit_exact(batch, seq):
    meta = {"model_id": "policy", "version": 3, "seq": seq, "step": 7}
    frame = encode_frame(batch, meta, Codec("raw"))
    m, out = decode_frame(frame)
    assert m["seq"] == seq and m["version"] == 3 and m["model_id"] == "policy" and m["step"] == 7
    assert list(out) == list(batch)
    for k, v in batch.items():
        assert type(out[k]) is type(v)
        assert out[k].dtype == v.dtype and tuple(out[k].shape) == tuple(v.shape)
        assert _bytes(out[k]) == _bytes(v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, name=st.sampled_from(["fp16", "bf16"]))
def test_compressed_round_trip_restores_dtype_and_never_gains_inf(batch, name):
    codec = Codec(name)
    plan = FramePlan(batch, {"model_id": "m", "version": 1, "seq": 0}, codec)
    buf = bytearray(plan.nbytes)
    plan.write_into(buf)
    fallbacks: list[str] = []  # float fields sent in their own dtype (no lossless_fields: the guard's fallbacks)
    _, out = decode_frame(buf, raw_floats=fallbacks)
    target = torch.float16 if name == "fp16" else torch.bfloat16
    for k, v in batch.items():
        src = torch.as_tensor(v) if isinstance(v, np.ndarray) else v
        got = torch.as_tensor(out[k])
        assert out[k].dtype == v.dtype and tuple(out[k].shape) == tuple(v.shape)
        if src.dtype in (torch.float32, torch.float64) and src.numel():
            if k in fallbacks:
                assert _bytes(got) == _bytes(src)  # sent in its own dtype, bit-exact
                finite = src[torch.isfinite(src)]
                assert finite.numel() and finite.abs().max() > torch.finfo(target).max
            else:
                assert torch.equal(got.isinf(), src.isinf())  # no inf gained, none lost
                assert torch.equal(got.isnan(), src.isnan())
                # the value the cast gives (NaN payload bits may differ between cast kernels)
                torch.testing.assert_close(got, src.to(target).to(src.dtype), rtol=0, atol=0, equal_nan=True)
        else:
            assert _bytes(got) == _bytes(src)  # ints, bools, fp16/bf16: lossless
    assert codec.fallbacks_among(fallbacks) == len(fallbacks)


def test_overflow_fallback_counted_and_bit_exact():
    codec = Codec("fp16")
    big = torch.tensor([1.0, -70000.0, 2.5, -math.inf], dtype=torch.float32)
    ok = torch.tensor([-0.5, -math.inf, -30.0, math.nan])
    plan = FramePlan({"big": big, "ok": ok, "m": torch.ones(3, dtype=torch.bool)}, {"seq": 1}, codec)
    buf = bytearray(plan.nbytes)
    plan.write_into(buf)
    raw_floats: list[str] = []
    _, out = decode_frame(buf, raw_floats=raw_floats)
    assert raw_floats == ["big"] and codec.fallbacks_among(raw_floats) == 1  # what the consumer counts
    assert _bytes(out["big"]) == _bytes(big)
    assert out["ok"][0] == -0.5 and out["ok"][1] == -math.inf and math.isnan(out["ok"][3])
    # exactly at the fp16 limit is cast (not counted); just above falls back
    assert FramePlan({"x": torch.tensor([65504.0])}, {}, codec).fields[0][4] == torch.float16
    assert FramePlan({"x": torch.tensor([65504.5])}, {}, codec).fields[0][4] == torch.float32


def test_lossless_fields_and_int_narrowing():
    codec = Codec("fp16", lossless_fields=["logps"])
    x = torch.randn(4, 5)
    batch = {
        "logps": x,
        "other": x.clone(),
        "ids": torch.tensor([0, 151_000, 7]),
        "mask": torch.tensor([[0, 1], [1, 1]]),
        "wide": torch.tensor([2**40, -1]),
    }
    plan = FramePlan(batch, {}, codec)
    wires = {f[0].rstrip(b"\0").decode(): f[4] for f in plan.fields}
    assert wires == {
        "logps": torch.float32,
        "other": torch.float16,
        "ids": torch.int32,
        "mask": torch.int8,
        "wide": torch.int64,
    }
    _, out = decode_frame(encode_frame(batch, {}, codec))
    assert torch.equal(out["logps"], x) and not torch.equal(out["other"], x)
    for k in ("ids", "mask", "wide"):
        assert out[k].dtype == torch.int64 and torch.equal(out[k], batch[k])


def test_fp16_logprob_error_within_documented_bound():
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(64, 1024, generator=g) * 16.0  # [-16, 0]
    _, out = decode_frame(encode_frame({"lp": logps}, {}, Codec("fp16")))
    err = (out["lp"] - logps).abs().max().item()
    assert 0 < err <= 2**-8  # documented: logprobs in [-16, 0] -> abs <= 2**-8 (3.9e-3)
    _, outb = decode_frame(encode_frame({"lp": logps}, {}, Codec("bf16")))
    assert (outb["lp"] - logps).abs().max().item() <= 2**-5


def test_decode_is_zero_copy_unless_copy_requested():
    x = torch.arange(16, dtype=torch.float32)
    buf = encode_frame({"x": x}, {}, Codec("raw"))
    _, view = decode_frame(buf)
    _, owned = decode_frame(buf, copy=True)
    raw = np.frombuffer(buf, np.uint8)
    assert np.shares_memory(view["x"].numpy(), raw) and not np.shares_memory(owned["x"].numpy(), raw)
    view["x"][0] = 99.0  # writes into buf
    assert owned["x"][0] == 0.0
    with pytest.raises(FrameError, match="payload checksum"):
        decode_frame(buf)  # the payload changed under the checksum


def test_numpy_fields_decode_as_views_unless_copy_requested():
    x = np.arange(16, dtype=np.int64)
    buf = encode_frame({"x": x, "bf": torch.arange(4, dtype=torch.bfloat16)}, {}, Codec("raw"))
    _, view = decode_frame(buf)
    _, owned = decode_frame(buf, copy=True)
    raw = np.frombuffer(buf, np.uint8)
    assert isinstance(view["x"], np.ndarray) and np.shares_memory(view["x"], raw)
    assert not np.shares_memory(owned["x"], raw) and np.array_equal(owned["x"], x)
    assert view["bf"].dtype == torch.bfloat16 and torch.equal(view["bf"], torch.arange(4, dtype=torch.bfloat16))
    assert np.shares_memory(view["bf"].view(torch.int16).numpy(), raw)
    assert not np.shares_memory(owned["bf"].view(torch.int16).numpy(), raw)


def test_fields_are_64_byte_aligned():
    batch = {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5), "c": np.zeros(7, dtype=np.int16)}
    plan = FramePlan(batch, {}, None)
    assert plan.header_len % 64 == 0 and all(f[5] % 64 == 0 for f in plan.fields)


@pytest.mark.parametrize(
    ("where", "match"),
    [(0, "magic"), (4, "format version"), (24, "header checksum"), (40, "header checksum"), ("payload", "payload")],
)
def test_corruption_raises_clear_frame_error(where, match):
    frame = encode_frame({"x": torch.randn(100)}, {"seq": 5}, Codec("raw"))
    if where == "payload":
        frame[-10] ^= 0xFF
    elif where == 4:
        struct.pack_into("<H", frame, 4, 99)
    else:
        frame[where] ^= 0xFF
    with pytest.raises(FrameError, match=match):
        decode_frame(frame)


def test_truncated_and_bad_input():
    frame = encode_frame({"x": torch.randn(100)}, {"seq": 5})
    with pytest.raises(FrameError, match="layout"):
        decode_frame(frame[: len(frame) - 64])
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(b"MRLF")
    with pytest.raises(FrameError, match="expected a torch.Tensor"):
        encode_frame({"x": [1, 2]}, {})
    with pytest.raises(FrameError, match="extra metadata must be int"):
        encode_frame({}, {"note": "text"})
    with pytest.raises(FrameError, match="field name"):
        encode_frame({"n" * 65: torch.ones(1)}, {})


def test_config_validation():
    cfg = CommConfig.from_dict({"codec": "raw", "ring_slots": 2, "lossless_fields": ["a"]})
    assert cfg.codec == "raw" and cfg.ring_slots == 2
    with pytest.raises(ConfigError, match="unknown comm key 'ring'.*ring_slots"):
        CommConfig.from_dict({"ring": 2})
    with pytest.raises(ConfigError, match="comm.full_policy was removed .* a full ring always waits"):
        from mrl_plugins.config import load_config

        load_config({"comm": {"full_policy": "drop_newest"}})
    with pytest.raises(ConfigError, match="ring_slots"):
        CommConfig.from_dict({"ring_slots": 0})
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        CommConfig.from_dict({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5})
    with pytest.raises(ConfigError, match="checksum"):
        CommConfig.from_dict({"checksum": "md5"})
    with pytest.raises(ConfigError, match="unknown codec 'fp8'"):
        Codec("fp8")


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
def test_each_payload_checksum_catches_a_flipped_byte(checksum):
    from mrl_plugins.comm.frame import FrameError, decode_frame, encode_frame

    batch = {"x": torch.arange(1000, dtype=torch.float32)}
    frame = encode_frame(batch, {"seq": 3}, checksum=checksum)
    meta, out = decode_frame(frame, copy=True)
    assert torch.equal(out["x"], batch["x"]) and meta["seq"] == 3
    frame[-5] ^= 0x40
    with pytest.raises(FrameError, match="payload checksum mismatch"):
        decode_frame(frame)


def test_unknown_checksum_is_refused():
    from mrl_plugins.comm.frame import FrameError, encode_frame

    with pytest.raises(FrameError, match="xxh3"):
        encode_frame({"x": torch.zeros(2)}, {}, checksum="md5")
