"""`pdserve bench` against the running disaggregated service: closed loop, a small Poisson sweep,
JSON and PNG output."""

import json

import pytest

from pdserve import bench

pytestmark = pytest.mark.slow


def test_bench_closed_loop_and_rate_sweep(disagg, tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    common = ["--url", disagg, "--requests", "4", "--input-len", "40", "--output-len", "4", "--no-progress"]
    assert bench.main(common + ["--concurrency", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    summary = data["runs"][0]["summary"]
    assert summary["failed"] == 0 and summary["requests"] == 4
    assert summary["ttft_p50"] > 0 and summary["tpot_p99"] >= summary["tpot_p50"] > 0
    assert all(r["tokens"] == 4 for r in data["runs"][0]["results"])
    assert 0 <= summary["goodput_req_per_s"] <= summary["req_per_s"]
    assert bench.main(common + ["--rates", "2,4", "--plot", str(png), "--ttft-slo", "0.000001"]) == 0
    assert png.stat().st_size > 10_000
