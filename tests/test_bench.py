"""`pdserve bench` against the running disaggregated service: closed loop, a small Poisson sweep,
JSON and PNG output."""

import json

import pytest

from pdserve import bench

pytestmark = pytest.mark.slow


def test_bench_closed_loop_and_rate_sweep(disagg, tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    common = ["--url", disagg, "--requests", "4", "--input-len", "40", "--output-len", "4", "--no-progress"]
    assert bench.main(common + ["--concurrency", "2", "--temperature", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["temperature"] == 1.0          # sampled, as OpenAI's default; greedy unless asked
    summary = data["runs"][0]["summary"]
    assert summary["failed"] == 0 and summary["requests"] == 4
    assert summary["ttft_p50"] > 0 and summary["tpot_p99"] >= summary["tpot_p50"] > 0
    assert all(r["tokens"] == 4 for r in data["runs"][0]["results"])
    assert 0 <= summary["goodput_req_per_s"] <= summary["req_per_s"]
    assert bench.main(common + ["--rates", "2,4", "--plot", str(png), "--ttft-slo", "0.000001",
                                "--json", str(out), "--seed", "1"]) == 0      # not the closed loop's prompts
    assert png.stat().st_size > 10_000
    # each rate sends its own prompts: the second would otherwise be served from the prefix cache
    sweep = json.loads(out.read_text())["runs"]
    assert [r["summary"]["cached_prompt_fraction"] for r in sweep] == [0.0, 0.0]


def test_bench_reports_prefix_cache_hits_of_repeated_prompts(disagg, tmp_path):
    """The same seed twice against one server: the second run's full prompt blocks come from the cache."""
    out = tmp_path / "b.json"
    args = ["--url", disagg, "--requests", "2", "--input-len", "40", "--jitter", "0", "--output-len", "2",
            "--concurrency", "1", "--seed", "4242", "--no-progress", "--json", str(out)]
    assert bench.main(args) == 0
    assert json.loads(out.read_text())["runs"][0]["summary"]["cached_prompt_fraction"] == 0.0
    assert bench.main(args) == 0
    assert json.loads(out.read_text())["runs"][0]["summary"]["cached_prompt_fraction"] > 0.5
