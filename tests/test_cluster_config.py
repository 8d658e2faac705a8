"""cluster.yaml passes Ray's own validator, and the Serve configs are consistent with it."""

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serving.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_is_valid_for_ray():
    config = prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    validate_config(config)
    types = config["available_node_types"]
    assert {"prefill_gpu", "decode_gpu"} <= set(types)


def test_every_ray_start_sets_the_serve_node_environment():
    """Serve's proxy calls the router over gRPC on every node (serving/ray_compat.SERVE_NODE_ENV)."""
    from serving.ray_compat import SERVE_NODE_ENV
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
              if "ray start" in c]
    assert len(starts) == 2, starts
    for command in starts:
        assert all(f"{key}={value} " in command for key, value in SERVE_NODE_ENV.items()), command


def test_cluster_serve_config_targets_node_types_of_cluster_yaml():
    types = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"]
    offered = {name: set(t.get("resources", {})) for name, t in types.items()}
    cfg = AppConfig.from_yaml(ROOT / "serve_config.cluster.yaml")
    for pool in ("prefill", "decode"):
        wanted = set(getattr(cfg, pool).resources)
        assert wanted, f"{pool} pool is not pinned to a node type"
        hosts = [name for name, res in offered.items() if wanted <= res]
        assert hosts == [f"{pool}_gpu"], f"{pool} pool resources {wanted} match node types {hosts}"


def test_local_serve_config_loads():
    cfg = AppConfig.from_yaml(ROOT / "serve_config.yaml")
    assert cfg.mode == "disaggregated" and cfg.prefill.resources == {} and cfg.decode.resources == {}


def test_pool_engine_overrides_survive_a_round_trip():
    cfg = AppConfig(engine={"dtype": "float32", "kv_cache_memory": "64MiB"},
                    prefill={"engine": {"max_num_batched_tokens": 16}})
    again = AppConfig.model_validate(cfg.model_dump())   # what every replica receives
    for c in (cfg, again):
        p = c.engine_for("prefill")
        assert (p.max_num_batched_tokens, p.dtype, p.kv_cache_memory) == (16, "float32", "64MiB")
        assert c.engine_for("decode").max_num_batched_tokens == 512
    # what the two pools' KV blocks depend on must agree (max_model_len: it pins a length-dependent RoPE)
    for key, value in (("dtype", "float32"), ("block_size", 32), ("max_model_len", 8192)):
        with pytest.raises(ValueError, match=f"same {key}"):
            AppConfig(prefill={"engine": {key: value}})
    assert AppConfig(engine={"max_model_len": 8192}).engine_for("prefill").max_model_len == 8192


def test_every_engine_key_the_readme_documents_is_accepted():
    # the README's configuration table lists `engine.<key>` rows; each must pass AppConfig's validation
    # (extra keys are refused) and reach EngineConfig
    import re
    keys = re.findall(r"^\| `engine\.(\w+)` \|", (ROOT / "README.md").read_text(), re.M)
    assert {"dtype", "cuda_graphs", "cpu_gemv", "num_threads"} <= set(keys), keys
    engine = AppConfig(engine={"cuda_graphs": False, "cpu_gemv": False}).engine_for("decode").engine_config("m")
    assert (engine.cuda_graphs, engine.cpu_gemv) == (False, False)
    fields = set(AppConfig().engine.model_fields)
    assert set(keys) <= fields, f"documented but refused: {set(keys) - fields}"


def test_transfer_options_reach_the_transfer_config():
    cfg = AppConfig(transfer={"chunk_bytes": 8 << 20, "lease_s": 12}).transfer.transfer_config()
    assert cfg.chunk_bytes == 8 << 20 and cfg.lease_s == 12
    assert AppConfig().transfer.transfer_config().chunk_bytes == 0   # by backend
    with pytest.raises(ValueError, match="chunk_bytes"):
        AppConfig(transfer={"chunk_bytes": 100})
    assert AppConfig(transfer={"max_pairs_per_peer": 2}).transfer.transfer_config().max_pairs_per_peer == 2
    with pytest.raises(ValueError, match="max_pairs_per_peer"):
        AppConfig(transfer={"max_pairs_per_peer": 0})


def _types(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())["available_node_types"]


def test_cluster_local_yaml_mirrors_cluster_yaml():
    """cluster.local.yaml (fake multi-node provider) passes Ray's validator as the autoscaler loads it, and has
    cluster.yaml's worker types, custom resources and limits; its head type is the fake provider's fixed name."""
    raw = yaml.safe_load((ROOT / "cluster.local.yaml").read_text())
    validate_config(raw)        # the autoscaler validates the file as written (no defaults file for this provider)
    real = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert raw["provider"]["type"] == "fake_multinode" and raw["head_node_type"] == "ray.head.default"
    assert raw["max_workers"] == real["max_workers"]
    local, cloud = _types("cluster.local.yaml"), _types("cluster.yaml")
    assert set(local) - {"ray.head.default"} == set(cloud) - {real["head_node_type"]}
    builtin = {"CPU", "GPU", "memory", "object_store_memory"}
    for name in set(cloud) - {real["head_node_type"]}:
        lt, ct = local[name], cloud[name]
        assert (lt["min_workers"], lt["max_workers"]) == (ct["min_workers"], ct["max_workers"]), name
        custom = {k: v for k, v in lt["resources"].items() if k not in builtin}
        assert custom == {k: v for k, v in ct["resources"].items() if k not in builtin}, name
        assert lt["resources"]["CPU"] == 1 and lt["resources"]["object_store_memory"] <= 200_000_000, name
    head = local["ray.head.default"]["resources"]
    assert head["CPU"] == cloud[real["head_node_type"]]["resources"]["CPU"] == 0


def test_local_cluster_serve_config_targets_node_types_of_cluster_local_yaml():
    offered = {name: set(t.get("resources", {})) for name, t in _types("cluster.local.yaml").items()}
    cfg = AppConfig.from_yaml(ROOT / "serve_config.cluster.local.yaml")
    for pool in ("prefill", "decode"):
        p = getattr(cfg, pool)
        hosts = [name for name, res in offered.items() if set(p.resources) <= res and p.resources]
        assert hosts == [f"{pool}_gpu"], f"{pool} pool resources {p.resources} match node types {hosts}"
        assert p.num_cpus == _types("cluster.local.yaml")[f"{pool}_gpu"]["resources"]["CPU"]   # one replica a node
        assert p.autoscaling is not None and p.autoscaling.max_replicas <= _types("cluster.yaml")[f"{pool}_gpu"]["max_workers"]


def test_router_registry_and_response_store_ask_for_the_head_node():
    from pdserve.app_builder import build_app
    from router.response_store import ResponseStore
    from serving.stats_registry import StatsRegistry
    app = build_app(AppConfig(engine={"dtype": "float32"}))
    router = app._bound_deployment
    assert router.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    assert StatsRegistry.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    assert ResponseStore.ray_actor_options == {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
    store = app._bound_deployment.init_kwargs["store"]
    assert store._bound_deployment.name == "ResponseStore"
    off = build_app(AppConfig(engine={"dtype": "float32"}, responses={"store": False}))
    assert off._bound_deployment.init_kwargs["store"] is None


def test_the_router_drains_as_long_as_the_pools_behind_it():
    """A router replica being replaced (a redeploy) keeps relaying its streams as long as the pools
    finish theirs; Serve's default (20 s) cut them, and a client got a plain-text 500."""
    from pdserve.app_builder import build_app
    app = build_app(AppConfig(prefill={"graceful_shutdown_timeout_s": 30}, decode={"graceful_shutdown_timeout_s": 45}))
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 45
    colocated = build_app(AppConfig(mode="colocated", colocated={"graceful_shutdown_timeout_s": 90}))
    assert colocated._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 90


def test_num_threads_auto_is_each_pools_num_cpus():
    cfg = AppConfig(decode={"num_cpus": 4}, prefill={"num_cpus": 0.5})
    assert cfg.engine_for("decode").num_threads == 4
    assert cfg.engine_for("prefill").num_threads == 1                    # at least one
    assert AppConfig(engine={"num_threads": 3}, decode={"num_cpus": 4}).engine_for("decode").num_threads == 3
    assert AppConfig(decode={"num_cpus": 4, "engine": {"num_threads": 2}}).engine_for("decode").num_threads == 2
    assert AppConfig(engine={"num_threads": None}).engine_for("decode").num_threads is None   # torch's default
    assert AppConfig.from_yaml(ROOT / "serve_config.yaml").engine_for("decode").num_threads == 1
    with pytest.raises(ValueError):
        AppConfig(engine={"num_threads": "many"})
    with pytest.raises(ValueError, match="num_threads"):
        AppConfig(engine={"num_threads": 0})
