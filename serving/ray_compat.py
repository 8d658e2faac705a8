"""Every Ray API that pdserve's runtime uses beyond Serve's stable surface, in one place.

Serve's custom request routers (`router/routing.py`) subclass `RequestRouter` and `FIFOMixin` and
rank `RunningReplica`s for a `PendingRequest`. Ray 2.60 exports these from
`ray.serve.request_router` as alpha APIs (defined in `ray.serve._private.request_router`); two
things the routers need have no public form at all:
  * the number of requests this router has in flight on a replica (`replica_queue_len_cache`, whose
    type is private, filled as it sends), read by `in_flight`;
  * asking Serve to back off and retry when every ranked replica is full, instead of queueing on the
    first one, set by `back_off_when_full` (`PendingRequest.routing_context`, a private class).
Nothing else in the runtime may import `ray.serve._private` or `ray._private`. pyproject.toml pins
Ray to the range the tests have run on; tests/test_ray_compat.py imports these names and exercises
both helpers, so an upgrade that moves them fails there, loudly, before anything is deployed.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

__all__ = ["FIFOMixin", "PendingRequest", "RequestRouter", "RunningReplica", "back_off_when_full", "in_flight"]


def in_flight(router: RequestRouter, replica: RunningReplica) -> int:
    """Requests `router` has sent to `replica` and not seen finish (0 before the router's cache exists)."""
    try:
        cache = router.replica_queue_len_cache
    except AttributeError:          # RequestRouter.__init__ has not made it yet
        return 0
    return cache.get(replica.replica_id) or 0


def back_off_when_full(pending_request: PendingRequest) -> None:
    """Have Serve wait and rank again when no replica of the ranking has room."""
    pending_request.routing_context.should_backoff = True
