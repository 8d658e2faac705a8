"""The replica runtime that the pools and the router share (the layer above `engine/` and
`kv_transfer/`, below `prefill_service/`, `decode_service/`, `colocated_service/` and `router/`).

  messages        one dataclass per message between router and replicas, msgpack (versioned)
  config          AppConfig and the per-pool pydantic models (every field described)
  engine_host     EngineHost / EngineReplica: the engine on its thread, stats and Serve hooks
  replica_util    the KV bind address and event encoding
  stats_registry  the StatsRegistry deployment (latest stats of every replica, for /metrics)
  histogram       Prometheus-style histograms and the replica histogram catalogue
  serve_metrics   the same series on Ray's metrics port (ray.serve.metrics)
  models          model resolution and preparation (`python -m serving.models`)
  autoscaling     per-pool Serve autoscaling policies
  ray_compat      every Ray API beyond Serve's stable surface (Ray is pinned to a tested range)
Nothing here imports a pool, the router or `pdserve` (app assembly and tools sit on top).
"""
