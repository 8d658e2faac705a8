"""The `pdserve simulate` subcommand: a P/D fleet simulated from the planner's per-replica model.

  1. the per-replica model: `--model`/`--hardware` (as `pdserve plan`), efficiencies from
     `--calibrate BENCH_JSON` (or `--prefill-eff`/`--decode-eff`), engine limits;
  2. one of:
     * `--fleet P:D` or `--fleet colocated:N`: one fixed fleet under `--rate`, `--schedule` or `--trace`;
     * `--policy slo|per-pool`: one autoscaled fleet (from 1:1) under `--schedule` or `--trace`;
     * `--validate BENCH_JSON`: each measured run of the report against its simulation;
     * none of these: the comparison at each of `--rates` (colocated vs best P:D split vs both policies),
       the recommended split, and with `--schedule` the two policies' replicas over time;
     with `--fleet`, `--policy` or `--validate`, `--host-cpu HOST_JSON` (and `--host-interference`)
     makes the replicas share one host's cores with the serving work, as `benchmarks/host_cpu.py` (and
     `core_interference.py`) measured them (pdserve/plan/sim_host.py);
  3. prints markdown tables; `--json` and `--plot` write them.
Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from pdserve.plan import calibrate as plan_calibrate
from pdserve.plan import sim_validate
from pdserve.plan import roofline
from pdserve.plan.cli import LOCAL_PREFILL_TOKENS
from pdserve.plan.model import resolve_spec
from pdserve.plan.sim_host import HostCpu
from pdserve.plan.sim_load import parse_schedule, poisson, prompt_lengths, read_trace
from pdserve.plan.sim_report import step_model, summarize
from pdserve.plan.sim_study import HEADER, Study, autoscaled, compare, make_scaler, recommend
from pdserve.plan.simulator import Fleet, Simulator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-7b",
                   help="preset, HF model directory / config.json, .gguf file or cached HF id (as plan)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="as plan's (default: what pdserve serves in)")
    p.add_argument("--params", type=float)
    p.add_argument("--hardware", default="h100", choices=["h100", "h200", "a100", "l40s", "cpu"])
    p.add_argument("--calibrate", metavar="BENCH_JSON", help="efficiencies from a pdserve bench report")
    p.add_argument("--calibration-run", metavar="NAME_END", help="calibrate from the report's run whose name ends "
                   "with this (e.g. 'rate 0.5/s') instead of its lowest-load run")
    p.add_argument("--prefill-eff", type=float, default=None, help="compute efficiency (default 1 or calibrated)")
    p.add_argument("--decode-eff", type=float, default=None, help="bandwidth efficiency (default 1 or calibrated)")
    p.add_argument("--kv-tokens", type=int, help="KV tokens per replica (default: 90%% of memory beside weights)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget of a step (prefill chunk)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--jitter", type=float, default=0.2, help="prompt lengths uniform in input_len * (1 +- jitter)")
    p.add_argument("--cached-len", type=int, default=0, help="every prompt's first N tokens are a prefix all "
                   "replicas hold (a shared system prompt): computed and sent once, held once per replica")
    p.add_argument("--local-prefill-tokens", type=int, default=LOCAL_PREFILL_TOKENS,
                   help="with --cached-len: a prompt computing at most this many tokens beyond the prefix, with "
                        "those its decode replica has queued, is prefilled by that replica in its decode steps "
                        "(pdserve's routing.local_prefill_tokens, default %(default)s; 0: all to the prefill pool)")
    p.add_argument("--ttft-slo", type=float, default=0.5)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--rates", default="1,10,100", help="comparison rates (req/s)")
    p.add_argument("--rate", type=float, help="one constant Poisson rate (with --fleet)")
    p.add_argument("--schedule", help="piecewise-constant Poisson rate 'time:rate,...', e.g. 0:1,60:50,180:5")
    p.add_argument("--trace", help="CSV of arrival_s,input_len,output_len")
    p.add_argument("--fleet", help="'P:D' or 'colocated:N': simulate this fixed fleet")
    p.add_argument("--policy", choices=["slo", "per-pool"], help="simulate one autoscaled fleet")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    p.add_argument("--startup-s", type=float, default=30.0, help="a new replica serves after this long")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment a fixed fleet must reach")
    p.add_argument("--max-replicas", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validate", metavar="BENCH_JSON", help="simulate each open-loop run of a pdserve bench report "
                   "on 1:1 and compare with the measurement (calibrates from it unless --calibrate is given)")
    p.add_argument("--seeds", type=int, default=20, help="--validate: simulations per run")
    p.add_argument("--host-cpu", metavar="HOST_JSON", help="replicas share one host's cores: costs from a "
                   "benchmarks/host_cpu.py report (a line through its two lowest rates); with --validate the efficiencies are then "
                   "calibrated by simulating the calibration run")
    p.add_argument("--host-interference", metavar="CORE_JSON", help="with --host-cpu: how much a decode step slows "
                   "while another engine steps, from a benchmarks/core_interference.py report (default: not at all)")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG")


def _model(args):
    dtype = args.dtype or roofline.served_dtype(args.hardware)
    spec = resolve_spec(args.model, dtype, args.params)
    hw = roofline.measure_cpu(dtype) if args.hardware == "cpu" else roofline.HARDWARE[args.hardware]
    pe, de = 1.0, 1.0
    if args.calibrate or args.validate:
        cal = plan_calibrate.calibrate(plan_calibrate.load_report(args.calibrate or args.validate), spec, hw,
                                       args.calibration_run)
        pe, de = cal.prefill_eff, cal.decode_eff
        print(plan_calibrate.describe(cal))
    pe = args.prefill_eff or pe
    de = args.decode_eff or de
    return step_model(spec, hw, pe, de, args.kv_tokens, args.max_num_seqs, args.max_batched_tokens), spec, hw


def _requests(args, study: Study):
    if args.trace:
        reqs = read_trace(args.trace, args.cached_len)
        return reqs, max(r.arrival for r in reqs), None
    schedule = parse_schedule(args.schedule) if args.schedule else [(0.0, args.rate or 1.0)]
    return poisson(schedule, args.duration, args.input_len, args.output_len, args.jitter, args.seed,
                   args.cached_len), \
        args.duration, schedule


def _fleet(text: str, local_prefill_tokens: int) -> Fleet:
    kind, _, n = text.partition(":")
    try:
        return Fleet("colocated", int(n)) if kind == "colocated" else \
            Fleet("disaggregated", int(kind), int(n), local_prefill_tokens=local_prefill_tokens)
    except ValueError:
        raise ValueError(f"--fleet {text!r}: expected 'P:D' or 'colocated:N'") from None


def _print_summary(label: str, s: dict) -> None:
    ms = (lambda v: f"{v * 1e3:.0f}" if v is not None else "-")
    print(f"| {label} | {ms(s['ttft_p50'])}/{ms(s['ttft_p90'])} | {ms(s['tpot_p50'])}/{ms(s['tpot_p90'])} "
          f"| {s['finished']}/{s['requests']} | {s['goodput']:.2f} | {s['attainment']:.2f} "
          f"| {s['replica_seconds']:.0f} | {s['goodput_per_replica']:.2f} |")


SUMMARY_HEADER = ("| fleet | TTFT p50/p90 ms | TPOT p50/p90 ms | finished | goodput req/s | attainment "
                  "| replica-s | goodput/replica |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def run(args) -> int:
    try:
        m, spec, hw = _model(args)
        study = Study(args.input_len, args.output_len, args.ttft_slo, args.tpot_slo, args.duration, args.jitter,
                      args.target, args.startup_s, args.max_replicas, args.seed, args.cached_len,
                      args.local_prefill_tokens)
        if args.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens {args.local_prefill_tokens} must be at least 0")
        if args.cached_len:
            if args.validate:
                raise ValueError("--cached-len does not apply to --validate (a bench report's prompts share no prefix)")
            if not 0 < args.cached_len < m.kv_tokens:
                raise ValueError(f"--cached-len {args.cached_len} must be positive and below the KV a replica holds")
            shortest = prompt_lengths(args.input_len, args.jitter)[0]
            if not args.trace and args.cached_len >= shortest:
                raise ValueError(f"--cached-len {args.cached_len} must be below the shortest prompt ({shortest} "
                                 "tokens: --input-len less --jitter)")
            m = dataclasses.replace(m, kv_tokens=m.kv_tokens - args.cached_len)   # the prefix, held once
        fleet = _fleet(args.fleet, args.local_prefill_tokens) if args.fleet else None
        rates = [float(r) for r in args.rates.split(",")] if not (fleet or args.policy) else []
        if args.policy and not (args.schedule or args.trace):
            raise ValueError("--policy needs --schedule or --trace")
        host = HostCpu.from_measurement(args.host_cpu) if args.host_cpu else None
        if args.host_interference:
            if not host:
                raise ValueError("--host-interference needs --host-cpu")
            host = host.with_interference(args.host_interference)
        if host and not (fleet or args.policy or args.validate):
            raise ValueError("--host-cpu models one host: use it with --fleet, --policy or --validate")
        if host and args.validate:
            m = sim_validate.calibrate_by_simulation(m, plan_calibrate.load_report(args.validate), host,
                                                     args.calibration_run, args.seeds)
    except ValueError as exc:
        print(f"pdserve simulate: {exc}", file=sys.stderr)
        return 2
    prefix = f" beside a {args.cached_len}-token shared prefix" if args.cached_len else ""
    window = f", a {spec.window}-token window on {spec.window_layers} of {spec.layers} layers" if spec.window else ""
    print(f"{spec.name} on {hw.name}: prefill eff {m.prefill_eff:.3g}, decode eff {m.decode_eff:.3g}, "
          f"KV {m.kv_tokens} tokens/replica{prefix}{window}, max_num_seqs {m.max_num_seqs}, step budget "
          f"{m.max_batched_tokens}; SLOs TTFT {args.ttft_slo * 1e3:.0f} ms, TPOT {args.tpot_slo * 1e3:.0f} ms")
    if host:
        print(f"one host: {host.cores:g} cores, {host.engine_cores:g} per stepping engine, "
              f"{host.token_cpu * 1e3:.2f} ms CPU per streamed token ({host.loop_token_cpu * 1e3:.2f} ms of it in "
              f"the decode replica's loop, serial with its step), {host.base_cores:.2f} cores of background, "
              f"decode steps beside another engine x{host.decode_interference:.2f}"
              + ("; efficiencies calibrated by simulation" if args.validate else ""))
    t0, out, timelines = time.perf_counter(), {"args": vars(args)}, {}
    if args.validate:
        rows = sim_validate.validate(m, plan_calibrate.load_report(args.validate), args.seeds, host)
        print(sim_validate.table(rows))
        out["validation"] = rows
    elif fleet or args.policy:
        try:
            reqs, duration, schedule = _requests(args, study)
        except ValueError as exc:
            print(f"pdserve simulate: {exc}", file=sys.stderr)
            return 2
        if args.policy:
            fleet = Fleet("disaggregated", 1, 1, make_scaler(m, study, args.policy), startup_s=args.startup_s,
                          local_prefill_tokens=args.local_prefill_tokens)
        res = Simulator(m, fleet, args.seed, host=host).run(reqs, duration)
        summary = summarize(res, args.ttft_slo, args.tpot_slo)
        print(SUMMARY_HEADER)
        _print_summary(args.fleet or f"{args.policy} policy", summary)
        out["summary"], out["timeline"] = summary, res.timeline
        if args.policy and schedule:
            timelines[args.policy] = (res, schedule)
    else:
        print(HEADER)
        rows = compare(m, study, rates)
        print("\nrecommended: " + recommend(rows))
        out["rows"] = rows
        if args.schedule:
            schedule = parse_schedule(args.schedule)
            print(f"\nautoscaling under the schedule {args.schedule}:\n" + SUMMARY_HEADER)
            for policy in ("slo", "per-pool"):
                summary, res = autoscaled(m, study, 0, policy, schedule=schedule, duration=args.duration)
                _print_summary(f"{policy} policy", summary)
                timelines[policy] = (res, schedule)
                out[f"{policy}_schedule"] = {"summary": summary, "timeline": res.timeline}
    print(f"\n(simulated in {time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.plot:
        from pdserve.plan.sim_plot import plot
        plot(args.plot, out.get("rows", []), timelines, f"{spec.name} on {hw.name}")
        print(f"wrote {args.plot}")
    return 0
