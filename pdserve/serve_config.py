"""The Serve config of a pdserve application, and deploying it (torch-free: `pdserve deploy` runs
beside the replicas on a serving host and imports neither the engine nor the services).

Each pool's scaling (`scaling_options`: its replica count or autoscaling config, and its
autoscaling targets as the `user_config` its replicas read) is what Serve can change in place on a
redeploy, through a Serve config's `deployments` overrides; a change in `args` (or in an
autoscaling policy's function or arguments) changes the application's code version and Serve
replaces every replica. So `application_config` moves the scaling out of `args` into the
overrides, `update_summary` says beforehand which of the two a new config does, and `deploy_app`
deploys it without removing the other config-deployed applications. `build_app`
(pdserve/app_builder.py) sets the same scaling options on the deployments it builds.

With `autoscaling: {policy: slo}` the application also gets an application-level policy
(`slo_policy(cfg)`), which lives in the Serve application config, outside `args`.
"""

from __future__ import annotations

import dataclasses

from pdserve.plan import calibrate as plan_calibrate
from pdserve.plan import roofline
from pdserve.plan.model import resolve_spec
from pdserve.plan.sim_report import step_model
from serving.config import AppConfig, PoolConfig
from serving.scaling_config import AutoscalingOptions, PoolBounds, ScalingTargets, SloAutoscalingOptions
from serving.models import resolve_model
from serving.ray_compat import app_code_version


POLICIES = {"prefill": "serving.autoscaling:PrefillPolicy", "decode": "serving.autoscaling:DecodePolicy",
            "colocated": "serving.autoscaling:DecodePolicy"}


def autoscaling_config(pool_name: str, a: AutoscalingOptions) -> dict:
    """Serve's autoscaling_config for a pool: bounds and delays, plus our policy with its hysteresis
    and warm-up (its targets go to the replicas: `scaling_options`)."""
    kwargs = {"hysteresis": a.hysteresis, "warmup_s": a.warmup_s}
    to_zero = {} if a.downscale_to_zero_delay_s is None else {"downscale_to_zero_delay_s": a.downscale_to_zero_delay_s}
    return {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": a.initial_replicas if a.initial_replicas is not None else a.min_replicas,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s, **to_zero,
            "look_back_period_s": a.look_back_period_s, "metrics_interval_s": a.metrics_interval_s,
            "policy": {"policy_function": POLICIES[pool_name], "policy_kwargs": kwargs}}


def slo_bounds_config(b: PoolBounds, a: SloAutoscalingOptions) -> dict:
    """A pool's autoscaling_config under the SLO policy: bounds and delays; the policy is the app's."""
    return {"min_replicas": b.min_replicas, "max_replicas": b.max_replicas,
            "initial_replicas": b.initial_replicas or b.min_replicas,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s, "metrics_interval_s": a.metrics_interval_s}


_PLAN_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}   # engine.dtype -> the planner's


def slo_policy(cfg: AppConfig) -> dict:
    """The application-level `autoscaling_policy` for `autoscaling: {policy: slo}`: SloPolicy with the
    per-replica model of the decode pool's engine from the planner (the served model's HF config in
    the decode engine's dtype; the hardware preset, or this CPU measured now in that dtype;
    efficiencies from `calibrate` or given). Side effects: prepares the model directory;
    `hardware: cpu` runs a 1-second CPU measurement."""
    a = cfg.autoscaling
    engine = cfg.engine_for("decode")
    dtype = _PLAN_DTYPES.get(engine.dtype) or roofline.served_dtype(a.hardware)     # auto: as the engine
    spec = resolve_spec(str(resolve_model(cfg.model, cfg.model_cache, progress=False)), dtype)
    hw = roofline.measure_cpu(dtype) if a.hardware == "cpu" else roofline.HARDWARE[a.hardware]
    pe = de = 1.0
    if a.calibrate:
        cal = plan_calibrate.calibrate(plan_calibrate.load_report(a.calibrate), spec, hw)
        pe, de = cal.prefill_eff, cal.decode_eff
    kv_tokens = int(2**30 // spec.kv_bytes_per_token) if a.hardware == "cpu" else None   # CPU auto pool: 1 GiB
    m = step_model(spec, hw, a.prefill_eff or pe, a.decode_eff or de, kv_tokens, engine.max_num_seqs,
                   cfg.engine_for("prefill").max_num_batched_tokens)
    return {"policy_function": "serving.slo_autoscaling:SloPolicy",
            "policy_kwargs": {"model": dataclasses.asdict(m), "ttft_slo": a.ttft_slo, "tpot_slo": a.tpot_slo,
                              "utilization": a.utilization, "hysteresis": a.hysteresis, "warmup_s": a.warmup_s,
                              "window_s": a.window_s, "correction_gain": a.correction_gain}}


POOL_DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer", "colocated": "ColocatedServer"}


def pools_of(cfg: AppConfig) -> tuple[str, ...]:
    return ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode")


def scaling_options(pool_name: str, pool: PoolConfig, slo: SloAutoscalingOptions | None = None) -> dict:
    """A pool deployment's scaling options, the ones Serve changes in place on a redeploy: its
    replica count or autoscaling_config, and its autoscaling targets as the `user_config` the
    replicas read (`EngineReplica.reconfigure`)."""
    targets = pool.autoscaling.targets if pool.autoscaling is not None else ScalingTargets()
    options: dict = {"user_config": targets.model_dump()}
    if slo is not None:
        options["autoscaling_config"] = slo_bounds_config(getattr(slo, pool_name), slo)
    elif pool.autoscaling is None:
        options["num_replicas"] = pool.num_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(pool_name, pool.autoscaling)
    return options


def without_scaling(cfg: AppConfig) -> AppConfig:
    """`cfg` with every pool's scaling (num_replicas, autoscaling; the SLO policy's pool bounds) at
    its default: the `args` of `application_config`, so that a new scaling leaves them, and the
    application's code version, as they were."""
    pool = {"num_replicas": 1, "autoscaling": None}
    update = {name: getattr(cfg, name).model_copy(update=pool) for name in POOL_DEPLOYMENTS}
    if cfg.autoscaling is not None:
        update["autoscaling"] = cfg.autoscaling.model_copy(update={"prefill": PoolBounds(), "decode": PoolBounds()})
    return cfg.model_copy(update=update)


def application_config(cfg: AppConfig, name: str = "pdserve", route_prefix: str | None = None,
                       running: dict | None = None) -> dict:
    """A Serve application config (one entry of a Serve config file's `applications`) for `cfg`:
    `args` without the pools' scaling, which goes into the `deployments` overrides (Serve applies a
    change there in place: replica counts, bounds, delays, targets; a change in `args` or in a
    policy's function or arguments changes the application's code version, and Serve replaces
    every replica), and the application-level SLO policy when `cfg.autoscaling` asks for it.
    `running`: the config of the application deployed now, if any; with the same `args` its SLO
    policy is kept (`hardware: cpu` measures this CPU anew each time, which would change it)."""
    args = without_scaling(cfg).model_dump(mode="json")
    overrides = [{"name": POOL_DEPLOYMENTS[p], **scaling_options(p, getattr(cfg, p), cfg.autoscaling)}
                 for p in pools_of(cfg)]
    app = {"name": name, "route_prefix": route_prefix or cfg.route_prefix,
           "import_path": "pdserve.app_builder:app_builder", "args": args, "deployments": overrides}
    if cfg.autoscaling is not None:
        same = running is not None and running.get("args") == args and running.get("autoscaling_policy")
        app["autoscaling_policy"] = running["autoscaling_policy"] if same else slo_policy(cfg)
    return app


def update_summary(running: dict | None, new: dict) -> str:
    """What deploying application config `new` over `running` (None: nothing deployed) does."""
    if running is None:
        return "a new application"
    if app_code_version(running) != app_code_version(new):
        changed = sorted(k for k in {*running.get("args", {}), *new["args"]}
                         if running.get("args", {}).get(k) != new["args"].get(k))
        policies = [f"{d['name']} autoscaling policy" for d in new["deployments"]
                    if (d.get("autoscaling_config") or {}).get("policy")
                    != (_override(running, d["name"]).get("autoscaling_config") or {}).get("policy")]
        if running.get("autoscaling_policy") != new.get("autoscaling_policy"):
            policies.append("the SLO policy")
        what = ", ".join([*(f"args.{k}" for k in changed), *policies]) or "the import path or runtime env"
        return f"Serve replaces every replica (changed: {what})"
    keys = ("num_replicas", "autoscaling_config", "user_config")
    changed = [f"{d['name']} {k}" for d in new["deployments"] for k in keys
               if d.get(k) != _override(running, d["name"]).get(k)]
    return f"in place, no replica restarted ({', '.join(changed)})" if changed else "no change"


def _override(app: dict, deployment: str) -> dict:
    return next((d for d in app.get("deployments") or () if d.get("name") == deployment), {})


def deploy(cfg: AppConfig, name: str = "pdserve", route_prefix: str | None = None) -> None:
    """Deploy `cfg` as the config-deployed Serve application `name` (`application_config`): see
    `deploy_app`."""
    deployed = deployed_app_configs()
    deploy_app(application_config(cfg, name, route_prefix, running=deployed.get(name)), deployed)


def deploy_app(app: dict, deployed: dict[str, dict]) -> None:
    """Deploy the application config `app`, a new application or over the running one of its name;
    Serve must be started. `deployed`: `deployed_app_configs()`, read by the caller; those other
    than `app` are deployed again unchanged (a config deploy removes those it does not list).
    Returns once the controller accepted it (not when it is healthy)."""
    from ray.serve.context import _get_global_client   # Serve's own client: `serve deploy` without the dashboard
    from ray.serve.schema import ServeDeploySchema
    others = [a for a in deployed.values() if a["name"] != app["name"]]
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[*others, app]))


def deployed_app_configs() -> dict[str, dict]:
    """The config of every application deployed from a config (`deploy`, `serve deploy`), by name."""
    from ray.serve.context import _get_global_client
    details = _get_global_client().get_serve_details().get("applications", {})
    return {name: d["deployed_app_config"] for name, d in details.items()
            if d.get("source") == "declarative" and d.get("deployed_app_config")}
