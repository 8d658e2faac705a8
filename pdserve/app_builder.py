"""`build_app(config)` returns the Serve application for a configuration.

Disaggregated: Router -> (PrefillServer pool, DecodeServer pool), plus the StatsRegistry.
Colocated: Router -> ColocatedServer pool, plus the StatsRegistry.
Each pool gets its own replica count, resources and request router; deployments reach each
other through handles passed by `.bind`.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from colocated_service.server import ColocatedServer
from decode_service.server import DecodeServer
from prefill_service.server import PrefillServer
from router.app import Router
from serving.config import AppConfig, AutoscalingOptions, PoolConfig
from serving.stats_registry import StatsRegistry

ROUTING_STATS_PERIOD_S = 1.0


POLICIES = {"prefill": "serving.autoscaling:PrefillPolicy", "decode": "serving.autoscaling:DecodePolicy",
            "colocated": "serving.autoscaling:DecodePolicy"}


def autoscaling_config(pool_name: str, a: AutoscalingOptions) -> dict:
    """Serve's autoscaling_config for a pool: bounds and delays, plus our policy and its targets."""
    kwargs = {"hysteresis": a.hysteresis, "warmup_s": a.warmup_s}
    if pool_name == "prefill":
        kwargs["target_queued_tokens"] = a.target_queued_tokens
    else:
        kwargs.update(target_kv_utilization=a.target_kv_utilization, target_running=a.target_running)
    return {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": a.initial_replicas or a.min_replicas,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s, "metrics_interval_s": a.metrics_interval_s,
            "policy": {"policy_function": POLICIES[pool_name], "policy_kwargs": kwargs}}


def _pool_options(pool_name: str, pool: PoolConfig, router_class: str | None,
                  router_kwargs: dict | None = None) -> dict:
    options = {
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                              "resources": dict(pool.resources)},
        "health_check_period_s": 5,
        # Serve stops routing to a replica being removed and waits this long for its streams.
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
    }
    if pool.autoscaling is None:
        options["num_replicas"] = pool.num_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(pool_name, pool.autoscaling)
    if router_class is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_router_kwargs=router_kwargs or {},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return options


def build_app(config: AppConfig | dict):
    cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    data = cfg.model_dump()
    registry = StatsRegistry.bind()
    router_opts = {"num_replicas": 1, "max_ongoing_requests": 4096, "ray_actor_options": {"num_cpus": 0}}
    if cfg.mode == "colocated":
        options = _pool_options("colocated", cfg.colocated, "router.routing.ColocatedRouter",
                                {**cfg.routing.model_dump(), "block_size": cfg.engine_for("colocated").block_size})
        colocated = ColocatedServer.options(**options).bind(data, registry)
        return Router.options(**router_opts).bind(data, colocated=colocated, registry=registry)
    prefill_options = _pool_options("prefill", cfg.prefill, "router.routing.QueuedPromptTokensRouter",
                                    {**cfg.routing.model_dump(), "block_size": cfg.engine_for("prefill").block_size})
    decode_options = _pool_options("decode", cfg.decode, "router.routing.FreeKVBlocksRouter")
    prefill = PrefillServer.options(**prefill_options).bind(data, registry)
    decode = DecodeServer.options(**decode_options).bind(data, registry)
    return Router.options(**router_opts).bind(data, prefill=prefill, decode=decode, registry=registry)


def app_builder(args: dict):
    """Entry point for `serve run pdserve.app_builder:app_builder` and Serve config files."""
    return build_app(AppConfig.model_validate(args or {}))
