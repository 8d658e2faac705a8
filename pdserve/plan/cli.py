"""The `pdserve plan` subcommand: arguments and the run, in the order it prints.

  1. resolve the model (preset or HF config, pdserve/plan/model.py) and the hardware (preset, or
     `cpu`: this machine measured now);
  2. print the roofline table (intensities, TTFT/TPOT bounds, KV transfer) and the roofline plan;
  3. with --calibrate: print the efficiencies from the bench report's lowest-load run, the
     measured-vs-predicted table for every run, and the calibrated plan;
  4. with --plot: write the intensity-vs-ridge PNG.
Bad input (unknown model, unreadable config or report) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.plan import calibrate as plan_calibrate
from pdserve.plan import roofline as planner
from pdserve.plan.model import resolve_spec
from serving.config import RoutingOptions

LOCAL_PREFILL_TOKENS = RoutingOptions.model_fields["local_prefill_tokens"].default   # `serve`'s default; simulate's too

HARDWARE_CHOICES = ["h100", "h200", "a100", "l40s", "cpu"]


def add_arguments(pl: argparse.ArgumentParser) -> None:
    """The `plan` subparser's options."""
    pl.add_argument("--model", default="qwen2.5-7b",
                    help="preset (qwen2.5-7b, smollm2-135m), a path to an HF model directory, its config.json or a "
                         ".gguf file, or an HF id in the local Hugging Face cache")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                    help="bytes per parameter and KV element, and on --hardware cpu the matmul measured "
                         "(default: what pdserve serves in: bf16 on GPUs and on CPUs with native bf16 or the engine's AVX2 GEMVs, else fp32)")
    pl.add_argument("--params", type=float, help="override the parameter count (e.g. 7.6e9)")
    pl.add_argument("--hardware", default="h200", choices=HARDWARE_CHOICES)
    pl.add_argument("--input-len", type=int, default=1024)
    pl.add_argument("--output-len", type=int, default=256)
    pl.add_argument("--cached-len", type=int, default=0,
                    help="leading prompt tokens the replicas hold already (a shared system prompt, earlier "
                         "turns): computed once, held once per decode replica")
    pl.add_argument("--local-prefill-tokens", type=int, default=LOCAL_PREFILL_TOKENS,
                    help="with --cached-len: at most this many tokens past the prefix are computed in the decode "
                         "replicas' steps, no prefill replica (pdserve's routing.local_prefill_tokens, default "
                         "%(default)s; 0: every prompt through the prefill pool)")
    pl.add_argument("--rate", type=float, default=10.0, help="requests per second")
    pl.add_argument("--ttft-slo", type=float, default=0.5, help="seconds")
    pl.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    pl.add_argument("--calibrate", metavar="BENCH_JSON",
                    help="a `pdserve bench --json` report of a deployment of this model on this hardware: "
                         "scale the bounds by the measured efficiencies")
    pl.add_argument("--plot", metavar="PNG", help="write intensity-vs-ridge and latency-bound plots")


def _print_plan(label: str, p) -> None:
    print(f"{label}: {p.prefill_replicas} prefill : {p.decode_replicas} decode replicas "
          f"(TTFT {p.ttft * 1e3:.1f} ms, TPOT {p.tpot * 1e3:.1f} ms; {p.reason})")


def run(args) -> int:
    try:
        dtype = args.dtype or planner.served_dtype(args.hardware)
        model = resolve_spec(args.model, dtype, args.params)
        report = None
        if args.calibrate:
            report = plan_calibrate.load_report(args.calibrate)
        if not 0 <= args.cached_len < args.input_len:
            raise ValueError(f"--cached-len {args.cached_len} must be at least 0 and below --input-len "
                             f"{args.input_len}")
        if args.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens {args.local_prefill_tokens} must be at least 0")
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    hw = planner.measure_cpu(dtype) if args.hardware == "cpu" else planner.HARDWARE[args.hardware]
    print(planner.report(model, hw))
    slos = (args.input_len, args.output_len, args.rate, args.ttft_slo, args.tpot_slo)
    cached = f" ({args.cached_len} of them cached)" if args.cached_len else ""
    print(f"\nworkload: {args.rate} req/s, {args.input_len} in{cached} / {args.output_len} out tokens, "
          f"SLOs TTFT {args.ttft_slo * 1e3:.0f} ms, TPOT {args.tpot_slo * 1e3:.0f} ms")
    _print_plan("recommended at the roofline", planner.plan(model, hw, *slos, cached_len=args.cached_len,
                                                            local_prefill_tokens=args.local_prefill_tokens))
    cal = None
    if report is not None:
        try:
            cal = plan_calibrate.calibrate(report, model, hw)
        except ValueError as exc:
            print(f"pdserve plan: {exc}", file=sys.stderr)
            return 2
        print("\n" + plan_calibrate.describe(cal) + "\n")
        print(plan_calibrate.ratio_table(report, model, hw, cal))
        print("(one efficiency per phase: ratios far from 1 at other runs are queueing, prefill/decode "
              "interference or noise that a single factor does not capture)\n")
        _print_plan("recommended, calibrated",
                    planner.plan(model, hw, *slos, prefill_eff=cal.prefill_eff, decode_eff=cal.decode_eff,
                                 cached_len=args.cached_len, local_prefill_tokens=args.local_prefill_tokens))
    if args.plot:
        from pdserve.plan.plot import plot
        plot(args.plot, model, hw, prefill_eff=cal and cal.prefill_eff, decode_eff=cal and cal.decode_eff)
        print(f"\nwrote {args.plot}")
    return 0
