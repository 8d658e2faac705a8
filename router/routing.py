"""Custom Serve request routers for the two pools.

Both rank every candidate replica (best first) from the stats the replicas publish with
`record_routing_stats`, corrected by the requests this router has in flight on each replica
(published stats are up to `request_routing_stats_period_s` old):
  * decode:  most free KV blocks (as a fraction of the pool), then fewest running sequences;
  * prefill: fewest queued prompt tokens.
Serve then sends to the first replica of the ranking that has room.
"""

from __future__ import annotations

import random
from typing import List, Optional

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter


class _RankingRouter(FIFOMixin, RequestRouter):
    def _in_flight(self, replica: RunningReplica) -> int:
        cache = getattr(self, "_replica_queue_len_cache", None)
        value = cache.get(replica.replica_id) if cache is not None else None
        return value or 0

    def score(self, replica: RunningReplica) -> tuple:
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        ranked = sorted(candidate_replicas, key=lambda r: (self.score(r), random.random()))
        return [[r] for r in ranked]


def free_kv_score(stats: dict, in_flight: int, max_ongoing: int) -> tuple:
    """Lower is better: less free KV (fraction) and more load rank later."""
    total = max(stats.get("kv_blocks_total") or 1, 1)
    free_fraction = stats.get("kv_blocks_free", total) / total
    return (-(free_fraction - in_flight / max(max_ongoing, 1)), stats.get("running", 0) + in_flight)


def queued_tokens_score(stats: dict, in_flight: int) -> tuple:
    return (stats.get("waiting_prompt_tokens", 0), in_flight)


class FreeKVBlocksRouter(_RankingRouter):
    """Decode pool: the replica with the most free KV blocks first."""

    def score(self, replica: RunningReplica) -> tuple:
        return free_kv_score(replica.routing_stats or {}, self._in_flight(replica), replica.max_ongoing_requests)


class QueuedPromptTokensRouter(_RankingRouter):
    """Prefill pool: the replica with the fewest queued prompt tokens first."""

    def score(self, replica: RunningReplica) -> tuple:
        return queued_tokens_score(replica.routing_stats or {}, self._in_flight(replica))
