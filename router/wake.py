"""The router's side of pools that scale to zero (a pool's autoscaling `min_replicas: 0`).

Waking (`PoolWaker`): a disaggregated request calls the decode pool first (the reservation) and
the prefill pool only once it has one (router/orchestrator.py step 2). With both pools at zero
replicas, Serve would start the decode replica for the waiting reservation and the prefill replica
only after it: two cold starts one after the other. So the router also sends the prefill pool a
cheap call (`stats`) when a reservation is slow to come (router/orchestrator.py `WAKE_AFTER_S`, as
from a decode pool starting; a running decode replica answers within a step, and then the
hand-off's own prefill call wakes the pool, while a prompt the decode replica prefills itself needs
none): while the pool has no replica the call waits at the handle, where Serve's autoscaler counts
it as a waiting request (`total_num_requests`, which serving.autoscaling's policies start a replica
for), so both pools start at once. The router's config does not say whether a pool may scale to
zero (the pools' scaling is not in the router's arguments, so that Serve changes it in place:
pdserve/serve_config.py), so the waker asks Serve (`serving.ray_compat.scales_to_zero`) at the
first hand-off and every `check_s` after, in the background, and pokes only while the answer is
yes (or not in yet). Who calls: the orchestrator, at every hand-off (`refresh`) and when its
reservation has not come within `WAKE_AFTER_S` (`poke`). At most one call is in flight and at
most one starts every `every_s`; its answer is dropped.

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
    def __init__(self, handle, every_s: float = 1.0, check_s: float = 30.0):
        self.handle, self.every_s, self.check_s = handle, every_s, check_s
        self._call: asyncio.Task | None = None
        self._last = float("-inf")
        self.may_be_at_zero: bool | None = None        # Serve's answer; None: not asked yet
        self._check: asyncio.Task | None = None
        self._checked = float("-inf")

    def refresh(self) -> None:
        """Ask Serve again, in the background, whether the pool may be at zero, if `check_s` passed
        since the last time (the orchestrator calls this at every hand-off, so that a pool's scaling
        changed in place is known before a slow reservation needs it)."""
        now = time.monotonic()
        if now - self._checked >= self.check_s and (self._check is None or self._check.done()):
            self._checked = now
            self._check = asyncio.ensure_future(self._ask_serve())

    def poke(self) -> None:
        """Send the pool a `stats` call (now: Serve submits it as `.remote()` returns) unless it keeps
        a replica (Serve said so), or a call is in flight, or one started less than `every_s` ago."""
        self.refresh()
        now = time.monotonic()
        if self.may_be_at_zero is False:
            return
        if (self._call is not None and not self._call.done()) or now - self._last < self.every_s:
            return
        self._last = now
        try:
            response = self.handle.stats.remote()
        except Exception as exc:  # noqa: BLE001 - a handle being torn down: the request itself will say
            log.debug("waking a pool: %s: %s", type(exc).__name__, exc)
            return
        self._call = asyncio.ensure_future(self._answer(response))

    async def _ask_serve(self) -> None:
        try:
            self.may_be_at_zero = self.handle.deployment_name in await _zero_deployments()
        except Exception as exc:  # noqa: BLE001 - outside a replica, or the controller busy: ask again later
            log.debug("asking Serve whether a pool scales to zero: %s: %s", type(exc).__name__, exc)

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
    zero = await _zero_deployments()
    return {pool for pool, name in deployments.items() if name in zero}


async def _zero_deployments() -> set[str]:
    """The deployments of this replica's application that may scale to zero (`scales_to_zero`,
    a blocking call to Serve's controller, on a worker thread)."""
    return await asyncio.to_thread(scales_to_zero, serve.get_replica_context().app_name)
