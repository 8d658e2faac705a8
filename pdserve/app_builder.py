"""`build_app(config)` returns the Serve application for a configuration.

Disaggregated: Router -> (PrefillServer pool, DecodeServer pool), plus the StatsRegistry and (unless
`responses.store` is off) the ResponseStore.
Colocated: Router -> ColocatedServer pool, plus the same two.
Each pool gets its own scaling (pdserve/serve_config.py `scaling_options`), resources and request
router; deployments reach each other through handles passed by `.bind`. The router, the
registry and the store are pinned to the head node (serving/placement.py): on a cluster only the
pools run on pool nodes.

With `autoscaling: {policy: slo}` both pools get bounds-and-delays autoscaling configs without a
policy of their own and the router an autoscaling config pinned at one replica (so that Serve
collects its `record_autoscaling_stats`); the application-level policy itself lives in the Serve
*application* config, outside `args`, so such an app is deployed from
`serve_config.application_config(cfg, ...)` (what `pdserve serve` does for every app; `serve.run`
of a bound app has no place for it).
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from colocated_service.server import ColocatedServer
from decode_service.server import DecodeServer
from prefill_service.server import PrefillServer
from router.app import Router
from router.response_store import ResponseStore
from pdserve.serve_config import pools_of, scaling_options, slo_bounds_config
from serving.config import AppConfig, PoolConfig
from serving.scaling_config import PoolBounds, SloAutoscalingOptions
from serving.placement import head_actor_options
from serving.stats_registry import StatsRegistry

ROUTING_STATS_PERIOD_S = 1.0


def _pool_options(pool_name: str, pool: PoolConfig, router_class: str | None,
                  router_kwargs: dict | None = None, slo: SloAutoscalingOptions | None = None) -> dict:
    options = {
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                              "resources": dict(pool.resources)},
        "health_check_period_s": 5,
        # Serve stops routing to a replica being removed and waits this long for its streams.
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
        **scaling_options(pool_name, pool, slo),
    }
    if router_class is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_router_kwargs=router_kwargs or {},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return options


def build_app(config: AppConfig | dict):
    cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    data = cfg.model_dump()
    registry = StatsRegistry.bind()
    store = ResponseStore.bind(cfg.responses.model_dump()) if cfg.responses.store else None
    pools = [getattr(cfg, p) for p in pools_of(cfg)]
    router_opts = {"num_replicas": 1, "max_ongoing_requests": 4096,
                   "ray_actor_options": head_actor_options(),      # on the head node, never on a pool's
                   # a router replica being replaced (any redeploy of the application) relays its
                   # streams as long as the pools behind it finish theirs (Serve's default: 20 s,
                   # which cut streams the pools would have finished, and the client got Serve's
                   # plain-text 500)
                   "graceful_shutdown_timeout_s": max(p.graceful_shutdown_timeout_s for p in pools)}
    if cfg.autoscaling is not None:      # pinned at 1: autoscaled only so that Serve collects its SLO window
        router_opts.pop("num_replicas")
        router_opts["autoscaling_config"] = slo_bounds_config(PoolBounds(max_replicas=1), cfg.autoscaling)
    if cfg.mode == "colocated":
        options = _pool_options("colocated", cfg.colocated, "router.routing.ColocatedRouter",
                                {**cfg.routing.model_dump(), "block_size": cfg.engine_for("colocated").block_size})
        colocated = ColocatedServer.options(**options).bind(data, registry)
        return Router.options(**router_opts).bind(data, colocated=colocated, registry=registry, store=store)
    prefill_options = _pool_options("prefill", cfg.prefill, "router.routing.QueuedPromptTokensRouter",
                                    {**cfg.routing.model_dump(), "block_size": cfg.engine_for("prefill").block_size},
                                    slo=cfg.autoscaling)
    decode_options = _pool_options("decode", cfg.decode, "router.routing.DecodeRouter",
                                   {**cfg.routing.model_dump(), "block_size": cfg.engine_for("decode").block_size,
                                    "max_imbalance_tokens": cfg.routing.decode_max_imbalance_tokens},
                                   slo=cfg.autoscaling)
    prefill = PrefillServer.options(**prefill_options).bind(data, registry)
    decode = DecodeServer.options(**decode_options).bind(data, registry)
    return Router.options(**router_opts).bind(data, prefill=prefill, decode=decode, registry=registry,
                                             store=store)


def app_builder(args: dict):
    """Entry point for `serve run pdserve.app_builder:app_builder` and Serve config files."""
    return build_app(AppConfig.model_validate(args or {}))
