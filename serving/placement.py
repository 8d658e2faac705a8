"""Where pdserve's singleton deployments run.

The router and the stats registry hold no pool's resources, so on a cluster they could land on any node,
and the autoscaler (which judges a node idle by its resources in use) could terminate a prefill or
decode node from under them. They ask for a sliver of Ray's head-node marker resource instead, as
Serve's controller is pinned: on a cluster they run on the head, which the autoscaler never removes;
on a one-machine `ray.init()` the only node is the head, so nothing changes there.
"""

from __future__ import annotations

# Ray adds this resource (1.0) to the head node only; Serve pins its controller with it.
HEAD_NODE_RESOURCE = "node:__internal_head__"

ON_HEAD_NODE: dict[str, float] = {HEAD_NODE_RESOURCE: 0.001}


def head_actor_options() -> dict:
    """`ray_actor_options` of a deployment pinned to the head node (no CPU)."""
    return {"num_cpus": 0, "resources": dict(ON_HEAD_NODE)}
