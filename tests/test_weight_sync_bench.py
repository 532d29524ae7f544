"""Smoke test of ``python -m benchmarks weights``: it runs end to end and reports every required figure.

No performance assertion here (performance is reported by the benchmark itself); only structure,
consistency of the ratios with the reported medians, and bit-exactness of the gloo transfers.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.weights import cli, qwen_shapes, small_shapes
from tests.marks import require_trl

pytestmark = pytest.mark.slow


def test_qwen_shape_list_matches_the_0_5b_model():
    shapes = qwen_shapes()
    assert len(shapes) == 290 and shapes[0][1] == (151936, 896)
    nbytes = sum(2 * __import__("math").prod(s) for _, s, _ in shapes)
    assert 980e6 < nbytes < 995e6


@require_trl
def test_small_case_is_the_small_preset_model():
    from mrl_plugins.demo.models import build_model

    model, _ = build_model("small")
    shapes, label = small_shapes()
    assert label.startswith("mrl_plugins.demo.models small")
    assert shapes == [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]


def test_bench_cli_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert cli(["--quick", "--reps", "1", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "ratio bucketed_vs_per_param" in out and "switch_ms" in out
    main = r["models"]["qwen0.5b"]
    for case in ("per_param", "bucketed", "shm_sequential"):
        assert main[case]["min"] <= main[case]["median"] <= main[case]["max"] and main[case]["median"] > 0
    assert (
        main["per_param"]["bit_exact"] and main["bucketed"]["bit_exact"] and main["bucketed_no_checksum"]["bit_exact"]
    )
    # the headline ratio is the default config (checksums computed and verified), paired within repetitions
    pp = main["per_param"]["per_rep"]
    assert len(pp) == 1 == len(main["bucketed"]["per_rep"])
    assert r["ratios"]["bucketed_vs_per_param"] == pytest.approx(main["bucketed"]["per_rep"][0] / pp[0])
    assert r["ratios"]["bucketed_vs_per_param_min"] == pytest.approx(r["ratios"]["bucketed_vs_per_param"])
    nocrc = main["bucketed_no_checksum"]["per_rep"][0]
    assert r["ratios"]["bucketed_no_checksum_vs_per_param"] == pytest.approx(nocrc / pp[0])
    shm = main["shm_sequential"]["median"]
    assert r["ratios"]["shm_sequential_vs_memcpy"] == pytest.approx(shm / r["memcpy_gbps"]["median"])
    assert "shm" not in main and "shm_vs_memcpy" not in r["ratios"]  # the streaming read is gone
    assert r["ratios"]["switch_ms"] == r["switch_ms"]["median"] > 0
    assert r["models"]["small"]["tensors"] > 10
    assert all(0 < main[c]["receiver_cpu_share"] < 4 for c in ("per_param", "bucketed", "bucketed_no_checksum"))
