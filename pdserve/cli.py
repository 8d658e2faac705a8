"""`pdserve` command line: `serve` (the HTTP service on Ray Serve), `deploy` (a new config for the
running service: scaling in place), `local-cluster` (the same on a
multi-node Ray cluster with its autoscaler, simulated on this machine: pdserve/local_cluster.py), `generate` (one-shot
generation with a local colocated engine, no Ray), `plan` and `simulate` (pdserve/plan/), `bench` (pdserve/bench.py)
and `run-batch` (an OpenAI batch file against a running server: pdserve/run_batch.py).
Ray, torch and the engine are imported only by the subcommands that need them."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request

from pdserve import run_batch
from pdserve.plan import cli as plan_cli
from pdserve.plan import sim_cli


def _serve(args) -> int:
    import ray

    from pdserve import local_ray

    cfg = _app_config(args)
    if args.address is None:                # one machine: Ray on loopback (pdserve/local_ray.py)
        _check_port(args.host, args.port)   # (with --address, Serve's proxies may bind on other machines)
        try:
            local_ray.init()
        except local_ray.LocalRayError as exc:
            raise SystemExit(str(exc)) from exc
    else:
        _connect(args.address)
    change = f"pdserve deploy --address {ray.get_runtime_context().gcs_address} --config {args.config or 'FILE'}"
    return _serve_until_stopped(cfg, args.host, args.port, change=change)


def _check_port(host: str, port: int) -> None:
    """One line on stderr and exit 2 where `host:port` cannot be listened on (another server holds
    it; a port below 1024 without the right), before Ray starts: else Serve's proxy fails to bind
    it later, a traceback from the controller. (A port taken after this check still fails there.)"""
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as exc:
            print(f"pdserve: cannot listen on {host}:{port}: {exc.strerror or exc} (another server there? "
                  "choose another port: --port N, or make serve PORT=N)", file=sys.stderr)
            raise SystemExit(2) from None


def _connect(address: str, log_to_driver: bool = True) -> None:
    from pdserve import local_ray
    try:
        local_ray.connect(address, log_to_driver=log_to_driver)
    except ConnectionError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def _local_cluster(args) -> int:
    """`pdserve local-cluster`: cluster.local.yaml's fake multi-node cluster (pdserve/local_cluster.py),
    pdserve deployed on it, everything stopped on Ctrl-C."""
    from pdserve.local_cluster import LocalCluster

    cfg = _app_config(args)
    _check_port(args.host, args.port)
    print(f"starting the local cluster of {args.cluster} ...", flush=True)
    cluster = LocalCluster.start(args.cluster)
    try:
        cluster.connect()
        want = {name: t["min_workers"] for name, t in cluster.config["available_node_types"].items()
                if t.get("min_workers")}
        print(f"Ray at {cluster.address} (temp dir {cluster.tmp_dir}); waiting for the nodes {want} ...", flush=True)
        if not cluster.wait_for_nodes(want, timeout_s=300):
            raise SystemExit(f"the autoscaler did not launch the min_workers nodes: {cluster.node_counts()}")
        env = " ".join(f"{k}={v}" for k, v in cluster.driver_env().items())
        return _serve_until_stopped(cfg, args.host, args.port, proxy_location="HeadOnly",
                                    change=f"{env} pdserve deploy --address {cluster.address} --config {args.config}")
    finally:
        left = cluster.stop()
        print(f"local cluster stopped{f' (still alive: {left})' if left else ''}.", flush=True)


def _deploy(args) -> int:
    """`pdserve deploy`: deploy a config over the pdserve application running on a Ray cluster (or
    print the Serve config it would deploy). Scaling changes apply in place; what else changed
    makes Serve replace every replica (pdserve/serve_config.py `application_config`); it says which
    before it deploys, then waits until the application runs."""
    import yaml

    from pdserve.serve_config import application_config, deploy_app, deployed_app_configs, update_summary
    if args.dry_run:
        cfg = _app_config(args)
        print(yaml.safe_dump({"applications": [application_config(cfg, args.name)]}, sort_keys=False), end="")
        return 0
    _connect(args.address, log_to_driver=False)      # the replicas' logs stay in the cluster's
    try:
        running = deployed_app_configs()
    except Exception as exc:  # noqa: BLE001 - Serve's client raises a bare RayServeException
        raise SystemExit(f"pdserve deploy: Serve is not running on the Ray cluster at {args.address} "
                         f"(start it with `pdserve serve`): {exc}") from None
    cfg = _app_config(args, (running.get(args.name) or {}).get("args"))
    app = application_config(cfg, args.name, running=running.get(args.name))
    print(f"deploying {args.name}: {update_summary(running.get(args.name), app)}", flush=True)
    if app != running.get(args.name):
        deploy_app(app, running)
    return _wait_deployed(args.name, app, args.timeout)


def _wait_deployed(name: str, app: dict, timeout: float) -> int:
    """Wait until application `name` runs `app`: 0, or 1 when its deploy failed or `timeout`
    passed (with Serve's messages)."""
    from ray.serve.context import _get_global_client

    def status(x: dict):
        return getattr(x.get("status"), "value", x.get("status"))      # a str enum or a str

    client, deadline, d = _get_global_client(), time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        time.sleep(1)
        d = client.get_serve_details().get("applications", {}).get(name) or {}
        current = d.get("deployed_app_config") == app
        healthy = all(status(v) == "HEALTHY" for v in d.get("deployments", {}).values())
        if current and status(d) == "RUNNING" and healthy:
            print(f"{name} is running the new config.", flush=True)
            return 0
        if current and status(d) in ("DEPLOY_FAILED", "UNHEALTHY"):
            break
    why = [f"{dep} {status(v)}: {v.get('message') or ''}".rstrip(": ")
           for dep, v in (d.get("deployments") or {}).items() if status(v) != "HEALTHY"]
    print(f"pdserve deploy: {name} is {status(d) or 'missing'} after {timeout:.0f} s"
          f"{': ' + d['message'] if d.get('message') else ''}{''.join(f'; {w}' for w in why)}", file=sys.stderr)
    return 1


# the AppConfig keys `pdserve serve` takes as flags
FLAG_KEYS = ("model", "served_model_name", "mode", "model_cache", "api_key", "chat_template", "lora_modules",
             "runtime_lora_updating", "max_loras", "scheduling_policy")


def _app_config(args, running_args: dict | None = None):
    """The AppConfig of `--config` and the flags, its model prepared on this machine.
    `running_args`: the running application's (`pdserve deploy`): of the keys `pdserve serve`
    takes as flags (FLAG_KEYS), those neither the file nor a flag sets are kept from it (the
    service keeps its model, its API key and where it prepared the model; a deploy without them
    would otherwise change them to the defaults)."""
    import pydantic
    import yaml

    from serving.config import AppConfig

    try:
        cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    except (OSError, yaml.YAMLError, pydantic.ValidationError) as exc:
        _config_error(args.config, exc)
    updates = {k: getattr(args, k, None) for k in FLAG_KEYS if getattr(args, k, None) is not None}
    if len(updates.get("served_model_name") or ()) == 1:       # --served-model-name NAME [NAME ...]
        updates["served_model_name"] = updates["served_model_name"][0]
    if "lora_modules" in updates:                               # --lora-modules NAME=PATH [NAME=PATH ...]
        updates["lora_modules"] = dict(updates["lora_modules"])
    data = cfg.model_dump()
    data.update(updates)
    kept = [k for k in FLAG_KEYS if running_args and k in running_args
            and k not in cfg.model_fields_set and k not in updates and running_args[k] != data[k]]
    for key in kept:
        data[key] = running_args[key]
    if kept:
        print(f"kept from the running application: {', '.join(kept)}", flush=True)
    for pool in ("prefill", "decode"):
        n = getattr(args, f"{pool}_replicas", None)
        if n is not None:
            data[pool]["num_replicas"] = n
    if getattr(args, "allowed_origin", None):
        data["cors"]["allowed_origins"] = args.allowed_origin
    try:
        cfg = AppConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        _config_error("the flags", exc)
    # stdout is the Serve config with `deploy --dry-run`
    print(f"preparing model {cfg.model} ...", file=sys.stderr if getattr(args, "dry_run", False) else sys.stdout,
          flush=True)
    _model_dir(cfg.model, cfg.model_cache)          # before Ray starts
    return cfg


def _config_error(source: str, exc: Exception):
    """A configuration that does not validate (or a file that does not read): what is wrong, one line a
    problem, on stderr, and exit 2 before anything starts."""
    import pydantic
    if isinstance(exc, pydantic.ValidationError):
        problems = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors()]        # a validator's message as written
    else:
        problems = [str(exc).splitlines()[0] if str(exc) else type(exc).__name__]
    print(f"pdserve: invalid configuration in {source}:", *(f"  {p}" for p in problems), sep="\n", file=sys.stderr)
    raise SystemExit(2) from None


def _model_dir(spec: str, cache: str | None):
    """`serving.models.resolve_model`, or one line on stderr and exit 2 (an unknown spec, a directory
    without weights, an architecture the engine cannot run, a failed preparation)."""
    from serving.models import ModelError, resolve_model
    try:
        return resolve_model(spec, cache)
    except ModelError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve_until_stopped(cfg, host: str, port: int, change: str, proxy_location: str | None = None) -> int:
    """Start Serve on the connected Ray, deploy `cfg`, wait until healthy, then until Ctrl-C or SIGTERM;
    shut Serve and the driver down. `change`: the command line that changes the deployment, shown."""
    import ray
    from ray import serve

    from pdserve.serve_config import deploy
    serve.start(http_options={"host": host, "port": port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    # as a Serve config (an application-level policy needs one), so that `pdserve deploy` can
    # change it in place later
    deploy(cfg, "pdserve", cfg.route_prefix)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    _wait_healthy(base, timeout=600)
    print(f"\npdserve is up ({cfg.mode}) at {base}  model: {cfg.model_name}\n\n"
          f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{cfg.model_name}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'\n\n"
          f"Change it (from another shell): {change}\nCtrl-C stops everything.", flush=True)
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

    from serving.chat_template import chat_template_text

    try:
        template = None if args.chat_template is None else chat_template_text(args.chat_template)
    except ValueError as exc:
        raise SystemExit(f"pdserve generate: --chat-template: {exc}") from None
    model_dir = _model_dir(args.model, args.model_cache)
    loras = {} if args.lora is None else {"lora": args.lora}
    try:
        engine = LLMEngine(EngineConfig(model=str(model_dir), num_threads=args.threads, lora_modules=loras))
    except ValueError as exc:           # an adapter it cannot serve
        raise SystemExit(f"pdserve generate: {exc}") from None
    tok = engine.tokenizer
    if template is not None:
        tok.chat_template = template
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            lora=None if args.lora is None else "lora")
    out = engine.generate([ids], params)[0]
    print(json.dumps({"text": out.text, "finish_reason": out.finish_reason,
                      "prompt_tokens": len(ids), "completion_tokens": len(out.token_ids)}, ensure_ascii=False))
    return 0


def _lora_module(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def _app_arguments(p: argparse.ArgumentParser) -> None:
    """The application's options, shared by `serve` and `deploy` (`_app_config` reads them)."""
    p.add_argument("--config", help="Serve config YAML (see serve_config.yaml)")
    p.add_argument("--model", help="the default model's id, a local HF model directory, a .gguf file, "
                   "or an HF id in the local Hugging Face cache")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model's id in the API; more names are aliases (as vLLM's flag)")
    p.add_argument("--model-cache", help="where the default model and GGUF files are converted and cached")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template in place of the model's own: a file, or the template's text")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", type=_lora_module,
                   help="LoRA adapters (PEFT directories) served beside the model; a request names one as its "
                        "model (as vLLM's flag; sets lora_modules)")
    p.add_argument("--runtime-lora-updating", action="store_true", default=None,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; sets runtime_lora_updating)")
    p.add_argument("--max-loras", type=int, metavar="N",
                   help="LoRA adapters loaded at run time each replica holds at once (as vLLM's flag; sets max_loras)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   help="fcfs (default) or priority: by each request's `priority`, lower first (as vLLM's flag)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every "
                   "endpoint but /health")
    p.add_argument("--allowed-origin", action="append", metavar="ORIGIN",
                   help="a web page origin that may call the API from a browser (CORS), e.g. http://localhost:3000, "
                        "or '*' for any; repeat for more (sets cors.allowed_origins)")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)


def build_parser() -> argparse.ArgumentParser:
    """The command line of every subcommand but `bench` (its own: pdserve/bench.py)."""
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start the OpenAI-compatible service on Ray Serve")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--address", help="existing Ray cluster address (e.g. 'auto' on a `ray up` head node); "
                                     "default: start a local cluster")
    _app_arguments(s)
    s.set_defaults(fn=_serve)
    d = sub.add_parser("deploy", help="deploy a config over the running pdserve (scaling changes in place)")
    d.add_argument("--address", default="auto", help="the Ray cluster pdserve serves on (default: auto, the "
                                                     "cluster `pdserve serve` or `ray start` began on this machine)")
    d.add_argument("--name", default="pdserve", help="Serve application name (default pdserve)")
    d.add_argument("--timeout", type=float, default=600, help="seconds to wait for the new config to run")
    d.add_argument("--dry-run", action="store_true", help="print the Serve config it would deploy (for "
                                                          "`serve deploy`), deploy nothing")
    _app_arguments(d)
    d.set_defaults(fn=_deploy)
    lc = sub.add_parser("local-cluster", help="cluster.local.yaml on this machine (Ray's autoscaler with fake "
                                              "nodes) with pdserve deployed; Ctrl-C stops everything")
    lc.add_argument("--cluster", default="cluster.local.yaml", help="fake multi-node cluster config")
    lc.add_argument("--config", default="serve_config.cluster.local.yaml", help="Serve config YAML")
    lc.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    lc.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    lc.add_argument("--model", help="the default model's id, a local HF model directory, a .gguf file, "
                    "or an HF id in the local Hugging Face cache")
    lc.add_argument("--model-cache", help="where the default model and GGUF files are converted and cached")
    lc.set_defaults(fn=_local_cluster)
    sub.add_parser("bench", help="load-test any OpenAI-compatible endpoint (pdserve bench --help)")
    rb = sub.add_parser("run-batch", help="an OpenAI batch input file (JSONL) against a running server, its "
                                          "output file written (as vLLM's run-batch)")
    run_batch.add_arguments(rb)
    rb.set_defaults(fn=run_batch.main)
    g = sub.add_parser("generate", help="one-shot chat generation with a local engine (no Ray)")
    g.add_argument("prompt")
    g.add_argument("--model", default="SmolLM2-135M-Instruct")
    g.add_argument("--model-cache")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--threads", type=int)
    g.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template in place of the model's own")
    g.add_argument("--lora", metavar="DIR", help="a PEFT LoRA adapter's directory to run the prompt with")
    g.set_defaults(fn=_generate)
    pl = sub.add_parser("plan", help="prefill/decode roofline and replica ratio for a workload")
    plan_cli.add_arguments(pl)
    pl.set_defaults(fn=plan_cli.run)
    sm = sub.add_parser("simulate", help="discrete-event simulation of a P/D or colocated fleet (pdserve/plan/sim_cli.py)")
    sim_cli.add_arguments(sm)
    sm.set_defaults(fn=sim_cli.run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:                       # its own parser: see pdserve/bench.py
        from pdserve import bench
        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
