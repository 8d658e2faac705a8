"""`pdserve deploy` against a running pdserve (the session's local Ray cluster, a tiny model): a new
scaling (a pool's fixed count, another's autoscaling target) is applied in place, with no replica
restarted and no request failing, and the new target takes effect (the decode pool grows under a
load it held at one replica before); a change in `args` makes Serve replace every replica, as the
command says beforehand."""

import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from pdserve.serve_config import deploy
from service_util import (TINY_ENGINE, closed_loop_load, delete_app, http, pools_all_free, reaches, running_replicas,
                          wait_healthy, wait_until)
from serving.config import AppConfig

pytestmark = pytest.mark.slow
NAME = "rd"
SCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 600,
           "look_back_period_s": 2, "metrics_interval_s": 0.5, "warmup_s": 0}


def replica_actors() -> set[str]:
    """The names of the application's replica actors (a restarted replica has a new one)."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f":{NAME}#" in a["name"]}


def running(deployment: str) -> int:
    return running_replicas(NAME, deployment)


def pdserve_deploy(cfg: AppConfig, tmp_path: Path) -> str:
    """`pdserve deploy --config FILE` in its own process, joining this session's cluster; its output."""
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"name": NAME, "args": cfg.model_dump(mode="json")}]}))
    cmd = [str(Path(sys.executable).parent / "pdserve"), "deploy", "--config", str(path), "--name", NAME,
           "--address", ray.get_runtime_context().gcs_address, "--timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_new_scaling_is_applied_in_place_and_anything_else_restarts(ray_serve, tiny_llama_dir, tmp_path):
    fields = {"model": str(tiny_llama_dir), "served_model_name": "tiny", "route_prefix": f"/{NAME}",
              "engine": TINY_ENGINE, "transfer": {"host": "127.0.0.1"}}
    # 3 clients are 3 running sequences at most: one replica's worth under target_running 100
    before = AppConfig.model_validate({**fields, "decode": {"autoscaling": {**SCALING, "target_running": 100}}})
    deploy(before, NAME, f"/{NAME}")
    base = f"{ray_serve}/{NAME}"
    try:
        wait_healthy(base)
        actors = replica_actors()
        assert len(actors) == 5, actors                       # router, registry, response store, prefill, decode
        after = before.model_copy(update={
            "prefill": before.prefill.model_copy(update={"num_replicas": 2}),
            "decode": AppConfig.model_validate({"decode": {"autoscaling": {**SCALING, "target_running": 1}}}).decode})
        with closed_loop_load(base, 3, 150) as statuses:
            assert wait_until(lambda: len(statuses) >= 3, 120)
            assert running("DecodeServer") == 1
            out = pdserve_deploy(after, tmp_path)
            peak = {"PrefillServer": 1, "DecodeServer": 1}
            grown = reaches(peak, NAME, {"PrefillServer": 2, "DecodeServer": 2}, 120)
        assert "in place, no replica restarted (PrefillServer num_replicas, DecodeServer user_config)" in out, out
        assert "is running the new config" in out, out
        assert grown, f"peak replicas after the in-place deploy: {peak}"
        assert actors <= replica_actors(), "a replica was restarted"
        assert statuses and all(s == 200 for s in statuses), f"{statuses.count(200)}/{len(statuses)} ok"
        status, _ = http(base, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert status == 200
        # anything in args (here stream_interval_ms) changes the code version: every replica replaced
        out = pdserve_deploy(after.model_copy(update={"stream_interval_ms": 20.0}), tmp_path)
        assert "Serve replaces every replica (changed: args.stream_interval_ms)" in out, out
        assert not actors & replica_actors(), "a replica of the old version is still running"
        wait_healthy(base)
        assert pools_all_free(base, {"prefill", "decode"})
    finally:
        delete_app(NAME)
