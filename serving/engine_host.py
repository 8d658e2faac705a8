"""What every engine replica (prefill, decode, colocated) does the same way: resolve the
model, build the engine on its thread, and report its load.

Stats go three ways: `record_routing_stats` (Serve's request routers read them), a push
to the `StatsRegistry` deployment every `STATS_PERIOD_S` (the router's /metrics reads it), and,
with each push, Ray Serve gauges (`serving.serve_metrics`, on Ray's metrics port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import ray

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from serving import messages
from serving.autoscaling import KV_METRIC, PREFILL_METRIC, RUNNING_METRIC, WAITING_METRIC, load_metrics
from serving.config import AppConfig, EngineOptions
from serving.scaling_config import ScalingTargets
from serving.cpu_share import CpuShare
from serving.histogram import REPLICA_HISTOGRAMS, Histogram
from serving.models import resolve_model
from serving.serve_logging import log_through_serve
from serving.serve_metrics import ReplicaSeries
from serving.stats_registry import HEARTBEAT_S

log = logging.getLogger(__name__)
STATS_PERIOD_S = 0.5


def replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests, CLI)
        return f"local-{os.getpid()}"


class EngineHost:
    def __init__(self, config: AppConfig, pool: str, registry=None):
        log_through_serve()
        self.config = config
        self.pool = pool
        self.replica_id = replica_id()
        model_dir = resolve_model(config.model, config.model_cache, progress=False)
        opts = config.engine_for(pool)
        engine_config = config.engine_config(pool, str(model_dir))
        self.cpu_share = _cpu_share(config, pool, opts)
        # built on its own thread, where it steps (AsyncEngine: one OpenMP pool a process)
        try:
            self.aengine = AsyncEngine(lambda: LLMEngine(engine_config), self.cpu_share)
        except BaseException:
            if self.cpu_share is not None:
                self.cpu_share.close()
            raise
        self.engine = engine = self.aengine.engine
        self.model_dir = model_dir
        self._registry = registry
        self._pusher: asyncio.Task | None = None
        self.counters: dict[str, float] = {}   # service-level counters, reported with the stats
        self.histograms: dict[str, Histogram] = {}   # REPLICA_HISTOGRAMS, reported with the stats
        self.series = ReplicaSeries(pool)
        # the autoscaling policy's per-replica targets: the deployment's user_config (pdserve's
        # deployments always have one: serve_config.scaling_options), which Serve hands to
        # EngineReplica.reconfigure before the replica serves, and again, in place, on a redeploy
        self.targets = ScalingTargets()
        log.info("%s replica %s: %d KV blocks of %d tokens (%s on %s), max_model_len %d", pool,
                 self.replica_id, engine.block_manager.num_blocks, engine.config.block_size,
                 engine.runner.kv_shape.dtype, engine.runner.device, engine.max_model_len)

    def start_stats_pusher(self) -> None:
        """Call from the replica's event loop (first request or an async init)."""
        if self._registry is not None and self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_stats())

    async def stats(self) -> messages.ReplicaStats:
        s = await self.aengine.call(lambda e: e.stats())
        extra = {k: s[k] for k in ("preemptions", "prefix_cache_hit_tokens", "prefix_cache_query_tokens",
                                   "spec_draft_tokens", "spec_accepted_tokens", "lora_loads", "lora_evictions")}
        extra.update(self.counters)
        extra["ray_metrics_errors"] = self.series.errors
        return messages.ReplicaStats(self.pool, self.replica_id, s["kv_blocks_total"], s["kv_blocks_free"],
                                     s["running"], s["waiting"], s["waiting_prompt_tokens"], extra,
                                     {k: h.to_wire() for k, h in self.histograms.items()}, s["lora_waiting"])

    def count(self, name: str, amount: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def observe(self, key: str, value: float) -> None:
        """Add `value` to the replica histogram `key` (one of REPLICA_HISTOGRAMS)."""
        if key not in self.histograms:
            help_text, buckets = REPLICA_HISTOGRAMS[key]
            self.histograms[key] = Histogram(f"pdserve_{key}", help_text, buckets)
        self.histograms[key].observe(value)
        self.series.observe(key, value)

    async def routing_stats(self) -> dict:
        s = await self.stats()
        return {"kv_blocks_free": s.kv_blocks_free, "kv_blocks_total": s.kv_blocks_total,
                "running": s.running, "waiting_prompt_tokens": s.waiting_prompt_tokens}

    async def _push_stats(self) -> None:
        """Every STATS_PERIOD_S: stats that changed go to the registry (and Ray's gauges); stats
        that did not, only every HEARTBEAT_S (an idle replica costs its node little)."""
        last, last_at = b"", 0.0
        while True:
            try:
                stats = await self.stats()
                data, now = messages.encode(stats), time.monotonic()
                if data != last or now - last_at >= HEARTBEAT_S:
                    self.series.load(stats)
                    await self._registry.report.remote(data)
                    last, last_at = data, now
            except Exception as exc:  # noqa: BLE001 - the registry may be restarting
                log.debug("stats push failed: %s", exc)
            await asyncio.sleep(STATS_PERIOD_S)

    def shutdown(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        self.aengine.shutdown()
        if self.cpu_share is not None:
            self.cpu_share.close()


def _cpu_share(config: AppConfig, pool: str, opts: EngineOptions) -> CpuShare | None:
    """This replica's slot on its Ray node's CPU board (serving.cpu_share), or None: sharing off,
    a GPU pool, or not in a Ray worker (nothing to share with). `opts`: the pool's engine options."""
    if not config.share_idle_cpus or getattr(config, pool).num_gpus > 0 or opts.device.startswith("cuda"):
        return None
    if not ray.is_initialized():
        return None
    return CpuShare.open(ray.get_runtime_context().get_node_id(), opts.num_threads or os.cpu_count() or 1)


class EngineReplica:
    """What the three engine deployments share: Serve's routing-stats and health hooks and a
    `stats` call, all answered from `self.host` (an `EngineHost`), and the shutdown: Serve calls
    the replica's `__del__` once when it stops the replica, which closes the replica's KV
    endpoint (`close_kv`) and then stops the engine thread."""

    host: EngineHost

    def close_kv(self) -> None:
        """Close this replica's KV endpoint (the prefill sender, the decode receiver); the
        colocated replica has none."""

    def kv_health(self) -> str:
        """'' while this replica's KV endpoint works, else why not (the decode receiver)."""
        return ""

    def __del__(self):
        if self.__dict__.get("_shut_down"):     # Serve calls it, then Python again at collection
            return
        self._shut_down = True
        with contextlib.suppress(Exception):    # best effort at teardown, also half-built
            self.close_kv()
        with contextlib.suppress(Exception):
            self.host.shutdown()

    async def record_routing_stats(self) -> dict:
        self.host.start_stats_pusher()
        return await self.host.routing_stats()

    def reconfigure(self, user_config: dict) -> None:
        """Serve's hook for the deployment's `user_config`, called after `__init__` and again, in
        place, when a deploy changes it: the pool's autoscaling targets (`ScalingTargets` fields;
        an invalid one raises pydantic's error, which Serve reports for the deployment)."""
        self.host.targets = ScalingTargets.model_validate(user_config or {})
        log.info("%s replica %s: autoscaling targets %s", self.host.pool, self.host.replica_id, self.host.targets)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: the signals of serving.autoscaling's policies (each raw, which
        the SLO policy reads, and as a fraction of this pool's target, which the per-pool ones do).
        Nothing once the replica is shut down (Serve may still ask while it stops it)."""
        if self.__dict__.get("_shut_down"):
            return {}
        s = await self.host.stats()
        raw = {PREFILL_METRIC: float(s.waiting_prompt_tokens),
               KV_METRIC: 1.0 - s.kv_blocks_free / max(s.kv_blocks_total, 1),
               RUNNING_METRIC: float(s.running), WAITING_METRIC: float(s.waiting)}
        return {**raw, **load_metrics(raw[PREFILL_METRIC], raw[KV_METRIC], raw[RUNNING_METRIC], self.host.targets)}

    async def check_health(self) -> None:
        """Serve's health hook: raising makes Serve replace the replica. Fails when the engine can
        no longer step (its thread is dead, or its last steps all failed) or the replica's KV
        endpoint is broken (the decode receiver closed or lost a thread)."""
        reason = self.host.aengine.health() or self.kv_health()
        if reason:
            raise RuntimeError(f"{self.host.pool} replica unhealthy: {reason}")

    async def stats(self) -> bytes:
        return messages.encode(await self.host.stats())
