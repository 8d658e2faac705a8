"""What a loaded engine holds: resident memory after `LLMEngine(...)` and the peak while it loads,
per weight format, each in a fresh process (the peak is the process's high-water mark).

  .venv/bin/python benchmarks/load_memory.py [--model DIR] [--formats fp32,bf16,int8,int4] [--kv 64MiB]

A decode or prefill replica holds this plus its share of Ray's and Serve's own memory. The KV pool
is a fixed size (`--kv`, zero-filled, so all of it resident) to keep the weights' part comparable.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from engine_bench import DEFAULT_MODEL, FORMATS

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks"]
from attention_bench import _status_mib       # VmRSS now, VmHWM: the peak since the process started
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
base = _status_mib("VmRSS")
t0 = time.perf_counter()
engine = LLMEngine(EngineConfig(model={model!r}, device="cpu", dtype={dtype!r}, quantization={quant!r},
                                kv_cache_memory={kv!r}))
print(json.dumps(dict(seconds=time.perf_counter() - t0, before=base, rss=_status_mib("VmRSS"),
                      peak=_status_mib("VmHWM"))))
"""


def measure(model: str, fmt: str, kv: str) -> dict:
    dtype, quant = FORMATS[fmt]
    code = _CHILD.format(root=str(ROOT), model=model, dtype=dtype, quant=quant, kv=kv)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{fmt}: the engine did not load:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--formats", default="fp32,bf16,int8,int4")
    ap.add_argument("--kv", default="64MiB", help="KV pool size (engine.kv_cache_memory)")
    args = ap.parse_args()
    print(f"model {args.model}, KV pool {args.kv}; MiB, each format in a fresh process")
    print("| format | before loading (imports) | after loading | peak while loading | load s |")
    print("|---|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        r = measure(args.model, fmt, args.kv)
        print(f"| {fmt} | {r['before']:.0f} | {r['rss']:.0f} | {r['peak']:.0f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
