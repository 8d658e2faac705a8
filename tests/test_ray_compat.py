"""Every Ray API beyond Serve's stable surface goes through serving/ray_compat.py; this test
imports those names and runs both helpers against Ray's own classes, and checks the installed Ray
is in the range pyproject.toml pins, so a Ray upgrade that moves or changes them fails here first."""

import asyncio
import importlib.metadata
import re
from types import SimpleNamespace

import ray
from packaging.requirements import Requirement
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from router.routing import ColocatedRouter, FreeKVBlocksRouter, QueuedPromptTokensRouter
from serving.ray_compat import FIFOMixin, PendingRequest, RequestRouter, RunningReplica, back_off_when_full, in_flight


def test_installed_ray_is_in_the_pinned_range():
    wanted = [Requirement(r) for r in importlib.metadata.requires("pdserve") if re.match(r"ray\b", r)]
    assert len(wanted) == 1 and wanted[0].specifier, "pyproject.toml must pin Ray to a tested range"
    assert wanted[0].specifier.contains(ray.__version__), f"Ray {ray.__version__} is outside {wanted[0]}"


def test_the_routers_build_on_the_compat_names():
    assert isinstance(RunningReplica, type)
    for cls in (FreeKVBlocksRouter, QueuedPromptTokensRouter, ColocatedRouter):
        assert issubclass(cls, RequestRouter) and issubclass(cls, FIFOMixin)
        assert "replica_queue_len_cache" in dir(cls)


def test_in_flight_reads_the_routers_queue_length_cache():
    router = object.__new__(FreeKVBlocksRouter)
    replica = SimpleNamespace(replica_id="r1")
    assert in_flight(router, replica) == 0          # before RequestRouter.__init__
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    assert in_flight(router, replica) == 0
    router._replica_queue_len_cache.update("r1", 3)
    assert in_flight(router, replica) == 3


def test_back_off_when_full_sets_the_routing_context():
    async def make():
        return PendingRequest(args=[], kwargs={}, metadata=None)
    request = asyncio.run(make())
    assert request.routing_context.should_backoff is False
    back_off_when_full(request)
    assert request.routing_context.should_backoff is True
