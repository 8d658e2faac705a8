"""`pdserve plan --calibrate`: efficiencies from a synthetic `pdserve bench` report in bench.py's schema."""

import json

import pytest

from pdserve.bench import summarize
from pdserve.plan.calibrate import calibrate, load_report, ratio_table, run_points
from pdserve.plan.roofline import HARDWARE, MODELS, decode_context, plan, tpot_bound, ttft_bound

QWEN, H200 = MODELS["qwen2.5-7b"], HARDWARE["h200"]
URL = "http://127.0.0.1:8000"


def _run(name: str, ttft: float, tpot: float, n: int = 8, tokens: int = 256, wall: float = 40.0) -> dict:
    results = [{"ok": True, "ttft": ttft, "e2e": ttft + tpot * (tokens - 1), "tokens": tokens, "tpot": tpot}
               for _ in range(n)]
    return {"name": name, "summary": summarize(results, wall, 2.0, 0.2), "results": results}


def _report(tmp_path):
    rep = {"args": {"url": URL, "compare": "http://other:8000", "input_len": 1024, "output_len": 256,
                    "rates": "0.2,1"},
           "runs": [_run(f"{URL} rate 1/s", 0.080, 0.012, wall=8.0),       # higher load listed first
                    _run(f"{URL} rate 0.2/s", 0.0315, 0.0064),
                    _run("http://other:8000 rate 0.1/s", 0.001, 0.001),     # the --compare endpoint
                    {"name": f"{URL} rate 0.05/s", "results": [],
                     "summary": summarize([{"ok": False, "error": "x", "e2e": 1.0}], 1.0, 2.0, 0.2)}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rep))
    return load_report(path)


def test_lowest_load_successful_primary_run_is_used(tmp_path):
    rep = _report(tmp_path)
    assert [p.name for p in run_points(rep)] == [f"{URL} rate 0.2/s", f"{URL} rate 1/s"]
    cal = calibrate(rep, QWEN, H200)
    assert cal.run.name == f"{URL} rate 0.2/s"
    # Little's law: 8 requests / 40 s * (255 * 6.4 ms) = 0.33 -> at least 1
    assert cal.run.decode_batch == 1
    assert run_points(rep)[1].decode_batch == round(8 / 8.0 * 255 * 0.012)


def test_efficiencies_and_calibrated_predictions_hit_the_measurement(tmp_path):
    rep = _report(tmp_path)
    cal = calibrate(rep, QWEN, H200)
    ctx = decode_context(1024, 256)
    assert cal.prefill_eff == pytest.approx(ttft_bound(QWEN, H200, 1024) / 0.0315)
    assert cal.decode_eff == pytest.approx(tpot_bound(QWEN, H200, ctx, 1) / 0.0064)
    assert 0 < cal.prefill_eff < 1 and 0 < cal.decode_eff < 1
    p = plan(QWEN, H200, 1024, 256, 10, 0.5, 0.05, prefill_eff=cal.prefill_eff, decode_eff=cal.decode_eff)
    assert p.ttft == pytest.approx(0.0315)
    assert tpot_bound(QWEN, H200, ctx, cal.run.decode_batch) / cal.decode_eff == pytest.approx(0.0064)
    bare, slow = (plan(QWEN, H200, 1024, 256, 100, 0.5, 0.03, prefill_eff=e, decode_eff=d)
                  for e, d in ((1.0, 1.0), (cal.prefill_eff, cal.decode_eff)))
    assert slow.prefill_replicas > bare.prefill_replicas and slow.decode_batch < bare.decode_batch
    assert slow.decode_replicas >= bare.decode_replicas and slow.tpot <= 0.03
    table = ratio_table(rep, QWEN, H200, cal)
    assert "rate 0.2/s (calibration) | 1 | 31.5 |" in table and table.count("| 1.00 |") == 2


def test_bad_reports_are_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="not a `pdserve bench"):
        load_report(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_report(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no successful run"):
        run_points({"args": {"url": URL, "input_len": 8, "output_len": 8}, "runs": []})
