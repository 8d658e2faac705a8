"""A one-machine Ray cluster that listens on loopback: what `pdserve serve` starts when it is given
no `--address`, and what the tests and the benchmarks start.

Who calls: the driver, once, instead of a plain `ray.init()`; `ray.shutdown()` ends it as usual.
`connect` is for a second driver joining such a cluster (`pdserve deploy`), or any running cluster.

Why more than `ray.init(_node_ip_address="127.0.0.1")`: Ray 2.60 rewrites a loopback node address to
the machine's network address (`resolve_ip_for_localhost`) on Linux, and its C++ servers (GCS,
raylet, every worker's core-worker server) listen on all interfaces unless the node address is
127.0.0.1. Ray keeps a node on loopback only where it treats the machine as single-node, which on
Linux is the switch `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (macOS and Windows default to it; on Linux
its only effect is that the node address defaults to 127.0.0.1 and `ray start` refuses to join
nodes). Ray reads it once at import and its child processes read it at their start, so `init`
sets it in `os.environ` and in Ray's imported constant for the duration of `ray.init` only
(`serving.ray_compat.single_node_start`: the GCS, raylet and agents it spawns inherit it, workers
inherit it from the raylet) and restores both after, so nothing else in the calling process (say a
test that starts a multi-node cluster) sees it.

What then binds where (Ray 2.60, Linux; tests/test_local_sockets.py lists and checks it), each on a
free port (the dashboard agent's HTTP server and the head's two metrics servers too, where Ray's
defaults are fixed: `ray_compat.agent_listen_port`, `head_ports_env`):
    127.0.0.1   GCS, raylet (node and object manager), dashboard agent (gRPC, HTTP, metrics
                export), runtime-env agent, autoscaler and dashboard metrics, every worker's
                core-worker gRPC server, the Serve proxy (its HTTP host is the caller's choice)
    all         each Serve replica's inter-deployment gRPC server: Ray Serve binds it to
                "[::]:0" in code (serve/_private/replica.py), with no option to change it. Ray's
                token authentication guards it (and TLS, when RAY_USE_TLS is set).
Token authentication: a new local Ray 2.60 cluster turns it on by default (the token lives in
~/.ray/auth_token). `init` refuses to start with `RAY_AUTH_MODE` set to anything but "token",
since the one listener Ray leaves on all interfaces would then take unauthenticated calls.
Serve's HTTP proxy calls the router over that gRPC server (`ray_compat.SERVE_NODE_ENV`, set for the
duration of `ray.init` only, like the single-node switch).
"""

from __future__ import annotations

import contextlib
import os

from serving import ray_compat

LOOPBACK = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


class LocalRayError(RuntimeError):
    """The local cluster could not be started on loopback with token authentication."""


def init(num_cpus: int | None = None, logging_level: str = "WARNING", log_to_driver: bool = True) -> None:
    """Start a new local Ray cluster bound to loopback, with token authentication on (a new one even
    when RAY_ADDRESS names another: `pdserve serve --address` is for joining a cluster).

    Raises LocalRayError (before starting anything) when RAY_AUTH_MODE asks for no authentication,
    and (after ray.shutdown()) when Ray did not take the loopback node address or did not turn
    authentication on, so a future Ray that changes either fails loudly instead of exposing a port.
    """
    import ray

    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        raise LocalRayError(f"{AUTH_MODE_ENV}={mode}: pdserve's local cluster keeps Ray's token authentication "
                            f"on (one Ray Serve listener per replica is not on loopback); unset it")
    with (ray_compat.single_node_start(),
          ray_compat.scoped_environ({**ray_compat.serve_node_env(), **ray_compat.head_ports_env()}),
          ray_compat.agent_listen_port(ray_compat.free_port())):
        ray.init(address="local", _node_ip_address=LOOPBACK, num_cpus=num_cpus, include_dashboard=False,
                 logging_level=logging_level, log_to_driver=log_to_driver)
    problem = ""
    if ray.util.get_node_ip_address() != LOOPBACK:
        problem = f"Ray took node address {ray.util.get_node_ip_address()}, not {LOOPBACK}"
    elif not ray_compat.token_auth_enabled():
        problem = "Ray started without token authentication"
    if problem:
        ray.shutdown()
        raise LocalRayError(f"the local Ray cluster is not as pdserve requires: {problem}")


def connect(address: str = "auto", logging_level: str = "WARNING", log_to_driver: bool = True) -> None:
    """Join a running Ray cluster as a driver (`pdserve deploy`, `pdserve serve --address`).
    `address`: host:port, or "auto" (RAY_ADDRESS, the last `ray start`, or the one Ray cluster
    running on this machine). A cluster on loopback (what `init` starts) is joined with Ray's
    single-node switch on, as `init` starts it (without it Ray rewrites 127.0.0.1 to the machine's
    network address, where such a cluster does not listen, and waits for it for minutes) and with
    token authentication (`init` turns it on; a driver joining a cluster has it off unless
    RAY_AUTH_MODE says so: this sets RAY_AUTH_MODE=token in os.environ unless it is set).
    Raises ConnectionError when "auto" finds no cluster or the cluster refuses the driver."""
    import ray

    resolved = ray_compat.bootstrap_address(address)
    loopback = resolved.rsplit(":", 1)[0] in (LOOPBACK, "localhost")
    if loopback and AUTH_MODE_ENV not in os.environ:
        os.environ[AUTH_MODE_ENV] = "token"
        ray_compat.reload_auth_config()
    with ray_compat.single_node_start() if loopback else contextlib.nullcontext():
        ray.init(address=resolved, logging_level=logging_level, log_to_driver=log_to_driver)
