"""`pdserve plan --plot` writes a PNG; the CLI takes an HF config path and a bench report end to end."""

import json

from pdserve.cli import main
from pdserve.plan.plot import plot
from pdserve.plan.roofline import HARDWARE, MODELS
from test_plan_calibrate import URL, _run
from test_plan_model import QWEN_CONFIG

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "plan.png"
    plot(str(out), MODELS["qwen2.5-7b"], HARDWARE["h200"], prefill_eff=0.5, decode_eff=0.5)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_with_config_calibration_and_plot(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_CONFIG))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"args": {"url": URL, "input_len": 1024, "output_len": 256},
                                 "runs": [_run(f"{URL} concurrency 1", 0.0315, 0.0064)]}))
    png = tmp_path / "p.png"
    rc = main(["plan", "--model", str(tmp_path), "--hardware", "h200", "--calibrate", str(bench), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.read_bytes()[:8] == PNG_MAGIC
    assert "| 1024 | 1020.1 |" in out and "lowest-load run" in out and "recommended, calibrated:" in out
    assert main(["plan", "--model", "nope"]) == 2
