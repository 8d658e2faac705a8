"""`build_app(config)` returns the Serve application for a configuration.

Disaggregated: Router -> (PrefillServer pool, DecodeServer pool), plus the StatsRegistry.
Colocated: Router -> ColocatedServer pool, plus the StatsRegistry.
Each pool gets its own replica count, resources and request router; deployments reach each
other through handles passed by `.bind`.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from pdserve.serve_config import AppConfig, PoolConfig

ROUTING_STATS_PERIOD_S = 1.0


def _pool_options(pool: PoolConfig, router_class: str | None) -> dict:
    options = {
        "num_replicas": pool.num_replicas,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                              "resources": dict(pool.resources)},
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 30,
    }
    if router_class is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return options


def build_app(config: AppConfig | dict):
    from decode_service.server import DecodeServer
    from pdserve.colocated_server import ColocatedServer
    from pdserve.stats_registry import StatsRegistry
    from prefill_service.server import PrefillServer
    from router.app import Router

    cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    data = cfg.model_dump()
    registry = StatsRegistry.bind()
    router_opts = {"num_replicas": 1, "max_ongoing_requests": 4096, "ray_actor_options": {"num_cpus": 0}}
    if cfg.mode == "colocated":
        colocated = ColocatedServer.options(**_pool_options(cfg.colocated, "router.routing.FreeKVBlocksRouter")) \
            .bind(data, registry)
        return Router.options(**router_opts).bind(data, colocated=colocated, registry=registry)
    prefill = PrefillServer.options(**_pool_options(cfg.prefill, "router.routing.QueuedPromptTokensRouter")) \
        .bind(data, registry)
    decode = DecodeServer.options(**_pool_options(cfg.decode, "router.routing.FreeKVBlocksRouter")) \
        .bind(data, registry)
    return Router.options(**router_opts).bind(data, prefill=prefill, decode=decode, registry=registry)


def app_builder(args: dict):
    """Entry point for `serve run pdserve.app_builder:app_builder` and Serve config files."""
    return build_app(AppConfig.model_validate(args or {}))
