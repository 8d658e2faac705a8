"""What a local deployment listens on: the session's Ray cluster (started as `pdserve serve` starts
it, pdserve/local_ray.py) serving the disaggregated app must listen on loopback only, except the one
listener Ray Serve binds to every interface in code: each Serve replica's inter-deployment gRPC
server (token-authenticated). The decode replicas' KV rendezvous binds the configured
`transfer.host` (127.0.0.1 here)."""

import os

import pytest

from pdserve import local_ray

from socket_util import listening, process_name, report


def test_local_deployment_listens_on_loopback_only(disagg):
    """Ray's processes are this (driver) process's descendants; the driver's own sockets are left
    out because other tests in the session may have opened listeners in it."""
    socks = listening(os.getpid(), include_root=False)
    print(report(socks))
    names = {s.name for s in socks}
    # the deployment is all there: Ray's servers, the proxy, the pools, the router, the registry
    for expected in ("gcs_server", "raylet", "ray::ProxyActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        assert expected in names, report(socks)
    replicas = {s.pid for s in socks if s.name.startswith("ray::ServeReplica:pd:")}
    assert len(replicas) >= 6, report(socks)   # registry, response store, router, 1 prefill, 2 decode
    exposed = [s for s in socks if not s.loopback]
    # the documented exception: one wildcard socket per Serve replica process, nothing else
    assert all(s.name.startswith("ray::ServeReplica:") and s.ip in ("::", "0.0.0.0") for s in exposed), report(socks)
    by_pid = [s.pid for s in exposed]
    assert len(by_pid) == len(set(by_pid)), report(socks)
    assert set(by_pid) == {s.pid for s in socks if s.name.startswith("ray::ServeReplica:")}, report(socks)


def test_local_cluster_takes_none_of_rays_fixed_ports(disagg):
    """Ray's dashboard agent (HTTP) and the head's autoscaler and dashboard metrics servers default
    to fixed ports (52365, 44217, 44227); the local cluster puts them on free ones
    (ray_compat.agent_listen_port, head_ports_env), and the addresses Ray publishes for the metrics
    servers and the node's agent are the ports that listen."""
    import ray
    from ray.experimental import internal_kv

    socks = listening(os.getpid(), include_root=False)
    ports = {s.port: s.name for s in socks}
    assert not set(ports) & {52365, 44217, 44227}, report(socks)
    for key in ("AutoscalerMetricsAddress", "DashboardMetricsAddress"):
        address = internal_kv._internal_kv_get(key, namespace=None)
        assert address, key
        assert int(address.decode().rsplit(":", 1)[1]) in ports, (key, address, report(socks))
    [node] = ray.nodes()
    assert ports.get(node["MetricsExportPort"]) == "ray::DashboardAgent", report(socks)
    agent = {p for p, name in ports.items() if name == "ray::DashboardAgent"}
    assert len(agent) == 3, report(socks)    # gRPC, HTTP, metrics export


def test_local_start_refuses_to_turn_off_token_auth(monkeypatch):
    monkeypatch.setenv(local_ray.AUTH_MODE_ENV, "disabled")
    with pytest.raises(local_ray.LocalRayError, match="token authentication"):
        local_ray.init()



def test_token_streams_use_serves_grpc_transport(disagg):
    """The calls every streamed token crosses go over the Serve replicas' own gRPC servers
    (serving/ray_compat.py: `direct_stream`, `SERVE_NODE_ENV`): after a request, the proxy holds a
    connection to the router's gRPC port, and the router to the prefill's and a decode replica's.
    Over Ray actor calls instead, they would talk to the core workers' (loopback) ports only."""
    import psutil

    from service_util import http
    status, _ = http(disagg, "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
    assert status == 200
    socks = listening(os.getpid(), include_root=False)
    grpc = {s.name.rsplit(":", 1)[1]: set() for s in socks if s.name.startswith("ray::ServeReplica:pd:")}
    for s in socks:
        if s.name.startswith("ray::ServeReplica:pd:") and not s.loopback:
            grpc[s.name.rsplit(":", 1)[1]].add(s.port)

    def peers(name: str) -> set[int]:
        ports, found = set(), False
        for p in psutil.Process().children(recursive=True):
            try:
                if process_name(p) == name:
                    found = True
                    ports |= {c.raddr.port for c in p.net_connections(kind="tcp")
                              if c.status == psutil.CONN_ESTABLISHED and c.raddr}
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        assert found, name
        return ports

    assert peers("ray::ProxyActor") & grpc["Router"], report(socks)
    router = peers("ray::ServeReplica:pd:Router")
    assert router & grpc["PrefillServer"] and router & grpc["DecodeServer"], report(socks)
