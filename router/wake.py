"""The router's side of pools that scale to zero (a pool's autoscaling `min_replicas: 0`).

Waking (`PoolWaker`): a disaggregated request calls the decode pool first (the reservation) and
the prefill pool only once it has one (router/orchestrator.py step 2). With both pools at zero
replicas, Serve would start the decode replica for the waiting reservation and the prefill replica
only after it: two cold starts one after the other. So the router also sends the prefill pool a
cheap call (`stats`) as each request starts: while the pool has no replica the call waits at the
handle, where Serve's autoscaler counts it as a waiting request (`total_num_requests`, which
serving.autoscaling's policies start a replica for), so both pools start at once. The router
cannot tell from its config whether a pool may scale to zero (the pools' scaling is not in the
router's arguments, so that Serve changes it in place: pdserve/serve_config.py), so it pokes
in every disaggregated app. Who calls: the orchestrator, at the start of every hand-off (`poke`).
At most one call is in flight and at most one starts every `every_s`: with replicas up it costs
about one `stats` call a second; its answer is dropped.

Health (`at_zero`): `/health` wants a ready replica in each pool, except in a pool that may scale to
zero (asked of Serve, `serving.ray_compat.scales_to_zero`, only when a pool has no ready replica).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from serving.ray_compat import scales_to_zero

log = logging.getLogger(__name__)


class PoolWaker:
    def __init__(self, handle, every_s: float = 1.0):
        self.handle, self.every_s = handle, every_s
        self._call: asyncio.Task | None = None
        self._last = float("-inf")

    def poke(self) -> None:
        """Send the pool a `stats` call (now: Serve submits it as `.remote()` returns) unless one is
        in flight or one started less than `every_s` ago."""
        now = time.monotonic()
        if (self._call is not None and not self._call.done()) or now - self._last < self.every_s:
            return
        self._last = now
        try:
            response = self.handle.stats.remote()
        except Exception as exc:  # noqa: BLE001 - a handle being torn down: the request itself will say
            log.debug("waking a pool: %s: %s", type(exc).__name__, exc)
            return
        self._call = asyncio.ensure_future(self._answer(response))

    @staticmethod
    async def _answer(response) -> None:
        try:
            await response
        except Exception as exc:  # noqa: BLE001 - a replica that died or a pool being redeployed: a later poke
            log.debug("waking a pool: %s: %s", type(exc).__name__, exc)


async def at_zero(deployments: dict[str, str]) -> set[str]:
    """Of the pools `deployments` names (pool -> its deployment in this router's application), those
    that may scale to zero (Serve runs them with `min_replicas` 0, not failed): ready with no
    replica, as a request starts one."""
    zero = await asyncio.to_thread(scales_to_zero, serve.get_replica_context().app_name)
    return {pool for pool, name in deployments.items() if name in zero}
