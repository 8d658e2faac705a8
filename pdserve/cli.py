"""`pdserve` command line: `serve` (the HTTP service on Ray Serve), `local-cluster` (the same on a
multi-node Ray cluster with its autoscaler, simulated on this machine: pdserve/local_cluster.py), `generate` (one-shot
generation with a local colocated engine, no Ray), `plan` and `simulate` (pdserve/plan/) and `bench` (pdserve/bench.py).
Ray, torch and the engine are imported only by the subcommands that need them."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request

from pdserve.plan import cli as plan_cli
from pdserve.plan import sim_cli


def _serve(args) -> int:
    import ray

    from pdserve import local_ray

    cfg = _app_config(args, local=args.address is None)
    if args.address is None:                # one machine: Ray on loopback (pdserve/local_ray.py)
        try:
            local_ray.init()
        except local_ray.LocalRayError as exc:
            raise SystemExit(str(exc)) from exc
    else:
        ray.init(address=args.address, logging_level="WARNING")
    return _serve_until_stopped(cfg, args.host, args.port)


def _local_cluster(args) -> int:
    """`pdserve local-cluster`: cluster.local.yaml's fake multi-node cluster (pdserve/local_cluster.py),
    pdserve deployed on it, everything stopped on Ctrl-C."""
    from pdserve.local_cluster import LocalCluster

    cfg = _app_config(args, local=False)
    print(f"starting the local cluster of {args.cluster} ...", flush=True)
    cluster = LocalCluster.start(args.cluster)
    try:
        cluster.connect()
        want = {name: t["min_workers"] for name, t in cluster.config["available_node_types"].items()
                if t.get("min_workers")}
        print(f"Ray at {cluster.address} (temp dir {cluster.tmp_dir}); waiting for the nodes {want} ...", flush=True)
        if not cluster.wait_for_nodes(want, timeout_s=300):
            raise SystemExit(f"the autoscaler did not launch the min_workers nodes: {cluster.node_counts()}")
        return _serve_until_stopped(cfg, args.host, args.port, proxy_location="HeadOnly")
    finally:
        left = cluster.stop()
        print(f"local cluster stopped{f' (still alive: {left})' if left else ''}.", flush=True)


def _app_config(args, local: bool):
    from serving.config import AppConfig

    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    updates = {k: v for k, v in {"model": args.model, "mode": getattr(args, "mode", None),
                                 "model_cache": args.model_cache,
                                 "api_key": getattr(args, "api_key", None)}.items() if v is not None}
    data = cfg.model_dump()
    data.update(updates)
    for pool in ("prefill", "decode"):
        n = getattr(args, f"{pool}_replicas", None)
        if n is not None:
            data[pool]["num_replicas"] = n
    if local:
        data["transfer"]["host"] = "127.0.0.1" if data["transfer"]["host"] == "auto" else data["transfer"]["host"]
    cfg = AppConfig.model_validate(data)
    print(f"preparing model {cfg.model} ...", flush=True)
    _model_dir(cfg.model, cfg.model_cache)          # before Ray starts
    return cfg


def _model_dir(spec: str, cache: str | None):
    """`serving.models.resolve_model`, or one line on stderr and exit 2 (an unknown spec, a directory
    without weights, an architecture the engine cannot run, a failed preparation)."""
    from serving.models import ModelError, resolve_model
    try:
        return resolve_model(spec, cache)
    except ModelError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve_until_stopped(cfg, host: str, port: int, proxy_location: str | None = None) -> int:
    """Start Serve on the connected Ray, deploy `cfg`, wait until healthy, then until Ctrl-C or SIGTERM;
    shut Serve and the driver down."""
    import ray
    from ray import serve

    from pdserve.app_builder import build_app, deploy
    serve.start(http_options={"host": host, "port": port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    if cfg.autoscaling is not None:         # an application-level policy needs a config deploy
        deploy(cfg, "pdserve", cfg.route_prefix)
    else:
        serve.run(build_app(cfg), name="pdserve", route_prefix=cfg.route_prefix, blocking=False)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    _wait_healthy(base, timeout=600)
    print(f"\npdserve is up ({cfg.mode}) at {base}  model: {cfg.model_name}\n\n"
          f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{cfg.model_name}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'\n\nCtrl-C stops everything.", flush=True)
    stop = threading.Event()
    # Ray installs its own SIGINT handling in the driver; ours makes Ctrl-C (and SIGTERM) stop cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
        print("\nstopping ...", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("stopped.", flush=True)
    return 0


def _wait_healthy(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise SystemExit(f"the service did not become healthy within {timeout:.0f} s")


def _generate(args) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model_dir = _model_dir(args.model, args.model_cache)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_threads=args.threads))
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = engine.generate([ids], params)[0]
    print(json.dumps({"text": out.text, "finish_reason": out.finish_reason,
                      "prompt_tokens": len(ids), "completion_tokens": len(out.token_ids)}, ensure_ascii=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:                       # its own parser: see pdserve/bench.py
        from pdserve import bench
        return bench.main(argv[1:])
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start the OpenAI-compatible service on Ray Serve")
    s.add_argument("--config", help="Serve config YAML (see serve_config.yaml)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--address", help="existing Ray cluster address (e.g. 'auto' on a `ray up` head node); "
                                     "default: start a local cluster")
    s.add_argument("--model", help="default model id or a local HF model directory")
    s.add_argument("--model-cache", help="where the default model is converted and cached")
    s.add_argument("--mode", choices=["disaggregated", "colocated"])
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    s.add_argument("--prefill-replicas", type=int)
    s.add_argument("--decode-replicas", type=int)
    s.set_defaults(fn=_serve)
    lc = sub.add_parser("local-cluster", help="cluster.local.yaml on this machine (Ray's autoscaler with fake "
                                              "nodes) with pdserve deployed; Ctrl-C stops everything")
    lc.add_argument("--cluster", default="cluster.local.yaml", help="fake multi-node cluster config")
    lc.add_argument("--config", default="serve_config.cluster.local.yaml", help="Serve config YAML")
    lc.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    lc.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    lc.add_argument("--model", help="default model id or a local HF model directory")
    lc.add_argument("--model-cache", help="where the default model is converted and cached")
    lc.set_defaults(fn=_local_cluster)
    sub.add_parser("bench", help="load-test any OpenAI-compatible endpoint (pdserve bench --help)")
    g = sub.add_parser("generate", help="one-shot chat generation with a local engine (no Ray)")
    g.add_argument("prompt")
    g.add_argument("--model", default="SmolLM2-135M-Instruct")
    g.add_argument("--model-cache")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--threads", type=int)
    g.set_defaults(fn=_generate)
    pl = sub.add_parser("plan", help="prefill/decode roofline and replica ratio for a workload")
    plan_cli.add_arguments(pl)
    pl.set_defaults(fn=plan_cli.run)
    sm = sub.add_parser("simulate", help="discrete-event simulation of a P/D or colocated fleet (pdserve/plan/sim_cli.py)")
    sim_cli.add_arguments(sm)
    sm.set_defaults(fn=sim_cli.run)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
