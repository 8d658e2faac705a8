"""Every Ray API beyond Serve's stable surface goes through serving/ray_compat.py; this test
imports those names and runs the helpers against Ray's own classes, and checks the installed Ray
is in the range pyproject.toml pins, so a Ray upgrade that moves or changes them fails here first."""

import asyncio
import importlib.metadata
import os
import re
from types import SimpleNamespace

import ray
from packaging.requirements import Requirement
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from router.routing import ColocatedRouter, FreeKVBlocksRouter, QueuedPromptTokensRouter
from serving import ray_compat
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


def test_single_node_start_is_confined_to_its_block(monkeypatch):
    """The switch that keeps a local node on loopback (pdserve/local_ray.py) reaches Ray's constant
    and the environment inside the block only."""
    from ray._private import ray_constants, services
    monkeypatch.delenv(ray_compat.SINGLE_NODE_ENV, raising=False)
    assert ray_compat.SINGLE_NODE_ENV == "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_compat.single_node_start():
        assert os.environ[ray_compat.SINGLE_NODE_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
        assert services.get_node_ip_address() == "127.0.0.1"
    assert ray_compat.SINGLE_NODE_ENV not in os.environ and ray_constants.ENABLE_RAY_CLUSTER == before
    assert isinstance(ray_compat.token_auth_enabled(), bool)


def test_serve_node_env_keeps_a_value_the_caller_set(monkeypatch):
    for key in ray_compat.SERVE_NODE_ENV:
        monkeypatch.delenv(key, raising=False)
    assert ray_compat.serve_node_env() == ray_compat.SERVE_NODE_ENV == {
        "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    assert ray_compat.serve_node_env()["RAY_SERVE_PROXY_USE_GRPC"] == "0"


def test_fixed_port_helpers_reach_rays_defaults_and_keep_the_callers_choice(monkeypatch):
    """Ray's fixed defaults are what the helpers stand in for (a Ray that moves them fails here), the
    agent's port reaches the RayParams `ray.init` builds within the block only, and a metrics port the
    caller set is kept."""
    from ray._private import parameter, ray_constants
    from ray.autoscaler._private import constants as autoscaler_constants
    from ray.dashboard import consts as dashboard_consts
    assert ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT == 52365
    assert (autoscaler_constants.AUTOSCALER_METRIC_PORT, dashboard_consts.DASHBOARD_METRIC_PORT) == (44217, 44227)
    assert ray_compat.HEAD_METRICS_PORT_ENVS == ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
    original = parameter.RayParams
    with ray_compat.agent_listen_port(40001):
        assert parameter.RayParams(num_cpus=1).dashboard_agent_listen_port == 40001
        assert parameter.RayParams(dashboard_agent_listen_port=40002).dashboard_agent_listen_port == 40002
    assert parameter.RayParams is original and original().dashboard_agent_listen_port == 52365
    for key in ray_compat.HEAD_METRICS_PORT_ENVS:
        monkeypatch.delenv(key, raising=False)
    chosen = ray_compat.head_ports_env()
    assert set(chosen) == set(ray_compat.HEAD_METRICS_PORT_ENVS)
    assert all(0 < int(port) < 65536 and int(port) not in (44217, 44227) for port in chosen.values())
    monkeypatch.setenv("DASHBOARD_METRIC_PORT", "45000")
    assert ray_compat.head_ports_env()["DASHBOARD_METRIC_PORT"] == "45000"


def test_direct_stream_only_where_grpc_takes_the_largest_message(monkeypatch):
    """Serve's gRPC transport where this process's Serve read a message limit that fits (the
    environment pdserve starts nodes with); by reference where it kept gRPC's 4 MiB."""
    class Handle:
        def options(self, **options):
            return options
    monkeypatch.setattr(ray_compat.serve_constants, "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 4 * 2**20)
    handle = Handle()
    assert ray_compat.direct_stream(handle, 64 * 2**20) is handle
    monkeypatch.setattr(ray_compat.serve_constants, "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 2**31 - 1)
    assert ray_compat.direct_stream(handle, 64 * 2**20) == {"_by_reference": False}


def test_the_serve_environment_is_set_for_the_start_only(monkeypatch):
    """`local_ray.init` sets ray_compat.SERVE_NODE_ENV for `ray.init` (whose processes inherit it,
    `scoped_environ`) and leaves the caller's environment as it was."""
    monkeypatch.delenv("RAY_SERVE_PROXY_USE_GRPC", raising=False)
    monkeypatch.setenv("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", "7")
    with ray_compat.scoped_environ({"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "9"}):
        assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "1"
        assert os.environ["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == "9"
    assert "RAY_SERVE_PROXY_USE_GRPC" not in os.environ
    assert os.environ["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == "7"


def test_bootstrap_address_is_the_one_ray_would_join_not_rewritten(monkeypatch):
    """`pdserve deploy` joins a local pdserve's cluster at 127.0.0.1 (pdserve/local_ray.py `connect`):
    Ray's own canonical form of that address is the machine's network address on Linux."""
    from ray._private import services
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6553")
    assert ray_compat.bootstrap_address("auto") == "127.0.0.1:6553"
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_compat.bootstrap_address("127.0.0.1:6553") == "127.0.0.1:6553"
    with ray_compat.single_node_start():
        assert services.canonicalize_bootstrap_address("127.0.0.1:6553") == "127.0.0.1:6553"


def test_app_code_version_sees_args_and_policies_not_the_deployment_overrides():
    """What `pdserve deploy` relies on (pdserve/serve_config.py): Serve's code version of an
    application config ignores a deployment override's replica count and user_config, and sees
    `args` and an override's autoscaling policy."""
    app = {"name": "x", "import_path": "m:app", "args": {"a": 1},
           "deployments": [{"name": "D", "num_replicas": 1, "user_config": {"t": 1}}]}
    same = {**app, "deployments": [{"name": "D", "num_replicas": 3, "user_config": {"t": 2}}]}
    assert ray_compat.app_code_version(app) == ray_compat.app_code_version(same)
    assert ray_compat.app_code_version(app) != ray_compat.app_code_version({**app, "args": {"a": 2}})
    policy = {"name": "D", "autoscaling_config": {
        "policy": {"policy_function": "serving.autoscaling:DecodePolicy", "policy_kwargs": {"hysteresis": 0.1}}}}
    assert ray_compat.app_code_version(app) != ray_compat.app_code_version({**app, "deployments": [policy]})


def test_scales_to_zero_reads_min_replicas_from_serve_s_instance_details(monkeypatch):
    """The shape `get_serve_details()` answers in (ray.serve.schema.ServeInstanceDetails as a dict):
    a deployment's autoscaling min_replicas under deployment_config, its status beside it."""
    from ray.serve import context
    from ray.serve.schema import DeploymentDetails, ServeInstanceDetails
    assert {"status", "deployment_config"} <= set(DeploymentDetails.model_fields)
    assert "applications" in ServeInstanceDetails.model_fields

    def deployment(min_replicas, status="HEALTHY"):
        auto = None if min_replicas is None else {"min_replicas": min_replicas, "max_replicas": 2}
        return {"status": status, "deployment_config": {"autoscaling_config": auto}}
    details = {"applications": {"app": {"deployments": {
        "Zero": deployment(0), "One": deployment(1), "Fixed": deployment(None),
        "Failed": deployment(0, "DEPLOY_FAILED"), "Upscaling": deployment(0, "UPSCALING")}}}}
    monkeypatch.setattr(context, "_get_global_client", lambda: SimpleNamespace(get_serve_details=lambda: details))
    assert ray_compat.scales_to_zero("app") == {"Zero", "Upscaling"}
    assert ray_compat.scales_to_zero("other") == set()
