"""Every Ray API that pdserve's runtime uses beyond Serve's stable surface, in one place.

Serve's custom request routers (`router/routing.py`) subclass `RequestRouter` and `FIFOMixin` and
rank `RunningReplica`s for a `PendingRequest`. Ray 2.60 exports these from
`ray.serve.request_router` as alpha APIs (defined in `ray.serve._private.request_router`); two
things the routers need have no public form at all:
  * the number of requests this router has in flight on a replica (`replica_queue_len_cache`, whose
    type is private, filled as it sends), read by `in_flight`;
  * asking Serve to back off and retry when every ranked replica is full, instead of queueing on the
    first one, set by `back_off_when_full` (`PendingRequest.routing_context`, a private class).
The local cluster's start (pdserve/local_ray.py) needs these, private in Ray 2.60:
  * `single_node_start`: Ray's single-node switch for the duration of `ray.init`, which keeps the
    node on 127.0.0.1 (nothing public does; see local_ray.py);
  * `token_auth_enabled`: whether this process runs Ray with token authentication;
  * `agent_listen_port` and `head_ports_env`: no fixed ports. Ray 2.60's dashboard agent takes
    52365 for its HTTP server unless told otherwise (`ray start --dashboard-agent-listen-port`;
    `ray.init` has no argument for it), and the head's autoscaler and dashboard processes export
    their metrics on 44217 and 44227 unless AUTOSCALER_METRIC_PORT / DASHBOARD_METRIC_PORT say
    otherwise. A second cluster on the machine, or anything else holding one of those ports, would
    cost the agent its HTTP server and leave those metrics unexported;
  (`scoped_environ`, which both switches use: an environment for the processes a block starts).
And a driver joining the local multi-node cluster with its token (pdserve/local_cluster.py):
  * `reload_auth_config`: Ray caches its config, the auth mode included, at first use; after the
    token's environment is set it must read it again (as Ray's own token setup does).
Serve's gRPC transport (what Ray Serve's throughput-optimized mode, RAY_SERVE_THROUGHPUT_OPTIMIZED,
turns on for every call), for the calls that carry each streamed token:
  * `direct_stream`: a handle whose requests and streamed items go to the replica's own gRPC server
    instead of through Ray actor tasks and the object store (`options(_by_reference=False)`; the
    router's calls to the prefill, decode and colocated pools);
  * `SERVE_NODE_ENV`: the environment a node's Serve processes need so Serve's HTTP proxy calls the
    router the same way (RAY_SERVE_PROXY_USE_GRPC) and so gRPC takes messages beyond its 4 MiB
    default (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH; a larger response failed with a bare 500),
    both read once when a process imports Serve: set by `serve_node_env()` for the local cluster's
    start (pdserve/local_ray.py, local_cluster.py) and on the `ray start` lines of cluster.yaml. A
    value the caller set is kept. Without it (`--address` to a cluster started otherwise) the
    router's calls stay by reference (`direct_stream` checks the limit its process read).
  Measured (`benchmarks/host_cpu.py`, docs/benchmarks.md "Serving overhead"): CPU per streamed token in the
  router, the proxy and the decode replica's loop roughly halves.
A driver joining a cluster that listens on loopback (`pdserve deploy` to a local `pdserve serve`):
  * `bootstrap_address`: the address `ray.init(address=...)` would join, found as Ray finds it
    (RAY_ADDRESS, the last `ray start`, a running GCS on this machine) but not rewritten: Ray
    turns a 127.0.0.1 address into the machine's network address, where a local cluster does not
    listen (pdserve/local_ray.py `connect` joins it inside `single_node_start`).
Redeploying the application (`pdserve deploy`, pdserve/cli.py) says beforehand whether Serve will
replace every replica or change the deployments in place:
  * `app_code_version`: Serve's code version of an application config (a hash of its `args`,
    import path, runtime env and autoscaling policies; every deployment's version), private in Ray 2.60.
The router's `/health` with pools that scale to zero (router/wake.py):
  * `scales_to_zero`: which deployments of an application Serve runs with autoscaling
    `min_replicas: 0` (the pools' scaling is not in the router's arguments, so that Serve changes it
    in place), read from Serve's instance details (`_get_global_client().get_serve_details()`, what
    `serve status -v` shows; no public call has the deployments' configs).
Nothing else in pdserve may import `ray.serve._private` or `ray._private`. pyproject.toml pins
Ray to the range the tests have run on; tests/test_ray_compat.py imports these names and exercises
the helpers, so an upgrade that moves them fails there, loudly, before anything is deployed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from ray._private import parameter as ray_parameter
from ray._private import ray_constants
from ray._private import services as ray_services
from ray._private.authentication import authentication_utils
from ray.serve._private import constants as serve_constants
from ray.serve._private.deploy_utils import get_app_code_version
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

__all__ = ["FIFOMixin", "PendingRequest", "RequestRouter", "RunningReplica", "SERVE_NODE_ENV", "SINGLE_NODE_ENV",
           "HEAD_METRICS_PORT_ENVS", "agent_listen_port", "app_code_version", "back_off_when_full",
           "bootstrap_address", "direct_stream", "free_port", "head_ports_env", "in_flight", "reload_auth_config",
           "scoped_environ", "serve_node_env", "single_node_start", "token_auth_enabled"]

SINGLE_NODE_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR    # "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
HEAD_METRICS_PORT_ENVS = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")    # Ray's defaults: 44217, 44227
SERVE_NODE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1",
                  # gRPC's 4 MiB default would fail a larger message (a non-streaming response with
                  # logprobs, a prefill's prompt logprobs); Ray's own limit for its other servers
                  "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def direct_stream(handle, largest_message: int):
    """`handle` over Serve's gRPC transport (see the module's docstring) where this process's
    Serve takes messages of `largest_message` bytes over it (SERVE_NODE_ENV); else `handle`
    as it is (by reference, no size limit): a cluster started without that environment."""
    if serve_constants.RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH < largest_message:
        return handle
    return handle.options(_by_reference=False)


def serve_node_env() -> dict[str, str]:
    """SERVE_NODE_ENV, each value the caller's own where this process's environment sets it."""
    return {key: os.environ.get(key, value) for key, value in SERVE_NODE_ENV.items()}


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


@contextlib.contextmanager
def scoped_environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment within the block (processes started in it inherit
    them), the previous values (or their absence) back on exit."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def single_node_start() -> Iterator[None]:
    """Within the block, Ray treats this machine as single-node: SINGLE_NODE_ENV=0 in this process's
    environment (processes started in the block inherit it) and in the constant Ray read from it
    at import. Both are restored on exit."""
    saved_const = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with scoped_environ({SINGLE_NODE_ENV: "0"}):
            yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const


def free_port() -> int:
    """A TCP port the OS reports free now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def head_ports_env() -> dict[str, str]:
    """A free port for each of HEAD_METRICS_PORT_ENVS, the caller's own where its environment sets
    one: the environment of the processes that start a head node (Ray's autoscaler monitor and
    dashboard read them once, at import, and publish the address they bind in the GCS)."""
    return {key: os.environ.get(key) or str(free_port()) for key in HEAD_METRICS_PORT_ENVS}


@contextlib.contextmanager
def agent_listen_port(port: int) -> Iterator[None]:
    """Within the block, a node that `ray.init` starts runs its dashboard agent's HTTP server on
    `port` unless the call names one: `ray.init` builds its RayParams through the module attribute,
    which is swapped for a subclass with that default for the block and restored on exit."""
    original = ray_parameter.RayParams

    class _RayParams(original):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("dashboard_agent_listen_port", port)
            super().__init__(*args, **kwargs)

    ray_parameter.RayParams = _RayParams
    try:
        yield
    finally:
        ray_parameter.RayParams = original


def reload_auth_config() -> None:
    """Make Ray in this process read its config (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH) again."""
    from ray._raylet import Config
    Config.initialize("")


def token_auth_enabled() -> bool:
    """Whether Ray in this process runs with token authentication (RAY_AUTH_MODE=token)."""
    return authentication_utils.is_token_auth_enabled()


def app_code_version(app_config: dict) -> str:
    """Serve's code version of one application config (an entry of a Serve config's
    `applications`): equal for two configs exactly when Serve changes a running application from
    one to the other in place, without replacing its replicas."""
    from ray.serve.schema import ServeApplicationSchema
    return get_app_code_version(ServeApplicationSchema.model_validate(app_config))


def bootstrap_address(address: str) -> str:
    """The host:port a driver given `address` ("auto", or host:port) would join, before Ray's
    localhost rewrite. Raises ConnectionError when "auto" finds no cluster (or several)."""
    found = ray_services.get_ray_address_from_environment(address, None)
    if not found or found == "auto":
        raise ConnectionError(f"no running Ray cluster found for address {address!r}")
    return found


def scales_to_zero(app_name: str) -> set[str]:
    """The deployments of Serve application `app_name` whose autoscaling config, as Serve runs it,
    has `min_replicas` 0 and whose status is not a failure (unhealthy, deploy failed). A blocking
    call to Serve's controller."""
    from ray.serve.context import _get_global_client
    app = (_get_global_client().get_serve_details().get("applications") or {}).get(app_name) or {}
    return {name for name, d in (app.get("deployments") or {}).items()
            if ((d.get("deployment_config") or {}).get("autoscaling_config") or {}).get("min_replicas") == 0
            and d.get("status") not in ("UNHEALTHY", "DEPLOY_FAILED")}
