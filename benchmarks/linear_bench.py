"""The decode step's linears one by one: each weight format's kernel at a few rows.

  .venv/bin/python benchmarks/linear_bench.py [--threads 1] [--rows 1,2,4,8] [--reps 5] [--formats ...]

SmolLM2-135M's shapes (fused QKV [960, 576], O [576, 576], fused gate/up [3072, 576], down
[576, 1536] in each of 30 layers, LM head [49152, 576]), random weights, a whole model of
each format called as a decode step calls it (layer by layer, then the LM head), so the weights
come from memory and not from a cache that one repeated call would keep warm. Prints the median
microseconds per call and the weight bytes each call reads per second (GB/s) for:

  bf16-onednn the prepacked oneDNN bf16 weight (engine.linear's dense path above its GEMV
              threshold; also the quantized formats' copy above `quantized_small_rows`)
  fp32-mkl    F.linear on the fp32 weight (MKL)
  bf16, fp32  the engine's dense GEMVs (engine.kernels.bf16_gemv on the blocked weight,
              fp32_gemv on the row-major one), where they build vectorized, at every row count
              (engine.linear switches away above its thresholds)
  bf16-amx    the AMX tile GEMM on the same blocked weight (engine.kernels.bf16_gemm_amx),
              where this CPU has AMX-BF16, at every row count (bf16_gemv hands it many rows)
  int8-aten   torch.ops.aten._weight_int8pack_mm
  int4-aten   torch.ops.aten._weight_int4pack_mm_for_cpu
  int8, int4  engine.linear's quantized kernels (engine.kernels.int8_gemv, int4_gemv),
              where they build, at every row count (no switch to the bf16 copy; on AMX they
              hand many rows to the AMX path themselves)
  int8-amx    int8's AMX path (engine.kernels.int8_gemm_amx: AMX-INT8 tiles on its own weight, x
              split into two int8 limbs a row) at every row count, where the CPU has AMX-INT8
  int4-amx    int4's AMX path (engine.kernels.int4_gemm_amx: the weight widened to bf16 a chunk at
              a time for the bf16 tiles) at every row count, where the CPU has AMX-BF16

and, per format and row count, the whole step's linears (sum over shapes x layers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import linear  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402

# name -> ([out, in], layers that have it)
SHAPES = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30),
          "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}
# bytes of weight a call reads per parameter (int4: + a bf16 scale and zero per 32)
BYTES = {"bf16-onednn": 2.0, "fp32-mkl": 4.0, "bf16": 2.0, "bf16-amx": 2.0, "fp32": 4.0, "int8-aten": 1.0,
         "int4-aten": 0.5 + 4 / 32, "int8": 1.0, "int4": 0.5 + 4 / 32, "int8-amx": 1.0, "int4-amx": 0.5 + 4 / 32}
DTYPE = {"fp32-mkl": torch.float32, "fp32": torch.float32}      # activations; the others bf16


def _factories(kernels) -> dict:
    bf16 = torch.bfloat16
    out = {"bf16-onednn": lambda w: linear._dense(w.to(bf16), None),
           "fp32-mkl": lambda w: linear._dense(w, None),
           "int8-aten": lambda w: linear._int8(w, None, None)[0],
           "int4-aten": lambda w: linear._int4(w, None, None)[0]}
    if kernels is not None and kernels.gemv_vectorized():
        out["bf16"] = lambda w: (lambda blocks, n: lambda x: kernels.bf16_gemv(x, blocks, None, n))(
            linear._blocks_of_16(w.to(bf16)), w.shape[0])
        out["fp32"] = lambda w: (lambda wf: lambda x: kernels.fp32_gemv(x, wf, None))(w.contiguous())
    if kernels is not None and kernels.amx_available():
        out["bf16-amx"] = lambda w: (lambda blocks, n: lambda x: kernels.bf16_gemm_amx(x, blocks, None, n))(
            linear._blocks_of_16(w.to(torch.bfloat16)), w.shape[0])
    if kernels is not None:
        out["int8"] = lambda w: linear._int8(w, None, kernels)[0]       # the kernel at every row count
        out["int4"] = lambda w: linear._int4(w, None, kernels)[0]
    if kernels is not None and kernels.amx_int8_available():
        out["int8-amx"] = lambda w: _int8_amx(w, kernels)
    if kernels is not None and kernels.amx_available():
        out["int4-amx"] = lambda w: _int4_amx(w, kernels)
    return out


def _int8_amx(w: torch.Tensor, kernels):
    """int8_gemv's layout and scales (random int8 weights: the time does not depend on them), run by
    the AMX path at every row count (int8_gemv takes it from some rows on by itself)."""
    q = torch.randint(-127, 128, w.shape, dtype=torch.int8)
    blocks, scale = linear._int8_quads(q), torch.full((-(-w.shape[0] // 16) * 16,), 0.01)
    return lambda x: kernels.int8_gemm_amx(x, blocks, scale, None, w.shape[0])


def _int4_amx(w: torch.Tensor, kernels):
    """int4_gemv's layout (random values), run by the AMX path at every row count."""
    groups = (w.shape[0], w.shape[1] // linear.INT4_GROUP)
    packed, sz = linear._int4_blocks(torch.randint(0, 16, w.shape), torch.full(groups, 0.01).bfloat16(),
                                     torch.zeros(groups).bfloat16())
    return lambda x: kernels.int4_gemm_amx(x, packed, sz, None, w.shape[0])


def _step_times(model: dict, xs: dict, reps: int) -> dict:
    """Seconds per call of each shape, median over `reps` passes of a whole step (every layer's
    linears in a step's order, then the LM head)."""
    per = {name: [] for name in SHAPES}
    for rep in range(reps + 1):
        spent = dict.fromkeys(SHAPES, 0.0)
        for i in range(SHAPES["qkv"][1]):
            for name in ("qkv", "o", "gate_up", "down"):
                t0 = time.perf_counter()
                model[name][i](xs[name])
                spent[name] += time.perf_counter() - t0
        t0 = time.perf_counter()
        model["lm_head"][0](xs["lm_head"])
        spent["lm_head"] += time.perf_counter() - t0
        if rep:                     # the first pass warms up
            for name, (_, count) in SHAPES.items():
                per[name].append(spent[name] / count)
    return {name: statistics.median(v) for name, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", default="", help="comma-separated subset of " + ",".join(BYTES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    factories = _factories(cpu_kernels())
    if args.formats:
        factories = {k: v for k, v in factories.items() if k in args.formats.split(",")}
    g = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(n, k, generator=g) * 0.05 for _ in range(count)]
               for name, ((n, k), count) in SHAPES.items()}
    print(f"threads {args.threads}; us per call (GB/s of weights read) at rows {rows}")
    results = {}
    with torch.inference_mode():
        for fmt, make in factories.items():
            model = {name: [make(w) for w in ws] for name, ws in weights.items()}
            for r in rows:
                xs = {name: torch.randn(r, k, generator=g).to(DTYPE.get(fmt, torch.bfloat16))
                      for name, ((_, k), _) in SHAPES.items()}
                results[fmt, r] = _step_times(model, xs, args.reps)
            del model
            for name, ((n, k), count) in SHAPES.items():
                times = [results[fmt, r][name] for r in rows]
                cells = "".join(f"{t * 1e6:8.1f} ({n * k * BYTES[fmt] / t / 1e9:4.1f})" for t in times)
                print(f"{name:8s} [{n:5d},{k:4d}] {fmt:10s}{cells}", flush=True)
    print("whole step's linears, ms:")
    for fmt in factories:
        print(f"  {fmt:10s}" + "".join(
            f"{sum(results[fmt, r][name] * c for name, (_, c) in SHAPES.items()) * 1e3:9.2f}" for r in rows))


if __name__ == "__main__":
    main()
