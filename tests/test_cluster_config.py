"""cluster.yaml passes Ray's own validator, and the Serve configs are consistent with it."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.serve_config import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_is_valid_for_ray():
    config = prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    validate_config(config)
    types = config["available_node_types"]
    assert {"prefill_gpu", "decode_gpu"} <= set(types)


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
