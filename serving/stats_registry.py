"""A one-replica Serve deployment that keeps the latest `ReplicaStats` of every engine
replica, so the router's /metrics can show every pool and replica.

Replicas push every 0.5 s while their stats change, and at least every `HEARTBEAT_S` while they
do not (an idle replica); an entry not refreshed for `STALE_S` (a dead or removed replica) is
dropped. Pinned to the head node (serving/placement.py).
"""

from __future__ import annotations

import time

from ray import serve

from serving import messages
from serving.placement import head_actor_options

STALE_S = 5.0
HEARTBEAT_S = 2.0        # < STALE_S, with room for a late push or two


@serve.deployment(num_replicas=1, ray_actor_options=head_actor_options(),
                  logging_config={"enable_access_log": False})
class StatsRegistry:
    def __init__(self):
        self._stats: dict[tuple[str, str], tuple[float, bytes]] = {}

    def report(self, data: bytes) -> None:
        stats = messages.decode(data, expect=messages.ReplicaStats)
        self._stats[(stats.pool, stats.replica_id)] = (time.monotonic(), data)

    def snapshot(self) -> list[bytes]:
        now = time.monotonic()
        self._stats = {k: v for k, v in self._stats.items() if now - v[0] < STALE_S}
        return [data for _, data in self._stats.values()]
